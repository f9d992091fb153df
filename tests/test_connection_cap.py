"""Connections per listener are bounded in number (`servers.CappedSockSite`): an outside probe's
19,990 slow-header connections filled the router's 20,000 descriptors, its accept loop failed with
EMFILE and another tenant waited 5-10 s. Real listener, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from waiting import until

from kvguard.workers.backpressure import BodyMemory
from kvguard.workers.openai_api import read_body
from kvguard.workers.servers import RESERVED_FDS, CappedSockSite, app_runner, connection_cap


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    return answer


async def _kept_alive(port: int, path: bytes = b"/", answer: bytes = b"ok") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose one request (GET `path`) was answered and which is kept alive: idle."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(answer), timeout=30)
    return reader, writer


HELD: list[None] = []  # a request of GET /hold being handled, one entry each
RELEASE: list[asyncio.Event] = []  # set: every GET /hold answers


async def _in_hand(port: int, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` connections, each with a GET /hold being handled (a request in hand)."""
    held = len(HELD)
    clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    for _reader, writer in clients:
        writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
    await until(lambda: len(HELD) == held + count, f"{count} requests in hand")
    return clients


@contextlib.asynccontextmanager
async def capped_listener(cap: int) -> AsyncIterator[tuple[CappedSockSite, web.AppRunner, int]]:
    """A listener of at most `cap` connections answering GET / with "ok": (site, runner, port)."""
    app = web.Application()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def hold(_: web.Request) -> web.Response:
        HELD.append(None)
        await RELEASE[0].wait()
        return web.Response(text="held")

    bodies = BodyMemory(1 << 20)

    async def body(request: web.Request) -> web.Response:
        """Reads its body as the router does (openai_api.read_body)."""
        with bodies.reading() as lease:
            return web.Response(text=f"read {len(await read_body(request, 1 << 20, 600.0, lease))}")

    HELD.clear()
    RELEASE[:] = [asyncio.Event()]
    app.router.add_get("/", ok)
    app.router.add_get("/hold", hold)
    app.router.add_get("/keyed", _keyed)
    app.router.add_post("/body", body)
    runner = app_runner(app, 30.0)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0), backlog=128)
    site = CappedSockSite(runner, sock, cap=cap)
    site.min_age_s = site.rescan_s = 0.0  # the tests below that need them set their own
    site.kept_idle_s = 3600.0  # idle keep-alive connections stay, but where a test says otherwise
    await site.start()
    try:
        yield site, runner, sock.getsockname()[1]
    finally:
        await runner.cleanup()


async def test_a_connection_over_the_cap_takes_the_place_of_the_oldest_one_waiting_for_a_request() -> None:
    """An outside probe: 4,200 connections that each sent half a request line held all 4,096
    places, and every other tenant was refused for as long as their sender reconnected. A
    connection that waits for a request now makes room for a new one; one with a request in hand
    is never closed for it."""
    async with capped_listener(2) as (site, runner, port):
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _reader, writer in slow:
            writer.write(b"GET / HT")  # half a request line
            await writer.drain()
        await until(lambda: len(runner.server.connections) == 2, "both slow clients held")  # type: ignore[union-attr]
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert (site.evicted, site.refused) == (1, 0)
        assert await asyncio.wait_for(slow[0][0].read(), timeout=30) == b""  # the oldest was closed
        # The other one is still served.
        reader, writer = slow[1]
        writer.write(b"TP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
        for _reader, writer in slow:
            writer.close()


async def test_a_client_that_never_sent_a_request_makes_room_before_an_idle_keep_alive_one() -> None:
    async with capped_listener(2) as (site, runner, port):
        kept_reader, kept = await asyncio.open_connection("127.0.0.1", port)
        kept.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: idle once answered
        await kept.drain()
        assert (await asyncio.wait_for(kept_reader.readuntil(b"ok"), timeout=30)).startswith(b"HTTP/1.1 200")
        slow_reader, slow = await asyncio.open_connection("127.0.0.1", port)
        slow.write(b"GET / HT")
        await slow.drain()
        await until(lambda: len(runner.server.connections) == 2, "both held")  # type: ignore[union-attr]
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(slow_reader.read(), timeout=30) == b""  # the younger, but it never asked
        kept.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # the older one still serves
        await kept.drain()
        assert (await asyncio.wait_for(kept_reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
        assert site.evicted == 1
        kept.close()
        slow.close()


async def test_a_kept_alive_connection_answered_lately_is_not_closed_to_make_room() -> None:
    """Three reviews: closed to make room (by age, then by idle time), a keep-alive client lost a
    request sent on the heels of an answer. One answered within KEPT_IDLE_S keeps its place."""
    async with capped_listener(2) as (site, _runner, port):
        kept = [await _kept_alive(port) for _ in range(2)]
        assert (await _get(port)).startswith(b"HTTP/1.1 503 ")  # kept_idle_s is an hour: both in use
        assert (site.evicted, site.refused) == (0, 1)
        for reader, writer in kept:  # both still served
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
            writer.close()


async def test_a_kept_alive_connection_idle_long_makes_room_last_and_its_client_reconnects() -> None:
    """An outside probe: each request re-arms the keep-alive timer, so one GET per connection every
    20 s (~205 a second, no new connection) held all 4,096 places while it ran, and every new tenant
    got 503. A connection idle for KEPT_IDLE_S since its answer now makes room, after every other
    kind (here: a slow body first), the one idle longest first; its client reconnects."""
    async with capped_listener(3) as (site, runner, port):
        site.kept_idle_s = 0.0
        kept = [await _kept_alive(port) for _ in range(2)]  # the first answered first: idle longest
        slow_reader, slow = await asyncio.open_connection("127.0.0.1", port)
        slow.write(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        await slow.drain()
        await until(lambda: any(getattr(c, "body_since", None) is not None for c in runner.server.connections),  # type: ignore[union-attr]
                    "the body being read")  # fmt: skip
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(slow_reader.read(), timeout=30) == b""  # the slow body went first
        in_hand = await _in_hand(port, 1)  # the cap again: two kept alive, one request in hand
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(kept[0][0].read(), timeout=30) == b""  # then the one idle longest
        reader, writer = kept[1]  # the other still serves
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
        assert (await _get(port)).startswith(b"HTTP/1.1 200")  # the closed client, on a new connection
        assert (site.evicted, site.refused) == (2, 0)
        RELEASE[0].set()
        assert (await asyncio.wait_for(in_hand[0][0].read(), timeout=30)).startswith(b"HTTP/1.1 200")  # never closed
        for _reader, writer in (*kept, (slow_reader, slow), *in_hand):
            writer.close()


async def test_a_request_answered_before_its_body_arrived_makes_room() -> None:
    """A review: a handler that answers without reading the body (a 401, a 404, a 413 by its
    Content-Length) leaves aiohttp reading and dropping the rest for up to 10 s (its lingering
    time), and such a connection counted as a request in hand: a flood of 410 such requests a
    second (4,096 / 10 s) still held every place, with no credential and no body read. Its answer
    is sent: it makes room as an idle one does."""
    async with capped_listener(2) as (site, _runner, port):
        [(_held_reader, held)] = await _in_hand(port, 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\nab")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), timeout=30)).startswith(b"HTTP/1.1 200")
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert (site.evicted, site.refused) == (1, 0)
        assert await asyncio.wait_for(reader.read(), timeout=30) == b""
        RELEASE[0].set()
        held.close()
        writer.close()


async def test_a_body_sent_slowly_makes_room_after_idle_connections_and_the_longest_arriving_first() -> None:
    """The same probe's other flood: connections that send a request head and then its body a byte
    at a time hold their places for as long as the body timeout. A request whose body has not
    arrived is not yet taken on: at the cap it makes room (the one reading longest first), after
    any connection waiting for a request, and a request in hand is never closed for it."""
    async with capped_listener(3) as (site, runner, port):
        in_hand = await _in_hand(port, 1)
        slow = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nConnection: close\r\n\r\nx")
            await writer.drain()
            slow.append((reader, writer))
            await until(lambda: sum(getattr(c, "body_since", None) is not None for c in runner.server.connections) == len(slow),  # type: ignore[union-attr]
                        "the body being read")  # fmt: skip
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert (site.evicted, site.refused) == (1, 0)
        assert await asyncio.wait_for(slow[0][0].read(), timeout=30) == b""  # reading longest: closed
        slow[1][1].write(b"y" * 99)  # the other one's body ends: it is answered
        await slow[1][1].drain()
        assert (await asyncio.wait_for(slow[1][0].read(), timeout=30)).endswith(b"read 100")
        RELEASE[0].set()
        assert (await asyncio.wait_for(in_hand[0][0].read(), timeout=30)).startswith(b"HTTP/1.1 200")
        for _reader, writer in [*slow, *in_hand]:
            writer.close()


async def test_a_connection_over_the_cap_gets_a_503_when_every_one_has_a_request_in_hand() -> None:
    async with capped_listener(2) as (site, runner, port):
        held = await _in_hand(port, 2)
        refused = await _get(port)
        head, body = refused.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head, head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert (site.refused, site.evicted) == (1, 0)
        # The requests in hand are answered, and their places are free again once they have closed.
        RELEASE[0].set()
        for reader, writer in held:
            assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
            writer.close()
        await until(lambda: not runner.server.connections, "the held connections closed")  # type: ignore[union-attr]
        assert (await _get(port)).startswith(b"HTTP/1.1 200")


async def test_a_refused_client_whose_request_arrived_first_still_reads_the_503() -> None:
    """A CI run under load: closed with the client's request unread, the kernel reset the
    connection and the client lost the 503 (requests raised ConnectionError). The request here is
    in the server's socket before the loop accepts the connection."""
    async with capped_listener(1) as (site, runner, port):
        [(_reader, holder)] = await _in_hand(port, 1)
        client = socket.create_connection(("127.0.0.1", port))  # the kernel accepts; the loop has not
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n" + b"x" * 65536)
        client.setblocking(False)
        answer = b""
        loop = asyncio.get_running_loop()
        while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), timeout=30):
            answer += chunk
        client.close()
        RELEASE[0].set()
        holder.close()
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer, answer[:200]
        assert site.refused == 1


def test_the_cap_leaves_the_processs_own_descriptors_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert connection_cap(4096, 2) == (1024 - RESERVED_FDS) // 2  # 384 per listener on a 1024 limit
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1_048_576, 1_048_576))
    assert connection_cap(4096, 2) == 4096
    monkeypatch.setattr(resource, "getrlimit", lambda _: (100, 100))
    assert connection_cap(4096, 2) == 1  # a tiny limit still serves one


def test_max_connections_is_a_worker_flag_with_its_bounds() -> None:
    from pydantic import ValidationError

    from kvguard.workers.args import parse_argv

    router = ["--role", "router", "--model", "/m", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert parse_argv(router).max_connections == 4096
    assert parse_argv([*router, "--max-connections", "10"]).max_connections == 10
    with pytest.raises(ValidationError, match="max_connections"):
        parse_argv([*router, "--max-connections", "0"])


async def test_a_burst_of_connections_accepted_at_once_stays_within_the_cap() -> None:
    """The event loop accepts up to the backlog (128) connections in one pass and creates each one's
    handler before any of them is counted in `server.connections` (connection_made comes a pass
    later): a burst of 60 at a cap of 5 had all 60 open (an outside review). Here every place is
    taken by a request in hand, so none can be made room for."""
    clients = []
    async with capped_listener(5) as (site, runner, port):
        held = await _in_hand(port, 5)
        for _ in range(60):  # connected by the kernel before the loop accepts any of them
            client = socket.socket()
            client.setblocking(False)
            assert client.connect_ex(("127.0.0.1", port)) in (0, 115)  # EINPROGRESS
            clients.append(client)
        try:
            await until(lambda: site.refused == 60, "the burst refused")
            assert len(runner.server.connections) == 5 and site.evicted == 0  # type: ignore[union-attr]
        finally:
            RELEASE[0].set()
            for client in clients:
                client.close()
            for _reader, writer in held:
                writer.close()


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    return answer


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01b\r\n\r\n",  # a control character in a header
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Foo: " + b"a" * 9000 + b"\r\n\r\n",  # a header line over aiohttp's 8190
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",  # both framings
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Type: a\r\nContent-Type: b\r\n\r\n",  # a duplicated singleton header
])  # fmt: skip
async def test_a_request_http_cannot_parse_gets_an_openai_shaped_400(request_bytes: bytes) -> None:
    """An outside probe: these were answered by aiohttp's parser with a plain-text `HTTP/1.0 400`
    that quoted the client's bytes back, not an OpenAI error body (issue 11: every client input
    gets a 4xx OpenAI error)."""
    async with capped_listener(8) as (_site, _runner, port):
        head, body = (await _raw(port, request_bytes)).split(b"\r\n\r\n", 1)
        assert head.split(b" ", 2)[1] == b"400", head  # HTTP/1.0: aiohttp answers a request it could not read so
        assert b"application/json" in head, head
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "malformed_http", error
        assert len(error["message"]) <= 300, error
        # The listener keeps serving.
        assert (await _get(port)).startswith(b"HTTP/1.1 200")


async def test_a_burst_of_idle_connections_keeps_the_listener_within_its_cap() -> None:
    """The same burst with every place taken by a connection that has sent nothing: each newcomer
    either takes the place of one (closed) or is refused, and the listener ends at its cap."""
    clients = []
    async with capped_listener(5) as (site, runner, port):
        for _ in range(60):
            client = socket.socket()
            client.setblocking(False)
            assert client.connect_ex(("127.0.0.1", port)) in (0, 115)  # EINPROGRESS
            clients.append(client)
        try:
            await until(lambda: site.refused + site.evicted == 55, "each of the burst past the cap placed or refused")
            await until(lambda: len(runner.server.connections) == 5, "the closed ones gone")  # type: ignore[union-attr]
            assert (await _get(port)).startswith(b"HTTP/1.1 200")  # and it still serves
        finally:
            for client in clients:
                client.close()


async def test_a_young_connection_is_not_closed_to_make_room() -> None:
    """A review: a newcomer counts as waiting for a request until the loop reads what it sent, so a
    flood could close a client whose request was already in the socket. A connection is left alone
    for its first MIN_AGE_S (here an hour): the newcomer is refused instead."""
    async with capped_listener(2) as (site, runner, port):
        site.min_age_s = 3600.0
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _reader, writer in slow:
            writer.write(b"GET / HT")
            await writer.drain()
        await until(lambda: len(runner.server.connections) == 2, "both slow clients held")  # type: ignore[union-attr]
        assert (await _get(port)).startswith(b"HTTP/1.1 503 ")
        assert (site.evicted, site.refused) == (0, 1)
        for _reader, writer in slow:
            writer.close()


async def test_refusing_at_the_cap_does_not_search_the_connections_for_each_newcomer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: with every place holding a request in hand, each newcomer searched all `cap`
    connections before its 503 (0.45 ms of the loop per refusal at 4,096 places, 4x the refusal
    itself), so a modest flood stalled every stream. A search that found nothing holds for
    `rescan_s` (here an hour)."""
    from kvguard.workers import servers

    searches: list[None] = []
    search = servers._room_to_make
    monkeypatch.setattr(servers, "_room_to_make", lambda *args: searches.append(None) or search(*args))
    async with capped_listener(40) as (site, _runner, port):
        site.rescan_s = 3600.0
        held = await _in_hand(port, 40)
        for _ in range(20):
            assert (await _get(port)).startswith(b"HTTP/1.1 503 ")
        assert site.refused == 20 and len(searches) == 1, len(searches)
        RELEASE[0].set()
        for _reader, writer in held:
            writer.close()


async def test_a_connection_that_becomes_idle_after_a_refusal_makes_room_again() -> None:
    async with capped_listener(2) as (site, _runner, port):
        [(_held_reader, held)] = await _in_hand(port, 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Answered before its body has arrived: aiohttp reads and drops the rest. Answered just
        # now, it is left alone (MIN_AGE_S, here an hour).
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), timeout=30)).startswith(b"HTTP/1.1 200")
        site.min_age_s = 3600.0
        assert (await _get(port)).startswith(b"HTTP/1.1 503 ")
        site.min_age_s = 0.0  # its answer is old now: the next newcomer takes its place
        served = await _get(port)
        assert served.startswith(b"HTTP/1.1 200") and site.evicted == 1, served[:100]
        assert await asyncio.wait_for(reader.read(), timeout=30) == b""
        RELEASE[0].set()
        held.close()
        writer.close()


@pytest.mark.parametrize("head", [b"POST /body", b"GET /"])
async def test_a_connection_closed_to_make_room_as_its_body_arrives_ends_as_a_hang_up_does(
    head: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A review (a slow-body flood against `kvguard serve`'s router): a connection closed to make
    room in the loop pass that delivered a piece of its body lost its transport at once, so the
    body's next read raised RuntimeError("Connection closed."), logged with its traceback as an
    unexpected error (the router's 500 path; aiohttp's "Unhandled exception" for a body it was
    dropping after an early answer) -- six a second in a flood. It ends as a client's hang-up:
    nothing is logged as an error. POST /body reads its body; GET / answers without reading it."""
    async with capped_listener(1) as (site, runner, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nx")
        await writer.drain()
        server = runner.server
        assert server is not None
        if head == b"POST /body":
            await until(lambda: server.connections and server.connections[0].body_since is not None, "the body being read")
        else:
            assert (await asyncio.wait_for(reader.readuntil(b"ok"), timeout=30)).startswith(b"HTTP/1.1 200")
        [connection] = server.connections
        caplog.clear()

        def more_body_and_a_newcomer() -> None:  # one loop pass: a piece of its body arrives, then a newcomer
            connection.data_received(b"y")
            assert site._make_room(server)

        asyncio.get_running_loop().call_soon(more_body_and_a_newcomer)
        await asyncio.wait_for(reader.read(), timeout=30)  # closed
        # aiohttp drops a connection when its handler task has ended, after anything it logged.
        await until(lambda: not server.connections, "the closed connection gone")
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        writer.close()


async def test_a_kept_alive_connection_that_showed_the_control_key_is_never_closed_to_make_room() -> None:
    """Reviews: a worker's internal listener closed the router's pooled connections once idle 2 s
    under a flood, and the router's next call met a full listener and got 503; exempting the whole
    listener let a client without the key hold it (aiohttp answers `Expect: x` with 417 before any
    check, keeping the connection). A connection that carried a whole, fresh signed call
    (`mark_keyed`, from control_auth) keeps its place; any other idle one makes room."""
    async with capped_listener(2) as (site, runner, port):
        site.kept_idle_s = 0.0
        keyed_reader, keyed = await _kept_alive(port, b"/keyed", b"keyed")
        other_reader, other = await _kept_alive(port)
        assert (await _get(port)).startswith(b"HTTP/1.1 200")  # the unkeyed one made room
        assert await asyncio.wait_for(other_reader.read(), timeout=30) == b""
        keyed.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # the keyed one still serves
        await keyed.drain()
        assert (await asyncio.wait_for(keyed_reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
        assert site.evicted == 1
        other.close()
        keyed.close()


async def _keyed(request: web.Request) -> web.Response:
    from kvguard.workers.servers import mark_keyed

    mark_keyed(request)
    return web.Response(text="keyed")
