"""The disaggregated engine through its public API: the official openai client against a real
router + prefill + decode trio on loopback (issue 4), healthy paths and intake rejection (S2)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from pd_harness import (
    TRANSFER_TIMEOUT_S,
    client,
    complete,
    deployment,
    hang_up_after,
    internal,
    metric,
    pools_used,
    reference_text,
    served_model,
    ticket_for,
    wait_metric,
    wait_pools_empty,
)
from waiting import wait_for

from kvguard.workers.launcher import LocalDeployment

PROMPTS = [
    "The quick brown fox",
    "kvguard keeps every tenant's KV cache to itself",
    "a" * 40,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
]


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as running:
        yield running


def test_completions_match_the_single_process_engine(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    for prompt in PROMPTS:
        assert complete(trio, prompt, max_tokens=24) == reference_text(tiny_model_dir, prompt, 24)


def test_streaming_gives_the_same_text_as_whole(trio: LocalDeployment) -> None:
    api = client(trio)
    model = served_model(trio)
    for prompt in PROMPTS[:2]:
        whole = api.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
        stream = api.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == whole.choices[0].text
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 20


def test_chat_completions_whole_and_streaming(trio: LocalDeployment) -> None:
    api = client(trio)
    model = served_model(trio)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content


def test_models_endpoint_reports_the_context_length(trio: LocalDeployment) -> None:
    cards = client(trio).models.list().data
    assert len(cards) == 1
    assert cards[0].model_extra is not None and cards[0].model_extra["max_model_len"] == 1024
    assert abs(cards[0].created - time.time()) < 3600  # when the router started, not 0


def test_concurrent_requests_each_get_their_solo_output(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    prompts = [f"tenant {i}: " + "x" * (7 * i) for i in range(12)]
    expected = [reference_text(tiny_model_dir, p, 20) for p in prompts]
    with cf.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda p: complete(trio, p, max_tokens=20), prompts))
    assert outputs == expected
    wait_pools_empty(trio)


def test_seeded_sampling_is_reproducible(trio: LocalDeployment) -> None:
    api, model = client(trio), served_model(trio)
    runs = [
        api.completions.create(model=model, prompt="seeded", max_tokens=16, temperature=0.9, top_p=0.9, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("stream", [False, True])
def test_over_length_is_rejected_at_the_router_before_any_worker_s2(trio: LocalDeployment, stream: bool) -> None:
    before = {role: metric(trio, role, "kvguard_requests_total") for role in ("prefill", "decode")}
    api, model = client(trio), served_model(trio)
    for prompt, max_tokens in (("x" * 1100, 4), ("short", 2000)):
        with pytest.raises(openai.BadRequestError) as caught:
            result = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=stream)
            list(result) if stream else None  # type: ignore[call-overload]
        assert caught.value.code == "context_length_exceeded"
        assert caught.value.status_code == 400
    after = {role: metric(trio, role, "kvguard_requests_total") for role in ("prefill", "decode")}
    assert after == before, "an over-length request reached a worker"
    assert pools_used(trio) == {"prefill": 0, "decode": 0}
    assert metric(trio, "router", "kvguard_rejected_requests_total", reason="context_length_exceeded") >= 2


def test_text_too_long_to_tokenize_counts_as_rejected_once_s2(trio: LocalDeployment) -> None:
    """Outside probe: text past the byte bound (no text that long fits the context, so it is refused
    before tokenizing) got the same 400 but moved neither counter: the S2 refusals read low on
    exactly the longest prompts, and the rollout analysis's request count missed them."""
    api, model = client(trio), served_model(trio)
    counters = (("kvguard_rejected_requests_total", {"reason": "context_length_exceeded"}),
                ("kvguard_requests_total", {"outcome": "rejected"}))  # fmt: skip
    before = [metric(trio, "router", name, **labels) for name, labels in counters]
    with pytest.raises(openai.BadRequestError) as text:
        api.completions.create(model=model, prompt="x" * 100_000, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as chat:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "y" * 100_000}], max_tokens=4)
    assert (text.value.code, chat.value.code) == ("context_length_exceeded", "context_length_exceeded")
    assert "bytes of text" in text.value.message  # the byte bound refused it, not the token count
    after = [metric(trio, "router", name, **labels) for name, labels in counters]
    assert after == [b + 2 for b in before]


def test_every_worker_rejects_over_length_at_its_own_intake_s2(trio: LocalDeployment) -> None:
    """Defence in depth: a request that bypasses the router is still refused before allocation."""
    request = {"request_id": "direct-1", "prompt_token_ids": [5] * 1100, "sampling": {"max_tokens": 4}}
    decode = internal(trio, "decode", "/internal/decode", request)
    assert decode.status_code == 400 and decode.json()["error"]["code"] == "context_length_exceeded"
    bootstrap = {"transfer_host": "127.0.0.1", "transfer_port": 9, "page_ids": [0], "generations": [1], "num_tokens": 1100,
                 "nonce": "00" * 16, "epoch": 0}  # fmt: skip
    prefill = internal(trio, "prefill", "/internal/prefill", {**request, "ticket": ticket_for(trio, "direct-1", bootstrap)})
    assert prefill.status_code == 400 and prefill.json()["error"]["code"] == "context_length_exceeded"
    assert pools_used(trio) == {"prefill": 0, "decode": 0}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "n": 129}, "n"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "model": "not-this-one"}, "model"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(trio: LocalDeployment, body: dict, param: str) -> None:
    body = {"model": served_model(trio), **body}
    response = requests.post(f"{trio.api_base}/completions", json=body, timeout=30)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert complete(trio, "still serving", max_tokens=3)  # the rest keeps serving


def test_malformed_json_is_a_400(trio: LocalDeployment) -> None:
    response = requests.post(f"{trio.api_base}/completions", data=b"{not json", timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_only_uncompressed_json_bodies_are_read(trio: LocalDeployment) -> None:
    """No listener inflates a body (a gzip bomb never is); a compressed body, whatever its coding,
    is a 415 naming it -- not a 500, a JSON error or a plain-text parser answer -- and so is a form
    or text/plain body (what a browser may send cross-site). JSON, labelled or not, is served."""
    import gzip

    body = json.dumps({"model": served_model(trio), "prompt": "hi", "max_tokens": 2}).encode()
    url = f"{trio.api_base}/completions"
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of spaces in ~64 KiB
    for coding, data in (("gzip", gzip.compress(body)), ("gzip", bomb), ("deflate", body), ("br", body), ("zstd", body), ("x", body)):
        answer = requests.post(url, data=data, headers={"Content-Type": "application/json", "Content-Encoding": coding}, timeout=30)
        assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type", (coding, answer.text)
        assert repr(coding) in answer.json()["error"]["message"]
    for media in ("application/x-www-form-urlencoded", "text/plain"):
        answer = requests.post(url, data=body, headers={"Content-Type": media}, timeout=30)
        assert answer.status_code == 415 and media in answer.json()["error"]["message"]
    for headers in ({}, {"Content-Type": "application/json; charset=utf-8"}, {"Content-Encoding": "identity"}):
        assert requests.post(url, data=body, headers=headers, timeout=30).status_code == 200, headers
    # Two Content-Encoding lines, the second naming gzip: every line counts, not the first.
    host, port = trio.api_base.removeprefix("http://").split("/", 1)[0].split(":")
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Encoding: identity\r\n"
           b"Content-Encoding: gzip\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(raw)
        assert conn.recv(64).startswith(b"HTTP/1.1 415")
    # A transfer coding other than chunked was de-chunked and the gzip read as JSON (400 invalid_json,
    # an outside probe): not implemented, said so (RFC 9112: 501).
    zipped = gzip.compress(body)
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Transfer-Encoding: gzip, chunked\r\n\r\n%x\r\n" % len(zipped)) + zipped + b"\r\n0\r\n\r\n"  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(raw)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501") and json.loads(error)["error"]["code"] == "not_implemented", answer


def test_an_http_1_0_stream_ends_with_its_connection(trio: LocalDeployment) -> None:
    """A streamed answer to HTTP/1.0 has no length and no chunks: only the close ends it. Kept
    alive (a client asking for keep-alive), the client saw [DONE] at once and the end of the body
    30 s later, the connection's place at the cap held meanwhile (an outside probe)."""
    body = json.dumps({"model": served_model(trio), "prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    host, port = trio.api_base.removeprefix("http://").split("/", 1)[0].split(":")
    raw = (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=20) as conn:  # the keep-alive timer is 30 s
        conn.sendall(raw)
        answer = b""
        while chunk := conn.recv(65536):  # to the server's close
            answer += chunk
    head, _, events = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and events.rstrip().endswith(b"data: [DONE]"), answer


def test_a_lone_surrogate_is_named_in_the_json_error(trio: LocalDeployment) -> None:
    body = json.dumps({"model": served_model(trio), "prompt": "\ud800", "max_tokens": 2})  # what json.dumps writes for it
    answer = requests.post(f"{trio.api_base}/completions", data=body, timeout=30)
    assert answer.status_code == 400 and "surrogate" in answer.json()["error"]["message"]


def test_a_reused_request_id_is_only_a_label_never_merged_or_refused_class_g_s9(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    """Class G (sglang#40125) without the 409: X-Request-Id is a correlation label, so a second
    request carrying an in-flight label is a request of its own; both finish, each with its own
    output, and each response echoes the label."""
    headers = {"X-Request-Id": "same-id"}
    body = {"model": served_model(trio), "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0, "stream": True}
    first = requests.post(f"{trio.api_base}/completions", json=body, headers=headers, stream=True, timeout=30)
    assert first.headers["X-Request-Id"] == "same-id"
    lines = first.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")  # first is streaming now
    second = requests.post(f"{trio.api_base}/completions", json={**body, "stream": False, "max_tokens": 8}, headers=headers, timeout=30)
    assert second.status_code == 200 and second.headers["X-Request-Id"] == "same-id"
    assert second.json()["choices"][0]["text"] == reference_text(tiny_model_dir, PROMPTS[1], 8)
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    first.close()
    wait_pools_empty(trio)


def test_client_disconnect_mid_stream_frees_both_pools_s4(trio: LocalDeployment) -> None:
    """Class B: a streaming client that goes away ends both legs; nothing is left allocated."""
    api, model = client(trio), served_model(trio)
    before = {(role, cause): metric(trio, role, "kvguard_aborts_total", cause=cause)
              for role in ("router", "decode") for cause in ("client_disconnect", "decode_error")}
    stream = api.completions.create(model=model, prompt="disconnect me", max_tokens=900, temperature=0, stream=True)
    next(iter(stream))
    assert pools_used(trio)["decode"] > 0
    stream.close()
    wait_pools_empty(trio)
    wait_metric(trio, "router", "kvguard_aborts_total", before["router", "client_disconnect"] + 1, cause="client_disconnect")
    # Decode saw its client go away mid-stream: a disconnect, never a decode failure (the abort
    # alert leaves disconnects out; a decode_error here would page someone for a closed browser tab).
    wait_metric(trio, "decode", "kvguard_aborts_total", before["decode", "client_disconnect"] + 1, cause="client_disconnect")
    assert metric(trio, "decode", "kvguard_aborts_total", cause="decode_error") == before["decode", "decode_error"]
    assert complete(trio, PROMPTS[0], 8)


def test_client_disconnect_while_waiting_for_a_whole_response_frees_both_pools_s4(trio: LocalDeployment) -> None:
    """The client hangs up once decode holds its KV: 900 tokens take seconds to decode, so the
    request is still running then, however fast or loaded the machine."""
    before = metric(trio, "router", "kvguard_aborts_total", cause="client_disconnect")
    with hang_up_after(trio, {"prompt": "slow", "max_tokens": 900, "temperature": 0}):
        wait_for(lambda: pools_used(trio)["decode"] > 0, "decode to hold the request's KV", interval=0.01)
    wait_pools_empty(trio)
    wait_metric(trio, "router", "kvguard_aborts_total", before + 1, cause="client_disconnect")
    assert metric(trio, "router", "kvguard_aborts_total", cause="client_disconnect") == before + 1


def test_prefill_failure_ends_the_decode_leg_at_once_s4(trio: LocalDeployment) -> None:
    """Classes A/B (sglang#24159, vllm#41269): prefill refuses a request after decode allocated;
    decode must not wait for KV that will never come."""
    request = {"request_id": "prefill-fails", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}}
    peer_aborts = metric(trio, "decode", "kvguard_aborts_total", cause="peer_abort")
    prefill_errors = metric(trio, "decode", "kvguard_aborts_total", cause="prefill_error")
    started = time.monotonic()
    with internal(trio, "decode", "/internal/decode", request, stream=True) as decode:
        events = (json.loads(line) for line in decode.iter_lines() if line)
        bootstrap = next(events)["bootstrap"]
        ticket = ticket_for(trio, "prefill-fails", bootstrap)
        bad = {**request, "prompt_token_ids": [10_000, 2, 3], "ticket": ticket}  # token id out of vocab
        refused = internal(trio, "prefill", "/internal/prefill", bad)
        assert refused.status_code == 400
        final = next(events)
    assert final["event"] == "error" and final["code"] == "kv_transfer_peer_abort"  # told by prefill, not by a timeout
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S / 2
    wait_pools_empty(trio)
    # Decode counts the cause prefill's abort named (as prefill counts it), not `peer_abort`.
    wait_metric(trio, "decode", "kvguard_aborts_total", prefill_errors + 1, cause="prefill_error")
    assert metric(trio, "decode", "kvguard_aborts_total", cause="peer_abort") == peer_aborts


def test_a_kv_plan_mismatch_at_prefill_ends_the_decode_leg_at_once_s4(trio: LocalDeployment) -> None:
    """Prefill's KV does not fill the pages decode planned (kv_plan_mismatch: here prefill computed
    one token more than decode allocated for; in the field, page sizes that differ). Prefill fails
    the request before its sender opens, so it must tell decode itself: no router is in this call
    to abort decode's leg, which would otherwise wait out its transfer timeout holding its pages."""
    request = {"request_id": "plan-mismatch", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}}
    prefill_errors = metric(trio, "decode", "kvguard_aborts_total", cause="prefill_error")
    started = time.monotonic()
    with internal(trio, "decode", "/internal/decode", request, stream=True) as decode:
        events = (json.loads(line) for line in decode.iter_lines() if line)
        ticket = ticket_for(trio, "plan-mismatch", next(events)["bootstrap"])
        longer = {**request, "prompt_token_ids": [1, 2, 3, 4], "ticket": ticket}
        refused = internal(trio, "prefill", "/internal/prefill", longer)
        assert refused.status_code == 500 and refused.json()["error"]["code"] == "kv_plan_mismatch", refused.text
        final = next(events)
    assert final["event"] == "error" and final["code"] == "kv_transfer_peer_abort", final  # told by prefill
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S / 2
    wait_pools_empty(trio)
    wait_metric(trio, "decode", "kvguard_aborts_total", prefill_errors + 1, cause="prefill_error")


SAFETY_COUNTERS = ("kvguard_tag_violations_total", "kvguard_checksum_failures_total", "kvguard_hmac_failures_total",
                   "kvguard_stale_writes_dropped_total")


def test_metrics_of_every_process_parse_and_name_the_contract(trio: LocalDeployment) -> None:
    # The trio is shared with fault tests (a chunk that lands after its transfer was aborted is
    # rightly dropped as stale, S2), so a clean request must leave the safety counters unchanged.
    before = {(role, name): metric(trio, role, name) for role in ("prefill", "decode") for name in SAFETY_COUNTERS}
    complete(trio, "one request so every counter has moved", max_tokens=2)
    for role in ("prefill", "decode"):
        assert metric(trio, role, "kvguard_kv_pool_capacity_tokens") == 4096
        assert metric(trio, role, "kvguard_context_length_tokens") == 1024
        for name in SAFETY_COUNTERS:
            assert metric(trio, role, name) == before[role, name], name
    assert metric(trio, "decode", "kvguard_kv_transfer_bytes_total") > 0
    # Disaggregated for real: prefill's forward passes only compute prompts, decode's only
    # generate (kvguard_step_requests, the batch occupancy a dashboard panel shows).
    steps = {(role, phase): metric(trio, role, "kvguard_step_requests_count", phase=phase)
             for role in ("prefill", "decode") for phase in ("prefill", "decode")}
    assert steps["prefill", "prefill"] > 0 and steps["decode", "decode"] > 0
    assert steps["prefill", "decode"] == 0 and steps["decode", "prefill"] == 0
    assert metric(trio, "router", "kvguard_requests_total", outcome="finished") > 0
    # What a progressive rollout's analysis compares between revisions (operator/analysis.py).
    for name in ("kvguard_router_request_duration_seconds", "kvguard_router_time_to_first_token_seconds",
                 "kvguard_router_inter_token_latency_seconds"):  # fmt: skip
        assert metric(trio, "router", f"{name}_count") > 0, name


def test_health(trio: LocalDeployment) -> None:
    assert requests.get(f"{trio.router_url}/health", timeout=30).json() == {"status": "ok"}


async def test_a_worker_health_check_that_fails_unexpectedly_reads_unreachable() -> None:
    """The router's /health shares one check among its callers: an error other than a timeout or a
    connection error (a closed session at shutdown) made every caller's answer a 500, and every
    next caller start a new check (a review)."""
    from types import SimpleNamespace

    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Router, Upstream

    class ClosedSession:
        def get(self, *_: object, **__: object) -> None:
            raise RuntimeError("Session is closed")

    router = SimpleNamespace(control=ClosedSession(), http=None)
    decode = Upstream("http://decode", WorkerInfo(role=Role.DECODE, model="m", context_length=1024, kv_pool_tokens=4096, page_size=16))
    assert await Router._worker_health(router, decode) == "unreachable"  # type: ignore[arg-type]


def test_router_refuses_workers_whose_page_sizes_differ() -> None:
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Upstream, Upstreams

    def worker(role: Role, page_size: int) -> Upstream:
        info = WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=4096, page_size=page_size)
        return Upstream(f"http://{role.value}", info)

    with pytest.raises(ValueError, match="page size"):
        Upstreams([worker(Role.PREFILL, 16)], [worker(Role.DECODE, 32)])
    assert Upstreams([worker(Role.PREFILL, 16)], [worker(Role.DECODE, 16)]).smallest_pool == 4096


def test_the_request_limit_is_the_context_or_a_smaller_pool() -> None:
    """What /v1/models reports as max_model_len and what an absent max_tokens fills up to: the
    context, unless a worker's pool is smaller (--allow-small-pool), so a client sizing prompts
    from the card is never refused by the pool."""
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Upstream, Upstreams

    def worker(role: Role, pool: int) -> Upstream:
        return Upstream(f"http://{role.value}", WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=pool, page_size=16))

    assert Upstreams([worker(Role.PREFILL, 4096)], [worker(Role.DECODE, 4096)]).request_limit == 1024
    assert Upstreams([worker(Role.PREFILL, 4096)], [worker(Role.DECODE, 592)]).request_limit == 592


def test_the_router_keeps_a_worker_with_a_too_small_pool_out_of_rotation_s7() -> None:
    """--min-kv-ratio (the local backend's readiness gate): a worker reporting a pool below the
    ratio x its context is not paired with, and intake's limits are those of the workers that
    serve; one that reports enough again comes back. No worker of a role left: 503 not_ready."""
    from kvguard.workers.openai_api import OpenAIError
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Upstream, Upstreams

    def info(role: Role, pool: int) -> WorkerInfo:
        return WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=pool, page_size=16)

    prefill = Upstream("http://p0", info(Role.PREFILL, 4096))
    decode = [Upstream("http://d0", info(Role.DECODE, 4096)), Upstream("http://d1", info(Role.DECODE, 4096))]
    upstreams = Upstreams([prefill], decode, min_kv_ratio=2.0)
    assert {upstreams.pair()[1].url for _ in range(4)} == {"http://d0", "http://d1"}
    change = upstreams.refresh(decode[1], info(Role.DECODE, 1024))  # restarted on a smaller node
    assert change is not None and "1024 tokens = 1.00x context 1024 < 2x required (2048 tokens)" in change and "kept out" in change
    assert {upstreams.pair()[1].url for _ in range(6)} == {"http://d0"}
    assert upstreams.smallest_pool == 4096 and [u.url for u in upstreams.kept_out()] == ["http://d1"]
    assert upstreams.refresh(decode[1], info(Role.DECODE, 1024)) is None  # no change, nothing to log
    upstreams.refresh(decode[0], info(Role.DECODE, 2047))
    with pytest.raises(OpenAIError) as refused:
        upstreams.pair()
    assert refused.value.status == 503 and refused.value.code == "not_ready"
    assert refused.value.response().headers["Retry-After"] == "1"  # as every other 503 (an outside probe)
    assert "in rotation again" in (upstreams.refresh(decode[1], info(Role.DECODE, 2048)) or "")
    assert upstreams.pair()[1].url == "http://d1"
    assert "did not answer" in (upstreams.refresh(decode[1], None) or "")  # down or restarting: out until it answers
    with pytest.raises(OpenAIError):
        upstreams.pair()
    assert upstreams.kept_out() == [decode[0]]  # (the gauge counts pool refusals only)
    assert Upstreams([prefill], [Upstream("http://d", info(Role.DECODE, 1024))]).pair()[1].url == "http://d"  # no ratio: no gate


def test_a_router_without_its_workers_is_not_ready_and_says_so(tiny_model_dir: Path) -> None:
    """In a pod the router may start before the workers: it answers 503 `not_ready` until it has
    learned their limits, rather than crashing or guessing them (S2 needs them)."""
    import os
    import subprocess
    import sys

    from kvguard.workers.args import bind_listener

    api, metrics, nobody = (bind_listener("127.0.0.1", 0) for _ in range(3))
    port, unused, metrics_port = api.getsockname()[1], nobody.getsockname()[1], metrics.getsockname()[1]
    nobody.close()
    router = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvguard", "worker", "--role", "router", "--model", str(tiny_model_dir),
         "--port", f"fd:{api.fileno()}", "--metrics-port", f"fd:{metrics.fileno()}",
         "--prefill", f"http://127.0.0.1:{unused}", "--decode", f"http://127.0.0.1:{unused}"],
        pass_fds=(api.fileno(), metrics.fileno()), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "KVGUARD_TRANSFER_KEY": "ab" * 32},  # every role holds the revision key
    )  # fmt: skip
    api.close()
    metrics.close()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except (requests.ConnectionError, requests.Timeout):  # queued in the backlog while it starts
                assert time.monotonic() < deadline, "the router never started"
                time.sleep(0.1)
        assert health.status_code == 503 and health.json()["error"]["code"] == "not_ready"
        answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready"
        assert answer.headers["Retry-After"] == "1"
        # An ended request, failed: the analysis' error ratio sees an outage of a role (outside
        # probe: 98% of clients failed while the router's counters said 29%).
        text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'kvguard_requests_total{outcome="failed"} 1.0' in text, text
    finally:
        router.terminate()
        router.wait(10)
