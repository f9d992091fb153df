"""The local backend's weighted splitter (workers/splitter.py): the one URL a client keeps through
promotions and traffic steps (#17), in front of revisions' routers.

The pure parts (the table, smooth weighted round-robin) are tested alone; the proxy runs on real
loopback sockets with the same runner every worker uses (`servers.app_runner`), in front of two
small aiohttp servers standing for two revisions' routers (the real routers behind it are in
e2e/test_local_progressive.py). Waits are on conditions (tests/waiting.py), never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from waiting import until

from kvguard.workers.backpressure import FREE_BODY_BYTES
from kvguard.workers.servers import app_runner
from kvguard.workers.splitter import (
    REVISION_HEADER,
    SplitBackend,
    SplitTable,
    Splitter,
    SplitterConfig,
    TableSource,
    WeightedTurns,
    write_table,
)


def table(**weights: tuple[int, int]) -> SplitTable:
    """revision=(port, weight) -> a table."""
    return SplitTable(backends=tuple(SplitBackend(revision=r, url=f"http://127.0.0.1:{p}", weight=w) for r, (p, w) in weights.items()))


# --- pure -----------------------------------------------------------------------------------------


def test_smooth_weighted_round_robin_gives_exact_shares_in_every_window() -> None:
    turns = WeightedTurns(table(stable=(1, 90), cand=(2, 10)))
    picks = [turns.order()[0].revision for _ in range(300)]
    for start in range(0, 300, 100):
        assert picks[start:start + 100].count("cand") == 10  # exact per window of sum(weights), not on average
    at = [i for i, p in enumerate(picks) if p == "cand"]
    assert {b - a for a, b in zip(at, at[1:], strict=False)} == {10}  # spread out evenly, not ten in a row


def test_fallback_order_and_weight_zero() -> None:
    turns = WeightedTurns(table(stable=(1, 100), cand=(2, 0)))
    assert [[b.revision for b in turns.order()] for _ in range(3)] == [["stable"]] * 3  # weight 0 gets nothing
    turns = WeightedTurns(table(a=(1, 50), b=(2, 30), c=(3, 20)))
    first = turns.order()
    assert sorted(b.revision for b in first) == ["a", "b", "c"]  # every live backend is a fallback
    assert WeightedTurns(SplitTable()).order() == []


@pytest.mark.parametrize(
    "backends, why",
    [
        ([{"revision": "a", "url": "http://10.0.0.1:80", "weight": 100}], "should match pattern"),  # loopback only
        ([{"revision": "a", "url": "http://127.0.0.1:1", "weight": 60}, {"revision": "a", "url": "http://127.0.0.1:2", "weight": 40}], "twice"),
        ([{"revision": "a", "url": "http://127.0.0.1:1", "weight": 0}], "every weight is 0"),
        ([{"revision": "a", "url": "http://127.0.0.1:1", "weight": 101}], "less than or equal"),
        ([{"revision": "A/../b", "url": "http://127.0.0.1:1", "weight": 1}], "should match pattern"),
    ],
)
def test_a_bad_table_is_refused(backends: list[dict[str, object]], why: str) -> None:
    with pytest.raises(ValidationError) as caught:
        SplitTable.model_validate({"backends": backends})
    assert why in str(caught.value)


def test_table_source_follows_the_file_and_keeps_the_last_good_table(tmp_path: Path) -> None:
    path = tmp_path / "split.json"
    source = TableSource(path)
    assert source.current().table == SplitTable()  # no file yet: nothing to route to
    write_table(path, table(stable=(1, 100)))
    assert source.current().table.weights() == {"stable": 100}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    write_table(path, table(stable=(1, 90), cand=(2, 10)))
    assert source.current().table.weights() == {"stable": 90, "cand": 10}
    path.write_text('{"backends": [{"revision": "x", "url": "http://evil.example:80", "weight": 100}]}')
    assert source.current().table.weights() == {"stable": 90, "cand": 10}  # refused: the last good one stays
    path.write_text("{half a tab")
    assert source.current().table.weights() == {"stable": 90, "cand": 10}
    path.write_text("")  # an in-place rewrite's first moment, or a file emptied by hand (outside probe: 503 for all)
    assert source.current().table.weights() == {"stable": 90, "cand": 10}
    path.unlink()  # removed: still the last good table
    assert source.current().table.weights() == {"stable": 90, "cand": 10}
    write_table(path, SplitTable())  # the backend's own "no traffic" is a table with no backends
    assert source.current().table == SplitTable()


def test_a_table_another_user_could_write_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The table routes every client's request: one group- or world-writable is not followed.
    path = tmp_path / "split.json"
    source = TableSource(path)
    write_table(path, table(stable=(1, 100)))
    assert source.current().table.weights() == {"stable": 100}
    write_table(path, table(cand=(2, 100)))
    os.chmod(path, 0o622)
    assert source.current().table.weights() == {"stable": 100}  # the last good one stays
    assert "writable by it alone" in caplog.text and "-rw--w--w-" in caplog.text
    os.chmod(path, 0o644)  # readable by others is fine: the table holds no secret
    assert source.current().table.weights() == {"cand": 100}


def test_table_source_sees_a_rewrite_that_keeps_inode_size_and_mtime(tmp_path: Path) -> None:
    """The rewrite a stat-based check misses: the new file takes the inode number of the one before
    (atomic replace alternates between two), names another revision (same size), and lands in the
    same clock tick. Made deterministic here by setting the old mtime back on the new file."""
    path = tmp_path / "split.json"
    source = TableSource(path)
    write_table(path, table(stable=(1, 100)))
    seen = os.stat(path)
    assert source.current().table.weights() == {"stable": 100}
    write_table(path, table(other=(1, 100)))  # same length as "stable": the file keeps its size
    write_table(path, table(second=(1, 100)))
    now = os.stat(path)
    os.utime(path, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    if (now.st_ino, now.st_size) != (seen.st_ino, seen.st_size):
        pytest.skip("this filesystem did not reuse the inode number (the bytes check holds anyway)")
    assert source.current().table.weights() == {"second": 100}


# --- on loopback ----------------------------------------------------------------------------------


class FakeRevisionRouter:
    """A router's HTTP surface, enough to see where requests land and how they are relayed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[bytes] = []
        self.release = asyncio.Event()
        self.cancelled = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"served_by": self.name, "query": request.query_string, "xff": request.headers.get("X-Forwarded-For")},
                                 headers={"x-request-id": "r1"})  # fmt: skip

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        if request.headers.get("x-flood") == "1":
            return await self._flood(request)
        if request.headers.get("x-stream") != "1":
            return web.json_response({"served_by": self.name}, status=201)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1  # the client went away: the router's handler is cancelled (S4)
            raise
        await response.write(b"data: [DONE]\n\n")
        return response


    async def _flood(self, request: web.Request) -> web.StreamResponse:
        """An answer without end (a huge one, as 16 choices x 20 logprobs make), until cancelled."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: " + b"x" * (1 << 20) + b"\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@asynccontextmanager
async def listening(app: web.Application) -> AsyncIterator[int]:
    runner = app_runner(app, 30.0)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield sock.getsockname()[1]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def splitter_in_front(tmp_path: Path, write_timeout_s: float = 30.0, max_body_bytes: int = 1024,
                            **config: Any) -> AsyncIterator[tuple[Splitter, int, int, dict[str, FakeRevisionRouter]]]:  # fmt: skip
    routers = {"stable": FakeRevisionRouter("stable"), "cand": FakeRevisionRouter("cand")}
    splitter = Splitter(SplitterConfig(table_path=tmp_path / "split.json", max_body_bytes=max_body_bytes, body_timeout_s=5,
                                       write_timeout_s=write_timeout_s, **config))  # fmt: skip
    async with listening(routers["stable"].app()) as p1, listening(routers["cand"].app()) as p2:
        async with listening(splitter.app()) as api, listening(splitter.metrics_app()) as metrics:
            splitter.ports = {"stable": p1, "cand": p2}  # type: ignore[attr-defined]
            yield splitter, api, metrics, routers


async def test_requests_follow_the_weights_exactly_and_say_who_served(tmp_path: Path) -> None:
    async with splitter_in_front(tmp_path) as (splitter, api, metrics, routers), aiohttp.ClientSession() as http:
        ports = splitter.ports  # type: ignore[attr-defined]
        async with http.get(f"http://127.0.0.1:{api}/v1/models") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_backend"  # no table yet
        write_table(splitter.config.table_path, table(stable=(ports["stable"], 70), cand=(ports["cand"], 30)))
        served = []
        for i in range(20):
            async with http.post(f"http://127.0.0.1:{api}/v1/completions", json={"i": i}) as resp:
                body = await resp.json()
                assert resp.status == 201  # the router's status, relayed
                assert resp.headers[REVISION_HEADER] == body["served_by"]
                served.append(body["served_by"])
        assert served.count("cand") == 6 and served.count("stable") == 14
        assert sorted(routers["stable"].bodies + routers["cand"].bodies) == sorted(f'{{"i": {i}}}'.encode() for i in range(20))
        async with http.get(f"http://127.0.0.1:{api}/v1/models?x=1", headers={"X-Forwarded-For": "10.1.1.1"}) as resp:
            seen = await resp.json()  # query and headers pass through; the splitter appends its client
            assert seen["query"] == "x=1" and resp.headers["x-request-id"] == "r1" and seen["xff"] == "10.1.1.1, 127.0.0.1"
        write_table(splitter.config.table_path, table(stable=(ports["stable"], 0), cand=(ports["cand"], 100)))
        for _ in range(5):  # a new table is in force from the next request on
            async with http.post(f"http://127.0.0.1:{api}/v1/completions", json={}) as resp:
                assert resp.headers[REVISION_HEADER] == "cand"
        async with http.get(f"http://127.0.0.1:{metrics}/metrics") as resp:
            text = await resp.text()
        counts = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name == "kvguard_splitter_requests_total"}  # fmt: skip
        assert counts[(("code", "201"), ("revision", "cand"))] == 11
        async with http.get(f"http://127.0.0.1:{api}/metrics") as resp:
            assert resp.status == 404  # one audience per port: metrics are not on the API port


async def test_streams_are_relayed_as_they_come_and_a_disconnect_reaches_the_router(tmp_path: Path) -> None:
    async with splitter_in_front(tmp_path) as (splitter, api, _, routers), aiohttp.ClientSession() as http:
        ports = splitter.ports  # type: ignore[attr-defined]
        write_table(splitter.config.table_path, table(stable=(ports["stable"], 100)))
        async with http.post(f"http://127.0.0.1:{api}/v1/completions", json={}, headers={"x-stream": "1"}) as resp:
            assert await resp.content.readuntil(b"\n\n") == b"data: first\n\n"  # before the router finished
            routers["stable"].release.set()
            assert await resp.content.read() == b"data: [DONE]\n\n"
        routers["stable"].release.clear()
        resp = await http.post(f"http://127.0.0.1:{api}/v1/completions", json={}, headers={"x-stream": "1"})
        assert await resp.content.readuntil(b"\n\n") == b"data: first\n\n"
        resp.close()  # the client goes away mid-stream
        await until(lambda: routers["stable"].cancelled == 1, "the router's handler to be cancelled by the disconnect")


async def test_bodies_held_at_once_are_bounded_as_at_the_router(tmp_path: Path) -> None:
    """The splitter holds a body until a router answers (a refused connection sends it to the next
    revision): those bodies are bounded in bytes as the router's are. A body arriving past the room
    is a 503 to retry (counted), an `Expect: 100-continue` that would not fit is refused before its
    upload, and streams already answered hold none of the room however long they run (a review:
    a few dozen slow streams of 7 MiB bodies filled it)."""
    limit, body = 200_000, b"x" * 150_000  # a body charges 150,000 - 64 KiB of the 200,000
    async with splitter_in_front(tmp_path, max_body_bytes=limit, max_body_memory=limit) as (splitter, api, metrics, routers), \
            aiohttp.ClientSession() as http:  # fmt: skip
        write_table(splitter.config.table_path, table(stable=(splitter.ports["stable"], 100)))  # type: ignore[attr-defined]
        url, stream = f"http://127.0.0.1:{api}/v1/completions", {"x-stream": "1"}
        streams = [await http.post(url, data=body, headers=stream) for _ in range(3)]  # 3 x 84 KB > 200 KB, were they held
        for held in streams:
            assert await held.content.readuntil(b"\n\n") == b"data: first\n\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", api)
        largest = b"x" * limit  # held one byte short of its end: with it, no other 150,000 bytes fit
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % limit + largest[:-1])
        await writer.drain()
        await until(lambda: splitter._bodies.held == limit - 1 - FREE_BODY_BYTES, "the held body's bytes to arrive")
        async with http.post(url, data=body) as refused:
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["code"] == "server_busy"
        async with http.post(url, data=body, headers={"Expect": "100-continue"}) as uninvited:
            assert uninvited.status == 503
        writer.write(largest[-1:])  # the held body ends: relayed, answered, its bytes back
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 201")
        writer.close()
        routers["stable"].release.set()
        for held in streams:
            assert await held.content.read() == b"data: [DONE]\n\n"
            held.release()
        assert splitter._bodies.held == 0
        async with http.post(url, data=body) as retried:
            assert retried.status == 201
        async with http.get(f"http://127.0.0.1:{metrics}/metrics") as resp:
            text = await resp.text()
        refusals = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "kvguard_splitter_requests_total" and s.labels == {"revision": "none", "code": "503"}]  # fmt: skip
        assert refusals == [2.0]


async def test_a_client_that_reads_nothing_through_the_splitter_loses_its_connection(tmp_path: Path) -> None:
    """Outside probe: the router dropped the splitter's stalled stream after its write timeout, but
    the splitter kept the client's connection (and megabytes in its send queue) for ever, its
    handler blocked in a write. It has the router's stall watch now; the router hears the end (S4)."""
    async with splitter_in_front(tmp_path, write_timeout_s=1.0) as (splitter, api, _, routers):
        write_table(splitter.config.table_path, table(stable=(splitter.ports["stable"], 100)))  # type: ignore[attr-defined]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", api))
        await asyncio.get_running_loop().sock_sendall(client, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                              b"x-flood: 1\r\nContent-Length: 0\r\n\r\n")  # fmt: skip
        try:
            # The client reads nothing: the splitter drops it, which cancels its relay and so the router's answer.
            await until(lambda: routers["stable"].cancelled == 1, "the stalled client dropped and the router's handler cancelled")
            assert routers["stable"].cancelled == 1
            # ...and its connection ended: reading now meets a reset (or the end, after what was buffered).
            loop = asyncio.get_running_loop()

            async def read_to_the_end() -> None:
                with contextlib.suppress(ConnectionResetError):
                    while await loop.sock_recv(client, 1 << 20):
                        pass

            await asyncio.wait_for(read_to_the_end(), 60)  # TimeoutError: the splitter kept the connection
        finally:
            client.close()


async def test_an_x_forwarded_for_the_splitters_entry_makes_too_long_is_a_431(tmp_path: Path) -> None:
    """The router takes an X-Forwarded-For of up to 8190 bytes; with ", 127.0.0.1" appended, one of
    8185 became aiohttp's plain-text 400 from the router (outside probe). The splitter says so."""
    async with splitter_in_front(tmp_path) as (splitter, api, _, routers), aiohttp.ClientSession() as http:
        write_table(splitter.config.table_path, table(stable=(splitter.ports["stable"], 100)))  # type: ignore[attr-defined]
        async with http.get(f"http://127.0.0.1:{api}/v1/models", headers={"X-Forwarded-For": "1" * 8000}) as resp:
            assert resp.status == 200  # room for the splitter's entry
        async with http.get(f"http://127.0.0.1:{api}/v1/models", headers={"X-Forwarded-For": "1" * 8185}) as resp:
            assert resp.status == 431 and (await resp.json())["error"]["code"] == "request_header_fields_too_large"


async def test_a_refused_connection_goes_to_the_next_revision_and_limits_hold(tmp_path: Path) -> None:
    async with splitter_in_front(tmp_path) as (splitter, api, _, _routers), aiohttp.ClientSession() as http:
        ports = splitter.ports  # type: ignore[attr-defined]
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        dead_port = dead.getsockname()[1]
        try:
            write_table(splitter.config.table_path, table(gone=(dead_port, 100), cand=(ports["cand"], 1)))
            for _ in range(3):
                async with http.post(f"http://127.0.0.1:{api}/v1/completions", json={}) as resp:
                    assert resp.status == 201 and resp.headers[REVISION_HEADER] == "cand"
            write_table(splitter.config.table_path, table(gone=(dead_port, 100)))
            async with http.post(f"http://127.0.0.1:{api}/v1/completions", json={}) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_backend"
                assert resp.headers["Retry-After"] == "1"  # as every 503 of the router's (a review)
        finally:
            dead.close()
        write_table(splitter.config.table_path, table(cand=(ports["cand"], 100)))
        async with http.post(f"http://127.0.0.1:{api}/v1/completions", data=b"x" * 2048) as resp:
            assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
        async with http.get(f"http://127.0.0.1:{api}/health") as resp:
            assert resp.status == 200 and (await resp.json())["weights"] == {"cand": 100}


async def test_a_body_over_the_limit_is_refused_from_its_headers_and_expect_answers_in_json(tmp_path: Path) -> None:
    """Outside probe: the splitter waited for a body its Content-Length already refused (the router
    answers 413 at once), invited one with `100 Continue`, and answered an unknown Expect in plain
    text. Now all three are the router's answers."""
    async with splitter_in_front(tmp_path) as (splitter, api, _, _routers):
        write_table(splitter.config.table_path, table(cand=(splitter.ports["cand"], 100)))  # type: ignore[attr-defined]
        for expect, status, code in [("", 413, "request_too_large"), ("Expect: 100-continue\r\n", 413, "request_too_large"),
                                     ("Expect: foo\r\n", 417, "expectation_failed")]:  # fmt: skip
            reader, writer = await asyncio.open_connection("127.0.0.1", api)
            length = 9 << 20 if status == 413 else 2
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {length}\r\n{expect}\r\n".encode())  # fmt: skip
            await writer.drain()  # no body sent: the answer must come from the headers alone
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(f"HTTP/1.1 {status}".encode()), head
            assert b"application/json" in head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            assert code.encode() in await reader.readexactly(length)
            writer.close()


async def test_hop_by_hop_headers_are_dropped_and_nothing_is_added_to_the_request(tmp_path: Path) -> None:
    """Outside probe: a header the client's `Connection` named reached the router, and the splitter
    added Accept, Accept-Encoding and User-Agent (and a body without Content-Type went up labelled
    application/octet-stream, which the router refuses with 415)."""
    seen: list[dict[str, str]] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({}, headers={"Connection": "X-Secret", "X-Secret": "s"})

    app = web.Application()
    app.router.add_post("/v1/completions", echo)
    splitter = Splitter(SplitterConfig(table_path=tmp_path / "split.json"))
    async with listening(app) as port, listening(splitter.app()) as api:
        write_table(splitter.config.table_path, table(up=(port, 100)))
        reader, writer = await asyncio.open_connection("127.0.0.1", api)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close, X-Hop\r\nX-Hop: h\r\n"
                     b"X-Kept: k\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"x-secret" not in answer.lower()
    received = {k.lower() for k in seen[0]}
    assert "x-kept" in received and "x-hop" not in received
    assert not {"accept", "accept-encoding", "user-agent", "content-type"} & received, received


# --- the router names its revision itself (what a Gateway, unlike the splitter, does not add) -----


@pytest.mark.parametrize("revision", ["abc123", None])
async def test_the_router_names_its_revision_on_every_api_response(revision: str | None) -> None:
    """Behind a cluster's Gateway nothing else tells revisions apart: the router started with
    `--revision-id` (as the operator renders it) names it in `x-kvguard-revision` on every answer of
    its public API, errors included. Here the router's workers are not up: it answers 503
    not_ready, named all the same; without the flag it names nothing (a plain `kvguard serve`)."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvguard.workers.args import WorkerArgs
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.router import Router, RouterConfig

    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{nobody.getsockname()[1]}"  # bound, never listening: refused at once
    config = RouterConfig(prefill_urls=(url,), decode_urls=(url,), model_name="m", revision=revision)
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    try:
        async with TestClient(TestServer(router.app())) as client:
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                async with client.request(method, path, json={"model": "m", "prompt": "x"}) as resp:
                    assert resp.status == 503
                    assert resp.headers.get(REVISION_HEADER) == revision
    finally:
        nobody.close()
    argv = WorkerArgs(role="router", model=Path("/m"), prefill=(url,), decode=(url,), revision_id="abc123").to_argv()
    assert argv[argv.index("--revision-id") + 1] == "abc123"
    with pytest.raises(ValidationError, match="router flag"):
        WorkerArgs(role="decode", model=Path("/m"), revision_id="abc123")


async def test_a_transfer_coding_other_than_chunked_is_a_501_at_the_splitter_too(tmp_path: Path) -> None:
    """A review: the splitter de-chunked `Transfer-Encoding: gzip, chunked` and forwarded the gzip
    without the header, so the router read it as JSON (400), and `identity, chunked` was served,
    where the router answers both 501. The splitter now answers as the router does."""
    async with splitter_in_front(tmp_path) as (splitter, api, _, _routers):
        write_table(splitter.config.table_path, table(stable=(splitter.ports["stable"], 100)))  # type: ignore[attr-defined]
        for coding in (b"gzip, chunked", b"identity, chunked"):
            reader, writer = await asyncio.open_connection("127.0.0.1", api)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Transfer-Encoding: " + coding + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")  # fmt: skip
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=30)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 501") and b'"not_implemented"' in answer, (coding, answer)
