"""Decode's side of the KV transfer: a listener that verifies every frame and feeds each request's sink.

Per connection: the first frame must be prefill's HELLO (MAC'd with the hello key); decode answers
WELCOME with a fresh nonce and its boot epoch, and the pair's nonces name the connection. A frame
that fails verification, or names a request not opened on this connection, closes this connection
only (and fails the transfers opened on it); nothing else is touched.

Per request (``InboundTransfer``, held by the decode job that owns the pages; the receiver finds it
with the ``lookup`` the server gives it): EXPECTED until an OPEN presents a ticket the router
issued whose nonce, epoch and pages are the ones decode granted; then OPEN on that connection only;
COMPLETE or FAILED (lifecycle.py). An OPEN that does not match is answered with a failed RESULT on
its own connection and leaves the transfer alone, so a replayed or foreign OPEN cannot end
another's transfer. Decode tells prefill every terminal verdict of an opened transfer in a
RESULT, so a decode-side failure or cancel stops prefill at once (S4).

Back-pressure (S6): credit (ACK, per connection) is returned only after the sink consumed a
chunk's bytes.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvguard.workers.faults import NO_FAULTS, Faults
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.stream_buffer import BufferedStreamProtocol
from kvguard.workers.transfer.channel import (
    DecryptError,
    FrameReader,
    FrameSink,
    FrameSource,
    FrameWriter,
    RequestCodec,
)
from kvguard.workers.transfer.config import DEFAULT_CONFIG, FailureReason, TransferConfig, TransferOutcome
from kvguard.workers.transfer.lifecycle import TERMINAL, TransferState, advance
from kvguard.workers.transfer.metrics import TransferMetrics
from kvguard.workers.transfer.plan import PlanTracker
from kvguard.workers.transfer.tickets import Ticket, TicketAuthority, TicketError, TicketRejection
from kvguard.workers.transfer.wire import (
    NONCE_BYTES,
    Abort,
    Ack,
    ChunkHeader,
    FrameType,
    Hello,
    HmacError,
    Manifest,
    Open,
    ProtocolError,
    RawFrame,
    Result,
    Welcome,
    decode,
    payload_checksum,
    validate_request_id,
    verify,
)

log = logging.getLogger("kvguard.transfer")


class WriteOutcome(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # lease/generation no longer current: dropped, never applied (S5)
    UNKNOWN_REQUEST = "unknown_request"


class KVSink(Protocol):
    """Where one request's verified payloads go: the decode job that owns its pages."""

    async def write_pages(self, page_ids: Sequence[int], generations: Sequence[int], payload: memoryview) -> WriteOutcome:
        """Write ``payload`` (the pages' bytes, in ``page_ids`` order) if the lease is current.

        Must stamp the pages' written generation only when it applies them; must copy out of
        ``payload`` before returning (the buffer is not kept)."""
        ...

    async def transfer_complete(self, manifest: Manifest) -> WriteOutcome:
        """Every planned page arrived and verified; APPLIED accepts, anything else fails it."""
        ...


class DuplicateRequestError(ValueError):
    """A transfer for this request id is already expected (class G)."""


class InboundTransfer:
    """Decode's state of one request's transfer (see lifecycle.py for its states)."""

    def __init__(self, receiver: KVReceiver, request_id: str, tracker: PlanTracker, sink: KVSink,
                 stall_timeout_s: float, open_timeout_s: float) -> None:  # fmt: skip
        self.request_id = request_id
        self.nonce = secrets.token_bytes(NONCE_BYTES)  # the ticket must carry it (S9)
        self.state = TransferState.EXPECTED
        self.tracker = tracker
        self.sink = sink
        self.stall_timeout_s = stall_timeout_s
        self.open_timeout_s = open_timeout_s
        self.future: asyncio.Future[TransferOutcome] = asyncio.get_running_loop().create_future()
        self.conn: _InboundConnection | None = None
        self.codec: RequestCodec | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._receiver = receiver

    @property
    def epoch(self) -> int:
        return self._receiver.epoch

    def done(self) -> bool:
        return self.future.done()

    async def wait(self) -> TransferOutcome:
        """The terminal outcome: complete and verified, or failed with a reason. Never hangs:
        the stall timeout fails a transfer that stops making progress."""
        return await asyncio.shield(self.future)

    def cancel(self, detail: str = "cancelled by decode") -> None:
        """Decode gave up on the request (S4): fail it now and tell prefill to stop sending."""
        self._receiver._fail(self, FailureReason.CANCELLED, detail)


TransferLookup = Callable[[str], "InboundTransfer | None"]


class _InboundConnection:
    def __init__(self, writer: FrameWriter, conn_id: bytes, ack_key: bytes | None, remembered: int) -> None:
        self.writer = writer
        self.conn_id = conn_id
        self.ack_key = ack_key
        self.opened: dict[str, InboundTransfer] = {}  # demultiplexing index for this connection
        self.carried = 0  # transfers opened here (an OPEN needs a ticket: only the revision's prefill has them)
        # Requests that ended (or were refused) on this connection: their late frames are still
        # verified, then dropped. Bounded; older ones are simply unknown.
        self.finished: collections.OrderedDict[str, RequestCodec] = collections.OrderedDict()
        self.remembered = remembered
        self.pending_credit = 0
        self.acks_sent = 0
        self.flush_scheduled = False

    def remember(self, request_id: str, codec: RequestCodec) -> None:
        self.finished[request_id] = codec
        while len(self.finished) > self.remembered:
            self.finished.popitem(last=False)


@dataclass(eq=False)
class _Slot:
    """One inbound connection's place under decode's connection bounds (`KVReceiver._make_room`)."""

    task: asyncio.Task[None]
    since: float  # when it connected, then when it last carried a frame
    conn: _InboundConnection | None = None  # once through the handshake

    def give_way_rank(self) -> tuple[int, float] | None:
        """Which connection makes room for a new one (lowest first, oldest first); None: never."""
        if self.conn is None:
            return 0, self.since  # not through its handshake: a scan, a flood, a slow peer
        if self.conn.opened:
            return None  # carrying a transfer
        if not self.conn.carried:
            return 1, self.since  # a HELLO (replayable) and nothing since: no proof it is prefill
        return 2, self.since  # prefill's, idle in its pool: it reconnects when it needs one


class _Throttled:
    """A warning an outsider can cause at will (a connection flood on the transfer port): one line
    per `every_s`, saying how many it stands for, rather than one per connection."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last = -every_s
        self._count = 0

    def warning(self, message: str, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            log.warning(message + " (%d such since the last line like it)", *args, self._count)
            self._last, self._count = now, 0


class KVReceiver:
    """Decode's transfer server: verifies every frame and feeds each transfer's ``KVSink``."""

    def __init__(self, keys: RevisionKeys, metrics: TransferMetrics, lookup: TransferLookup,
                 config: TransferConfig = DEFAULT_CONFIG, faults: Faults = NO_FAULTS) -> None:  # fmt: skip
        self.epoch = secrets.randbits(64)  # per boot: tickets of an earlier process are refused
        self._keys = keys
        self._tickets = TicketAuthority(keys.ticket)
        self._hello_key: bytes | None = keys.hello if config.verify_integrity else None
        self._lookup = lookup
        self._metrics = metrics
        self._bytes_in = metrics.transfer_bytes.labels(direction="received")
        self._chunks_in = metrics.chunk_bytes.labels(direction="received")
        self._config = config
        self._faults = faults
        self._live: set[InboundTransfer] = set()  # to fail them all at close; not a lookup
        self._server: asyncio.Server | None = None
        self._slots: dict[asyncio.Task[None], _Slot] = {}  # every connection open
        self._closing_log = _Throttled()

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
        tasks = list(self._slots)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for transfer in list(self._live):
            self._fail(transfer, FailureReason.CANCELLED, "receiver closed")
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def active_requests(self) -> int:
        return len(self._live)

    def expect(self, request_id: str, page_ids: Sequence[int], generations: Sequence[int], sink: KVSink,
               *, stall_timeout_s: float | None = None, open_timeout_s: float | None = None) -> InboundTransfer:  # fmt: skip
        """Plan a request's transfer (at bootstrap, before prefill learns the destination) and
        draw its ticket nonce. The caller keeps the transfer where ``lookup`` finds it.

        Two clocks bound it (S4): until OPEN, the open timeout (prefill may still be queueing or
        computing: it opens only once the prompt's KV exists); from OPEN on, the stall timeout
        (no frame for that long). A stall timer armed here would fail every request whose
        prefill takes longer than a stall, e.g. a long prompt on a large model."""
        validate_request_id(request_id)
        if (existing := self._lookup(request_id)) is not None and existing.state not in TERMINAL:
            raise DuplicateRequestError(f"request id {request_id!r} is already expected")
        transfer = InboundTransfer(self, request_id, PlanTracker(page_ids, generations), sink,
                                   stall_timeout_s or self._config.stall_timeout_s,
                                   open_timeout_s or self._config.open_timeout_s)  # fmt: skip
        self._live.add(transfer)
        self._arm(transfer, transfer.open_timeout_s)
        return transfer

    # -- connection loop ----------------------------------------------------------------------

    async def _serve(self, reader: FrameSource, writer: FrameSink) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._make_room(established=False)  # each connection holds a buffer: bounded
        slot = self._slots[task] = _Slot(task, time.monotonic())
        conn: _InboundConnection | None = None
        reason, detail = FailureReason.CONNECTION_LOST, "prefill connection closed"
        frames_in = FrameReader(reader, self._config.max_payload_bytes, frame_timeout_s=self._config.stall_timeout_s,
                                max_pages=self._config.max_pages)  # fmt: skip
        frames_out = FrameWriter(writer)
        try:
            conn = await self._handshake(frames_in, frames_out)
            if conn is not None and not self._make_room(established=True):
                raise ProtocolError(f"{self._config.max_inbound_connections} transfer connections open, each carrying a transfer")
            slot.conn = conn
            while conn is not None and (head := await frames_in.read_head()):
                await self._dispatch(conn, head, frames_in)
                slot.since = time.monotonic()
                await writer.drain()
        except HmacError as exc:
            self._metrics.hmac_failures.inc()
            reason, detail = FailureReason.PROTOCOL_ERROR, str(exc)
            self._closing_log.warning("closing transfer connection: %s", exc)
        except (ProtocolError, TimeoutError) as exc:
            reason, detail = FailureReason.PROTOCOL_ERROR, str(exc) or "handshake timed out"
            self._closing_log.warning("closing transfer connection: %s", detail)
        except (ConnectionError, asyncio.CancelledError) as exc:
            detail = f"prefill connection lost: {exc!r}"
        finally:
            for transfer in list(conn.opened.values()) if conn else ():
                self._fail(transfer, reason, detail, notify=False)
            writer.close()
            self._slots.pop(task, None)

    def _make_room(self, established: bool) -> bool:
        """Room for one more connection still in its handshake (`max_handshaking_connections`) or
        through it (`max_inbound_connections`): under the bound, or one of the same kind gives way
        -- in its handshake, the oldest; through it, the oldest that sent only a HELLO
        (replayable), then prefill's oldest idle one (it reconnects when it needs one); never one
        carrying a transfer. So the bounds limit memory, not who gets in: a flood of connections
        that send nothing, or of replayed HELLOs, cannot keep prefill out, and what a new
        connection evicts is never the one that just got through. False: all carry transfers."""
        peers = [slot for slot in self._slots.values() if (slot.conn is not None) is established]
        bound = self._config.max_inbound_connections if established else self._config.max_handshaking_connections
        if len(peers) < bound:
            return True
        ranked = [(rank, slot) for slot in peers if (rank := slot.give_way_rank()) is not None]
        if not ranked:
            return False
        _, victim = min(ranked, key=lambda entry: entry[0])
        del self._slots[victim.task]  # its place is the new one's now; the task ends once cancelled
        victim.task.cancel()
        return True

    async def _handshake(self, reader: FrameReader, writer: FrameWriter) -> _InboundConnection | None:
        """HELLO in, WELCOME out: the connection's id is both nonces (keys.py)."""
        async with asyncio.timeout(self._config.connect_timeout_s):
            raw = await reader.read(expect=FrameType.HELLO)
        if raw is None:
            return None
        verify(raw, self._hello_key)
        hello = decode(raw)
        assert isinstance(hello, Hello)
        welcome = Welcome(hello.nonce, secrets.token_bytes(NONCE_BYTES), self.epoch, self._config.encryption)
        writer.send_frame(self._hello_key, welcome)
        if hello.encryption is not self._config.encryption:
            raise ProtocolError(f"prefill sends with encryption {hello.encryption}, decode expects {self._config.encryption}")
        ack_key = self._keys.connection(welcome.conn_id) if self._config.verify_integrity else None
        return _InboundConnection(writer, welcome.conn_id, ack_key, self._config.remembered_per_connection)

    async def _dispatch(self, conn: _InboundConnection, head: RawFrame, frames: FrameReader) -> None:
        """One frame, from its head: its tag is verified before its payload is read (FrameReader)."""
        if head.kind is FrameType.OPEN:
            self._on_open(conn, head)  # no payload
            return
        if head.kind not in (FrameType.CHUNK, FrameType.MANIFEST, FrameType.ABORT):
            raise ProtocolError(f"unexpected {head.kind.name} frame from prefill")
        # Parsed (bounds-checked) before verification only to pick the key; acted on only after.
        frame = decode(head)
        rid = frame.request_id  # type: ignore[union-attr]
        transfer = conn.opened.get(rid)
        if transfer is None:
            await self._drop_late(conn, rid, head, frames)
            return
        assert transfer.codec is not None
        transfer.codec.verify(head)
        raw = await frames.read_payload(head)
        if isinstance(frame, ChunkHeader):
            await self._on_chunk(transfer, frame, raw)
            self._return_credit(conn, len(raw.payload))
        elif isinstance(frame, Manifest):
            await self._on_manifest(transfer, frame, raw)
        elif isinstance(frame, Abort):
            self._fail(transfer, FailureReason.PEER_ABORT, frame.reason, notify=False)

    async def _drop_late(self, conn: _InboundConnection, rid: str, head: RawFrame, frames: FrameReader) -> None:
        """A frame for a request that ended (or was refused) on this connection: verify, read past
        its payload, drop. One for a request never opened here is a protocol error: this
        connection closes, its payload never read."""
        codec = conn.finished.get(rid)
        if codec is None:
            raise ProtocolError(f"{head.kind.name} for request {rid!r}, which was not opened on this connection")
        codec.verify(head)
        raw = await frames.read_payload(head)
        self._metrics.frames_dropped.labels(reason="late").inc()
        if raw.kind is FrameType.CHUNK:
            self._return_credit(conn, len(raw.payload))

    # -- OPEN: the ticket check (S9) ------------------------------------------------------------

    def _on_open(self, conn: _InboundConnection, raw: RawFrame) -> None:
        frame = decode(raw)  # parsed (bounds-checked) before its MAC: the key comes from the ticket
        assert isinstance(frame, Open)
        try:
            ticket = self._tickets.authenticate(frame.ticket)
        except TicketError as exc:
            self._metrics.ticket_rejections.labels(reason=exc.reason).inc()
            raise ProtocolError(f"OPEN with a ticket this revision did not issue: {exc}") from None
        codec = RequestCodec(self._keys.request(ticket.nonce, conn.conn_id) if self._config.verify_integrity else None,
                             self._config.encryption)  # fmt: skip
        codec.verify(raw)  # this ticket's nonce, this connection
        if frame.request_id != ticket.request_id:
            raise ProtocolError("OPEN names another request than its ticket")
        transfer = self._lookup(ticket.request_id)
        refusal = self._refusal(conn, ticket, transfer)
        if refusal is not None:
            reason, detail = refusal
            conn.remember(ticket.request_id, codec)  # its chunks may already be on the way
            codec.write(conn.writer, Result(ticket.request_id, False, str(reason), detail))
            return
        assert transfer is not None
        transfer.state = advance(transfer.state, TransferState.OPEN)
        transfer.conn, transfer.codec = conn, codec
        conn.opened[transfer.request_id] = transfer
        conn.carried += 1
        self._arm(transfer, transfer.stall_timeout_s)  # the open timeout's deadline may lie far later

    def _refusal(self, conn: _InboundConnection, ticket: Ticket, transfer: InboundTransfer | None) -> tuple[str, str] | None:
        """Why this (authentic) ticket does not open ``transfer`` here, or None. Never changes it."""
        try:
            self._tickets.check_time(ticket)
        except TicketError as exc:
            return self._refuse_ticket(exc.reason, str(exc))
        if ticket.epoch != self.epoch:
            return self._refuse_ticket("epoch", "the ticket is for another boot of this decode worker")
        if transfer is None:
            self._metrics.frames_dropped.labels(reason="unknown_request").inc()
            return FailureReason.UNKNOWN_REQUEST, "decode does not expect it"
        if not hmac.compare_digest(ticket.nonce, transfer.nonce) or not transfer.tracker.is_plan(ticket.page_ids, ticket.generations):
            return self._refuse_ticket("mismatch", "the ticket's nonce or pages are not the ones decode granted")
        if transfer.state is TransferState.OPEN:
            return self._refuse_ticket("already_open", "the transfer is already open on another connection")
        if transfer.state in TERMINAL:
            self._metrics.frames_dropped.labels(reason="late").inc()
            outcome = transfer.future.result()
            return str(outcome.reason or "complete"), outcome.detail or "the transfer already ended"
        return None

    def _refuse_ticket(self, reason: TicketRejection, detail: str) -> tuple[str, str]:
        self._metrics.ticket_rejections.labels(reason=reason).inc()
        return FailureReason.TICKET, detail

    # -- CHUNK, MANIFEST --------------------------------------------------------------------------

    async def _on_chunk(self, transfer: InboundTransfer, chunk: ChunkHeader, raw: RawFrame) -> None:
        self._bytes_in.inc(len(raw.payload))
        self._chunks_in.observe(len(raw.payload))
        if (problem := transfer.tracker.check_chunk(chunk)) is not None:
            self._fail(transfer, FailureReason.PLAN_MISMATCH, problem)
            return
        payload = self._plaintext(transfer, chunk, raw)
        if payload is None:
            return
        try:
            written = await transfer.sink.write_pages(chunk.page_ids, chunk.generations, memoryview(payload))
        except Exception as exc:  # a sink bug fails this request, never the connection
            log.exception("KV sink write failed for %s", transfer.request_id)
            self._fail(transfer, FailureReason.SINK_ERROR, repr(exc))
            return
        if written is WriteOutcome.STALE:
            self._metrics.stale_writes_dropped.inc()
            self._fail(transfer, FailureReason.STALE, f"chunk seq {chunk.seq}: lease no longer current")
        elif written is not WriteOutcome.APPLIED:
            self._fail(transfer, FailureReason.UNKNOWN_REQUEST, "decode no longer knows the request")
        elif not transfer.done():
            transfer.tracker.record(chunk, len(payload))
            self._touch(transfer)

    def _plaintext(self, transfer: InboundTransfer, chunk: ChunkHeader, raw: RawFrame) -> bytes | memoryview | None:
        """The chunk's verified plaintext (S3), or None after failing the transfer."""
        assert transfer.codec is not None
        try:
            payload = transfer.codec.chunk_payload(raw, chunk)
        except DecryptError as exc:
            self._metrics.checksum_failures.inc()
            self._fail(transfer, FailureReason.CHECKSUM, str(exc))
            return None
        checked = self._config.verify_integrity and not raw.encrypted and not self._faults.no_checksum
        if checked and payload_checksum(payload) != chunk.checksum:
            self._metrics.checksum_failures.inc()
            self._fail(transfer, FailureReason.CHECKSUM, f"chunk seq {chunk.seq} checksum mismatch")
            return None
        return payload

    async def _on_manifest(self, transfer: InboundTransfer, manifest: Manifest, raw: RawFrame) -> None:
        if not self._faults.ignore_manifest:
            if (problem := transfer.tracker.check_manifest(manifest)) is not None:
                self._fail(transfer, FailureReason.MANIFEST_MISMATCH, problem)
                return
        assert transfer.codec is not None
        checked = self._config.verify_integrity and not raw.encrypted and not self._faults.no_checksum
        if checked and payload_checksum(raw.payload) != manifest.checksum:  # the first token it carries (S3)
            self._metrics.checksum_failures.inc()
            self._fail(transfer, FailureReason.CHECKSUM, "manifest's first-token record checksum mismatch")
            return
        try:
            manifest = replace(manifest, first=transfer.codec.first_token(raw))
        except DecryptError as exc:
            self._metrics.checksum_failures.inc()
            self._fail(transfer, FailureReason.CHECKSUM, str(exc))
            return
        except ProtocolError as exc:
            self._fail(transfer, FailureReason.PROTOCOL_ERROR, str(exc))
            return
        try:
            accepted = await transfer.sink.transfer_complete(manifest)
        except Exception as exc:
            log.exception("KV sink completion failed for %s", transfer.request_id)
            self._fail(transfer, FailureReason.SINK_ERROR, repr(exc))
            return
        if accepted is WriteOutcome.APPLIED:
            tracker = transfer.tracker
            self._finish(transfer, TransferOutcome(transfer.request_id, True, chunks=tracker.chunks, bytes=tracker.bytes))
        elif accepted is WriteOutcome.STALE:
            self._fail(transfer, FailureReason.STALE, "lease no longer current at completion")
        else:
            self._fail(transfer, FailureReason.UNKNOWN_REQUEST, "decode no longer knows the request")

    # -- credit (S6) ------------------------------------------------------------------------------

    def _return_credit(self, conn: _InboundConnection, nbytes: int) -> None:
        """Credit goes back only after the sink consumed the bytes (S6). ACKs are coalesced: the
        flush runs when this connection's task next yields, i.e. before it blocks on the socket."""
        conn.pending_credit += nbytes
        if not conn.flush_scheduled:
            conn.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_credit, conn)

    def _flush_credit(self, conn: _InboundConnection) -> None:
        conn.flush_scheduled = False
        if conn.pending_credit and not conn.writer.is_closing():
            conn.acks_sent += 1
            conn.writer.send_frame(conn.ack_key, Ack(conn.acks_sent, conn.pending_credit))
        conn.pending_credit = 0

    # -- terminal transitions -------------------------------------------------------------------

    def _arm(self, transfer: InboundTransfer, timeout_s: float) -> None:
        """Set the transfer's deadline `timeout_s` from now and its timer to fire then."""
        loop = asyncio.get_running_loop()
        transfer.deadline = loop.time() + timeout_s
        if transfer.timer is not None:
            transfer.timer.cancel()
        transfer.timer = loop.call_at(transfer.deadline, self._on_timer, transfer)

    def _touch(self, transfer: InboundTransfer) -> None:
        """Progress on an open transfer: push its stall deadline (the timer re-arms lazily)."""
        transfer.deadline = asyncio.get_running_loop().time() + transfer.stall_timeout_s

    def _on_timer(self, transfer: InboundTransfer) -> None:
        if transfer.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= transfer.deadline and transfer.state is TransferState.EXPECTED:
            self._fail(transfer, FailureReason.TIMEOUT, f"prefill did not open the transfer within {transfer.open_timeout_s:g}s")
        elif loop.time() >= transfer.deadline:
            self._fail(transfer, FailureReason.TIMEOUT, f"no transfer progress for {transfer.stall_timeout_s:g}s")
        else:  # progress since arming: re-arm lazily instead of once per chunk
            transfer.timer = loop.call_at(transfer.deadline, self._on_timer, transfer)

    def _fail(self, transfer: InboundTransfer, reason: FailureReason, detail: str, *, notify: bool = True) -> None:
        if transfer.done():
            return
        tracker = transfer.tracker
        self._finish(transfer, TransferOutcome(transfer.request_id, False, reason, detail, tracker.chunks, tracker.bytes), notify)

    def _finish(self, transfer: InboundTransfer, outcome: TransferOutcome, notify: bool = True) -> None:
        if transfer.done():
            return
        transfer.state = advance(transfer.state, TransferState.COMPLETE if outcome.ok else TransferState.FAILED)
        if transfer.timer is not None:
            transfer.timer.cancel()
        self._live.discard(transfer)
        conn, codec = transfer.conn, transfer.codec
        if conn is not None and codec is not None:
            conn.opened.pop(transfer.request_id, None)
            conn.remember(transfer.request_id, codec)
            if notify and not conn.writer.is_closing():
                codec.write(conn.writer, Result(transfer.request_id, outcome.ok, str(outcome.reason or ""), outcome.detail))
        transfer.future.set_result(outcome)
        self._metrics.count_outcome("receiver", outcome)
        if not outcome.ok:
            log.info("transfer %s failed: %s (%s)", transfer.request_id, outcome.reason, outcome.detail)
