"""Prefill's side of the KV transfer: send one request's KV where its ticket says, with credit.

``KVSender.send(ticket, chunks, first)`` verifies the ticket (the router's MAC and its expiry)
before connecting anywhere, and connects only to the ticket's address. A connection starts with
HELLO / WELCOME; a WELCOME whose epoch is not the ticket's means decode restarted since it granted
the pages, and nothing is sent. Then OPEN (the ticket, verbatim), CHUNKs, the MANIFEST, and decode's
RESULT is the outcome. Connections to one decode are pooled and shared by concurrent requests.

Back-pressure (S6): each sender keeps a byte credit per destination (``max_transfer_batch``);
a chunk's bytes are taken before it is written and returned only when decode ACKs them after its
sink consumed them, so in-flight bytes stay capped however large the socket buffers are. A single
chunk larger than the whole cap is let through only when nothing else is in flight.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

from kvguard.workers.faults import NO_FAULTS, Faults
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.transfer.channel import FrameReader, FrameWriter, RequestCodec
from kvguard.workers.transfer.config import DEFAULT_CONFIG, FailureReason, TransferConfig, TransferOutcome, failure_reason
from kvguard.workers.transfer.lifecycle import TransferState, advance
from kvguard.workers.transfer.metrics import TransferMetrics
from kvguard.workers.transfer.tickets import Ticket, TicketAuthority, TicketError
from kvguard.workers.transfer.wire import (
    NONCE_BYTES,
    Abort,
    Ack,
    FirstToken,
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
    verify,
)

log = logging.getLogger("kvguard.transfer")

CRASH_EXIT_CODE = 70
CONNECT_RETRY_DELAYS_S = (0.05, 0.2, 0.5)  # before each further try of a connection refused before WELCOME


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


class OutboundTransfer:
    """Prefill's state of one request's transfer (see lifecycle.py for its states)."""

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.state = TransferState.CONNECTING
        self.codec: RequestCodec | None = None
        self.result: asyncio.Future[TransferOutcome] = asyncio.get_running_loop().create_future()

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    def settle(self, outcome: TransferOutcome) -> None:
        if not self.result.done():
            self.result.set_result(outcome)


class _Peer:
    """One decode destination: its connection pool and the pair's byte credit."""

    def __init__(self, dest: tuple[str, int], capacity: int) -> None:
        self.dest = dest
        self.credit = ByteCredit(capacity)
        self.conns: list[_OutboundConnection] = []
        self.open_lock = asyncio.Lock()


class _OutboundConnection:
    def __init__(self, peer: _Peer, reader: FrameReader, writer: FrameWriter,
                 welcome: Welcome, ack_key: bytes | None) -> None:  # fmt: skip
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.conn_id = welcome.conn_id
        self.epoch = welcome.epoch
        self.ack_key = ack_key
        self.sending: dict[str, OutboundTransfer] = {}  # demultiplexing index for RESULTs
        self.unacked = 0  # bytes written on this connection and not yet credited back
        self.acks_seen = 0
        self.closed = False
        self.reader_task: asyncio.Task[None] | None = None

    def release_all(self) -> None:
        total, self.unacked = self.unacked, 0
        if total:
            self.peer.credit.release(total)


class KVSender:
    """Prefill's side: sends one request's chunks and manifest to decode, with credit."""

    def __init__(self, keys: RevisionKeys, metrics: TransferMetrics, config: TransferConfig = DEFAULT_CONFIG,
                 faults: Faults = NO_FAULTS, on_crash: Callable[[], None] = _hard_exit) -> None:  # fmt: skip
        self._keys = keys
        self._tickets = TicketAuthority(keys.ticket)
        self._hello_key: bytes | None = keys.hello if config.verify_integrity else None
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

    async def send(self, ticket: Ticket, chunks: AsyncIterable[KVChunk] | Iterable[KVChunk],
                   first: FirstToken | None = None) -> TransferOutcome:  # fmt: skip
        """Send every chunk, then the manifest (carrying prefill's first token), and return
        decode's verdict.

        Returns a failed outcome for a refused ticket (nothing is sent, no connection is made when
        the ticket itself is bad), decode-side failures, stalls (TIMEOUT) and lost connections.
        If ``chunks`` raises (prefill error) or this task is cancelled (client disconnect), an
        ABORT frame tells decode to release at once (S4), and the exception propagates."""
        transfer = OutboundTransfer(ticket)
        opened = await self._open(transfer)
        if isinstance(opened, TransferOutcome):
            return self._end(transfer, opened)
        conn = opened
        try:
            outcome = await self._send_all(conn, transfer, chunks, first)
        except TimeoutError:
            self._abort(conn, transfer, "prefill timed out waiting for decode")
            outcome = self._failed(transfer, FailureReason.TIMEOUT, f"no progress for {self._config.stall_timeout_s:g}s")
        except ConnectionError as exc:
            outcome = self._failed(transfer, FailureReason.CONNECTION_LOST, repr(exc))
        except BaseException as exc:  # prefill error, client disconnect (cancel), crash
            if not isinstance(exc, PrefillCrashed):
                self._abort(conn, transfer, f"prefill aborted: {exc!r}")
            self._end(transfer, self._failed(transfer, FailureReason.CANCELLED, repr(exc)))
            raise
        finally:
            conn.sending.pop(transfer.request_id, None)
        return self._end(transfer, outcome)

    async def abort(self, ticket: Ticket, reason: str) -> None:
        """Tell decode to release a request prefill will never send (e.g. prefill failed early):
        OPEN with its ticket, then ABORT, on one connection (decode takes ABORT only there)."""
        if self._faults.no_abort_propagation:
            return
        transfer = OutboundTransfer(ticket)
        opened = await self._open(transfer)
        if isinstance(opened, TransferOutcome):
            return
        self._abort(opened, transfer, reason)
        opened.sending.pop(transfer.request_id, None)
        self._end(transfer, self._failed(transfer, FailureReason.CANCELLED, reason))
        async with asyncio.timeout(self._config.stall_timeout_s):  # a decode that reads nothing: TimeoutError
            await opened.writer.drain()

    # -- internals ----------------------------------------------------------------------------

    async def _open(self, transfer: OutboundTransfer) -> _OutboundConnection | TransferOutcome:
        """Check the ticket, connect to its address, check decode's epoch, write OPEN."""
        ticket = transfer.ticket
        try:
            self._tickets.verify(ticket.blob)
        except TicketError as exc:
            self._metrics.ticket_rejections.labels(reason=exc.reason).inc()
            return self._failed(transfer, FailureReason.TICKET, str(exc))
        try:
            conn = await self._connection_retrying(ticket.address)
        except (OSError, TimeoutError) as exc:
            return self._failed(transfer, FailureReason.CONNECTION_LOST, f"cannot connect to decode at {ticket.address}: {exc!r}")
        except ProtocolError as exc:
            return self._failed(transfer, FailureReason.PROTOCOL_ERROR, f"decode at {ticket.address}: {exc}")
        if conn.epoch != ticket.epoch:
            self._metrics.ticket_rejections.labels(reason="epoch").inc()
            return self._failed(transfer, FailureReason.TICKET, "decode restarted since it granted the pages (epoch differs)")
        if ticket.request_id in conn.sending:
            raise ValueError(f"request {ticket.request_id!r} is already being sent")
        keys = self._keys.request(ticket.nonce, conn.conn_id) if self._config.verify_integrity else None
        transfer.codec = RequestCodec(keys, self._config.encryption)
        conn.sending[ticket.request_id] = transfer
        transfer.codec.write(conn.writer, Open(ticket.request_id, ticket.blob))
        transfer.state = advance(transfer.state, TransferState.OPEN)
        return conn

    async def _connection_retrying(self, dest: tuple[str, int]) -> _OutboundConnection:
        """`_connection`, tried again when decode reset or closed it before its WELCOME: under a
        connection flood decode makes room by closing others (`KVReceiver._make_room`), and
        nothing of the transfer has been sent yet. A timeout is not tried again (it took long)."""
        for delay in CONNECT_RETRY_DELAYS_S:
            try:
                return await self._connection(dest)
            except TimeoutError:
                raise
            except (OSError, ProtocolError) as exc:
                log.info("connecting to decode at %s failed (%r); trying again", dest, exc)
                await asyncio.sleep(delay)
        return await self._connection(dest)

    def _failed(self, transfer: OutboundTransfer, reason: FailureReason, detail: str) -> TransferOutcome:
        return TransferOutcome(transfer.request_id, False, reason, detail)

    def _end(self, transfer: OutboundTransfer, outcome: TransferOutcome) -> TransferOutcome:
        if transfer.state not in (TransferState.COMPLETE, TransferState.FAILED):
            transfer.state = advance(transfer.state, TransferState.COMPLETE if outcome.ok else TransferState.FAILED)
            self._metrics.count_outcome("sender", outcome)
        transfer.settle(outcome)
        return outcome

    async def _send_all(self, conn: _OutboundConnection, transfer: OutboundTransfer,
                        chunks: AsyncIterable[KVChunk] | Iterable[KVChunk], first: FirstToken | None) -> TransferOutcome:  # fmt: skip
        ticket, codec = transfer.ticket, transfer.codec
        assert codec is not None
        plan = dict(zip(ticket.page_ids, ticket.generations))
        seq = total = 0
        sent: list[int] = []
        async for chunk in _aiter(chunks):
            if transfer.result.done():  # decode already gave its verdict (failure or cancel): stop
                return transfer.result.result()
            try:
                gens = tuple(plan[p] for p in chunk.page_ids)
            except KeyError as exc:
                raise ValueError(f"page {exc.args[0]} is not in the ticket") from None
            payload = memoryview(chunk.payload).cast("B")
            await self._send_chunk(conn, codec, transfer.request_id, seq, tuple(chunk.page_ids), gens, payload, transfer.result)
            seq, total = seq + 1, total + len(payload)
            sent.extend(chunk.page_ids)
        if transfer.result.done():
            return transfer.result.result()
        codec.write_manifest(conn.writer, Manifest(
            transfer.request_id, seq, total, tuple(sent), tuple(plan[p] for p in sent), first))  # fmt: skip
        transfer.state = advance(transfer.state, TransferState.SEALED)
        async with asyncio.timeout(self._config.stall_timeout_s):
            await conn.writer.drain()
            return await asyncio.shield(transfer.result)

    async def _send_chunk(self, conn: _OutboundConnection, codec: RequestCodec, rid: str, seq: int,
                          page_ids: tuple[int, ...], gens: tuple[int, ...], payload: memoryview,
                          verdict: asyncio.Future[TransferOutcome]) -> None:  # fmt: skip
        faults = self._faults
        if faults.delay_chunk_ms:
            await asyncio.sleep(faults.delay_chunk_ms / 1000)
        head, wire = codec.seal_chunk(rid, seq, page_ids, gens, payload)
        if faults.corrupt_chunk and self._rng.random() < faults.corrupt_chunk:
            wire = self._corrupted(wire)  # after sealing: decode must catch it (S3)
        dropped = faults.drop_chunk and self._rng.random() < faults.drop_chunk
        if conn.closed:
            raise ConnectionResetError("connection to decode lost")
        n = len(wire)
        credit = conn.peer.credit
        if not credit.try_acquire(n):  # only arm a timer when we actually have to wait
            async with asyncio.timeout(self._config.stall_timeout_s):
                await credit.acquire(n)
            if conn.closed:  # lost while we waited: its `release_all` has run, so these bytes
                credit.release(n)  # would never come back and the pair's cap would shrink for good (S6)
                raise ConnectionResetError("connection to decode lost")
            if verdict.done():  # decode ended the transfer while we waited: the chunk would only be a
                credit.release(n)  # late frame it drops; the model's chunk step runs while no verdict is in
                return
        if dropped:
            credit.release(n)
        else:
            conn.unacked += n
            codec.send(conn.writer, head, wire)
            self._bytes_out.inc(n)
            self._chunks_out.observe(n)
            if conn.writer.buffered():
                async with asyncio.timeout(self._config.stall_timeout_s):
                    await conn.writer.drain()
        self._chunks_sent += 1
        if faults.crash_prefill_after_chunks is not None and self._chunks_sent >= faults.crash_prefill_after_chunks:
            self._crash()

    def _corrupted(self, wire: bytes | memoryview) -> memoryview:
        corrupted = bytearray(wire)
        n = len(corrupted)
        if n:
            # A run of flipped bytes, as a misdirected or torn write leaves: one flipped low
            # mantissa byte would be invisible in the output and prove nothing.
            width = min(n, max(64, n // 8))
            start = self._rng.randrange(n - width + 1)
            corrupted[start : start + width] = bytes(b ^ 0xFF for b in corrupted[start : start + width])
        return memoryview(corrupted)

    def _crash(self) -> None:
        self._on_crash()
        # The hook returned (tests): die as far as the peers can tell, without any ABORT.
        for peer in self._peers.values():
            for conn in peer.conns:
                conn.writer.sink.transport.abort()
        raise PrefillCrashed("crash_prefill_after_chunks fired")

    def _abort(self, conn: _OutboundConnection, transfer: OutboundTransfer, reason: str) -> None:
        if self._faults.no_abort_propagation or conn.closed or conn.writer.is_closing() or transfer.codec is None:
            return
        transfer.codec.write(conn.writer, Abort(transfer.request_id, reason))

    def _peer(self, dest: tuple[str, int]) -> _Peer:
        dest = (dest[0], int(dest[1]))
        if (peer := self._peers.get(dest)) is None:
            peer = self._peers[dest] = _Peer(dest, self._config.max_transfer_batch)
        return peer

    async def _connection(self, dest: tuple[str, int]) -> _OutboundConnection:
        peer = self._peer(dest)
        async with peer.open_lock:
            peer.conns = [c for c in peer.conns if not c.closed]
            idle = [c for c in peer.conns if not c.sending]
            if idle or len(peer.conns) >= self._config.max_connections_per_peer:
                return min(idle or peer.conns, key=lambda c: len(c.sending))
            conn = await self._handshake(peer)
            conn.reader_task = asyncio.create_task(self._read_replies(conn))
            peer.conns.append(conn)
            return conn

    async def _handshake(self, peer: _Peer) -> _OutboundConnection:
        """Connect, HELLO, and check decode's WELCOME (fresh: it echoes our nonce)."""
        async with asyncio.timeout(self._config.connect_timeout_s):
            reader, writer = await asyncio.open_connection(*peer.dest)
        frames_in, frames_out = FrameReader(reader, 0), FrameWriter(writer)
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            frames_out.send_frame(self._hello_key, Hello(nonce, self._config.encryption))
            async with asyncio.timeout(self._config.connect_timeout_s):
                raw = await frames_in.read(expect=FrameType.WELCOME)
            if raw is None or raw.kind is not FrameType.WELCOME:
                raise ProtocolError("decode did not answer HELLO with WELCOME")
            verify(raw, self._hello_key)
            welcome = decode(raw)
            assert isinstance(welcome, Welcome)
            if welcome.client_nonce != nonce:
                raise ProtocolError("WELCOME does not answer this connection's HELLO")
            if welcome.encryption is not self._config.encryption:
                raise ProtocolError(f"decode expects encryption {welcome.encryption}, prefill is set to {self._config.encryption}")
        except BaseException:
            writer.close()
            raise
        ack_key = self._keys.connection(welcome.conn_id) if self._config.verify_integrity else None
        return _OutboundConnection(peer, frames_in, frames_out, welcome, ack_key)

    async def _read_replies(self, conn: _OutboundConnection) -> None:
        detail = "decode closed the connection"
        try:
            while (raw := await conn.reader.read()) is not None:
                self._on_reply(conn, raw)
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
            for transfer in list(conn.sending.values()):
                transfer.settle(TransferOutcome(transfer.request_id, False, FailureReason.CONNECTION_LOST, detail))

    def _on_reply(self, conn: _OutboundConnection, raw: RawFrame) -> None:
        if raw.kind is FrameType.ACK:
            verify(raw, conn.ack_key)
            ack = decode(raw)
            assert isinstance(ack, Ack)
            if ack.number != conn.acks_seen + 1:
                raise ProtocolError(f"ACK number {ack.number} after {conn.acks_seen}: replayed or lost")
            conn.acks_seen = ack.number
            n = min(ack.nbytes, conn.unacked)  # never more than was sent on it
            conn.unacked -= n
            conn.peer.credit.release(n)
        elif raw.kind is FrameType.RESULT:
            result = decode(raw)  # parsed only to pick the key; trusted once verified
            assert isinstance(result, Result)
            transfer = conn.sending.get(result.request_id)
            if transfer is None or transfer.codec is None:  # no longer sending it: cannot verify, drop
                self._metrics.frames_dropped.labels(reason="late").inc()
                return
            transfer.codec.verify(raw)
            reason = failure_reason(result.reason) if not result.ok else None
            transfer.settle(TransferOutcome(result.request_id, result.ok, reason, result.detail))
        else:
            raise ProtocolError(f"unexpected {raw.kind.name} frame from decode")


async def _aiter(chunks: AsyncIterable[KVChunk] | Iterable[KVChunk]) -> AsyncIterator[KVChunk]:
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk
