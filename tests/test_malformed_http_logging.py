"""A client's malformed HTTP is answered 400 by aiohttp's parser and must not flood the logs: aiohttp
logs each at ERROR with a traceback (~570 bytes per ~60-byte request) unless
`servers.quiet_malformed_requests` filters it. Real listener, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from test_connection_cap import capped_listener

from kvguard.workers.servers import quiet_malformed_requests

MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",  # a header over aiohttp's 8190 bytes
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # smuggling shape
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
]


async def _answer(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(200), timeout=20)
    writer.close()
    return answer


async def test_malformed_requests_get_a_400_and_leave_no_error_log(caplog: pytest.LogCaptureFixture) -> None:
    quiet_malformed_requests()
    async with capped_listener(64) as (_site, _runner, port):  # the listener every worker serves on
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            for raw in MALFORMED:
                answer = await _answer(port, raw)
                assert b" 400 " in answer.split(b"\r\n", 1)[0], (raw[:40], answer[:80])
            assert (await _answer(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.WARNING]


async def test_a_client_gone_while_a_chunk_is_written_is_a_disconnect_not_a_logged_bug(caplog: pytest.LogCaptureFixture) -> None:
    """Outside soak: when the client closed while the router wrote a chunk, aiohttp raised
    ConnectionResetError before the handler was cancelled; the router took it for a bug, logged an
    ERROR with a traceback, and wrote a 500 frame into the closed transport (a second ERROR from
    aiohttp): about 3% of mid-stream closes, so any client could fill the ERROR log."""
    from types import SimpleNamespace

    from kvguard.workers.protocol import FinishEvent, TokenEvent
    from kvguard.workers.router import Router

    class Gone:
        headers: dict[str, str] = {}
        writes = 0

        async def write(self, data: bytes) -> None:
            self.writes += 1
            raise ConnectionResetError("Cannot write to closing transport")

    async def events():  # type: ignore[no-untyped-def]
        yield 0, FinishEvent(finish_reason="length", prompt_tokens=1, completion_tokens=2)

    builder = SimpleNamespace(text_chunk_sse=lambda *_, **__: b"data: {}\n\n")
    response = Gone()
    with caplog.at_level(logging.WARNING):
        returned = await Router._relay(SimpleNamespace(_cut=set()), response, events(), (0, TokenEvent(token_ids=(5,), text="x")),  # type: ignore[arg-type]
                                       contextlib.nullcontext(), builder, SimpleNamespace(include_usage=False), 1, b"")  # type: ignore[arg-type]
    assert returned is response and response.writes == 1  # nothing more written into the closed transport
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
