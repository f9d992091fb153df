"""A receive path that copies each byte once: the kernel writes straight into a reused buffer.

asyncio's StreamReader copies every received byte three times (recv() makes a bytes object,
feed_data() extends the reader's buffer with it, readexactly() slices a new bytes out of that).
On decode's KV-transfer port that cost more CPU per GiB than the socket itself. Here a
BufferedProtocol has the transport `recv_into` a bytearray, and `readexactly` hands out a
memoryview of it: no copy at all.

The price is a lifetime rule: a view returned by `readexactly` is valid until the next call
(that call may compact or replace the buffer). Callers copy what they keep; the KV receiver keeps
nothing (the sink copies the payload into the pool before the next frame is read).

Back-pressure (S6): the buffer holds at most one frame plus what arrived behind it, up to a fixed
size; when it is full the transport stops reading, so TCP flow control holds prefill back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

INITIAL_BYTES = 256 << 10
"""Every connection's buffer to start with (zero-filled: resident at once); it grows to the first
frame that needs more. 1 MiB made 400 idle connections of a replayed HELLO cost 400 MiB."""


class BufferedStreamReader:
    """`readexactly` over a buffer the transport fills in place (see the module doc)."""

    def __init__(self, initial_bytes: int = INITIAL_BYTES) -> None:
        self._buf = bytearray(initial_bytes)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._paused = False

    # -- called by the protocol (event loop) ---------------------------------------------------
    def attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def free_space(self) -> memoryview:
        if self._end == len(self._buf):  # read while full (reading is paused then): grow, never
            self._grow(2 * len(self._buf))  # compact here, a view handed out may still be in use
        return memoryview(self._buf)[self._end :]

    def filled(self, nbytes: int) -> None:
        self._end += nbytes
        if self._end == len(self._buf) and self._transport is not None:
            self._transport.pause_reading()  # full: let TCP hold the sender back
            self._paused = True
        self._wake()

    def end_of_stream(self, exc: BaseException | None = None) -> None:
        self._eof, self._exc = True, exc
        self._wake()

    # -- called by the consumer ----------------------------------------------------------------
    async def readexactly(self, n: int) -> memoryview:
        """The next `n` bytes, as a view valid until the next call. Raises
        asyncio.IncompleteReadError when the stream ends first (its `partial` holds what came),
        ConnectionResetError when the connection was lost."""
        self._make_room(n)
        while self._end - self._start < n:
            if self._exc is not None:  # reset, not a clean end: say so, as StreamReader does
                raise ConnectionResetError(f"connection lost: {self._exc!r}")
            if self._eof:
                partial = bytes(self._buf[self._start : self._end])
                self._start = self._end
                raise asyncio.IncompleteReadError(partial, n)
            self._resume()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        view = memoryview(self._buf)[self._start : self._start + n]
        self._start += n
        return view

    def _make_room(self, n: int) -> None:
        """Room for `n` unread bytes from `_start`: rewind, compact, or grow (only here, in the
        consumer's call, so no view handed out earlier is still in use)."""
        unread = self._end - self._start
        if unread == 0:
            self._start = self._end = 0
        if len(self._buf) - self._start >= n:
            return
        if len(self._buf) >= n:
            self._buf[0:unread] = self._buf[self._start : self._end]  # same size: allowed with views out
            self._start, self._end = 0, unread
        else:
            self._grow(max(n, 2 * len(self._buf)))

    def _grow(self, size: int) -> None:
        """A bigger buffer; views of the old one stay valid (they keep it alive)."""
        unread = self._end - self._start
        grown = bytearray(size)
        grown[0:unread] = self._buf[self._start : self._end]
        self._buf, self._start, self._end = grown, 0, unread

    def _resume(self) -> None:
        if self._paused and self._end < len(self._buf) and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class TransportWriter:
    """The part of asyncio.StreamWriter the KV receiver uses, over a plain transport."""

    def __init__(self, transport: asyncio.Transport, protocol: BufferedStreamProtocol) -> None:
        self.transport = transport
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        await self._protocol.writable()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()


Handler = Callable[[BufferedStreamReader, TransportWriter], Coroutine[Any, Any, None]]


class BufferedStreamProtocol(asyncio.BufferedProtocol):
    """One connection: a BufferedStreamReader, a TransportWriter, and `handler(reader, writer)`
    run as a task (what asyncio.start_server does with streams)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.reader = BufferedStreamReader()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._lost = False
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.reader.attach(transport)
        writer = TransportWriter(transport, self)
        # Held here, as asyncio's StreamReaderProtocol holds its handler: the loop keeps only weak references to tasks.
        self._task = asyncio.get_running_loop().create_task(self._handler(self.reader, writer))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.free_space()

    def buffer_updated(self, nbytes: int) -> None:
        self.reader.filled(nbytes)

    def eof_received(self) -> bool:
        self.reader.end_of_stream()
        return True  # keep the transport: the handler still writes, then closes it

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._can_write.set()
        self.reader.end_of_stream(exc)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def writable(self) -> None:
        """Wait until the transport's write buffer drained below its high-water mark."""
        if self._lost:
            raise ConnectionResetError("connection lost")
        await self._can_write.wait()
        if self._lost:
            raise ConnectionResetError("connection lost")
