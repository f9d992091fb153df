"""The one-copy receive path under decode's KV-transfer port: exact reads over arbitrary splits,
compaction and growth, back-pressure when full, clean and unclean ends (real loopback sockets)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvguard.workers.stream_buffer import BufferedStreamProtocol, BufferedStreamReader, TransportWriter


class Server:
    """A loopback server whose handler records what `readexactly` returned, one frame per size."""

    def __init__(self, sizes: list[int], initial_bytes: int) -> None:
        self.sizes, self.initial_bytes = sizes, initial_bytes
        self.frames: list[bytes] = []
        self.ended: BaseException | None = None
        self.done = asyncio.Event()
        self.reader: BufferedStreamReader | None = None

    def protocol(self) -> BufferedStreamProtocol:
        proto = BufferedStreamProtocol(self.handle)
        proto.reader = BufferedStreamReader(self.initial_bytes)
        self.reader = proto.reader
        return proto

    async def handle(self, reader: BufferedStreamReader, writer: TransportWriter) -> None:
        try:
            for size in self.sizes:
                view = await reader.readexactly(size)
                self.frames.append(bytes(view))  # copy: the view is valid until the next call
                await asyncio.sleep(0)  # let more data land behind it
            writer.write(b"ok")
            await writer.drain()
            await reader.readexactly(1)  # expect the end of the stream
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.ended = exc
        finally:
            writer.close()
            self.done.set()


Start = Callable[..., Awaitable[tuple[Server, int]]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    servers: list[asyncio.Server] = []

    async def start(sizes: list[int], initial_bytes: int = 64) -> tuple[Server, int]:
        server = Server(sizes, initial_bytes)
        listener = await asyncio.get_running_loop().create_server(server.protocol, "127.0.0.1", 0)
        servers.append(listener)
        return server, listener.sockets[0].getsockname()[1]

    yield start
    for listener in servers:
        listener.close()
        await listener.wait_closed()


async def test_exact_reads_over_any_split_with_compaction_and_growth(serve: Start) -> None:
    sizes = [5, 100, 1, 3000, 64, 70_000, 17]  # several frames larger than the 64-byte buffer
    payload = os.urandom(sum(sizes))
    server, port = await serve(sizes)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for off in range(0, len(payload), 777):  # splits that never line up with the frames
        writer.write(payload[off : off + 777])
        await writer.drain()
    assert await reader.readexactly(2) == b"ok"
    writer.close()
    await asyncio.wait_for(server.done.wait(), 60)  # real sockets: generous
    expected, off = [], 0
    for size in sizes:
        expected.append(payload[off : off + size])
        off += size
    assert server.frames == expected
    assert isinstance(server.ended, asyncio.IncompleteReadError) and server.ended.partial == b""  # clean end


async def test_a_stream_ending_inside_a_read_reports_what_came(serve: Start) -> None:
    server, port = await serve([10, 500])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"0123456789" + b"x" * 20)
    await writer.drain()
    writer.close()
    await asyncio.wait_for(server.done.wait(), 60)  # real sockets: generous
    assert server.frames == [b"0123456789"]
    assert isinstance(server.ended, asyncio.IncompleteReadError) and server.ended.partial == b"x" * 20


class RecordingTransport(asyncio.Transport):
    """Only what the reader calls: pause and resume (the sockets above cover the real one)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def feed(reader: BufferedStreamReader, data: bytes) -> None:
    space = reader.free_space()
    space[: len(data)] = data
    reader.filled(len(data))


async def test_a_full_buffer_pauses_the_socket_until_the_consumer_reads() -> None:
    transport = RecordingTransport()
    reader = BufferedStreamReader(16)
    reader.attach(transport)
    feed(reader, b"a" * 10)
    assert transport.calls == []
    feed(reader, b"b" * 6)  # 16 of 16 bytes: S6, TCP now holds the sender back
    assert transport.calls == ["pause"]
    assert bytes(await reader.readexactly(12)) == b"a" * 10 + b"bb"
    pending = asyncio.ensure_future(reader.readexactly(8))  # needs more than is buffered
    await asyncio.sleep(0)
    assert transport.calls == ["pause", "resume"] and not pending.done()
    feed(reader, b"cccc")
    assert bytes(await pending) == b"bbbbcccc"


async def test_a_lost_connection_is_a_connection_error_not_a_clean_end() -> None:
    reader = BufferedStreamReader(16)
    reader.attach(RecordingTransport())
    feed(reader, b"abc")
    reader.end_of_stream(ConnectionResetError("peer reset"))
    with pytest.raises(ConnectionResetError):
        await reader.readexactly(8)


async def test_drain_waits_while_the_transport_is_paused_and_fails_once_the_connection_is_lost() -> None:
    async def handler(reader: BufferedStreamReader, writer: TransportWriter) -> None:
        return None

    protocol = BufferedStreamProtocol(handler)
    writer = TransportWriter(RecordingTransport(), protocol)
    await writer.drain()  # not paused: returns at once
    protocol.pause_writing()
    draining = asyncio.ensure_future(writer.drain())
    await asyncio.sleep(0)
    assert not draining.done()
    protocol.resume_writing()
    await asyncio.wait_for(draining, 1)
    protocol.pause_writing()
    draining = asyncio.ensure_future(writer.drain())
    await asyncio.sleep(0)
    protocol.connection_lost(None)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(draining, 1)
