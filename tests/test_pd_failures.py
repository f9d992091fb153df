"""One deterministic test per failure class of ../shared/reference/pd-bug-classes.md (A-I), against a
real router + prefill + decode trio with faults injected. Each asserts: the right client gets a
clean error, other clients' outputs are unchanged, both pools return to empty, nothing outlives the
timeout. (Class F, prefix sharing, does not apply: the engine shares no pages between requests.)"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import openai
import pytest
import requests
from pd_harness import (
    client,
    complete,
    deployment,
    first_chunk_then_leave,
    hang_up_after,
    internal,
    metric,
    pools_used,
    reference_text,
    served_model,
    ticket_for,
    wait_healthy,
    wait_metric,
    wait_pools_empty,
)
from waiting import wait_for

from kvguard.workers.launcher import LocalDeployment


def _outcome(d: LocalDeployment, prompt: str, max_tokens: int = 12) -> tuple[str, str]:
    """('ok', text) or ('error', code) -- never anything in between."""
    try:
        return "ok", complete(d, prompt, max_tokens=max_tokens)
    except openai.APIStatusError as err:
        assert err.status_code >= 400
        return "error", str(err.code)


class Failed(NamedTuple):
    """How a completion that failed ended: its error, how long it took, and the router's count of
    `timeout` aborts once both pools are empty again."""

    status: int
    code: str | None
    took_s: float
    timeout_aborts: float


def failed_completion(d: LocalDeployment, prompt: str, client_timeout: float = 30.0) -> Failed:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client(d, timeout=client_timeout).completions.create(model=served_model(d), prompt=prompt, max_tokens=4)
    took = time.monotonic() - started
    wait_pools_empty(d)
    return Failed(caught.value.status_code, caught.value.code, took, metric(d, "router", "kvguard_aborts_total", cause="timeout"))


def _check_mixed_outcomes(d: LocalDeployment, model_dir: Path, expected_code: str, n: int = 12) -> None:
    """Some requests fail (cleanly, with `expected_code`), the rest give exactly their solo output."""
    prompts = [f"request {i} " + "y" * (3 * i) for i in range(n)]
    outcomes = [_outcome(d, p) for p in prompts]
    failed = [value for kind, value in outcomes if kind == "error"]
    assert failed and len(failed) < n, outcomes
    assert set(failed) == {expected_code}
    for prompt, (kind, value) in zip(prompts, outcomes):
        if kind == "ok":
            assert value == reference_text(model_dir, prompt, 12)
    wait_pools_empty(d)


def test_corruption_in_flight_fails_only_that_request_s3(tiny_model_dir: Path) -> None:
    """Class I (vllm#44238): a flipped byte is caught by the checksum before decode generates."""
    with deployment(tiny_model_dir, "corrupt_chunk=0.5,seed=3") as d:
        _check_mixed_outcomes(d, tiny_model_dir, "kv_transfer_checksum")
        assert metric(d, "decode", "kvguard_checksum_failures_total") > 0
        assert metric(d, "decode", "kvguard_tag_violations_total") == 0


def test_choices_ended_because_a_sibling_failed_are_not_counted_as_client_disconnects(tiny_model_dir: Path) -> None:
    """Outside probe: with n > 1, one choice failing (here a corrupted transfer, S3) cancels its
    siblings, and the router counted those as `client_disconnect` / `aborted`: the client never left,
    and KvguardAbortsHigh and the rollout's error ratio, which leave disconnects out, missed them."""
    with deployment(tiny_model_dir, "corrupt_chunk=1") as d:
        for stream in (False, True):
            with pytest.raises(openai.APIError) as caught:
                answer = client(d).completions.create(model=served_model(d), prompt="siblings " * 40, max_tokens=8, n=8,
                                                      stream=stream)  # fmt: skip
                list(answer) if stream else None  # type: ignore[call-overload]
            assert caught.value.code == "kv_transfer_checksum"
        wait_pools_empty(d)
        assert metric(d, "router", "kvguard_aborts_total", cause="client_disconnect") == 0
        assert metric(d, "router", "kvguard_requests_total", outcome="aborted") == 0
        # Counted as the workers count it (integrity), not by the error's code (kv_transfer_checksum).
        ended = metric(d, "router", "kvguard_aborts_total", cause="integrity") + metric(
            d, "router", "kvguard_aborts_total", cause="sibling_failed")
        assert ended == metric(d, "router", "kvguard_requests_total", outcome="failed") == 16


def test_partial_transfer_never_reaches_generation_s3(tiny_model_dir: Path) -> None:
    """Classes C/D (vllm#50754, sglang#23797): a dropped chunk makes the manifest disagree with what
    arrived; decode fails the request instead of reading half-written pages."""
    with deployment(tiny_model_dir, "drop_chunk=0.5,seed=5") as d:
        _check_mixed_outcomes(d, tiny_model_dir, "kv_transfer_manifest_mismatch")
        assert metric(d, "decode", "kvguard_tag_violations_total") == 0  # no half-written page was ever read


STALL_TIMEOUT_S, CHUNK_DELAY_S = 1.5, 120


def test_stalled_transfer_times_out_and_frees_both_sides_s4(tiny_model_dir: Path) -> None:
    """Classes C/H (vllm#35943, sglang#37166): KV that never comes fails the request by the timeout.
    The first chunk is held back far longer than the timeout, so the request can only end by it."""
    with deployment(tiny_model_dir, f"delay_chunk_ms={CHUNK_DELAY_S * 1000}", transfer_timeout_s=STALL_TIMEOUT_S) as d:
        started = time.monotonic()
        kind, code = _outcome(d, "stalled")
        took = time.monotonic() - started
        assert kind == "error" and code == "kv_transfer_timeout"
        assert STALL_TIMEOUT_S <= took < CHUNK_DELAY_S / 2  # by the timeout, long before the chunk could come
        wait_pools_empty(d)
        # Every side counts the abort for what it was: prefill's call was cancelled by the router's
        # abort, which names the cause (cancelled first, it read as a client disconnect: paging
        # rules that leave disconnects out never saw it).
        wait_metric(d, "prefill", "kvguard_aborts_total", 1, cause="transfer_timeout")
        assert metric(d, "router", "kvguard_aborts_total", cause="transfer_timeout") == 1  # one name on every role
        assert metric(d, "prefill", "kvguard_aborts_total", cause="client_disconnect") == 0


def test_a_prefill_slower_than_the_transfer_timeout_still_serves_s4(tiny_model_dir: Path) -> None:
    """A long prompt on a large model computes for longer than a transfer may stall. Decode's stall
    timer runs from prefill's OPEN, which comes once the KV exists: before, it ran from decode's
    bootstrap and failed every such request with a 502 kv_transfer_timeout."""
    stall, prefill_s = 2.0, 4.5  # no stall of 2 s after OPEN, even with prefill descheduled on a loaded machine
    with deployment(tiny_model_dir, f"delay_prefill_ms={prefill_s * 1000:.0f}", transfer_timeout_s=stall) as d:
        started = time.monotonic()
        assert complete(d, "a slow prefill", max_tokens=8) == reference_text(tiny_model_dir, "a slow prefill", 8)
        assert time.monotonic() - started >= prefill_s
        wait_pools_empty(d)
        assert metric(d, "decode", "kvguard_aborts_total") == 0


def test_a_transfer_prefill_never_opens_ends_at_the_bootstrap_timeout_s4(tiny_model_dir: Path) -> None:
    """Decode's granted pages wait for prefill's OPEN at most --bootstrap-timeout (rendered from
    spec.kvTransfer.bootstrapTimeoutSeconds); then the request fails and both sides are freed."""
    bootstrap = 1.0
    with deployment(tiny_model_dir, f"delay_prefill_ms={CHUNK_DELAY_S * 1000}", bootstrap_timeout_s=bootstrap) as d:
        started = time.monotonic()
        kind, code = _outcome(d, "never opened")
        took = time.monotonic() - started
        assert (kind, code) == ("error", "kv_transfer_timeout")
        assert bootstrap <= took < CHUNK_DELAY_S / 2
        wait_pools_empty(d)
        wait_metric(d, "decode", "kvguard_aborts_total", 1, cause="transfer_timeout")
        # Prefill was still computing (its engine had not seen the request): the abort counts there too.
        wait_for(lambda: metric(d, "prefill", "kvguard_aborts_total") == 1, "prefill to count the abort", timeout=30)


def test_the_router_ends_a_request_that_waits_too_long_for_a_token_s4(tiny_model_dir: Path) -> None:
    """The router's --request-timeout bounds waiting: KV that never comes (transfer timeout set far
    longer) ends the request with a 504 by the router's timeout, and both legs are aborted."""
    request_timeout = 1.5
    with deployment(tiny_model_dir, f"delay_chunk_ms={CHUNK_DELAY_S * 1000}", transfer_timeout_s=CHUNK_DELAY_S / 2,
                    request_timeout_s=request_timeout) as d:  # fmt: skip
        failed = failed_completion(d, "stalled")
        assert (failed.status, failed.code, failed.timeout_aborts) == (504, "timeout", 1)
        assert request_timeout <= failed.took_s < CHUNK_DELAY_S / 4


def test_the_504_for_a_hung_worker_does_not_wait_for_its_abort_to_be_acknowledged_s4(tiny_model_dir: Path) -> None:
    """A decode worker that hangs mid-generation (SIGSTOP) cannot acknowledge the router's abort.
    The client's 504 comes at --request-timeout all the same: it used to wait for the abort too, up
    to --abort-timeout longer (here far longer than the client waits). Once the worker runs again
    the abort reaches it with the router's cause, not as a client disconnect, and both pools drain.
    Until then the request keeps its router slot (its pages are still held there): with one slot,
    the next request waits for it, and is served once the abort went through."""
    request_timeout, abort_timeout = 4.0, 600.0
    with deployment(tiny_model_dir, request_timeout_s=request_timeout, abort_timeout_s=abort_timeout,
                    max_inflight_choices=1, context_length=4096, kv_pool_tokens=8192) as d:  # fmt: skip
        decode = d.processes["decode"].popen
        assert decode is not None
        # 4000 tokens take seconds: decode is still generating when the signal lands, however
        # long this process waits for its turn after the first chunk.
        stream = client(d, timeout=abort_timeout / 4).completions.create(
            model=served_model(d), prompt="hung", max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        events = iter(stream)
        next(events)
        decode.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(openai.APIError) as caught:
                for _ in events:
                    pass
            took = time.monotonic() - started
            with cf.ThreadPoolExecutor(1) as pool:
                following = pool.submit(complete, d, "next", 4)
                wait_for(lambda: metric(d, "router", "kvguard_router_waiting_choices") == 1, "the next request to wait for the slot")
                assert not following.done()
                decode.send_signal(signal.SIGCONT)
                assert following.result() == reference_text(tiny_model_dir, "next", 4)
        finally:
            decode.send_signal(signal.SIGCONT)
        assert caught.value.code == "timeout", caught.value.message
        assert took < abort_timeout / 10  # about request_timeout: nothing waited on the hung worker
        wait_pools_empty(d)
        wait_metric(d, "router", "kvguard_aborts_total", 1, cause="timeout")
        wait_metric(d, "decode", "kvguard_aborts_total", 1, cause="timeout")
        assert metric(d, "decode", "kvguard_aborts_total", cause="client_disconnect") == 0
        # Nor as decode's fault: the ticket a failed prefill leg no longer waited for was cancelled
        # with it, and decode's bootstrap then read as "a second bootstrap" (outside probe).
        for role in ("router", "decode"):
            assert metric(d, role, "kvguard_aborts_total", cause="decode_error") == 0, role


def test_a_prefill_that_hangs_after_the_transfer_ends_the_request_at_the_request_timeout_s4(tiny_model_dir: Path) -> None:
    """Outside probe (the model against the code): the model's router timer fires in every phase,
    waiting for prefill's answer after decode's FINISH included; the code awaited that answer with
    no bound, so a prefill hung after sending the KV held the client and its router slot for ever.
    Now that wait is bounded by --request-timeout: a 504, both legs aborted, both pools empty."""
    request_timeout, hang_s = 1.5, 600
    with deployment(tiny_model_dir, f"delay_prefill_reply_ms={hang_s * 1000}", request_timeout_s=request_timeout) as d:
        failed = failed_completion(d, "hung prefill", client_timeout=hang_s / 4)
        assert (failed.status, failed.code, failed.timeout_aborts) == (504, "timeout", 1)
        assert request_timeout <= failed.took_s < hang_s / 10


def test_choices_queued_behind_their_own_siblings_wait_while_the_request_produces(tiny_model_dir: Path) -> None:
    """Outside probe: n choices need n times the pages, so on a pool of 2 contexts the later
    choices of one request wait in decode's queue behind its earlier ones. They shared one
    first-token deadline, so a request streaming tokens the whole time got a 504 (n=8 after 1 s,
    with --request-timeout 1). The deadline now moves on while any choice produces: --request-timeout
    bounds waiting, not generating, for a request as for one generation."""
    # Paced at 1 ms a step, the 4 rounds of 2 choices x 1000 tokens take longer than the timeout
    # however fast the machine; 3 s keeps a gap on a loaded machine far inside it.
    request_timeout = 3.0
    with deployment(tiny_model_dir, "delay_step_ms=1", kv_pool_tokens=2048, request_timeout_s=request_timeout) as d:
        assert complete(d, "warm-up", 4)  # a fresh deployment's first request is its slowest (a load audit)
        started = time.monotonic()
        # 8,000 paced steps' tokens: the client waits as long as a loaded machine needs (the 504 it
        # guards against comes from the router, not from this timeout).
        answer = client(d, timeout=600).completions.create(model=served_model(d), prompt="a", max_tokens=1000, n=8,
                                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        took = time.monotonic() - started
        assert sorted(c.index for c in answer.choices) == list(range(8))
        assert {c.finish_reason for c in answer.choices} == {"length"} and answer.usage.completion_tokens == 8000  # type: ignore[union-attr]
        assert len({c.text for c in answer.choices}) == 1  # greedy: every choice the same
        assert took > request_timeout  # the later choices waited longer than the timeout, producing all along
        assert metric(d, "router", "kvguard_aborts_total") == 0


def test_a_generation_that_keeps_producing_outlives_the_request_timeout(tiny_model_dir: Path) -> None:
    """--request-timeout is not a cap on a generation's length: an outside probe found every
    generation longer than 120 s cut off with a 504 (max_tokens defaults to the rest of the context)."""
    # Each wait (first token, the gap between steps) is far inside the timeout even on a loaded
    # machine (gaps of 0.8 s were seen there: a timeout of 1 s was too close), after a warm-up
    # request; paced at 5 ms a step, 800 tokens take longer than the timeout however fast the machine.
    request_timeout, tokens = 3.0, 800
    with deployment(tiny_model_dir, "delay_step_ms=5", request_timeout_s=request_timeout, context_length=4096, kv_pool_tokens=8192) as d:
        assert complete(d, "warm-up", 4)
        started = time.monotonic()
        answer = client(d).completions.create(model=served_model(d), prompt="long", max_tokens=tokens, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        took = time.monotonic() - started
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == tokens  # type: ignore[union-attr]
        assert took > request_timeout  # ran past it


def test_prefill_dying_mid_transfer_fails_the_client_and_frees_decode_s4(tiny_model_dir: Path) -> None:
    """Class C (vllm#46283): prefill crashes after sending its second chunk (the second request's
    only chunk), before the manifest; the restarted prefill serves the third request."""
    with deployment(tiny_model_dir, "crash_prefill_after_chunks=2") as d:
        assert _outcome(d, "first request")[0] == "ok"
        kind, _ = _outcome(d, "second request crashes prefill")
        assert kind == "error"
        wait_pools_empty(d, roles=("decode",))
        wait_for(lambda: d.processes["prefill"].restarts == 1, "the launcher to restart the crashed prefill")
        wait_healthy(d)
        assert d.processes["prefill"].restarts == 1
        assert _outcome(d, "third request") == ("ok", reference_text(tiny_model_dir, "third request", 12))


def test_decode_counts_a_failed_prefill_by_its_cause_not_as_a_client_disconnect(tiny_model_dir: Path) -> None:
    """Requests waiting on a prefill that crashes fail with the router's cause on every process:
    the router keeps decode's stream open until its abort has gone out. (It closed the stream
    first once, and decode counted 10 of 12 as client disconnects, which paging rules leave out.)"""
    with deployment(tiny_model_dir, "crash_prefill_after_chunks=2") as d:
        with cf.ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(lambda i: _outcome(d, f"request {i} " * 5)[0], range(12)))
        assert "error" in outcomes
        wait_pools_empty(d, roles=("decode",))
        wait_for(lambda: metric(d, "decode", "kvguard_aborts_total") >= 1, "decode to count an abort")
        assert metric(d, "decode", "kvguard_aborts_total", cause="client_disconnect") == 0


async def test_a_prefill_leg_that_fails_first_leaves_the_ticket_to_decode() -> None:
    """Outside probe: right after prefill died (workers run apart), its leg failed before decode's
    bootstrap; cancelling the leg's ticket delivery cancelled the ticket future itself, and the
    bootstrap then read as "decode sent a second bootstrap": clients were told decode failed, and
    router and decode counted `decode_failed`. The delivery waits on the ticket shielded now.
    (The control call is a stand-in that refuses the connection, as a dead prefill's port does.)"""
    import asyncio
    from types import SimpleNamespace

    import aiohttp

    from kvguard.workers.protocol import PrefillRequest, SamplingParams
    from kvguard.workers.router import Router

    def refused(*_: object, **__: object) -> None:
        raise aiohttp.ClientConnectionError("connection refused")

    ticket: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    request = PrefillRequest(request_id="cmpl-x", prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2))
    with pytest.raises(aiohttp.ClientConnectionError):
        await Router._prefill(SimpleNamespace(_control_call=refused), "http://prefill", request, ticket)  # type: ignore[arg-type]
    assert not ticket.done()  # decode's bootstrap can still set it: the prefill error is the one reported


def test_prefill_dying_while_decode_queues_the_request_ends_it_with_the_routers_cause_s4(tiny_model_dir: Path) -> None:
    """The router now waits for decode's answer and prefill's failure together. Giving up on the
    decode call by cancelling it, before the aborts went out, closed the connection first: decode
    counted a client disconnect, which the paging rules leave out (a review found it). Decode
    records the router's cause, and frees everything."""
    with deployment(tiny_model_dir, max_running_requests=1) as d:
        api = client(d, timeout=120)
        model = served_model(d)
        holder = api.completions.create(model=model, prompt="holds decode's one slot", max_tokens=900, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        chunks = iter(holder)
        next(chunks)
        disconnects = metric(d, "decode", "kvguard_aborts_total", cause="client_disconnect")
        with cf.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(api.completions.create, model=model, prompt="queued on decode", max_tokens=8, temperature=0)
            wait_for(lambda: metric(d, "decode", "kvguard_waiting_requests") == 1, "the second request waiting on decode")
            d.kill("prefill")
            with pytest.raises(openai.APIError):
                queued.result(timeout=120)
        causes = ("worker_died", "prefill_error", "transfer_failed", "bootstrap_timeout")
        wait_for(lambda: sum(metric(d, "decode", "kvguard_aborts_total", cause=c) for c in causes) >= 1,
                 "decode to count the router's cause for the queued request")  # fmt: skip
        # No abort went to the dead prefill: the one restarted on its port took it from the backlog
        # and refused it as signed for another instance, an S9 refusal with no attacker (an outside
        # probe: one per failed choice, on every crash).
        wait_healthy(d)
        assert metric(d, "prefill", "kvguard_control_auth_failures_total", reason="wrong_target") == 0
        assert metric(d, "decode", "kvguard_aborts_total", cause="client_disconnect") == disconnects
        # The holder's abort (if it is still streaming) goes to the restarted prefill too: signed for
        # the instance now there, read again after the connection failed, not refused as another's.
        holder.close()
        wait_pools_empty(d, roles=("decode",))
        assert metric(d, "prefill", "kvguard_control_auth_failures_total", reason="wrong_target") == 0


def test_a_request_that_times_out_queued_on_decode_is_counted_there_as_the_routers_timeout_s4(tiny_model_dir: Path) -> None:
    """Decode's one slot is held by a request whose KV is late (prefill delayed), so the other
    waits on decode; both reach the router's first-token deadline. The deadline cancelled the
    queued one's decode call itself, before the aborts went out: decode counted a client
    disconnect, not the router's timeout (an outside probe: 15 of 15)."""
    with deployment(tiny_model_dir, faults="delay_prefill_ms=4000", max_running_requests=1, request_timeout_s=2.0) as d:
        api = client(d, timeout=120)
        model = served_model(d)
        with cf.ThreadPoolExecutor(2) as pool:
            sent = [pool.submit(api.completions.create, model=model, prompt=f"late {i}", max_tokens=4, temperature=0) for i in range(2)]
            wait_for(lambda: metric(d, "decode", "kvguard_waiting_requests") == 1, "one request waiting on decode")
            for future in sent:
                with pytest.raises(openai.APIStatusError) as timed_out:
                    future.result(timeout=120)
                assert timed_out.value.status_code == 504
        wait_for(lambda: metric(d, "decode", "kvguard_aborts_total", cause="timeout") == 2, "decode to count both as timeouts")
        assert metric(d, "decode", "kvguard_aborts_total", cause="client_disconnect") == 0
        wait_pools_empty(d)


def test_decode_dying_mid_request_fails_the_client_and_frees_prefill_s4(tiny_model_dir: Path) -> None:
    with deployment(tiny_model_dir) as d:
        api = client(d)
        stream = api.completions.create(model=served_model(d), prompt="victim", max_tokens=900, temperature=0, stream=True)
        next(iter(stream))
        d.kill("decode")
        with pytest.raises(openai.APIError) as caught:
            list(stream)
        # What happened, not aiohttp's wording ("Response payload is not completed: <TransferEncodingError: 400 ...>")
        assert "payload" not in caught.value.message and "Error" not in caught.value.message, caught.value.message
        wait_pools_empty(d, roles=("prefill",))
        wait_healthy(d)
        assert complete(d, "after the restart", 8) == reference_text(tiny_model_dir, "after the restart", 8)


def test_sigterm_to_every_role_at_once_lets_a_stream_in_flight_finish(tiny_model_dir: Path) -> None:
    """Deleting a revision's Deployments sends SIGTERM to its router, prefill and decode pods at
    once: the stream in flight still ends whole, as it would have (servers.Drain), because the
    router finishes what it has and decode and prefill serve it until they hold nothing. SIGINT,
    by contrast, stops at once, also in the middle of a drain (`kvguard serve`'s own stop)."""
    with deployment(tiny_model_dir) as d:
        api = client(d)
        stream = api.completions.create(model=served_model(d), prompt="drained", max_tokens=600, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        popens = [d.processes[role].popen for role in ("router", "prefill", "decode")]
        for popen in popens:
            assert popen is not None
            popen.send_signal(signal.SIGTERM)
        chunks_after = list(chunks)
        assert chunks_after[-2].choices[0].finish_reason == "length"
        assert chunks_after[-1].usage is not None and chunks_after[-1].usage.completion_tokens == 600
        for popen in popens:
            assert popen is not None and popen.wait(60) == 0  # each stopped by itself once its requests were done
        wait_healthy(d)  # the launcher restarts them, as a Deployment would
        stream = api.completions.create(model=served_model(d), prompt="cut", max_tokens=900, temperature=0, stream=True)
        next(iter(stream))
        popen = d.processes["decode"].popen
        assert popen is not None
        popen.send_signal(signal.SIGTERM)
        popen.send_signal(signal.SIGINT)  # Ctrl-C in the middle of a drain: stop now
        with pytest.raises(openai.APIError):
            list(stream)


@pytest.mark.parametrize("token_channel", [True, False])
def test_a_decode_call_closed_unanswered_is_sent_once_more_s4(tiny_model_dir: Path, token_channel: bool) -> None:
    """A pooled connection to a decode worker whose drain just ended (or whose pod just died)
    closes under the leg in transit: that request failed with a 502 (an A/B probe of a worker
    signalled alone). Before decode's answer nothing reached prefill, so the router sends the leg
    once more."""
    with deployment(tiny_model_dir, "cut_decode_calls=1", token_channel=token_channel) as d:
        assert complete(d, "cut once", 8) == reference_text(tiny_model_dir, "cut once", 8)
        assert metric(d, "router", "kvguard_requests_total", outcome="failed") == 0


def test_a_decode_call_closed_unanswered_twice_fails_and_frees_both_pools_s4(tiny_model_dir: Path) -> None:
    """Once more, not for ever: a second cut is the request's failure, with nothing left held."""
    with deployment(tiny_model_dir, "cut_decode_calls=2") as d:
        failed = failed_completion(d, "cut twice")  # waits for both pools to be empty
        assert (failed.status, failed.code) == (502, "worker_failed")
        assert complete(d, "after the cuts", 8) == reference_text(tiny_model_dir, "after the cuts", 8)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_worker_signalled_alone_serves_on_and_closes_each_connection_after_its_answer(tiny_model_dir: Path, role: str) -> None:
    """A node drained under a serving revision: one worker gets SIGTERM while its router serves on.
    It finishes what it holds and still serves what comes (a router draining with it may need
    it), but every answer now says `Connection: close`, so the router's pooled connections stop
    bringing it legs: on a cluster the next connection goes to a pod that is not leaving."""

    def says_close() -> bool:
        return internal(d, role, "/internal/health").headers.get("Connection", "").lower() == "close"

    # A leg on each worker that waits until the test aborts it (decode for prefill's KV, prefill
    # for its ticket): the signalled worker's drain lasts exactly as long as the test needs.
    held = {"request_id": "cmpl-held", "prompt_token_ids": [7, 8, 9], "sampling": {"max_tokens": 2}}
    with deployment(tiny_model_dir) as d, cf.ThreadPoolExecutor(1) as pool:
        assert not says_close()
        with internal(d, "decode", "/internal/decode", held, stream=True, timeout=60) as decode_leg:
            assert decode_leg.status_code == 200
            prefill_leg = pool.submit(internal, d, "prefill", "/internal/prefill", held, timeout=60)
            wait_for(lambda: all(pools_used(d).values()), "both workers to hold the leg")
            popen = d.processes[role].popen
            assert popen is not None
            popen.send_signal(signal.SIGTERM)
            wait_for(says_close, f"{role}'s answers to close their connections")
            assert complete(d, "while it drains", 8) == reference_text(tiny_model_dir, "while it drains", 8)
            assert popen.poll() is None  # still draining: it holds the leg
            other = "prefill" if role == "decode" else "decode"
            assert internal(d, other, "/internal/abort", {"request_id": "cmpl-held"}).ok
            # Its last leg: the drain ends with it, and the worker may stop before it answers.
            with contextlib.suppress(requests.ConnectionError):
                internal(d, role, "/internal/abort", {"request_id": "cmpl-held"})
            with contextlib.suppress(requests.ConnectionError):  # an aborted leg's call is closed unanswered
                assert prefill_leg.result(timeout=60).status_code != 200
        assert popen.wait(60) == 0  # stopped by itself once it held nothing
        wait_pools_empty(d)


def test_a_draining_router_refuses_requests_on_open_connections_and_ends_streams_past_the_grace_with_an_error(
    tiny_model_dir: Path,
) -> None:
    """Outside probe of the drain: a request on a keep-alive connection opened before SIGTERM was
    still served (a pooling proxy kept a retiring router busy for its whole grace, then its last
    requests got no answer), and a stream still going when the grace ended was cut with no error
    event. Now such a request gets 503 `shutting_down` and its connection closes; at the end of the
    grace a stream still going ends with a `shutting_down` error event, a whole answer still being
    made is a 503 `shutting_down`: never a bare close."""
    with deployment(tiny_model_dir, drain_timeout_s=1.0, context_length=4096, kv_pool_tokens=10 * 4096) as d:
        kept, polling = requests.Session(), requests.Session()
        model = served_model(d)
        assert kept.post(f"{d.api_base}/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30).ok
        assert polling.get(f"{d.api_base}/models", timeout=30).ok
        ends: list[bytes] = []
        started = [threading.Event() for _ in range(8)]

        def stream(i: int) -> None:
            body = {"model": model, "prompt": f"long {i}", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            last = b""
            try:
                with requests.post(f"{d.api_base}/completions", json=body, stream=True, timeout=60) as response:
                    for line in response.iter_lines():
                        if line:
                            last = line
                            started[i].set()
            except requests.RequestException as exc:  # a stream cut without its end
                last = repr(exc).encode()
            ends.append(last)

        whole: list[requests.Response] = []

        def ask_whole() -> None:
            body = {"model": model, "prompt": "whole", "max_tokens": 4000, "ignore_eos": True}
            whole.append(requests.post(f"{d.api_base}/completions", json=body, timeout=60))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)] + [threading.Thread(target=ask_whole)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60)
        wait_for(lambda: metric(d, "decode", "kvguard_running_requests") >= 9, "all nine generations at decode", 120)
        router = d.processes["router"].popen
        assert router is not None
        router.send_signal(signal.SIGTERM)
        health = f"{d.url(d.ports['router-metrics'])}/health"
        wait_for(lambda: requests.get(health, timeout=5).json().get("status") == "draining", "the router draining",
                 ignoring=(requests.RequestException,))  # a busy router's slow answer: asked again  # fmt: skip
        refused = kept.post(f"{d.api_base}/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["Retry-After"] == "1"  # as every 503 of the router's (a review)
        assert refused.headers.get("Connection", "").lower() == "close"
        listed = polling.get(f"{d.api_base}/models", timeout=30)  # any other answer closes its connection too
        assert listed.ok and listed.headers.get("Connection", "").lower() == "close"
        for thread in threads:
            thread.join(60)
        assert len(ends) == 8 and all(end == b"data: [DONE]" or b'"shutting_down"' in end for end in ends), ends
        assert any(b'"shutting_down"' in end for end in ends)  # 8 x 4000 tokens outlast a 1 s grace
        assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "shutting_down"
        assert router.wait(60) == 0


def test_a_hung_decode_leaves_the_rotation_and_comes_back_when_it_answers(tiny_model_dir: Path) -> None:
    """A SIGSTOPped decode answers nothing, and is not dead: requests sent to it waited for the
    request timeout. After MAX_SILENT_READS timed-out reads the router refuses at once (503), and
    serves again once the worker answers."""
    with deployment(tiny_model_dir) as d:
        assert complete(d, "before", 4)
        model = served_model(d)
        decode = d.processes["decode"].popen
        assert decode is not None
        decode.send_signal(signal.SIGSTOP)
        try:
            def refused_at_once() -> bool:
                try:  # until it is out of rotation, a request waits on the hung worker: give up on it soon
                    client(d, timeout=5).completions.create(model=model, prompt="while hung", max_tokens=4)
                except openai.APITimeoutError:
                    return False
                except openai.APIStatusError as err:
                    return (err.status_code, err.code) == (503, "not_ready")
                return False

            wait_for(refused_at_once, "the router to take the hung decode out of rotation", 120)
            health = requests.get(f"{d.router_url}/health", timeout=30)
            assert (health.status_code, health.json()) == (503, {"status": "unreachable", "role": "decode"})
            # Not ready, but alive: the router's liveness probe asks /livez, which does not judge
            # its workers (as liveness, /health had every router restarted for a worker down).
            live = requests.get(f"{d.url(d.ports['router-metrics'])}/livez", timeout=30)
            assert (live.status_code, live.json()) == (200, {"status": "ok"})
        finally:
            decode.send_signal(signal.SIGCONT)
        wait_for(lambda: _outcome(d, "after")[0] == "ok", "the decode worker back in rotation", 60, 0.5)
        assert complete(d, "after", 8) == reference_text(tiny_model_dir, "after", 8)


def test_abort_during_transfer_ends_both_legs_s4(tiny_model_dir: Path) -> None:
    """Class B (dynamo#7489): the client leaves while its KV is in flight. The first chunk is held
    back longer than the test can take, so the KV is still in flight when the client hangs up."""
    with deployment(tiny_model_dir, f"delay_chunk_ms={CHUNK_DELAY_S * 1000}") as d:
        with hang_up_after(d, {"prompt": "leaving", "max_tokens": 8, "temperature": 0}):
            wait_for(lambda: all(pools_used(d).values()), "the request's KV allocated on both sides")
        wait_pools_empty(d)  # well before the transfer timeout: freed by the abort
        wait_metric(d, "router", "kvguard_aborts_total", 1, cause="client_disconnect")
        assert metric(d, "router", "kvguard_aborts_total", cause="client_disconnect") == 1


def test_late_write_after_abort_never_reaches_the_next_owner_s5(tiny_model_dir: Path) -> None:
    """Class E (sglang#24527): A's pages are freed and handed to B while A's writer is still out
    there; A's late chunk must be refused and B must read only its own KV."""
    with deployment(tiny_model_dir, kv_pool_tokens=64, context_length=64, allow_small_pool=True) as d:
        a = {"request_id": "writer-A", "prompt_token_ids": list(range(1, 31)), "sampling": {"max_tokens": 20, "temperature": 0}}
        with internal(d, "decode", "/internal/decode", a, stream=True) as leg:
            bootstrap = json.loads(next(line for line in leg.iter_lines() if line))["bootstrap"]
        internal(d, "decode", "/internal/abort", {"request_id": "writer-A"})
        wait_pools_empty(d)
        b_prompt = "B owns these pages now"
        b_stream = client(d).completions.create(
            model=served_model(d), prompt=b_prompt, max_tokens=30, temperature=0, stream=True
        )
        chunks = iter(b_stream)
        b_text = next(chunks).choices[0].text
        # A's writer still holds a valid ticket for pages that are B's now.
        late = internal(d, "prefill", "/internal/prefill", {**a, "ticket": ticket_for(d, "writer-A", bootstrap)})
        assert late.status_code == 502  # decode refused A's KV: its lease is gone
        b_text += "".join(c.choices[0].text for c in chunks)
        assert b_text == reference_text(tiny_model_dir, b_prompt, 30, kv_pool_tokens=64, context_length=64)
        wait_pools_empty(d)


def test_soak_with_random_aborts_every_output_equals_its_solo_reference(tiny_model_dir: Path) -> None:
    """Class I (sglang#23020): many requests, random disconnects, a pool so small pages are reused
    constantly; no output may differ from the same request served alone. The clients chosen to
    leave read their first streamed chunk and hang up (mid-decode unless their request was already
    done); every other request must complete, whatever the machine's speed."""
    pool, context = 256, 128
    rng = random.Random(11)
    prompts = [f"soak {i} " + "z" * rng.randrange(0, 60) for i in range(60)]
    leave = {i for i in range(60) if rng.random() < 0.3}
    with deployment(tiny_model_dir, kv_pool_tokens=pool, context_length=context) as d:

        def run(i: int) -> str:
            if i in leave:
                return first_chunk_then_leave(d, prompts[i], max_tokens=24)
            return complete(d, prompts[i], max_tokens=24)

        with cf.ThreadPoolExecutor(6) as executor:
            outputs = list(executor.map(run, range(60)))
        for i, text in enumerate(outputs):
            solo = reference_text(tiny_model_dir, prompts[i], 24, kv_pool_tokens=pool, context_length=context)
            if i in leave:
                assert solo.startswith(text), (i, text, solo)  # what a leaver got was its own output so far
            else:
                assert text == solo, i
        wait_pools_empty(d)
        for role in ("prefill", "decode"):
            assert metric(d, role, "kvguard_tag_violations_total") == 0


def test_sigterm_stops_a_prefill_whose_requests_wait_for_tickets_within_the_grace(tiny_model_dir: Path) -> None:
    """Decode's pool holds 4 of these requests; prefill computes the rest ahead and waits for their
    tickets. SIGTERM must still stop prefill within its grace (--drain-timeout to finish what
    it holds, then SHUTDOWN_GRACE_S), not aiohttp's 60 s: past a pod's 30 s termination grace it
    would be SIGKILLed."""
    from kvguard.workers.args import DEFAULT_DRAIN_TIMEOUT_S
    from kvguard.workers.servers import SHUTDOWN_GRACE_S

    assert DEFAULT_DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S <= 20  # leaves a pod's default 30 s room to exit

    with deployment(tiny_model_dir, kv_pool_tokens=4096, context_length=1024) as d:
        with cf.ThreadPoolExecutor(6) as pool:
            for i in range(6):
                pool.submit(_outcome, d, f"long request {i} " * 3, 900)
            wait_for(lambda: metric(d, "decode", "kvguard_running_requests") >= 4 and metric(d, "prefill", "kvguard_running_requests") >= 1,
                     "decode's pool full, prefill holding the rest", 120)  # fmt: skip
            prefill = d.processes["prefill"].popen
            assert prefill is not None
            started = time.monotonic()
            prefill.send_signal(signal.SIGTERM)
            prefill.wait(timeout=60)
            assert prefill.returncode == 0 and time.monotonic() - started < 30
            d.stop()
