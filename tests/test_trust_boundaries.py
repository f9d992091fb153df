"""S9 on a real router + prefill + decode trio: identity, authenticated control, the prefill
signing oracle, one audience per port. Each test is an attack of issue 11 that worked before.

Tenants use the public API (the official client or plain HTTP); "another pod" calls the internal
control API without the revision key; tests that must get past that layer to reach the next one
sign their calls as the router does (pd_harness.internal)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from pd_harness import (
    deployment,
    internal,
    metric,
    pools_used,
    reference_text,
    second_router,
    ticket_for,
    wait_metric,
    wait_pools_empty,
)
from waiting import wait_for

from kvguard.workers.control_auth import AUTH_HEADER, auth_headers
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.launcher import LocalDeployment
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.prefill_server import EarlyBudget, PrefillJob
from kvguard.workers.serving import Job, Jobs
from kvguard.workers.transfer import TicketAuthority

TIMEOUT_S = 30  # "no hang" (S4): every answer comes within this
PROMPT_A = "tenant A writes a long story about"


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as running:
        yield running


def _stream(base: str, prompt: str, max_tokens: int, label: str | None = None) -> requests.Response:
    headers = {"X-Request-Id": label} if label else {}
    body = {"model": _model(base), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    response = requests.post(f"{base}/completions", json=body, headers=headers, stream=True, timeout=TIMEOUT_S)
    assert response.status_code == 200
    return response


def _model(base: str) -> str:
    return str(requests.get(f"{base}/models", timeout=TIMEOUT_S).json()["data"][0]["id"])


def _events(response: requests.Response) -> Iterator[dict | str]:
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            yield data if data == "[DONE]" else json.loads(data)


def _finish(events: Iterator[dict | str], first: dict) -> str:
    """The whole text of a stream whose first event was ``first``; asserts it ended cleanly."""
    text = first["choices"][0]["text"]
    for event in events:
        if event == "[DONE]":
            return text
        assert isinstance(event, dict) and "error" not in event, event
        text += event["choices"][0]["text"]
    raise AssertionError("the stream ended without [DONE]")


def _whole(base: str, prompt: str, max_tokens: int, label: str | None = None, timeout: float = TIMEOUT_S) -> requests.Response:
    headers = {"X-Request-Id": label} if label else {}
    body = {"model": _model(base), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return requests.post(f"{base}/completions", json=body, headers=headers, timeout=timeout)


# -- identity -------------------------------------------------------------------------------------


def test_a_tenant_reusing_anothers_request_id_through_another_router_cannot_abort_it_s9(
    trio: LocalDeployment, tiny_model_dir: Path
) -> None:
    """Issue 11, item 1: B sends A's X-Request-Id through the second router, succeeds, then goes
    away mid-request (its router aborts its legs); A's stream on the first router is untouched."""
    with second_router(trio, tiny_model_dir) as other:
        a = _stream(trio.api_base, PROMPT_A, 300, label="shared-trace-id")
        events = _events(a)
        first = next(events)
        assert isinstance(first, dict)
        b = _whole(other, "tenant B", 6, label="shared-trace-id")
        assert b.status_code == 200 and b.headers["X-Request-Id"] == "shared-trace-id"
        assert b.json()["choices"][0]["text"] == reference_text(tiny_model_dir, "tenant B", 6)
        leaving = _stream(other, "tenant B leaves", 400, label="shared-trace-id")
        assert isinstance(next(_events(leaving)), dict)
        leaving.close()  # B leaves mid-stream (whatever the machine's speed): router 2 aborts B's legs
        assert _finish(events, first) == reference_text(tiny_model_dir, PROMPT_A, 300)
        assert first["id"] != "shared-trace-id"  # the response id is the router's internal id
    wait_pools_empty(trio)


def test_a_retry_that_keeps_its_request_id_succeeds_and_never_hangs_s4_s9(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    """Issue 11, item 1: a finished id re-used got 502, an in-flight one no answer at all."""
    expected = reference_text(tiny_model_dir, "retry me", 8)
    for _ in range(3):  # the same label, one after another (a finished id)
        answer = _whole(trio.api_base, "retry me", 8, label="client-retry-1")
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
    with cf.ThreadPoolExecutor(4) as pool:  # and all at once (in flight)
        answers = list(pool.map(lambda _: _whole(trio.api_base, "retry me", 8, label="client-retry-1"), range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.json()["choices"][0]["text"] for a in answers} == {expected}
    assert len({a.json()["id"] for a in answers}) == 4  # four requests, four internal ids


@pytest.mark.parametrize("label", ["x" * 129, "caf\u00e9", "has space", "tab\there", ""])
def test_a_bad_request_id_label_is_a_400_naming_it(trio: LocalDeployment, label: str) -> None:
    answer = requests.post(f"{trio.api_base}/completions", json={"model": _model(trio.api_base), "prompt": "hi", "max_tokens": 2},
                           headers={"X-Request-Id": label.encode("utf-8")}, timeout=TIMEOUT_S)  # type: ignore[dict-item]
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_request_id" and answer.json()["error"]["param"] == "X-Request-Id"
    assert "X-Request-Id" not in answer.headers  # an invalid label is never echoed


def test_two_request_id_labels_are_a_400_not_the_first_silently(trio: LocalDeployment) -> None:
    import http.client

    host, port = trio.router_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    body = json.dumps({"model": _model(trio.api_base), "prompt": "hi", "max_tokens": 2})
    connection.putrequest("POST", "/v1/completions")
    for header, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                          ("X-Request-Id", "first"), ("X-Request-Id", "second")):  # fmt: skip
        connection.putheader(header, value)
    connection.endheaders(body.encode())
    answer = connection.getresponse()
    error = json.loads(answer.read())["error"]
    assert answer.status == 400 and error["code"] == "invalid_request_id" and answer.getheader("X-Request-Id") is None
    connection.close()


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)])
def test_a_label_is_echoed_on_answers_no_handler_gave(trio: LocalDeployment, method: str, path: str, status: int) -> None:
    answer = requests.request(method, f"{trio.router_url}{path}", headers={"X-Request-Id": "t-404"}, timeout=TIMEOUT_S)
    assert answer.status_code == status and answer.headers["X-Request-Id"] == "t-404"


def test_without_a_label_the_response_header_carries_the_internal_id(trio: LocalDeployment) -> None:
    answer = _whole(trio.api_base, "no label", 2)
    assert answer.status_code == 200 and answer.headers["X-Request-Id"] == answer.json()["id"]
    assert len(answer.json()["id"].split("-", 1)[1]) == 32  # 128 random bits


# -- authenticated control --------------------------------------------------------------------------

CALLS = [
    ("GET", "/internal/info", None),
    ("GET", "/internal/health", None),
    ("POST", "/internal/abort", {"request_id": "cmpl-victim"}),
]


def _unsigned(d: LocalDeployment, role: str, method: str, path: str, body: dict | None, headers: dict | None = None) -> requests.Response:
    return requests.request(method, f"{d.internal_urls[role]}{path}", json=body, headers=headers or {}, timeout=TIMEOUT_S)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_internal_endpoints_refuse_calls_not_signed_by_the_router_s9(trio: LocalDeployment, role: str) -> None:
    leg = {"request_id": "cmpl-x", "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 2}}
    own = [("POST", "/internal/decode", leg), ("POST", "/internal/stream", {})] if role == "decode" else [
        ("POST", "/internal/prefill", {**leg, "ticket": "AA"}), ("POST", "/internal/prefill", leg),
        ("POST", "/internal/ticket", {"request_id": "cmpl-x", "ticket": "AA"})]  # fmt: skip
    calls = [*CALLS, *own]
    before = metric(trio, role, "kvguard_control_auth_failures_total")
    for method, path, body in calls:
        forged = f"v3 ts={int(time.time() * 1000)} nonce={secrets.token_hex(16)} target=any sha256={'0' * 64} mac={'0' * 64}"
        for headers in ({}, {AUTH_HEADER: forged}):  # well formed and fresh, without the key
            refused = _unsigned(trio, role, method, path, body, headers)
            assert refused.status_code == 401, (method, path, refused.text)
            assert refused.json()["error"]["code"] == "unauthenticated"
    assert metric(trio, role, "kvguard_control_auth_failures_total") == before + 2 * len(calls)
    assert pools_used(trio) == {"prefill": 0, "decode": 0}


def test_a_captured_router_call_cannot_be_replayed_or_repurposed_s9(trio: LocalDeployment) -> None:
    signed = internal(trio, "decode", "/internal/abort", {"request_id": "cmpl-someone"})
    assert signed.status_code == 200
    header = signed.request.headers[AUTH_HEADER]
    body = signed.request.body
    url = trio.internal_urls["decode"]
    again = requests.post(f"{url}/internal/abort", data=body, headers={AUTH_HEADER: header, "Content-Type": "application/json"}, timeout=5)
    other_path = requests.post(f"{url}/internal/decode", data=body, headers={AUTH_HEADER: header}, timeout=5)
    other_id = requests.post(f"{url}/internal/abort", json={"request_id": "cmpl-victim"}, headers={AUTH_HEADER: header}, timeout=5)
    assert [r.status_code for r in (again, other_path, other_id)] == [401, 401, 401]
    assert metric(trio, "decode", "kvguard_control_auth_failures_total", reason="replay") >= 1


def test_a_call_captured_on_its_way_to_one_worker_is_refused_by_another_s9(trio: LocalDeployment) -> None:
    """Every worker of a revision holds the same key and keeps its own replay cache: a prefill call
    captured on its way to one replica made another compute the prompt and hold its pages (outside
    probe). A call that acts is signed for one worker instance; here decode's abort, replayed to
    prefill (which has the same endpoint), is refused there, as it is by decode itself."""
    signed = internal(trio, "decode", "/internal/abort", {"request_id": "cmpl-someone"})
    assert signed.status_code == 200
    header = {AUTH_HEADER: signed.request.headers[AUTH_HEADER], "Content-Type": "application/json"}
    before = metric(trio, "prefill", "kvguard_control_auth_failures_total", reason="wrong_target")
    elsewhere = requests.post(f"{trio.internal_urls['prefill']}/internal/abort", data=signed.request.body, headers=header, timeout=5)
    assert elsewhere.status_code == 401 and "another worker" in elsewhere.json()["error"]["message"]
    assert metric(trio, "prefill", "kvguard_control_auth_failures_total", reason="wrong_target") == before + 1
    unbound = _unsigned(trio, "prefill", "POST", "/internal/abort", {"request_id": "cmpl-someone"},
                        auth_headers(trio.keys.control, "POST", f"{trio.internal_urls['prefill']}/internal/abort",
                                     b'{"request_id": "cmpl-someone"}'))  # fmt: skip
    assert unbound.status_code == 401  # signed with the key, but for any worker: only reads may be
    assert internal(trio, "prefill", "/internal/abort", {"request_id": "cmpl-someone"}).status_code == 200


def test_an_unsigned_abort_cannot_end_another_tenants_stream_s9(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    """Even knowing the victim's internal id (its response id), another pod's abort is refused."""
    a = _stream(trio.api_base, PROMPT_A, 200)
    events = _events(a)
    first = next(events)
    assert isinstance(first, dict)
    for role in ("decode", "prefill"):
        refused = _unsigned(trio, role, "POST", "/internal/abort", {"request_id": first["id"]})
        assert refused.status_code == 401
    assert _finish(events, first) == reference_text(tiny_model_dir, PROMPT_A, 200)


def test_the_metrics_port_serves_no_internal_endpoint_s9(trio: LocalDeployment) -> None:
    """Issue 11, item 3: scrapers reach only /metrics and /health."""
    for role, metrics_url in trio.metrics_urls.items():
        base = metrics_url.removesuffix("/metrics")
        for path in ("/internal/info", "/internal/health", "/internal/abort", "/internal/decode", "/internal/stream",
                     "/internal/prefill", "/internal/ticket"):
            for method in ("GET", "POST"):
                signed = internal(trio, "decode", "/internal/info")  # a real router header, for the wrong port
                got = requests.request(method, f"{base}{path}", json={}, headers={AUTH_HEADER: signed.request.headers[AUTH_HEADER]}, timeout=5)
                assert got.status_code in (404, 405), (role, method, path)
                assert "error" in got.json(), (role, method, path)  # an OpenAI error body on every listener
        assert requests.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=5).status_code == 404


# -- prefill is not a signing oracle ------------------------------------------------------------------


class Spy:
    """A port an attacker wants prefill to connect to (and stream signed frames into)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()[:2]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_prefill_sends_nowhere_without_a_ticket_the_router_issued_s9(trio: LocalDeployment) -> None:
    """Issue 11, item 2: /internal/prefill trusted any bootstrap, so any pod could make prefill
    connect anywhere and sign frames for chosen ids and pages. Now the destination exists only
    inside the router's ticket: forged, tampered, expired or foreign tickets are refused before
    any compute, and nothing connects to the attacker's port."""
    spy = Spy()
    rid = "cmpl-attack"
    leg = {"request_id": rid, "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}
    bootstrap = {"transfer_host": spy.address[0], "transfer_port": spy.address[1], "page_ids": [0], "generations": [1],
                 "num_tokens": 3, "nonce": "11" * 16, "epoch": 7}  # fmt: skip
    genuine = ticket_for(trio, rid, {**bootstrap, "transfer_port": 9})
    blob = bytearray(base64.urlsafe_b64decode(genuine))
    port_at = blob.index((9).to_bytes(2, "little") + (7).to_bytes(8, "little"))
    blob[port_at : port_at + 2] = spy.address[1].to_bytes(2, "little")  # redirect, keep the MAC
    attacker = TicketAuthority(RevisionKeys.derive(b"attacker-chosen-key-0123456789").ticket)
    forged = attacker.issue(rid, spy.address, 7, bytes(16), 3, (0,), (1,), 30).text
    an_hour_ago = TicketAuthority(trio.keys.ticket, clock=lambda: time.time() - 3600)  # a genuine, old ticket
    expired = an_hour_ago.issue(rid, spy.address, 7, bytes(16), 3, (0,), (1,), 30).text
    before = pools_used(trio)
    try:
        legacy = internal(trio, "prefill", "/internal/prefill", {**leg, "bootstrap": bootstrap})
        assert legacy.status_code == 400  # the old field does not exist any more
        cases = {
            "forged": forged,
            "tampered": base64.urlsafe_b64encode(bytes(blob)).decode(),
            "expired": expired,
            "another request": ticket_for(trio, "cmpl-someone-else", bootstrap),
        }
        for case, ticket in cases.items():
            answer = internal(trio, "prefill", "/internal/prefill", {**leg, "ticket": ticket})
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "invalid_ticket", (case, answer.text)
        unsigned = _unsigned(trio, "prefill", "POST", "/internal/prefill", {**leg, "ticket": genuine})
        assert unsigned.status_code == 401
    finally:
        spy.close()
    assert spy.connections == 0, "prefill connected to an address no genuine ticket named"
    assert pools_used(trio) == before
    assert metric(trio, "prefill", "kvguard_ticket_rejections_total", reason="bad_mac") >= 2
    assert metric(trio, "prefill", "kvguard_ticket_rejections_total", reason="mismatch") >= 1
    assert metric(trio, "prefill", "kvguard_ticket_rejections_total", reason="expired") >= 1


def test_a_ticket_whose_plan_differs_from_prefills_kv_is_counted_as_a_prefill_error_s4(trio: LocalDeployment) -> None:
    """A genuine ticket that plans other tokens than prefill computed (kv_plan_mismatch: page sizes
    differ) fails before OPEN (`_check_plan`). The request was counted as a client disconnect, which
    the paging alerts leave out; it is prefill's own failure, and its pages are freed (S4). (Prefill
    then tries to tell decode, here the spy: test_pd_serving's plan-mismatch test.)"""
    spy = Spy()
    rid = "cmpl-plan-mismatch"
    leg = {"request_id": rid, "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}
    bootstrap = {"transfer_host": spy.address[0], "transfer_port": spy.address[1], "page_ids": [0], "generations": [1],
                 "num_tokens": 5, "nonce": "22" * 16, "epoch": 7}  # fmt: skip
    disconnects = metric(trio, "prefill", "kvguard_aborts_total", cause="client_disconnect")
    errors = metric(trio, "prefill", "kvguard_aborts_total", cause="prefill_error")
    try:
        answer = internal(trio, "prefill", "/internal/prefill", {**leg, "ticket": ticket_for(trio, rid, bootstrap)}, timeout=TIMEOUT_S)
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "kv_plan_mismatch", answer.text
    finally:
        spy.close()
    wait_pools_empty(trio, roles=("prefill",))
    wait_metric(trio, "prefill", "kvguard_aborts_total", errors + 1, cause="prefill_error")
    assert metric(trio, "prefill", "kvguard_aborts_total", cause="client_disconnect") == disconnects


def test_prefill_computes_before_its_ticket_and_sends_nothing_until_one_verifies_s9(trio: LocalDeployment) -> None:
    """The router starts prefill with decode (issue 14: prefill computes while decode allocates),
    so the ticket follows in POST /internal/ticket. Computing needs the router's signed call;
    sending needs a verified ticket: while none is here, prefill holds its KV and connects nowhere,
    and a refused ticket ends the request (403 on both calls, pages freed)."""
    spy = Spy()
    leg = {"request_id": "cmpl-early", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}
    attacker = TicketAuthority(RevisionKeys.derive(b"attacker-chosen-key-0123456789").ticket)
    forged = attacker.issue("cmpl-early", spy.address, 7, bytes(16), 3, (0,), (1,), 30).text
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            computing = pool.submit(internal, trio, "prefill", "/internal/prefill", leg, timeout=TIMEOUT_S)
            wait_for(lambda: pools_used(trio, ("prefill",))["prefill"] > 0, "prefill to hold the request's KV")
            assert spy.connections == 0 and not computing.done(), "prefill sent or answered before any ticket"
            delivery = {"request_id": "cmpl-early", "ticket": forged}
            unsigned = _unsigned(trio, "prefill", "POST", "/internal/ticket", delivery)
            assert unsigned.status_code == 401  # another pod cannot hand prefill a destination
            refused = internal(trio, "prefill", "/internal/ticket", delivery)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "invalid_ticket", refused.text
            answer = computing.result(TIMEOUT_S)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "invalid_ticket", answer.text
        wait_pools_empty(trio)
    finally:
        spy.close()
    assert spy.connections == 0, "prefill connected somewhere without a ticket the router issued"


def test_a_second_call_waits_for_the_job_it_names_until_its_deadline() -> None:
    """Jobs.claimed, which the ticket call uses: the job once claimed, None past the deadline."""

    async def scenario() -> None:
        jobs = Jobs()
        waiting = asyncio.ensure_future(jobs.claimed("r1", 30.0))
        while "r1" not in jobs._awaited:  # until it waits: the ticket overtook its request
            await asyncio.sleep(0)
        job = Job("r1", waiting)  # any task stands for the handler's
        jobs.claim(job)
        assert await waiting is job
        assert await jobs.claimed("r1", 0.0) is job  # already there: no wait
        assert await jobs.claimed("nobody", 0.01) is None
        assert not jobs._awaited, "a waiter that gave up left state behind"

    asyncio.run(scenario())


def test_the_early_budget_leaves_one_full_context_to_requests_with_a_ticket_s4() -> None:
    """Prefill computes ahead of a ticket only within its budget (the pool less one context):
    without it the pools deadlock (formal/README.md, mutant unbounded_early)."""
    budget = EarlyBudget(limit_pages=4, limit_requests=10)  # e.g. 8 pages, a context of 4
    assert budget.take(3) and not budget.take(2) and budget.take(1)
    assert not budget.take(1)  # full: the next request waits for its ticket first
    budget.give(3)
    assert budget.take(2) and budget.held_pages == 3
    assert not EarlyBudget(limit_pages=0, limit_requests=10).take(1)  # a pool of one context: the old protocol


def test_the_early_budget_leaves_one_running_slot_to_requests_with_a_ticket_s4() -> None:
    """The same for the engine's max_running slots: one-page requests without tickets must not take
    every slot (a burst deadlocked prefill's 64 slots against decode's 64, well within the pages)."""
    budget = EarlyBudget(limit_pages=100, limit_requests=2)  # max_running 3
    assert budget.take(1) and budget.take(1) and not budget.take(1)
    budget.give(1)
    assert budget.take(1) and (budget.held_pages, budget.held_requests) == (2, 2)
    assert not EarlyBudget(limit_pages=100, limit_requests=0).take(1)  # max_running 1: no computing ahead


def test_a_request_takes_one_ticket() -> None:
    """A second ticket for a request in flight is refused (409), whatever it says."""

    async def scenario() -> None:
        job = PrefillJob("r1", asyncio.ensure_future(asyncio.sleep(0)))
        ticket = TicketAuthority(RevisionKeys.derive(b"k" * 32).ticket).verify_text(
            TicketAuthority(RevisionKeys.derive(b"k" * 32).ticket).issue("r1", ("127.0.0.1", 9), 1, bytes(16), 3, (0,), (1,), 30).text)
        job.deliver(ticket)
        with pytest.raises(OpenAIError) as second:
            job.deliver(ticket)
        assert second.value.status == 409 and job.ticket == ticket
        await job.task

    asyncio.run(scenario())


def test_a_ticket_that_overtakes_its_prefill_call_waits_for_it_s9(trio: LocalDeployment) -> None:
    """The two calls travel on different connections: a ticket may arrive first (sent first here;
    which one the worker reads first is up to the machine) and waits for its request, at most
    until it expires. The KV goes where it says -- here a port that is not
    a decode worker, so the transfer fails and both calls end cleanly. A ticket for a request
    that is not (or no longer) here is refused when it expires."""
    spy = Spy()
    rid = "cmpl-overtaken"
    leg = {"request_id": rid, "prompt_token_ids": [4, 5, 6], "sampling": {"max_tokens": 2}}
    bootstrap = {"transfer_host": spy.address[0], "transfer_port": spy.address[1], "page_ids": [0], "generations": [1],
                 "num_tokens": 3, "nonce": "33" * 16, "epoch": 7}  # fmt: skip
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            delivered = pool.submit(internal, trio, "prefill", "/internal/ticket",
                                    {"request_id": rid, "ticket": ticket_for(trio, rid, bootstrap)}, timeout=TIMEOUT_S)  # fmt: skip
            computing = pool.submit(internal, trio, "prefill", "/internal/prefill", leg, timeout=TIMEOUT_S)
            accepted = delivered.result(TIMEOUT_S)
            assert accepted.status_code == 200 and accepted.json() == {"accepted": True}, accepted.text
            answer = computing.result(TIMEOUT_S)
        assert answer.status_code == 502 and answer.json()["error"]["code"].startswith("kv_transfer_"), answer.text
        assert spy.connections >= 1, "prefill did not send where the genuine ticket said"
        for late_rid in (rid, "cmpl-never-sent"):  # ended, and never here: refused once it expires
            late = internal(trio, "prefill", "/internal/ticket", {"request_id": late_rid, "ticket": ticket_for(trio, late_rid, bootstrap, ttl_s=1.0)})
            assert late.status_code == 404 and late.json()["error"]["code"] == "unknown_request", late.text
        wait_pools_empty(trio)
    finally:
        spy.close()


def test_a_ticket_that_never_comes_ends_the_request_at_prefills_own_deadline_s4(tiny_model_dir: Path) -> None:
    """A router that hangs without closing its call (so no connection close cancels the handler)
    must not hold prefill's pages for ever: past --bootstrap-timeout the request is aborted, its
    pages freed, and the call answers 504 bootstrap_timeout (SGLang's bootstrap timeout does the
    same)."""
    with deployment(tiny_model_dir, bootstrap_timeout_s=1.0) as d:
        leg = {"request_id": "cmpl-no-ticket", "prompt_token_ids": [7, 8, 9], "sampling": {"max_tokens": 2}}
        answer = internal(d, "prefill", "/internal/prefill", leg, timeout=TIMEOUT_S)
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "bootstrap_timeout", answer.text
        wait_pools_empty(d, roles=("prefill",))
        wait_metric(d, "prefill", "kvguard_aborts_total", 1, cause="bootstrap_timeout")
        late = internal(d, "prefill", "/internal/ticket", {"request_id": "cmpl-no-ticket", "ticket": "x"}, timeout=TIMEOUT_S)
        assert late.status_code == 403  # the request is gone; a ticket for it changes nothing


def test_aes_gcm_transfer_serves_the_same_outputs(tiny_model_dir: Path) -> None:
    """kvTransfer.encryption: aes-gcm end to end: the same greedy outputs as the colocated engine."""
    with deployment(tiny_model_dir, transfer_encryption="aes-gcm") as d:
        for prompt in ("encrypted KV", "a" * 50):
            answer = _whole(d.api_base, prompt, 12)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == reference_text(tiny_model_dir, prompt, 12)
        assert metric(d, "decode", "kvguard_checksum_failures_total") == 0
        assert metric(d, "decode", "kvguard_kv_transfer_bytes_total") > 0
