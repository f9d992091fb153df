"""Signed internal HTTP calls (S9): what the worker-side verifier accepts and refuses."""

from __future__ import annotations

import socket

import pytest
from waiting import until

from kvguard.workers.control_auth import ANY_WORKER, AUTH_HEADER, AuthError, ControlVerifier, ReplayCache, auth_headers, sign
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.servers import CappedSockSite

KEYS = RevisionKeys.derive(b"control-test-key-0123456789abcdef")
BODY = b'{"request_id": "cmpl-1", "cause": "client_disconnect"}'
INSTANCE = "ab" * 16  # the verifying worker's instance id


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _verifier(clock: Clock) -> ControlVerifier:
    return ControlVerifier(KEYS.control, instance=INSTANCE, clock=clock)


def _reason(verifier: ControlVerifier, method: str, path: str, body: bytes, header: str | None) -> str:
    with pytest.raises(AuthError) as caught:
        verifier.verify(method, path, body, header)
    return caught.value.reason


def test_a_signed_call_verifies_once() -> None:
    clock = Clock()
    verifier = _verifier(clock)
    header = sign(KEYS.control, "POST", "/internal/abort", BODY, target=INSTANCE, now=clock.now)
    verifier.verify("POST", "/internal/abort", BODY, header)
    assert _reason(verifier, "POST", "/internal/abort", BODY, header) == "replay"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/internal/abort", BODY),  # another method
        ("POST", "/internal/decode", BODY),  # the abort's header on another endpoint
        ("POST", "/internal/abort?x=1", BODY),  # a query added
        ("POST", "/internal/abort", BODY.replace(b"cmpl-1", b"cmpl-2")),  # another request's id
        ("POST", "/internal/abort", b""),
    ],
)
def test_the_mac_binds_method_path_and_body(method: str, path: str, body: bytes) -> None:
    clock = Clock()
    header = sign(KEYS.control, "POST", "/internal/abort", BODY, target=INSTANCE, now=clock.now)
    assert _reason(_verifier(clock), method, path, body, header) == "bad_mac"


def test_a_header_sent_ahead_with_another_body_does_not_use_up_the_real_calls_nonce() -> None:
    """Someone who sees a signed header on the wire and races it with a swapped body is refused,
    and the real call (header and its own body) still verifies: only whole calls enter the cache."""
    clock = Clock()
    verifier = _verifier(clock)
    header = sign(KEYS.control, "POST", "/internal/abort", BODY, target=INSTANCE, now=clock.now)
    assert _reason(verifier, "POST", "/internal/abort", BODY.replace(b"cmpl-1", b"cmpl-2"), header) == "bad_mac"
    verifier.verify("POST", "/internal/abort", BODY, header)
    assert _reason(verifier, "POST", "/internal/abort", BODY, header) == "replay"


def test_missing_malformed_and_foreign_headers_are_refused() -> None:
    clock = Clock()
    verifier = _verifier(clock)
    assert _reason(verifier, "GET", "/internal/info", b"", None) == "missing"
    assert _reason(verifier, "GET", "/internal/info", b"", "Bearer something") == "malformed"
    foreign = RevisionKeys.derive(b"another revision's key..........")
    for key in (foreign.control, KEYS.ticket, KEYS.root):  # another revision, another purpose, the raw key
        assert _reason(verifier, "GET", "/internal/info", b"", sign(key, "GET", "/internal/info", now=clock.now)) == "bad_mac"


def test_timestamps_outside_the_skew_bound_are_refused() -> None:
    clock = Clock()
    verifier = ControlVerifier(KEYS.control, instance=INSTANCE, clock=clock, started=clock.now - 3600)  # long running
    for offset in (-31.0, 31.0):
        header = sign(KEYS.control, "GET", "/internal/info", now=clock.now + offset)
        assert _reason(verifier, "GET", "/internal/info", b"", header) == "stale"
    verifier.verify("GET", "/internal/info", b"", sign(KEYS.control, "GET", "/internal/info", now=clock.now - 29.0))


def test_replay_cache_forgets_only_what_the_clock_already_refuses() -> None:
    cache = ReplayCache(window_s=60.0, capacity=2)
    cache.add("a", 0.0)
    cache.add("b", 1.0)
    with pytest.raises(AuthError, match="too many"):
        cache.add("c", 2.0)  # full: refuse rather than forget a nonce still inside the window
    cache.add("c", 61.5)  # "a" and "b" aged out
    with pytest.raises(AuthError, match="already"):
        cache.add("c", 62.0)


def test_replay_cache_forgets_what_a_clock_stepped_back_refuses() -> None:
    """A wall clock stepped back by more than the window (an NTP correction): the entries from
    before the step are forgotten, as a header they admitted is now refused as stale, rather than
    kept until the clock catches up while the cache fills (then every call is a 503)."""
    cache = ReplayCache(window_s=60.0, capacity=2)
    cache.add("a", 1000.0)
    cache.add("b", 1001.0)
    cache.add("c", 100.0)  # the clock went back 900 s
    cache.add("d", 100.5)
    with pytest.raises(AuthError, match="already"):
        cache.add("d", 101.0)
    clock = Clock()
    verifier = _verifier(clock)
    header = sign(KEYS.control, "POST", "/internal/abort", BODY, target=INSTANCE, now=clock.now)
    verifier.verify("POST", "/internal/abort", BODY, header)
    clock.now -= 900.0
    assert _reason(verifier, "POST", "/internal/abort", BODY, header) == "stale"  # what was forgotten cannot come back


def test_a_call_that_acts_is_signed_for_one_worker_and_only_reads_for_any() -> None:
    """Every replica of a revision holds the key and keeps its own replay cache: a call captured on
    its way to one was taken by another (outside probe). The instance id it is signed for binds it;
    the target is inside the MAC, so the header cannot be re-aimed."""
    clock = Clock()
    other = sign(KEYS.control, "POST", "/internal/abort", BODY, target="cd" * 16, now=clock.now)
    assert _reason(_verifier(clock), "POST", "/internal/abort", BODY, other) == "wrong_target"
    anyone = sign(KEYS.control, "POST", "/internal/abort", BODY, now=clock.now)  # target "any"
    assert _reason(_verifier(clock), "POST", "/internal/abort", BODY, anyone) == "wrong_target"
    re_aimed = other.replace("target=" + "cd" * 16, "target=" + INSTANCE)
    assert _reason(_verifier(clock), "POST", "/internal/abort", BODY, re_aimed) == "bad_mac"
    for path in ("/internal/info", "/internal/health", "/internal/info?verbose=1"):
        _verifier(clock).verify("GET", path, b"", sign(KEYS.control, "GET", path, now=clock.now))  # reads: any worker
    assert _reason(_verifier(clock), "GET", "/internal/stream", b"", sign(KEYS.control, "GET", "/internal/stream", now=clock.now)) == "wrong_target"


def test_a_call_signed_from_a_read_older_than_the_worker_counts_as_its_predecessors() -> None:
    """A worker restarted at its address refuses the calls the router signed for the instance it
    read there before: refused all the same, but counted `previous_instance`, outside the S9 alert
    (restarts fired it with no attacker). Only a call read before this worker started and signed
    within PREVIOUS_INSTANCE_WINDOW_S of that start is: a call for another instance read after the
    start, or an old read sent later (review: an abort to a departed worker, replayed to a replica
    started after its read), or one for any worker, is `wrong_target`. The read is inside the MAC."""
    from kvguard.workers.control_auth import PREVIOUS_INSTANCE_WINDOW_S as WINDOW

    clock = Clock()
    started = clock.now
    verifier = ControlVerifier(KEYS.control, instance=INSTANCE, clock=clock, started=started)

    def reason(read_at: float, signed_at: float, target: str = "cd" * 16) -> str | None:
        clock.now = signed_at + 0.5
        header = sign(KEYS.control, "POST", "/internal/abort", BODY, target=target, read_at=read_at, now=signed_at)
        return _reason(verifier, "POST", "/internal/abort", BODY, header)

    assert reason(started - 1, started + 2) == "previous_instance"
    assert reason(started - 1, started - 0.5) == "previous_instance"  # signed before, queued in the listen backlog
    assert reason(started + 1, started + 2) == "wrong_target"  # read after this worker started
    assert reason(started - 1, started + WINDOW + 1) == "wrong_target"  # an old read, sent late
    assert reason(started - 1, started + 2, ANY_WORKER) == "wrong_target"
    clock.now = started + 2
    replayed = sign(KEYS.control, "POST", "/internal/abort", BODY, target="cd" * 16, read_at=started + 1, now=started + 2)
    backdated = replayed.replace(f"read={int((started + 1) * 1000)}", f"read={int((started - 60) * 1000)}")
    assert backdated != replayed and _reason(verifier, "POST", "/internal/abort", BODY, backdated) == "bad_mac"
    verifier.verify("POST", "/internal/abort", BODY, sign(KEYS.control, "POST", "/internal/abort", BODY, target=INSTANCE,
                                                          read_at=started - 100, now=clock.now))  # its own id: read whenever


def test_a_read_that_waited_in_the_backlog_while_the_worker_loaded_is_not_an_s9_refusal() -> None:
    """The launcher holds a worker's socket across its restart: the router's signed reads queue in
    the listen backlog while the model loads, and past the skew window each was refused as
    `stale`, which fires the S9 alert (review). A key holder's read signed before this worker
    started is `queued_before_start`; a call that acts, a forged read, or a read signed after the
    start is still `stale`."""
    clock = Clock()
    started = clock.now
    verifier = ControlVerifier(KEYS.control, instance=INSTANCE, clock=clock, started=started)
    clock.now = started + 60  # it loaded for a minute
    before = sign(KEYS.control, "GET", "/internal/info", now=started - 5)
    assert _reason(verifier, "GET", "/internal/info", b"", before) == "queued_before_start"
    acting = sign(KEYS.control, "POST", "/internal/abort", BODY, target="cd" * 16, read_at=started - 6, now=started - 5)
    assert _reason(verifier, "POST", "/internal/abort", BODY, acting) == "stale"
    forged = sign(b"not the key" * 3, "GET", "/internal/info", now=started - 5)
    assert _reason(verifier, "GET", "/internal/info", b"", forged) == "stale"
    after = sign(KEYS.control, "GET", "/internal/info", now=started + 1)
    assert _reason(verifier, "GET", "/internal/info", b"", after) == "stale"


def test_auth_headers_sign_the_path_and_query_on_the_request_line() -> None:
    headers = auth_headers(KEYS.control, "GET", "http://10.0.0.1:8000/internal/info?verbose=1")
    verifier = ControlVerifier(KEYS.control)
    verifier.verify("GET", "/internal/info?verbose=1", b"", headers[AUTH_HEADER])  # raises if it does not verify
    with pytest.raises(AuthError, match="does not verify"):  # the query is part of what is signed
        ControlVerifier(KEYS.control).verify("GET", "/internal/info?verbose=0", b"", headers[AUTH_HEADER])


# --- the middleware on a real listener: nothing is uploaded before the header passes -------------


async def _internal_app(body_timeout_s: float = 30.0):  # noqa: ANN202
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from kvguard.workers.control_auth import auth_failures_counter, control_auth_middleware
    from kvguard.workers.openai_api import error_middleware

    key = RevisionKeys.derive(b"k" * 32).control
    auth = control_auth_middleware(ControlVerifier(key, instance=INSTANCE), auth_failures_counter(CollectorRegistry()),
                                   body_timeout_s=body_timeout_s, max_body_bytes=1024 * 1024)  # fmt: skip

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": len(await request.read())})

    app = web.Application(middlewares=[error_middleware, auth], client_max_size=1024 * 1024)
    app.router.add_post("/internal/abort", echo)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # the refused uploads' connections need no grace
    await runner.setup()
    site = CappedSockSite(runner, socket.create_server(("127.0.0.1", 0)), cap=64)  # the workers' listener
    await site.start()
    return runner, site._sock.getsockname()[1], key  # type: ignore[union-attr]


async def _exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send a request's head (and part of a body), then read the answer the server gives."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(4096), timeout=20)
    writer.close()
    return answer


async def test_an_unsigned_or_oversized_upload_is_refused_before_its_body_is_read() -> None:
    """A pod that can reach the port but has no key used to upload 256 MiB before its 401, and
    then (v1 headers: form and freshness checked first, the MAC after the body) 32 MiB per
    connection. The v2 header's MAC covers the body's digest, so it is checked from the head."""
    import time

    runner, port, key = await _internal_app()
    try:
        head = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 50000\r\n\r\n"
        assert (await _exchange(port, head)).startswith(b"HTTP/1.1 401")  # no body was sent at all
        fresh = f"v3 ts={int(time.time() * 1000)} nonce={'0' * 32} target={INSTANCE} sha256={'0' * 64} mac={'0' * 64}".encode()
        forged = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 50000\r\n" + AUTH_HEADER.encode() + b": " + fresh + b"\r\n\r\n"
        assert (await _exchange(port, forged, b"x" * 1000)).startswith(b"HTTP/1.1 401")  # refused with the body unread
        signed = sign(key, "POST", "/internal/abort", b"x" * 50_000_000, target=INSTANCE).encode()
        huge = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n" + AUTH_HEADER.encode() + b": " + signed + b"\r\n\r\n"
        assert (await _exchange(port, huge)).startswith(b"HTTP/1.1 413")  # even a key holder: larger than any internal body
    finally:
        await runner.cleanup()


async def test_a_signed_body_that_never_arrives_is_cut_off_and_a_swapped_one_refused() -> None:
    runner, port, key = await _internal_app(body_timeout_s=0.5)
    try:
        signed = sign(key, "POST", "/internal/abort", b"0" * 100, target=INSTANCE).encode()
        head = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n" + AUTH_HEADER.encode() + b": " + signed + b"\r\n\r\n"
        assert (await _exchange(port, head, b"0123456789")).startswith(b"HTTP/1.1 408")
        signed = sign(key, "POST", "/internal/abort", b"0" * 10, target=INSTANCE).encode()
        head = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n" + AUTH_HEADER.encode() + b": " + signed + b"\r\n\r\n"
        assert (await _exchange(port, head, b"1" * 10)).startswith(b"HTTP/1.1 401")  # not the body that was signed
    finally:
        await runner.cleanup()


async def _answers_then_eof(port: int, request: bytes, eof_within_s: float = 20.0) -> tuple[bytes, bool]:
    """One request on a fresh connection: (the answer, whether the server closed it within
    `eof_within_s` of answering; aiohttp's keep-alive timer here is 75 s)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=20)
        length = int(next(line.split(b":")[1] for line in answer.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await asyncio.wait_for(reader.readexactly(length), timeout=20)
        rest = await asyncio.wait_for(reader.read(1), timeout=eof_within_s)
        return answer, rest == b""
    except TimeoutError:
        return answer, False
    finally:
        writer.close()


async def test_only_a_whole_fresh_signed_call_marks_its_connection_as_the_routers() -> None:
    """A kept-alive connection that carried a signed call is never closed to make room
    (servers.mark_keyed). A replayed header (its nonce used) or a refused one marks nothing: one
    captured header would otherwise mark every connection of a flood."""
    import asyncio

    runner, port, key = await _internal_app()
    try:
        signed = sign(key, "POST", "/internal/abort", b"{}", target=INSTANCE).encode()
        call = b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + AUTH_HEADER.encode() + b": " + signed + b"\r\n\r\n{}"
        statuses = []
        for request in (call, call, b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            statuses.append((await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=20)).split(b" ")[1])
            connections = list(runner.server.connections)  # type: ignore[union-attr]
            statuses.append([c.keyed for c in connections if not c.closing])  # type: ignore[attr-defined]
            writer.close()
            await until(lambda: all(c.closing for c in runner.server.connections), "the connection closed")  # type: ignore[union-attr]
        assert statuses == [b"200", [True], b"401", [False], b"401", []], statuses  # a replay; no key (closed)
    finally:
        await runner.cleanup()


async def test_a_connection_without_the_key_is_closed_once_answered_and_the_routers_kept() -> None:
    """S9 / connection caps: kept alive after their 401, 8,164 connections of one refused health
    check each (repeated every 20 s, which re-arms the keep-alive timer) held both workers' caps
    with no reconnecting, and 15 of 16 public requests got 503 (an outside probe). A caller
    without the key is closed after every refusal; a signed call keeps its connection."""
    runner, port, key = await _internal_app()
    try:
        answer, closed = await _answers_then_eof(port, b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer and closed, answer
        answer, closed = await _answers_then_eof(port, b"GET /elsewhere HTTP/1.1\r\nHost: x\r\n\r\n")  # no route here
        assert answer.startswith(b"HTTP/1.1 404") and b"Connection: close" in answer and closed, answer

        def call(target: str) -> bytes:
            signed = sign(key, "POST", "/internal/abort", b"{}", target=target).encode()
            return b"POST /internal/abort HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + AUTH_HEADER.encode() + b": " + signed + b"\r\n\r\n{}"

        answer, closed = await _answers_then_eof(port, call(INSTANCE), eof_within_s=1.0)  # a close would come at once
        assert answer.startswith(b"HTTP/1.1 200") and not closed, answer
        # A key holder's call for another worker is refused, its connection kept (the router's pool).
        answer, closed = await _answers_then_eof(port, call("cd" * 16), eof_within_s=1.0)
        assert answer.startswith(b"HTTP/1.1 401") and not closed, answer
    finally:
        await runner.cleanup()
