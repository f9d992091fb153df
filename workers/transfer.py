"""KV transfer between a prefill worker (``KVSender``) and a decode worker (``KVReceiver``).

The wire format is documented in ``transfer_protocol``. This module does the asyncio I/O.

Request life on the decode side (one ``TransferHandle`` per request)::

    expect() -> RECEIVING -> COMPLETE (every planned page written, manifest matches, S3)
                          -> FAILED(reason)   from any point: checksum, plan or manifest mismatch,
                                              stale lease, peer ABORT, local cancel, stall
                                              timeout, connection lost/protocol error (S4)

A failure of one request never touches another on the same connection. A protocol-level error
(bad magic, bad header HMAC: the request id itself cannot be trusted) closes that connection only
and fails the requests bound to it. Decode tells prefill every terminal verdict in a RESULT frame,
so a decode-side failure or cancel stops prefill at once (S4).

Back-pressure (S6): each sender keeps a byte credit per destination (``max_transfer_batch``);
a chunk's bytes are taken before it is written and returned only when decode ACKs the chunk
after its sink has consumed it, so in-flight bytes stay capped however large the socket buffers
are. A single chunk larger than the whole cap is let through only when nothing else is in flight.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import socket
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvguard.workers.faults import NO_FAULTS, Faults
from kvguard.workers.stream_buffer import BufferedStreamProtocol
from kvguard.workers.transfer_protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    TAG_BYTES,
    Abort,
    Ack,
    ChunkHeader,
    Frame,
    HmacError,
    Manifest,
    PlanTracker,
    ProtocolError,
    Result,
    open_header,
    parse_prefix,
    payload_checksum,
    seal,
    validate_request_id,
)

log = logging.getLogger("kvguard.transfer")

CRASH_EXIT_CODE = 70
_JOIN_BELOW = 64 << 10  # payloads smaller than this go out in one write() with their header


# ---------------------------------------------------------------------------------------------
# Configuration, outcomes, metrics


@dataclass(frozen=True)
class TransferConfig:
    """Knobs shared by sender and receiver."""

    max_transfer_batch: int = 16 << 20  # S6: bytes in flight per prefill->decode pair
    stall_timeout_s: float = 5.0  # no progress for this long ends the transfer (S4)
    connect_timeout_s: float = 2.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_connections_per_peer: int = 2
    remembered_finished: int = 4096  # finished ids kept to drop late frames and refuse reuse
    verify_integrity: bool = True  # False only for bench/transfer.py's cost measurement

    def __post_init__(self) -> None:
        if self.max_transfer_batch <= 0:
            raise ValueError("max_transfer_batch must be > 0 bytes")
        if self.stall_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        if not 0 < self.max_payload_bytes <= 1 << 30:
            raise ValueError("max_payload_bytes must be in (0, 1 GiB]")
        if self.max_connections_per_peer < 1 or self.remembered_finished < 1:
            raise ValueError("max_connections_per_peer and remembered_finished must be >= 1")


class FailureReason(enum.StrEnum):
    CHECKSUM = "checksum"
    PLAN_MISMATCH = "plan_mismatch"
    MANIFEST_MISMATCH = "manifest_mismatch"
    STALE = "stale_lease"
    UNKNOWN_REQUEST = "unknown_request"
    PEER_ABORT = "peer_abort"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    CONNECTION_LOST = "connection_lost"
    PROTOCOL_ERROR = "protocol_error"
    SINK_ERROR = "sink_error"


class AbortCause(enum.StrEnum):
    """Label values of ``kvguard_aborts_total{cause}``, shared by the servers and the router."""

    CLIENT_DISCONNECT = "client_disconnect"
    PREFILL_ERROR = "prefill_error"
    DECODE_ERROR = "decode_error"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    INTEGRITY = "integrity"
    STALE_LEASE = "stale_lease"
    PEER_ABORT = "peer_abort"
    WORKER_DIED = "worker_died"


_CAUSE_OF_REASON = {
    FailureReason.CHECKSUM: AbortCause.INTEGRITY,
    FailureReason.PROTOCOL_ERROR: AbortCause.INTEGRITY,
    FailureReason.TIMEOUT: AbortCause.TRANSFER_TIMEOUT,
    FailureReason.STALE: AbortCause.STALE_LEASE,
    FailureReason.PEER_ABORT: AbortCause.PEER_ABORT,
    FailureReason.CONNECTION_LOST: AbortCause.WORKER_DIED,
}


def abort_cause(reason: FailureReason | str | None) -> AbortCause:
    """The ``kvguard_aborts_total`` cause a server should count for a failed transfer."""
    return _CAUSE_OF_REASON.get(reason, AbortCause.TRANSFER_FAILED)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransferOutcome:
    """Terminal outcome of one request's transfer. ``ok`` means complete and verified (S3)."""

    request_id: str
    ok: bool
    reason: FailureReason | str | None = None
    detail: str = ""
    chunks: int = 0
    bytes: int = 0


_CHUNK_BUCKETS = tuple(float(1 << s) for s in range(10, 27, 2))  # 1 KiB .. 64 MiB


@dataclass(frozen=True)
class TransferMetrics:
    """Transfer metrics on a process's registry. ``aborts`` is shared with the servers: they
    count each aborted request once with ``count_abort``; the transfer layer itself never does."""

    checksum_failures: Counter
    hmac_failures: Counter
    stale_writes_dropped: Counter
    transfer_bytes: Counter
    chunk_bytes: Histogram
    transfers: Counter
    frames_dropped: Counter
    aborts: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> TransferMetrics:
        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labelnames=labels, registry=registry)

        return cls(
            checksum_failures=counter(
                "kvguard_checksum_failures_total", "KV chunks whose payload checksum failed (S3)"),
            hmac_failures=counter(
                "kvguard_hmac_failures_total", "Transfer frames whose header HMAC failed (S3)"),
            stale_writes_dropped=counter(
                "kvguard_stale_writes_dropped_total",
                "KV writes for a lease no longer current: dropped, never applied (S5)"),
            transfer_bytes=counter(
                "kvguard_kv_transfer_bytes_total", "KV payload bytes moved", ["direction"]),
            chunk_bytes=Histogram(
                "kvguard_kv_transfer_chunk_bytes", "KV chunk payload sizes", ["direction"],
                buckets=_CHUNK_BUCKETS, registry=registry),
            transfers=counter(
                "kvguard_kv_transfers_total", "Terminal transfer outcomes", ["role", "outcome"]),
            frames_dropped=counter(
                "kvguard_kv_transfer_frames_dropped_total",
                "Late or unknown transfer frames dropped (class G)", ["reason"]),
            aborts=counter(
                "kvguard_aborts_total", "Requests aborted, by cause (S4)", ["cause"]),
        )

    def count_abort(self, cause: AbortCause | str) -> None:
        self.aborts.labels(cause=str(cause)).inc()

    def count_outcome(self, role: str, outcome: TransferOutcome) -> None:
        label = "complete" if outcome.ok else str(outcome.reason)
        self.transfers.labels(role=role, outcome=label).inc()


# ---------------------------------------------------------------------------------------------
# Frame I/O shared by both ends


class FrameSource(Protocol):
    """asyncio.StreamReader (prefill reads replies) or BufferedStreamReader (decode reads KV)."""

    async def readexactly(self, n: int) -> bytes | memoryview: ...


class FrameSink(Protocol):
    """asyncio.StreamWriter or stream_buffer.TransportWriter."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def drain(self) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...


async def read_frame(
    reader: FrameSource, key: bytes | None, max_payload: int
) -> tuple[Frame, bytes | memoryview] | None:
    """Read one frame; None on a clean end of stream between frames. Raises ProtocolError.
    The payload may be a view into the reader's buffer, valid until the next read."""
    try:
        prefix = bytes(await reader.readexactly(PREFIX.size))
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("stream ended inside a frame prefix") from None
    kind, header_len, payload_len = parse_prefix(prefix, max_payload)
    try:
        header_and_tag = bytes(await reader.readexactly(header_len + TAG_BYTES))
        frame = open_header(key, prefix, header_and_tag, kind)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("stream ended inside a frame") from None
    return frame, payload


def write_frame(writer: FrameSink, key: bytes | None, frame: Frame,
                payload: memoryview | bytes = b"") -> None:
    """Queue one whole frame. Synchronous, so frames of concurrent requests never interleave."""
    head = seal(key, frame, len(payload))
    if len(payload) < _JOIN_BELOW:
        writer.write(head + payload if payload else head)
    else:
        # Two writes instead of writelines(): 3.11's writelines joins, copying the payload.
        writer.write(head)
        writer.write(payload)


# ---------------------------------------------------------------------------------------------
# Receiver (decode side)


class WriteOutcome(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # lease/generation no longer current: dropped, never applied (S5)
    UNKNOWN_REQUEST = "unknown_request"


class KVSink(Protocol):
    """Where decode's transfer receiver puts verified payloads: the decode server's KV pool."""

    async def write_pages(
        self, request_id: str, page_ids: Sequence[int], generations: Sequence[int],
        payload: memoryview,
    ) -> WriteOutcome:
        """Write ``payload`` (the pages' bytes, in ``page_ids`` order) if the lease is current.

        Must stamp the pages' written generation only when it applies them; must copy out of
        ``payload`` before returning (the buffer is not kept)."""
        ...

    async def transfer_complete(self, request_id: str, manifest: Manifest) -> WriteOutcome:
        """Every planned page arrived and verified; APPLIED accepts, anything else fails it."""
        ...


class DuplicateRequestError(ValueError):
    """The request id is already being received, or was recently (class G)."""


class _Inbound:
    """Decode-side state of one expected transfer."""

    def __init__(self, request_id: str, tracker: PlanTracker, future: asyncio.Future[TransferOutcome],
                 stall_timeout_s: float) -> None:
        self.request_id = request_id
        self.tracker = tracker
        self.future = future
        self.stall_timeout_s = stall_timeout_s
        self.conn: _InboundConnection | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None


class _InboundConnection:
    def __init__(self, writer: FrameSink) -> None:
        self.writer = writer
        self.requests: set[str] = set()
        self.pending_credit = 0
        self.last_acked = ("", 0)
        self.flush_scheduled = False


class TransferHandle:
    """Decode's view of one expected transfer."""

    def __init__(self, receiver: KVReceiver, state: _Inbound) -> None:
        self._receiver = receiver
        self._state = state

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def done(self) -> bool:
        return self._state.future.done()

    async def wait(self) -> TransferOutcome:
        """The terminal outcome: complete and verified, or failed with a reason. Never hangs:
        the stall timeout fails a transfer that stops making progress."""
        return await asyncio.shield(self._state.future)

    def cancel(self, detail: str = "cancelled by decode") -> None:
        """Decode gave up on the request (S4): fail it now and tell prefill to stop sending."""
        self._receiver._fail(self._state, FailureReason.CANCELLED, detail)


class KVReceiver:
    """Decode's transfer server: verifies every frame and feeds the ``KVSink``."""

    def __init__(self, sink: KVSink, key: bytes, metrics: TransferMetrics,
                 config: TransferConfig = TransferConfig(), faults: Faults = NO_FAULTS) -> None:
        if config.verify_integrity and len(key) < 16:
            raise ValueError("the transfer key must be at least 16 bytes")
        self._sink = sink
        self._key: bytes | None = key if config.verify_integrity else None
        self._metrics = metrics
        self._bytes_in = metrics.transfer_bytes.labels(direction="received")
        self._chunks_in = metrics.chunk_bytes.labels(direction="received")
        self._config = config
        self._faults = faults
        self._active: dict[str, _Inbound] = {}
        self._finished: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._server: asyncio.Server | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> tuple[str, int]:
        """Listen on (host, port), or on an already bound `sock`; returns the bound (host, port)."""
        loop = asyncio.get_running_loop()
        factory = lambda: BufferedStreamProtocol(self._serve)  # noqa: E731
        if sock is not None:
            self._server = await loop.create_server(factory, sock=sock)
        else:
            self._server = await loop.create_server(factory, host, port)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        return sock_host, sock_port

    async def close(self) -> None:
        """Stop listening, close every connection and fail every transfer still in flight."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conn_tasks):
            task.cancel()
        await asyncio.gather(*self._conn_tasks, return_exceptions=True)
        for state in list(self._active.values()):
            self._fail(state, FailureReason.CANCELLED, "receiver closed")
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def expect(self, request_id: str, page_ids: Sequence[int], generations: Sequence[int],
               *, stall_timeout_s: float | None = None) -> TransferHandle:
        """Register decode's plan for a request (at bootstrap, before prefill learns the
        destination). Raises DuplicateRequestError for an id that is active or recently done."""
        validate_request_id(request_id)
        if request_id in self._active or request_id in self._finished:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        tracker = PlanTracker(page_ids, generations)
        loop = asyncio.get_running_loop()
        state = _Inbound(request_id, tracker, loop.create_future(),
                         stall_timeout_s or self._config.stall_timeout_s)
        self._active[request_id] = state
        self._touch(state)
        state.timer = loop.call_at(state.deadline, self._on_timer, state)
        return TransferHandle(self, state)

    # -- connection loop ----------------------------------------------------------------------

    async def _serve(self, reader: FrameSource, writer: FrameSink) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conn_tasks.add(task)
        conn = _InboundConnection(writer)
        reason, detail = FailureReason.CONNECTION_LOST, "prefill connection closed"
        try:
            while (got := await read_frame(reader, self._key, self._config.max_payload_bytes)):
                await self._dispatch(conn, *got)
                await writer.drain()
        except HmacError as exc:
            self._metrics.hmac_failures.inc()
            reason, detail = FailureReason.PROTOCOL_ERROR, str(exc)
            log.warning("closing transfer connection: %s", exc)
        except ProtocolError as exc:
            reason, detail = FailureReason.PROTOCOL_ERROR, str(exc)
            log.warning("closing transfer connection: %s", exc)
        except (ConnectionError, asyncio.CancelledError) as exc:
            detail = f"prefill connection lost: {exc!r}"
        finally:
            for rid in list(conn.requests):
                if (state := self._active.get(rid)) is not None:
                    self._fail(state, reason, detail, notify=False)
            writer.close()
            self._conn_tasks.discard(task)

    async def _dispatch(self, conn: _InboundConnection, frame: Frame, payload: bytes | memoryview) -> None:
        match frame:
            case ChunkHeader():
                await self._on_chunk(conn, frame, payload)
                self._return_credit(conn, frame, len(payload))
            case Manifest():
                await self._on_manifest(conn, frame)
            case Abort():
                if (state := self._active.get(frame.request_id)) is not None:
                    self._fail(state, FailureReason.PEER_ABORT, frame.reason, notify=False)
            case _:
                raise ProtocolError(f"unexpected {type(frame).__name__} frame from prefill")

    def _return_credit(self, conn: _InboundConnection, chunk: ChunkHeader, nbytes: int) -> None:
        """Credit goes back only after the sink consumed the bytes (S6). ACKs are coalesced: the
        flush runs when this connection's task next yields, i.e. before it blocks on the socket."""
        conn.pending_credit += nbytes
        conn.last_acked = (chunk.request_id, chunk.seq)
        if not conn.flush_scheduled:
            conn.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_credit, conn)

    def _flush_credit(self, conn: _InboundConnection) -> None:
        conn.flush_scheduled = False
        if conn.pending_credit and not conn.writer.is_closing():
            rid, seq = conn.last_acked
            write_frame(conn.writer, self._key, Ack(rid, seq, conn.pending_credit))
        conn.pending_credit = 0

    def _claim(self, conn: _InboundConnection, request_id: str) -> _Inbound | None:
        """The live state for a frame, or None after answering a late/unknown one (class G)."""
        state = self._active.get(request_id)
        if state is None:
            finished = self._finished.get(request_id)
            kind = "late" if finished else "unknown_request"
            self._metrics.frames_dropped.labels(reason=kind).inc()
            reason, detail = finished or (FailureReason.UNKNOWN_REQUEST, "decode does not expect it")
            write_frame(conn.writer, self._key, Result(request_id, False, reason, detail))
            return None
        if state.conn is None:
            state.conn = conn
            conn.requests.add(request_id)
        elif state.conn is not conn:
            self._fail(state, FailureReason.PLAN_MISMATCH, "frames on a second connection")
            return None
        return state

    async def _on_chunk(self, conn: _InboundConnection, chunk: ChunkHeader, payload: bytes | memoryview) -> None:
        self._bytes_in.inc(len(payload))
        self._chunks_in.observe(len(payload))
        if (state := self._claim(conn, chunk.request_id)) is None:
            return
        if (problem := state.tracker.check_chunk(chunk)) is not None:
            self._fail(state, FailureReason.PLAN_MISMATCH, problem)
            return
        if self._key is not None and not self._faults.no_checksum:
            if payload_checksum(payload) != chunk.checksum:
                self._metrics.checksum_failures.inc()
                self._fail(state, FailureReason.CHECKSUM, f"chunk seq {chunk.seq} checksum mismatch")
                return
        try:
            written = await self._sink.write_pages(
                chunk.request_id, chunk.page_ids, chunk.generations, memoryview(payload))
        except Exception as exc:  # a sink bug fails this request, never the connection
            log.exception("KV sink write failed for %s", chunk.request_id)
            self._fail(state, FailureReason.SINK_ERROR, repr(exc))
            return
        if written is WriteOutcome.STALE:
            self._metrics.stale_writes_dropped.inc()
            self._fail(state, FailureReason.STALE, f"chunk seq {chunk.seq}: lease no longer current")
        elif written is not WriteOutcome.APPLIED:
            self._fail(state, FailureReason.UNKNOWN_REQUEST, "decode no longer knows the request")
        elif not state.future.done():
            state.tracker.record(chunk, len(payload))
            self._touch(state)

    async def _on_manifest(self, conn: _InboundConnection, manifest: Manifest) -> None:
        if (state := self._claim(conn, manifest.request_id)) is None:
            return
        if not self._faults.ignore_manifest:
            if (problem := state.tracker.check_manifest(manifest)) is not None:
                self._fail(state, FailureReason.MANIFEST_MISMATCH, problem)
                return
        try:
            accepted = await self._sink.transfer_complete(manifest.request_id, manifest)
        except Exception as exc:
            log.exception("KV sink completion failed for %s", manifest.request_id)
            self._fail(state, FailureReason.SINK_ERROR, repr(exc))
            return
        if accepted is WriteOutcome.APPLIED:
            self._finish(state, TransferOutcome(
                state.request_id, True, chunks=state.tracker.chunks, bytes=state.tracker.bytes))
        elif accepted is WriteOutcome.STALE:
            self._fail(state, FailureReason.STALE, "lease no longer current at completion")
        else:
            self._fail(state, FailureReason.UNKNOWN_REQUEST, "decode no longer knows the request")

    # -- terminal transitions -----------------------------------------------------------------

    def _touch(self, state: _Inbound) -> None:
        state.deadline = asyncio.get_running_loop().time() + state.stall_timeout_s

    def _on_timer(self, state: _Inbound) -> None:
        if state.future.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= state.deadline:
            self._fail(state, FailureReason.TIMEOUT,
                       f"no transfer progress for {state.stall_timeout_s:g}s")
        else:  # progress since arming: re-arm lazily instead of once per chunk
            state.timer = loop.call_at(state.deadline, self._on_timer, state)

    def _fail(self, state: _Inbound, reason: FailureReason, detail: str, *, notify: bool = True) -> None:
        if state.future.done():
            return
        self._finish(state, TransferOutcome(state.request_id, False, reason, detail,
                                            state.tracker.chunks, state.tracker.bytes), notify)

    def _finish(self, state: _Inbound, outcome: TransferOutcome, notify: bool = True) -> None:
        if state.future.done():
            return
        if state.timer is not None:
            state.timer.cancel()
        self._active.pop(state.request_id, None)
        self._finished[state.request_id] = (str(outcome.reason or "complete"), outcome.detail)
        while len(self._finished) > self._config.remembered_finished:
            self._finished.popitem(last=False)
        if state.conn is not None:
            state.conn.requests.discard(state.request_id)
            if notify and not state.conn.writer.is_closing():
                write_frame(state.conn.writer, self._key, Result(
                    state.request_id, outcome.ok, str(outcome.reason or ""), outcome.detail))
        state.future.set_result(outcome)
        self._metrics.count_outcome("receiver", outcome)
        if not outcome.ok:
            log.info("transfer %s failed: %s (%s)", state.request_id, outcome.reason, outcome.detail)


# ---------------------------------------------------------------------------------------------
# Sender (prefill side)


@dataclass(frozen=True)
class KVChunk:
    """One chunk to send: the pages it fills and their bytes, in ``page_ids`` order."""

    page_ids: Sequence[int]
    payload: bytes | bytearray | memoryview


class PrefillCrashed(RuntimeError):
    """Raised in-process when ``crash_prefill_after_chunks`` fires and the crash hook returned."""


def _hard_exit() -> None:
    log.critical("FAULT crash_prefill_after_chunks: prefill process exiting now")
    logging.shutdown()
    os._exit(CRASH_EXIT_CODE)


class ByteCredit:
    """FIFO byte semaphore: the in-flight cap of one prefill->decode pair (S6)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.max_in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_acquire(self, n: int) -> bool:
        if self._waiters or not self._fits(n):
            return False
        self._take(n)
        return True

    def _fits(self, n: int) -> bool:
        return self.in_use == 0 or self.in_use + n <= self.capacity

    def _take(self, n: int) -> None:
        self.in_use += n
        self.max_in_use = max(self.max_in_use, self.in_use)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        self.in_use -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)


class _Peer:
    """One decode destination: its connection pool and the pair's byte credit."""

    def __init__(self, dest: tuple[str, int], capacity: int) -> None:
        self.dest = dest
        self.credit = ByteCredit(capacity)
        self.conns: list[_OutboundConnection] = []
        self.open_lock = asyncio.Lock()


class _OutboundConnection:
    def __init__(self, peer: _Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.results: dict[str, asyncio.Future[TransferOutcome]] = {}
        self.unacked = 0  # bytes written on this connection and not yet credited back
        self.closed = False
        self.reader_task: asyncio.Task[None] | None = None

    def release_all(self) -> None:
        total, self.unacked = self.unacked, 0
        if total:
            self.peer.credit.release(total)


class KVSender:
    """Prefill's side: sends one request's chunks and manifest to decode, with credit."""

    def __init__(self, key: bytes, metrics: TransferMetrics,
                 config: TransferConfig = TransferConfig(), faults: Faults = NO_FAULTS,
                 on_crash: Callable[[], None] = _hard_exit) -> None:
        if config.verify_integrity and len(key) < 16:
            raise ValueError("the transfer key must be at least 16 bytes")
        self._key: bytes | None = key if config.verify_integrity else None
        self._metrics = metrics
        self._bytes_out = metrics.transfer_bytes.labels(direction="sent")
        self._chunks_out = metrics.chunk_bytes.labels(direction="sent")
        self._config = config
        self._faults = faults
        self._rng = faults.rng()
        self._on_crash = on_crash
        self._chunks_sent = 0
        self._peers: dict[tuple[str, int], _Peer] = {}

    def credit(self, dest: tuple[str, int]) -> ByteCredit:
        """The pair's byte credit (its ``max_in_use`` is the high-water mark of bytes in flight)."""
        return self._peer(dest).credit

    async def close(self) -> None:
        conns = [c for p in self._peers.values() for c in p.conns]
        for conn in conns:
            conn.writer.close()
        await asyncio.gather(*(c.reader_task for c in conns if c.reader_task), return_exceptions=True)

    async def send(self, request_id: str, dest: tuple[str, int], page_ids: Sequence[int],
                   generations: Sequence[int],
                   chunks: AsyncIterable[KVChunk] | Iterable[KVChunk],
                   first_token: int = -1) -> TransferOutcome:
        """Send every chunk, then the manifest (carrying prefill's first token), and return
        decode's verdict.

        Returns a failed outcome for decode-side failures, stalls (TIMEOUT) and lost connections.
        If ``chunks`` raises (prefill error) or this task is cancelled (client disconnect), an
        ABORT frame tells decode to release at once (S4), and the exception propagates."""
        validate_request_id(request_id)
        plan = dict(zip(page_ids, generations))
        if len(plan) != len(page_ids) or len(page_ids) != len(generations):
            raise ValueError("page ids must be unique and match generations one to one")
        try:
            conn = await self._connection(dest)
        except (OSError, TimeoutError) as exc:
            outcome = TransferOutcome(request_id, False, FailureReason.CONNECTION_LOST,
                                      f"cannot connect to decode at {dest}: {exc!r}")
            self._metrics.count_outcome("sender", outcome)
            return outcome
        if request_id in conn.results:
            raise ValueError(f"request {request_id!r} is already being sent")
        result: asyncio.Future[TransferOutcome] = asyncio.get_running_loop().create_future()
        conn.results[request_id] = result
        try:
            outcome = await self._send_all(conn, request_id, plan, chunks, result, first_token)
        except TimeoutError:
            self._abort(conn, request_id, "prefill timed out waiting for decode")
            outcome = TransferOutcome(request_id, False, FailureReason.TIMEOUT,
                                      f"no progress for {self._config.stall_timeout_s:g}s")
        except ConnectionError as exc:
            outcome = TransferOutcome(request_id, False, FailureReason.CONNECTION_LOST, repr(exc))
        except BaseException as exc:  # prefill error, client disconnect (cancel), crash
            if not isinstance(exc, PrefillCrashed):
                self._abort(conn, request_id, f"prefill aborted: {exc!r}")
            raise
        finally:
            conn.results.pop(request_id, None)
        self._metrics.count_outcome("sender", outcome)
        return outcome

    async def abort(self, request_id: str, dest: tuple[str, int], reason: str) -> None:
        """Tell decode to release a request prefill will never send (e.g. prefill failed early)."""
        if self._faults.no_abort_propagation:
            return
        conn = await self._connection(dest)
        write_frame(conn.writer, self._key, Abort(request_id, reason))
        await conn.writer.drain()

    # -- internals ----------------------------------------------------------------------------

    async def _send_all(self, conn: _OutboundConnection, request_id: str, plan: dict[int, int],
                        chunks: AsyncIterable[KVChunk] | Iterable[KVChunk],
                        result: asyncio.Future[TransferOutcome], first_token: int) -> TransferOutcome:
        seq = total = 0
        sent: list[int] = []
        async for chunk in _aiter(chunks):
            if result.done():  # decode already gave its verdict (failure or cancel): stop
                return result.result()
            try:
                gens = tuple(plan[p] for p in chunk.page_ids)
            except KeyError as exc:
                raise ValueError(f"page {exc.args[0]} is not in decode's plan") from None
            payload = memoryview(chunk.payload).cast("B")
            await self._send_chunk(conn, ChunkHeader(
                request_id, seq, self._checksum(payload), tuple(chunk.page_ids), gens), payload)
            seq, total = seq + 1, total + len(payload)
            sent.extend(chunk.page_ids)
        if result.done():
            return result.result()
        write_frame(conn.writer, self._key, Manifest(
            request_id, seq, total, tuple(sent), tuple(plan[p] for p in sent), first_token))
        async with asyncio.timeout(self._config.stall_timeout_s):
            await conn.writer.drain()
            return await asyncio.shield(result)

    def _checksum(self, payload: memoryview) -> bytes:
        return payload_checksum(payload) if self._key is not None else bytes(16)

    async def _send_chunk(self, conn: _OutboundConnection, header: ChunkHeader,
                          payload: memoryview) -> None:
        faults, n = self._faults, len(payload)
        if faults.delay_chunk_ms:
            await asyncio.sleep(faults.delay_chunk_ms / 1000)
        if faults.corrupt_chunk and self._rng.random() < faults.corrupt_chunk:
            corrupted = bytearray(payload)  # after checksumming: decode must catch it (S3)
            if n:
                # A run of flipped bytes, as a misdirected or torn write leaves: one flipped low
                # mantissa byte would be invisible in the output and prove nothing.
                width = min(n, max(64, n // 8))
                start = self._rng.randrange(n - width + 1)
                corrupted[start:start + width] = bytes(b ^ 0xFF for b in corrupted[start:start + width])
            payload = memoryview(corrupted)
        dropped = faults.drop_chunk and self._rng.random() < faults.drop_chunk
        if conn.closed:
            raise ConnectionResetError("connection to decode lost")
        credit = conn.peer.credit
        if not credit.try_acquire(n):  # only arm a timer when we actually have to wait
            async with asyncio.timeout(self._config.stall_timeout_s):
                await credit.acquire(n)
        if dropped:
            credit.release(n)
        else:
            conn.unacked += n
            write_frame(conn.writer, self._key, header, payload)
            self._bytes_out.inc(n)
            self._chunks_out.observe(n)
            if conn.writer.transport.get_write_buffer_size():
                async with asyncio.timeout(self._config.stall_timeout_s):
                    await conn.writer.drain()
        self._chunks_sent += 1
        if faults.crash_prefill_after_chunks is not None and \
                self._chunks_sent >= faults.crash_prefill_after_chunks:
            self._crash()

    def _crash(self) -> None:
        self._on_crash()
        # The hook returned (tests): die as far as the peers can tell, without any ABORT.
        for peer in self._peers.values():
            for conn in peer.conns:
                conn.writer.transport.abort()
        raise PrefillCrashed("crash_prefill_after_chunks fired")

    def _abort(self, conn: _OutboundConnection, request_id: str, reason: str) -> None:
        if self._faults.no_abort_propagation or conn.closed or conn.writer.is_closing():
            return
        write_frame(conn.writer, self._key, Abort(request_id, reason))

    def _peer(self, dest: tuple[str, int]) -> _Peer:
        dest = (dest[0], int(dest[1]))
        if (peer := self._peers.get(dest)) is None:
            peer = self._peers[dest] = _Peer(dest, self._config.max_transfer_batch)
        return peer

    async def _connection(self, dest: tuple[str, int]) -> _OutboundConnection:
        peer = self._peer(dest)
        async with peer.open_lock:
            peer.conns = [c for c in peer.conns if not c.closed]
            idle = [c for c in peer.conns if not c.results]
            if idle or len(peer.conns) >= self._config.max_connections_per_peer:
                return min(idle or peer.conns, key=lambda c: len(c.results))
            async with asyncio.timeout(self._config.connect_timeout_s):
                reader, writer = await asyncio.open_connection(*peer.dest)
            conn = _OutboundConnection(peer, reader, writer)
            conn.reader_task = asyncio.create_task(self._read_replies(conn))
            peer.conns.append(conn)
            return conn

    async def _read_replies(self, conn: _OutboundConnection) -> None:
        detail = "decode closed the connection"
        try:
            while (got := await read_frame(conn.reader, self._key, 0)) is not None:
                self._on_reply(conn, got[0])
        except HmacError as exc:
            self._metrics.hmac_failures.inc()
            detail = str(exc)
        except ProtocolError as exc:
            detail = str(exc)
        except (ConnectionError, asyncio.CancelledError) as exc:
            detail = f"connection to decode lost: {exc!r}"
        finally:
            conn.closed = True
            conn.writer.close()
            conn.release_all()
            for rid, fut in list(conn.results.items()):
                if not fut.done():
                    fut.set_result(TransferOutcome(rid, False, FailureReason.CONNECTION_LOST, detail))

    def _on_reply(self, conn: _OutboundConnection, frame: Frame) -> None:
        match frame:
            case Ack():
                n = min(frame.nbytes, conn.unacked)  # never more than was sent on it
                conn.unacked -= n
                conn.peer.credit.release(n)
            case Result():
                fut = conn.results.get(frame.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(TransferOutcome(
                        frame.request_id, frame.ok, _reason(frame.reason) if not frame.ok else None,
                        frame.detail))
            case _:
                raise ProtocolError(f"unexpected {type(frame).__name__} frame from decode")


def _reason(text: str) -> FailureReason | str:
    try:
        return FailureReason(text)
    except ValueError:
        return text


async def _aiter(chunks: AsyncIterable[KVChunk] | Iterable[KVChunk]):  # type: ignore[no-untyped-def]
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk
