"""KV transfer over real loopback sockets: integrity (S3), aborts and timeouts (S4), stale writes
(S5), back-pressure (S6), the bug classes C, D, G, H, I of pd-bug-classes.md, and the transfer's
trust boundary (S9): tickets, connection-bound frames, replays, cross-connection ABORT, the boot
epoch, and AES-GCM payloads. Attack tests are marked ``_s9``."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from kvguard.workers.faults import NO_FAULTS, Faults
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.transfer import (
    Encryption,
    FailureReason,
    FirstToken,
    InboundTransfer,
    KVChunk,
    KVReceiver,
    KVSender,
    PrefillCrashed,
    Ticket,
    TicketAuthority,
    TransferConfig,
    TransferMetrics,
    TransferState,
    WriteOutcome,
    abort_cause,
)
from kvguard.workers.transfer.channel import FrameReader, FrameWriter, RequestCodec
from kvguard.workers.transfer.metrics import AbortCause
from kvguard.workers.transfer.receiver import DuplicateRequestError
from kvguard.workers.transfer.sender import CONNECT_RETRY_DELAYS_S
from kvguard.workers.transfer.wire import (
    MAGIC,
    PAGE_LIST_SLACK_BYTES,
    PREFIX,
    TAG_BYTES,
    VERSION,
    Abort,
    ChunkHeader,
    FrameType,
    Hello,
    HmacError,
    Manifest,
    Open,
    RawFrame,
    Result,
    Welcome,
    decode,
    encode_first_token,
    encode_head,
    frame_tag,
    header_bound,
    parse_prefix,
    payload_checksum,
    verify,
)

KEYS = RevisionKeys.derive(b"test-shared-key-0123456789abcdef")
PAGE = 512
# Timeouts that must fire are set per request (STALL_S); every other one is generous, so that a
# transfer on a loaded machine never times out by chance, and waits for an outcome longer still.
FAST = TransferConfig(stall_timeout_s=30.0)
STALL_S = 0.3
PATIENT_S = 60.0
TICKET_TTL_S = 30.0


def page_bytes(rid: str, page: int) -> bytes:
    return (f"{rid}:{page}:".encode() * PAGE)[:PAGE]


@dataclass
class RecordingSink:
    """Records what each request's sink applied; optional per-write delay, gate and stale ids."""

    delay_s: float = 0.0
    stale: set[str] = field(default_factory=set)
    gate: asyncio.Event | None = None
    applied: dict[str, dict[int, bytes]] = field(default_factory=lambda: defaultdict(dict))
    writes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    manifests: dict[str, Manifest] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    applied_bytes: int = 0
    on_write: list = field(default_factory=list)  # type: ignore[type-arg]

    def for_request(self, rid: str) -> RequestSink:
        return RequestSink(self, rid)


@dataclass
class RequestSink:
    """The KVSink of one request (on decode: the job that owns the pages)."""

    recorder: RecordingSink
    rid: str

    async def write_pages(self, page_ids: Sequence[int], generations: Sequence[int], payload: memoryview) -> WriteOutcome:
        r = self.recorder
        for hook in r.on_write:
            hook()
        if r.gate is not None:
            await r.gate.wait()
        if r.delay_s:
            await asyncio.sleep(r.delay_s)
        if self.rid in r.stale:
            return WriteOutcome.STALE  # S5: never applied
        for i, page in enumerate(page_ids):
            r.applied[self.rid][page] = bytes(payload[i * PAGE : (i + 1) * PAGE])
        r.writes[self.rid] += 1
        r.applied_bytes += len(payload)
        r.order.append(self.rid)
        return WriteOutcome.APPLIED

    async def transfer_complete(self, manifest: Manifest) -> WriteOutcome:
        self.recorder.manifests[self.rid] = manifest
        return WriteOutcome.APPLIED


@dataclass
class Expected:
    """A transfer decode expects, and the ticket the router would issue for it."""

    transfer: InboundTransfer
    ticket: Ticket

    async def wait(self):  # type: ignore[no-untyped-def]
        return await self.transfer.wait()


@dataclass
class Pair:
    receiver: KVReceiver
    sender: KVSender
    sink: RecordingSink
    dest: tuple[str, int]
    table: dict[str, InboundTransfer]
    tickets: TicketAuthority
    recv_registry: CollectorRegistry
    send_registry: CollectorRegistry
    recv_metrics: TransferMetrics

    def expect(self, rid: str, ids: Sequence[int], gens: Sequence[int], *, stall_timeout_s: float | None = None,
               open_timeout_s: float | None = None, dest: tuple[str, int] | None = None) -> Expected:  # fmt: skip
        """Decode's bootstrap and the router's ticket, as in production."""
        transfer = self.receiver.expect(rid, ids, gens, self.sink.for_request(rid), stall_timeout_s=stall_timeout_s,
                                        open_timeout_s=open_timeout_s)  # fmt: skip
        self.table[rid] = transfer
        return Expected(transfer, issue(self.tickets, transfer, dest or self.dest, len(ids) * 16))

    def recv_metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.recv_registry.get_sample_value(name, labels or {}) or 0.0


def issue(tickets: TicketAuthority, transfer: InboundTransfer, dest: tuple[str, int], num_tokens: int,
          ttl_s: float = TICKET_TTL_S) -> Ticket:  # fmt: skip
    ids, gens = transfer.tracker.order
    return tickets.issue(transfer.request_id, dest, transfer.epoch, transfer.nonce, num_tokens, ids, gens, ttl_s)


@contextlib.asynccontextmanager
async def make_pair(*, config: TransferConfig = FAST, sink: RecordingSink | None = None,
                    sender_faults: Faults = NO_FAULTS, receiver_faults: Faults = NO_FAULTS,
                    sender_keys: RevisionKeys = KEYS, sender_config: TransferConfig | None = None,
                    on_crash=None) -> AsyncIterator[Pair]:  # type: ignore[no-untyped-def]
    sink = sink or RecordingSink()
    recv_reg, send_reg = CollectorRegistry(), CollectorRegistry()
    recv_metrics = TransferMetrics.create(recv_reg)
    table: dict[str, InboundTransfer] = {}
    receiver = KVReceiver(KEYS, recv_metrics, table.get, config, receiver_faults)
    dest = await receiver.start()
    kwargs = {"on_crash": on_crash} if on_crash else {}
    sender = KVSender(sender_keys, TransferMetrics.create(send_reg), sender_config or config, sender_faults, **kwargs)
    try:
        yield Pair(receiver, sender, sink, dest, table, TicketAuthority(KEYS.ticket), recv_reg, send_reg, recv_metrics)
    finally:
        if sink.gate is not None:
            sink.gate.set()
        await sender.close()
        await receiver.close()


def plan(n_pages: int, first: int = 0, generation: int = 1) -> tuple[list[int], list[int]]:
    return list(range(first, first + n_pages)), [generation] * n_pages


async def chunks_of(rid: str, pages: list[int], per_chunk: int = 1, pause_s: float = 0.0) -> AsyncIterator[KVChunk]:
    for i in range(0, len(pages), per_chunk):
        ids = pages[i : i + per_chunk]
        yield KVChunk(ids, b"".join(page_bytes(rid, p) for p in ids))
        await asyncio.sleep(pause_s)


async def test_round_trip_many_interleaved_requests_s3() -> None:
    config = TransferConfig(stall_timeout_s=30.0, max_connections_per_peer=1)
    async with make_pair(config=config) as p:
        expected, sends = [], []
        for r in range(16):
            rid = f"req-{r}"
            ids, gens = plan(6, first=r * 6, generation=r + 1)
            e = p.expect(rid, ids, gens)
            expected.append(e)
            sends.append(p.sender.send(e.ticket, chunks_of(rid, ids, per_chunk=2), FirstToken(r, -0.25, ((r, -0.25), (7, -2.0)))))
        sent = await asyncio.gather(*sends)
        received = await asyncio.gather(*(e.wait() for e in expected))
    assert all(o.ok for o in sent), sent
    assert all(o.ok and o.chunks == 3 and o.bytes == 6 * PAGE for o in received), received
    for r in range(16):
        rid = f"req-{r}"
        assert p.sink.applied[rid] == {pg: page_bytes(rid, pg) for pg in range(r * 6, r * 6 + 6)}
        # The first-token record travels in the authenticated MANIFEST (P/D logprobs).
        assert p.sink.manifests[rid].first == FirstToken(r, -0.25, ((r, -0.25), (7, -2.0)))
    assert all(e.transfer.state is TransferState.COMPLETE for e in expected)
    switches = sum(a != b for a, b in zip(p.sink.order, p.sink.order[1:]))
    assert switches > 16, "requests were not interleaved on the shared connection"
    assert p.recv_metric("kvguard_kv_transfers_total", {"side": "receiver", "outcome": "complete"}) == 16


class RawPeer:
    """Speaks the wire protocol by hand, to send what a buggy or hostile prefill would. It holds
    the revision key: the worst case short of being the router."""

    def __init__(self, reader: FrameReader, writer: FrameWriter, welcome: Welcome, keys: RevisionKeys) -> None:
        self.reader, self.writer, self.welcome, self.keys = reader, writer, welcome, keys
        self.codecs: dict[str, list[RequestCodec]] = defaultdict(list)  # every OPEN's keys

    @classmethod
    async def connect(cls, dest: tuple[str, int], keys: RevisionKeys = KEYS) -> RawPeer:
        stream_reader, stream_writer = await asyncio.open_connection(*dest)
        reader, writer = FrameReader(stream_reader, 0), FrameWriter(stream_writer)
        writer.send_frame(keys.hello, Hello(os.urandom(16), Encryption.NONE))
        raw = await asyncio.wait_for(reader.read(), PATIENT_S)
        assert raw is not None
        verify(raw, keys.hello)
        welcome = decode(raw)
        assert isinstance(welcome, Welcome)
        return cls(reader, writer, welcome, keys)

    def open(self, ticket: Ticket, nonce: bytes | None = None) -> None:
        codec = RequestCodec(self.keys.request(nonce or ticket.nonce, self.welcome.conn_id))
        self.codecs[ticket.request_id].append(codec)
        codec.write(self.writer, Open(ticket.request_id, ticket.blob))

    def codec(self, rid: str) -> RequestCodec:
        # A request never opened here: the best the peer can do is a key for a guessed nonce.
        opened = self.codecs.get(rid)
        return opened[-1] if opened else RequestCodec(self.keys.request(bytes(16), self.welcome.conn_id))

    def chunk(self, rid: str, seq: int, pages: Sequence[int], gens: Sequence[int], corrupt: bool = False) -> None:
        payload = b"".join(page_bytes(rid, pg) for pg in pages)
        codec = self.codec(rid)
        head, wire = codec.seal_chunk(rid, seq, tuple(pages), tuple(gens), memoryview(payload))
        if corrupt:
            wire = bytes([wire[0] ^ 0x40]) + bytes(wire[1:])
        codec.send(self.writer, head, wire)

    def manifest(self, rid: str, chunks: int, pages: Sequence[int], gens: Sequence[int]) -> None:
        self.codec(rid).write_manifest(self.writer, Manifest(rid, chunks, len(pages) * PAGE, tuple(pages), tuple(gens)))

    def abort(self, rid: str, reason: str = "hostile abort") -> None:
        self.codec(rid).write(self.writer, Abort(rid, reason))

    async def results(self, *request_ids: str) -> dict[str, Result]:
        """The RESULTs (the last per request) of at least `request_ids` -- waited for however slow
        the machine is -- and whatever else arrives until the receiver goes quiet or hangs up;
        each must verify under the keys of one of this peer's OPENs for it."""
        out: dict[str, Result] = {}
        async with asyncio.timeout(PATIENT_S):
            while True:
                wanted = not set(request_ids) <= set(out)
                try:
                    raw = await (self.reader.read() if wanted else asyncio.wait_for(self.reader.read(), STALL_S))
                except TimeoutError:
                    return out  # quiet after everything wanted arrived
                if raw is None:
                    return out
                if raw.kind is FrameType.RESULT:
                    result = decode(raw)
                    assert isinstance(result, Result)
                    assert any(_verifies(codec, raw) for codec in self.codecs[result.request_id])
                    out[result.request_id] = result

    async def closed_by_decode(self) -> bool:
        with contextlib.suppress(TimeoutError, ConnectionError):
            while await asyncio.wait_for(self.reader.source.read(1 << 16), PATIENT_S):
                pass
            return True
        return False

    def close(self) -> None:
        self.writer.close()


def _verifies(codec: RequestCodec, raw: RawFrame) -> bool:
    try:
        codec.verify(raw)
    except HmacError:
        return False
    return True


async def test_corrupt_chunk_fails_only_that_request_on_the_same_connection_s3_class_i() -> None:
    async with make_pair() as p:
        expected = {rid: p.expect(rid, [i * 2, i * 2 + 1], [1, 1]) for i, rid in enumerate(("a", "b", "c"))}
        peer = await RawPeer.connect(p.dest)
        for e in expected.values():
            peer.open(e.ticket)
        for seq in range(2):
            for i, rid in enumerate(("a", "b", "c")):
                peer.chunk(rid, seq, [i * 2 + seq], [1], corrupt=(rid == "b" and seq == 1))
        for i, rid in enumerate(("a", "b", "c")):
            peer.manifest(rid, 2, [i * 2, i * 2 + 1], [1, 1])
        outcomes = {rid: await e.wait() for rid, e in expected.items()}
        results = await peer.results("a", "b", "c")
        peer.close()
    assert outcomes["a"].ok and outcomes["c"].ok
    assert outcomes["b"].reason is FailureReason.CHECKSUM
    assert 3 not in p.sink.applied["b"], "a corrupted page was applied"
    assert results["b"].ok is False and results["a"].ok and results["c"].ok
    assert p.recv_metric("kvguard_checksum_failures_total") == 1


@pytest.mark.parametrize("encryption", [Encryption.NONE, Encryption.AES_GCM])
async def test_corrupt_chunk_fault_is_caught_and_no_checksum_lets_it_through(encryption: Encryption) -> None:
    ids, gens = plan(3)
    config = TransferConfig(stall_timeout_s=30.0, encryption=encryption)
    async with make_pair(config=config, sender_faults=Faults(corrupt_chunk=1.0)) as p:
        e = p.expect("r", ids, gens)
        sent = await p.sender.send(e.ticket, chunks_of("r", ids))
        assert (await e.wait()).reason is FailureReason.CHECKSUM
        assert sent.reason is FailureReason.CHECKSUM
    if encryption is Encryption.AES_GCM:
        return  # AES-GCM authenticates every payload: there is no switch to skip it
    async with make_pair(config=config, sender_faults=Faults(corrupt_chunk=1.0), receiver_faults=Faults(no_checksum=True)) as p:
        e = p.expect("r", ids, gens)
        await p.sender.send(e.ticket, chunks_of("r", ids))
        assert (await e.wait()).ok  # the fault switch disables the S3 check: by design
        assert p.sink.applied["r"][0] != page_bytes("r", 0)


async def test_wrong_revision_key_cannot_even_connect_s3_s9() -> None:
    ids, gens = plan(2)
    config = FAST
    other = RevisionKeys.derive(b"not-the-deployment-key-!!!!!!!!!")
    async with make_pair(config=config, sender_keys=other) as p:
        e = p.expect("r", ids, gens, open_timeout_s=STALL_S)  # only r's timer may fire: it is never opened
        forged = issue(TicketAuthority(other.ticket), e.transfer, p.dest, 32)  # its own "router"
        sent = await p.sender.send(forged, chunks_of("r", ids))
        outcome = await e.wait()
        good = KVSender(KEYS, TransferMetrics.create(CollectorRegistry()), config)
        ok = p.expect("ok", [7], [1])
        assert (await good.send(ok.ticket, chunks_of("ok", [7]))).ok
        assert (await ok.wait()).ok
        await good.close()
    assert sent.reason is FailureReason.PROTOCOL_ERROR  # decode hung up on its HELLO
    assert outcome.reason is FailureReason.TIMEOUT  # nothing it sent was trusted: only the timer ends it
    assert "did not open the transfer" in outcome.detail
    # Each try's HELLO refused (prefill tries a connection closed before WELCOME again: it cannot
    # tell a wrong key from a decode making room under a flood).
    assert p.recv_metric("kvguard_hmac_failures_total") == 1 + len(CONNECT_RETRY_DELAYS_S)
    assert "r" not in p.sink.applied


async def test_dropped_chunk_fails_by_manifest_class_c_and_ignore_manifest_misses_it() -> None:
    ids, gens = plan(4)
    faults = Faults(drop_chunk=0.5, seed=1)
    async with make_pair(sender_faults=faults) as p:
        e = p.expect("r", ids, gens)
        sent = await p.sender.send(e.ticket, chunks_of("r", ids))
        outcome = await e.wait()
    assert 0 < len(p.sink.applied["r"]) < 4, "seed 1 should drop some but not all chunks"
    assert outcome.reason is FailureReason.MANIFEST_MISMATCH and sent.reason is outcome.reason
    async with make_pair(sender_faults=faults, receiver_faults=Faults(ignore_manifest=True)) as p:
        e = p.expect("r", ids, gens)
        await p.sender.send(e.ticket, chunks_of("r", ids))
        assert (await e.wait()).ok  # the canary suite must catch this switch


async def test_chunk_accounting_mismatches_fail_the_request_class_d() -> None:
    async with make_pair() as p:
        short = p.expect("short", [0, 1, 2], [1, 1, 1])
        extra = p.expect("extra", [10, 11], [1, 1])
        dup = p.expect("dup", [20, 21], [1, 1])
        order = p.expect("order", [30, 31], [1, 1])
        stale_gen = p.expect("gen", [40], [5])
        fine = p.expect("fine", [50], [1])
        peer = await RawPeer.connect(p.dest)
        for e in (short, extra, dup, order, stale_gen, fine):
            peer.open(e.ticket)
        peer.chunk("short", 0, [0, 1], [1, 1])  # a shortened send plan, honest manifest
        peer.manifest("short", 1, [0, 1], [1, 1])
        peer.chunk("extra", 0, [10, 99], [1, 1])
        peer.chunk("dup", 0, [20], [1])
        peer.chunk("dup", 1, [20], [1])
        peer.chunk("order", 1, [31], [1])
        peer.chunk("order", 0, [30], [1])
        peer.chunk("gen", 0, [40], [4])
        peer.chunk("fine", 0, [50], [1])
        peer.manifest("fine", 1, [50], [1])
        outcomes = {e.transfer.request_id: await e.wait() for e in (short, extra, dup, order, stale_gen, fine)}
        peer.close()
    assert outcomes.pop("fine").ok
    assert outcomes.pop("short").reason is FailureReason.MANIFEST_MISMATCH
    assert {o.reason for o in outcomes.values()} == {FailureReason.PLAN_MISMATCH}, outcomes
    assert 99 not in p.sink.applied["extra"] and "gen" not in p.sink.applied


async def _stalling(rid: str, pages: list[int]) -> AsyncIterator[KVChunk]:
    yield KVChunk(pages[:1], page_bytes(rid, pages[0]))
    await asyncio.Event().wait()  # prefill hangs forever after one chunk
    yield KVChunk(pages[1:], b"")  # pragma: no cover


async def test_stalled_sender_times_out_on_the_receiver_class_h() -> None:
    ids, gens = plan(3)
    async with make_pair() as p:
        e = p.expect("r", ids, gens, stall_timeout_s=STALL_S)
        task = asyncio.create_task(p.sender.send(e.ticket, _stalling("r", ids)))
        loop = asyncio.get_running_loop()
        start = loop.time()
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
        elapsed = loop.time() - start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert outcome.reason is FailureReason.TIMEOUT
    assert elapsed >= 0.25  # by its own short timer, not before it
    assert p.receiver.active_requests == 0


async def test_a_prefill_slower_than_a_stall_still_delivers_s4() -> None:
    """Prefill opens a transfer only once it has computed the prompt, and may queue before that.
    Decode's stall timer governs from OPEN on; before it, the (much longer) open timeout does. A
    stall timer armed at bootstrap failed every request whose prefill outlasted one stall."""
    ids, gens = plan(3)
    # A stall of its own, longer than STALL_S: after OPEN it must not fire, and sender and receiver
    # share this event loop, so a pause of the process (GC, a starved core) as long as the stall
    # would fire it with the chunk already in the socket (a load audit: 0.3 s was the suite's
    # tightest must-not-fire bound).
    stall_s = 1.0
    async with make_pair() as p:
        e = p.expect("r", ids, gens, stall_timeout_s=stall_s, open_timeout_s=PATIENT_S)
        loop = asyncio.get_running_loop()
        late = loop.time() + 2 * stall_s
        while loop.time() < late:  # prefill still computing: two stalls pass without a frame
            await asyncio.sleep(stall_s / 4)
        assert not e.transfer.done() and e.transfer.state is TransferState.EXPECTED
        assert (await p.sender.send(e.ticket, chunks_of("r", ids))).ok
        assert (await e.wait()).ok
    assert p.sink.applied["r"][0] == page_bytes("r", 0)


async def test_a_transfer_never_opened_ends_at_the_open_timeout_s4() -> None:
    """Pages granted to a request that prefill never opens (it died, or its ticket was lost) are
    given back when the open timeout runs out, with a reason that says which clock ran out."""
    ids, gens = plan(2)
    async with make_pair() as p:
        e = p.expect("r", ids, gens, stall_timeout_s=PATIENT_S, open_timeout_s=STALL_S)
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
        assert p.receiver.active_requests == 0
    assert outcome.reason is FailureReason.TIMEOUT
    assert outcome.detail == f"prefill did not open the transfer within {STALL_S:g}s"


async def test_stalled_receiver_times_out_on_the_sender_class_h() -> None:
    ids, gens = plan(8)
    config = TransferConfig(stall_timeout_s=STALL_S, max_transfer_batch=2 * PAGE)
    async with make_pair(config=config, sink=RecordingSink(gate=asyncio.Event())) as p:
        e = p.expect("r", ids, gens)
        sent = await asyncio.wait_for(p.sender.send(e.ticket, chunks_of("r", ids)), PATIENT_S)
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert sent.reason is FailureReason.TIMEOUT
    assert not outcome.ok


async def _failing(rid: str, pages: list[int]) -> AsyncIterator[KVChunk]:
    yield KVChunk(pages[:1], page_bytes(rid, pages[0]))
    raise RuntimeError("prefill forward failed")


async def test_prefill_error_sends_abort_and_decode_releases_at_once_s4() -> None:
    ids, gens = plan(3)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        e = p.expect("r", ids, gens)
        with pytest.raises(RuntimeError, match="prefill forward failed"):
            await p.sender.send(e.ticket, _failing("r", ids))
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT
    assert "prefill forward failed" in outcome.detail


async def test_client_disconnect_cancels_send_and_aborts_decode_s4() -> None:
    ids, gens = plan(3)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        e = p.expect("r", ids, gens)
        task = asyncio.create_task(p.sender.send(e.ticket, _stalling("r", ids)))
        await until(lambda: p.sink.applied["r"], "the first chunk applied", timeout=PATIENT_S)
        task.cancel()
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT


async def test_no_abort_propagation_leaves_decode_to_its_timeout() -> None:
    ids, gens = plan(3)
    async with make_pair(sender_faults=Faults(no_abort_propagation=True)) as p:
        e = p.expect("r", ids, gens, stall_timeout_s=STALL_S)
        with pytest.raises(RuntimeError):
            await p.sender.send(e.ticket, _failing("r", ids))
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.TIMEOUT


async def test_decode_cancel_stops_prefill_s4() -> None:
    ids, gens = plan(20)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        e = p.expect("r", ids, gens)
        p.sink.on_write.append(lambda: e.transfer.cancel("client of decode went away") if len(p.sink.applied["r"]) >= 2 else None)
        sent = await asyncio.wait_for(p.sender.send(e.ticket, chunks_of("r", ids, pause_s=0.01)), PATIENT_S)
        outcome = await e.wait()
    assert outcome.reason is FailureReason.CANCELLED
    assert sent.reason is FailureReason.CANCELLED and "went away" in sent.detail
    assert len(p.sink.applied["r"]) < 20


async def test_prefill_crash_mid_transfer_fails_decode_at_once_class_c() -> None:
    ids, gens = plan(4)
    async with make_pair(sender_faults=Faults(crash_prefill_after_chunks=2), config=TransferConfig(stall_timeout_s=2 * PATIENT_S),
                         on_crash=lambda: None) as p:  # fmt: skip
        e = p.expect("r", ids, gens)
        with pytest.raises(PrefillCrashed):
            await p.sender.send(e.ticket, chunks_of("r", ids))
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.CONNECTION_LOST


async def test_stale_write_is_counted_and_never_applied_s5_class_e() -> None:
    async with make_pair(sink=RecordingSink(stale={"old"})) as p:
        old = p.expect("old", [0, 1], [3, 3])
        new = p.expect("new", [2], [1])
        results = await asyncio.gather(p.sender.send(old.ticket, chunks_of("old", [0, 1])),
                                       p.sender.send(new.ticket, chunks_of("new", [2])))  # fmt: skip
        assert (await old.wait()).reason is FailureReason.STALE
        assert (await new.wait()).ok and results[1].ok
    assert "old" not in p.sink.applied
    assert p.recv_metric("kvguard_stale_writes_dropped_total") >= 1


async def test_late_and_unknown_frames_are_dropped_and_counted_class_g() -> None:
    async with make_pair() as p:
        done = p.expect("done", [0], [1])
        assert (await p.sender.send(done.ticket, chunks_of("done", [0]))).ok
        assert (await done.wait()).ok
        gone = p.expect("gone", [1], [1])
        del p.table["gone"]  # decode's job ended and forgot the request
        peer = await RawPeer.connect(p.dest)
        peer.open(done.ticket)  # the ticket is authentic, the transfer over
        peer.chunk("done", 5, [0], [1])
        peer.open(gone.ticket)
        peer.chunk("gone", 0, [1], [1])
        results = await peer.results("done", "gone")
        # _closed_soon bounds its own wait (0.3 s); an outer 1 s deadline around it raised TimeoutError
        # whenever this process was stalled past both (a loaded machine), instead of answering False.
        assert not await _closed_soon(peer)  # late frames do not close the connection
        peer.close()
    assert results["gone"].reason == FailureReason.UNKNOWN_REQUEST
    assert results["done"].ok is False and results["done"].reason == "complete"  # answered here only
    await until(lambda: p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "late"}) == 3, "late frames")  # OPEN + 2 CHUNKs
    assert p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "unknown_request"}) == 1
    assert list(p.sink.applied) == ["done"] and p.sink.writes["done"] == 1


async def test_a_forged_first_token_record_fails_the_checksum_s3() -> None:
    """Outside probe (an on-path proxy): without encryption the MANIFEST's first-token record was
    covered by neither the HMAC (header only) nor a checksum, so rewriting the token gave the
    client another answer with a 200. Its xxh3-128 is in the MAC'd header now (wire v4)."""
    async with make_pair() as p:
        e = p.expect("r", [0], [1])
        peer = await RawPeer.connect(p.dest)
        peer.open(e.ticket)
        peer.chunk("r", 0, [0], [1])
        record = encode_first_token(FirstToken(7, -0.25))
        head = encode_head(Manifest("r", 1, PAGE, (0,), (1,), checksum=payload_checksum(record)), len(record))
        peer.codec("r").send(peer.writer, head, encode_first_token(FirstToken(5, -0.25)))  # same length, another token
        outcome = await e.wait()
        peer.close()
    assert outcome.reason is FailureReason.CHECKSUM and "first-token record" in outcome.detail
    assert p.recv_metric("kvguard_checksum_failures_total") == 1


async def test_no_payload_is_read_before_its_frame_verifies_and_a_frame_must_not_stall() -> None:
    """Outside probe: after a replayed HELLO (which any connection can send), decode read a CHUNK's
    whole announced payload (up to 64 MiB) before looking at its request or tag, and waited for it
    with no deadline: 12 connections held ~770 MiB. A frame for a request not opened here now
    closes the connection from its head, and a frame that stops half-way closes it at the stall
    timeout."""
    config = TransferConfig(stall_timeout_s=0.5)
    async with make_pair(config=config) as p:
        peer = await RawPeer.connect(p.dest)
        chunk = ChunkHeader("never-opened", 0, bytes(16), (0,), (1,))
        head = encode_head(chunk, 60 << 20)
        peer.writer.sink.write(head + frame_tag(None, 1, head))  # the head alone: 60 MiB announced, none sent
        assert await peer.closed_by_decode()
        stalled = await RawPeer.connect(p.dest)
        e = p.expect("r", [0], [1])
        stalled.open(e.ticket)
        stalled.writer.sink.write(encode_head(ChunkHeader("r", 0, bytes(16), (0,), (1,)), PAGE)[:10])  # half a prefix
        assert await stalled.closed_by_decode()
        assert not (await e.wait()).ok


async def test_what_decode_reads_unverified_is_bounded_by_its_pool_and_its_connection_count() -> None:
    """Outside probe (after the fix above): a peer that replayed a HELLO could still announce a
    9 MiB OPEN or MANIFEST header, read whole before its tag, and open connections without limit
    (80 of them: +800 MiB). A receiver that knows its pool (max_pages) refuses a header longer
    than that many pages take from its prefix, and no more than max_inbound_connections stay
    open (one past it makes another give way); a real transfer still goes through."""
    config = TransferConfig(stall_timeout_s=30.0, max_pages=64, max_inbound_connections=3)
    assert header_bound(FrameType.OPEN, 64) == PAGE_LIST_SLACK_BYTES + 12 * 64 < header_bound(FrameType.OPEN, None)
    async with make_pair(config=config) as p:
        e = p.expect("r", [0, 1], [1, 1])
        assert (await p.sender.send(e.ticket, chunks_of("r", [0, 1]))).ok
        peer = await RawPeer.connect(p.dest)
        big = PREFIX.pack(MAGIC, VERSION, FrameType.OPEN, 0, header_bound(FrameType.OPEN, 64) + 1, 0)
        peer.writer.sink.write(big)  # the prefix alone: its header is longer than 64 pages take
        assert await peer.closed_by_decode()
        held = [await RawPeer.connect(p.dest) for _ in range(4)]  # one more than the bound
        assert len(p.receiver._slots) <= 3
        assert await held[0].closed_by_decode()  # the oldest that never carried a transfer gave way
        for extra in held:
            extra.close()


async def test_a_flood_of_connections_cannot_keep_prefill_out_s9() -> None:
    """Outside probe: the connection bound counted connections that had sent nothing, and replayed
    HELLOs that then sat idle: anyone reaching decode's transfer port, without any key, could fill
    it and every transfer from a prefill not yet connected failed (a new revision, a restart). Now
    connections in their handshake and through it have bounds of their own, and one past a bound
    makes another of its kind give way -- the oldest in its handshake; through it, the oldest
    that only sent a HELLO -- never one carrying a transfer; prefill retries a connection closed
    before its WELCOME."""
    config = TransferConfig(stall_timeout_s=30.0, max_inbound_connections=3, max_handshaking_connections=2)

    def counts(p: Pair) -> tuple[int, int]:
        slots = p.receiver._slots.values()
        return sum(s.conn is None for s in slots), sum(s.conn is not None for s in slots)

    async with make_pair(config=config) as p:
        silent = [await asyncio.open_connection(*p.dest) for _ in range(3)]  # send nothing at all
        await until(lambda: counts(p)[0] == 2, "the silent ones at their bound")
        replayed = [await RawPeer.connect(p.dest) for _ in range(4)]  # a HELLO, then nothing
        assert counts(p)[1] == 3 and await replayed[0].closed_by_decode()  # the oldest, not the newest
        assert not await _closed_soon(replayed[-1])
        e = p.expect("r", [0, 1], [1, 1])
        assert (await p.sender.send(e.ticket, chunks_of("r", [0, 1]))).ok
        busy = p.expect("busy", [2], [1])
        carrier = await RawPeer.connect(p.dest)
        carrier.open(busy.ticket)
        await until(lambda: any(s.conn is not None and s.conn.opened for s in p.receiver._slots.values()), "the OPEN")
        flood = [await RawPeer.connect(p.dest) for _ in range(6)]
        assert counts(p)[1] <= 3
        assert not await _closed_soon(carrier)  # carrying a transfer: never gives way
        f = p.expect("f", [3], [1])
        assert (await p.sender.send(f.ticket, chunks_of("f", [3]))).ok  # and prefill still gets in
        for _, writer in silent:
            writer.close()
        for peer in (*replayed, *flood, carrier):
            peer.close()


async def _closed_soon(peer: RawPeer) -> bool:
    with contextlib.suppress(TimeoutError):
        return await asyncio.wait_for(peer.reader.source.read(1), 0.3) == b""
    return False


async def test_duplicate_expectation_is_rejected_class_g() -> None:
    async with make_pair() as p:
        e = p.expect("r", [0], [1])
        with pytest.raises(DuplicateRequestError):
            p.expect("r", [1], [1])
        assert (await p.sender.send(e.ticket, chunks_of("r", [0]))).ok


async def test_in_flight_bytes_never_exceed_the_cap_with_a_slow_sink_s6() -> None:
    cap, chunk = 64 << 10, 8 << 10  # 8 KiB chunks = 16 pages of PAGE bytes
    config = TransferConfig(stall_timeout_s=30, max_transfer_batch=cap)
    async with make_pair(config=config, sink=RecordingSink(delay_s=0.002)) as p:
        observed: list[float] = []

        def in_flight() -> None:  # measured independently of the sender's own accounting
            sent = p.send_registry.get_sample_value("kvguard_kv_transfer_bytes_total", {"direction": "sent"}) or 0.0
            observed.append(sent - p.sink.applied_bytes)

        p.sink.on_write.append(in_flight)
        expected, sends = [], []
        for r in range(4):
            ids, gens = plan(16 * 12, first=r * 1000)
            e = p.expect(f"r{r}", ids, gens)
            expected.append(e)
            sends.append(p.sender.send(e.ticket, chunks_of(f"r{r}", ids, 16)))
        assert all(o.ok for o in await asyncio.gather(*sends))
        assert all(o.ok for o in await asyncio.gather(*(e.wait() for e in expected)))
        credit = p.sender.credit(p.dest)
    assert max(observed) <= cap
    assert credit.max_in_use <= cap
    assert max(observed) >= cap - chunk, "the test never filled the pipe"
    assert credit.in_use == 0


async def test_a_cap_below_one_page_lets_one_page_at_a_time_through_s6() -> None:
    # KV moves in whole pages, so a cap smaller than a page cannot be kept to the byte; what holds
    # (and what prefill warns of at start-up) is one page in flight at a time.
    config = TransferConfig(stall_timeout_s=30, max_transfer_batch=PAGE // 2)
    async with make_pair(config=config, sink=RecordingSink(delay_s=0.002)) as p:
        observed: list[float] = []

        def in_flight() -> None:
            sent = p.send_registry.get_sample_value("kvguard_kv_transfer_bytes_total", {"direction": "sent"}) or 0.0
            observed.append(sent - p.sink.applied_bytes)

        p.sink.on_write.append(in_flight)
        ids, gens = plan(8)
        e = p.expect("r", ids, gens)
        assert (await p.sender.send(e.ticket, chunks_of("r", ids, 1))).ok
        assert (await e.wait()).ok
        credit = p.sender.credit(p.dest)
    assert len(observed) == 8 and max(observed) <= PAGE
    assert credit.max_in_use <= PAGE and credit.in_use == 0


async def test_a_chunk_waiting_for_credit_when_decode_goes_away_gives_its_credit_back_s6() -> None:
    # A's page holds the whole cap un-ACKed (decode's sink is stuck), so B's page waits for credit
    # on the same connection. Decode then goes away: the connection's close releases what it had
    # in flight, and B, woken with the credit, must hand it back rather than "send" on the dead
    # connection -- else the pair's cap shrinks for good and a restarted decode at the same address
    # never gets KV from this prefill again.
    config = TransferConfig(stall_timeout_s=30, max_transfer_batch=PAGE, max_connections_per_peer=1)
    async with make_pair(config=config, sink=RecordingSink(gate=asyncio.Event())) as p:
        stuck: list[bool] = []
        p.sink.on_write.append(lambda: stuck.append(True))
        a, b = p.expect("a", [0], [1]), p.expect("b", [1], [1])
        sent_a = asyncio.create_task(p.sender.send(a.ticket, chunks_of("a", [0])))
        await until(lambda: stuck, "A's page to reach decode's stuck sink")
        sent_b = asyncio.create_task(p.sender.send(b.ticket, chunks_of("b", [1])))
        credit = p.sender.credit(p.dest)
        await until(lambda: credit._waiters, "B to wait for credit")
        await p.receiver.close()
        outcomes = await asyncio.wait_for(asyncio.gather(sent_a, sent_b), PATIENT_S)
        assert not any(o.ok for o in outcomes)
        assert credit.in_use == 0


async def test_a_chunk_waiting_for_credit_after_decode_gave_up_on_its_transfer_is_not_sent_s6() -> None:
    # B opens first (decode reads its OPEN), then A's page takes the whole cap and sticks in
    # decode's sink, so B's page waits for credit. Decode cancels B (RESULT: failed) meanwhile,
    # on a connection that stays up. B, woken with the credit once A lands, sent its chunk anyway:
    # a late frame decode dropped. The formal model's chunk step runs only while no verdict is in
    # (a review of the model against the code found the difference).
    config = TransferConfig(stall_timeout_s=30, max_transfer_batch=PAGE, max_connections_per_peer=1)
    gate, b_has_a_page = asyncio.Event(), asyncio.Event()
    async with make_pair(config=config, sink=RecordingSink(gate=gate)) as p:
        stuck: list[bool] = []
        p.sink.on_write.append(lambda: stuck.append(True))
        a, b = p.expect("a", [0], [1]), p.expect("b", [1], [1])

        async def b_chunks() -> AsyncIterator[KVChunk]:
            await b_has_a_page.wait()
            async for chunk in chunks_of("b", [1]):
                yield chunk

        sent_b = asyncio.create_task(p.sender.send(b.ticket, b_chunks()))
        await until(lambda: b.transfer.state is not TransferState.EXPECTED, "decode to read B's OPEN")
        sent_a = asyncio.create_task(p.sender.send(a.ticket, chunks_of("a", [0])))
        await until(lambda: stuck, "A's page to reach decode's stuck sink")
        b_has_a_page.set()
        credit = p.sender.credit(p.dest)
        await until(lambda: credit._waiters, "B to wait for credit")
        b.transfer.cancel()
        (conn,) = p.sender._peers[p.dest].conns
        await until(lambda: conn.sending["b"].result.done(), "decode's verdict on B to reach prefill")
        gate.set()  # A's page lands, its credit comes back, B wakes with it
        outcome_a, outcome_b = await asyncio.wait_for(asyncio.gather(sent_a, sent_b), PATIENT_S)
        assert outcome_a.ok and not outcome_b.ok
        assert p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "late"}) == 0
        assert credit.in_use == 0


async def test_garbage_on_the_port_closes_that_connection_only() -> None:
    async with make_pair() as p:
        for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n",
                     b"KVGT\x02\x01\x00\x00\xff\xff\xff\x7f\x00\x00\x00\x00", b"KVGT\x02"):  # fmt: skip
            reader, writer = await asyncio.open_connection(*p.dest)
            writer.write(junk)
            await writer.drain()
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), PATIENT_S) == b""  # the receiver hung up
            writer.close()
        e = p.expect("r", [0], [1])
        assert (await p.sender.send(e.ticket, chunks_of("r", [0]))).ok
        assert (await e.wait()).ok


async def test_metrics_are_exposed_in_prometheus_text() -> None:
    async with make_pair() as p:
        e = p.expect("r", [0, 1], [1, 1])
        await p.sender.send(e.ticket, chunks_of("r", [0, 1]))
        await e.wait()
        p.recv_metrics.count_abort(abort_cause(FailureReason.TIMEOUT))  # the servers' counter
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(p.recv_registry).decode())}
    for name in ("kvguard_checksum_failures", "kvguard_hmac_failures", "kvguard_ticket_rejections",
                 "kvguard_stale_writes_dropped", "kvguard_kv_transfer_bytes", "kvguard_aborts"):  # fmt: skip
        assert name in families, name
    received = [s for s in families["kvguard_kv_transfer_bytes"].samples if s.labels.get("direction") == "received"]
    assert received[0].value == 2 * PAGE
    counts = [s for s in families["kvguard_kv_transfer_chunk_bytes"].samples if s.name.endswith("_count")]
    assert counts[0].value == 2
    aborts = families["kvguard_aborts"].samples
    counted = {s.labels["cause"]: s.value for s in aborts if s.name == "kvguard_aborts_total"}
    assert {cause: value for cause, value in counted.items() if value} == {"transfer_timeout": 1.0}
    assert set(counted) == set(AbortCause)  # every cause exported from the start, at 0 (rate() sees the first)


async def test_standalone_abort_releases_decode_before_any_chunk_s4() -> None:
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        e = p.expect("r", [0], [1])
        await p.sender.abort(e.ticket, "prefill rejected the request")
        outcome = await asyncio.wait_for(e.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT and "rejected" in outcome.detail


async def test_unreachable_decode_is_a_failed_outcome_not_a_hang() -> None:
    async with make_pair() as p:
        e = p.expect("r", [0], [1])
    sender = KVSender(KEYS, TransferMetrics.create(CollectorRegistry()), FAST)
    outcome = await sender.send(e.ticket, chunks_of("r", [0]))
    assert outcome.reason is FailureReason.CONNECTION_LOST


# -- S9: tickets ------------------------------------------------------------------------------------


class Listener:
    """A socket an attacker would like prefill to connect to: counts what arrives."""

    def __init__(self) -> None:
        self.connections = 0
        self.bytes = 0

    async def start(self) -> tuple[str, int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.bytes += len(await reader.read(1 << 20))
            writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        self.server.close()


async def test_sender_refuses_a_forged_or_expired_ticket_before_connecting_anywhere_s9() -> None:
    """The signing oracle (issue 11, item 2): without a ticket the router issued, prefill connects
    nowhere and signs nothing."""
    spy = Listener()
    dest = await spy.start()
    async with make_pair() as p:
        e = p.expect("victim", [0, 1], [1, 1], dest=dest)
        forged = TicketAuthority(RevisionKeys.derive(b"attacker-chosen-key-....").ticket)
        outcomes = [
            await p.sender.send(issue(forged, e.transfer, dest, 32), chunks_of("victim", [0, 1])),
            await p.sender.send(replace(e.ticket, blob=e.ticket.blob[:-1] + bytes([e.ticket.blob[-1] ^ 1])), chunks_of("victim", [0, 1])),
            await p.sender.send(issue(_expired(), e.transfer, dest, 32), chunks_of("victim", [0, 1])),
        ]
    spy.close()
    assert all(o.reason is FailureReason.TICKET for o in outcomes), outcomes
    assert "expired" in outcomes[2].detail
    assert spy.connections == 0 and spy.bytes == 0


def _expired() -> TicketAuthority:
    """A genuine authority whose clock is an hour behind: its tickets are long expired."""
    import time

    return TicketAuthority(KEYS.ticket, clock=lambda: time.time() - 3600)


async def test_open_with_a_ticket_decode_did_not_grant_is_refused_and_the_victim_unharmed_s9() -> None:
    """An authentic ticket with another nonce or other pages (e.g. replayed from another request
    or another boot) never opens the victim's transfer, and does not fail it either."""
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        victim = p.expect("victim", [0, 1], [1, 1])
        wrong_nonce = p.tickets.issue("victim", p.dest, p.receiver.epoch, os.urandom(16), 32, (0, 1), (1, 1), 30)
        wrong_pages = p.tickets.issue("victim", p.dest, p.receiver.epoch, victim.transfer.nonce, 32, (1, 0), (1, 1), 30)
        other_boot = p.tickets.issue("victim", p.dest, p.receiver.epoch ^ 1, victim.transfer.nonce, 32, (0, 1), (1, 1), 30)
        expired = issue(_expired(), victim.transfer, p.dest, 32)
        peer = await RawPeer.connect(p.dest)
        for ticket in (wrong_nonce, wrong_pages, other_boot, expired):
            peer.open(ticket)
            peer.chunk("victim", 0, [0], [1])  # follows its OPEN: verified, dropped
        results = await peer.results("victim")
        assert len(results) == 1 and results["victim"].reason == FailureReason.TICKET
        assert victim.transfer.state is TransferState.EXPECTED
        assert (await p.sender.send(victim.ticket, chunks_of("victim", [0, 1]))).ok
        assert (await victim.wait()).ok
        peer.close()
    assert p.sink.writes["victim"] == 2  # only the genuine sender's two chunks
    def rejections() -> dict[str, float]:
        return {r: p.recv_metric("kvguard_ticket_rejections_total", {"reason": r}) for r in ("mismatch", "epoch", "expired")}

    await until(lambda: rejections() == {"mismatch": 2, "epoch": 1, "expired": 1}, "every refused OPEN counted", detail=rejections)


async def test_abort_or_open_from_another_connection_cannot_touch_a_transfer_s9() -> None:
    """Cross-connection ABORT (issue 11, item 4): even a peer holding the revision key and the
    victim's ticket cannot end, or take over, a transfer another connection opened."""
    gate = asyncio.Event()
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S), sink=RecordingSink(gate=gate)) as p:
        victim = p.expect("victim", [0, 1], [1, 1])
        sending = asyncio.create_task(p.sender.send(victim.ticket, chunks_of("victim", [0, 1])))
        await until(lambda: victim.transfer.state is TransferState.OPEN, "the victim's transfer open", timeout=PATIENT_S)
        bare = await RawPeer.connect(p.dest)
        bare.abort("victim")  # never opened on this connection: its connection is closed
        assert await bare.closed_by_decode()
        holder = await RawPeer.connect(p.dest)
        holder.open(victim.ticket)  # the right ticket, the wrong connection
        holder.abort("victim")
        holder.chunk("victim", 0, [0], [1])
        results = await holder.results("victim")
        assert results["victim"].reason == FailureReason.TICKET and "another connection" in results["victim"].detail
        assert victim.transfer.state is TransferState.OPEN
        gate.set()
        assert (await sending).ok and (await victim.wait()).ok
        holder.close()
        bare.close()
    assert p.sink.writes["victim"] == 2
    assert p.recv_metric("kvguard_ticket_rejections_total", {"reason": "already_open"}) == 1


# -- S9: replayed frames ----------------------------------------------------------------------------


class Tap:
    """A TCP relay between prefill and decode that records prefill's bytes and can inject more."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.recorded: list[bytearray] = []
        self.to_decode: list[asyncio.StreamWriter] = []

    async def start(self) -> tuple[str, int]:
        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bytearray | None) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(1 << 16):
                    if record is not None:
                        record += data
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            record = bytearray()
            self.recorded.append(record)
            self.to_decode.append(up_writer)
            await asyncio.gather(pump(reader, up_writer, record), pump(up_reader, writer, None))

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    def stream(self, i: int = 0) -> bytes:
        """What prefill sent on its i-th connection so far (empty until it connected)."""
        return bytes(self.recorded[i]) if len(self.recorded) > i else b""

    def close(self) -> None:
        self.server.close()


def frames(stream: bytes) -> list[tuple[FrameType, bytes]]:
    """Split recorded bytes into whole frames."""
    out, pos = [], 0
    while pos + PREFIX.size <= len(stream):
        kind, _, header_len, payload_len = parse_prefix(stream[pos : pos + PREFIX.size], 1 << 30)
        end = pos + PREFIX.size + header_len + TAG_BYTES + payload_len
        if end > len(stream):  # still arriving
            break
        out.append((kind, stream[pos:end]))
        pos = end
    return out


async def test_replayed_frames_on_the_same_connection_fail_verification_and_close_it_s6_s9() -> None:
    """Wire v3: every frame's HMAC covers its number on its connection, so an authentic frame
    copied back into its own connection (an on-path injector: formal/README.md, ONPATH) fails
    verification and closes it -- it is never applied again and never earns credit (S6)."""
    async with make_pair() as p:
        tap = Tap(p.dest)
        via = await tap.start()
        first = p.expect("first", [0, 1], [1, 1], dest=via)
        assert (await p.sender.send(first.ticket, chunks_of("first", [0, 1]))).ok
        replay = b"".join(data for kind, data in frames(tap.stream()) if kind is not FrameType.HELLO)
        tap.to_decode[0].write(replay)  # OPEN, CHUNK, CHUNK, MANIFEST of a finished transfer, again
        await tap.to_decode[0].drain()
        await until(lambda: p.recv_metric("kvguard_hmac_failures_total") == 1, "the replayed OPEN refused", timeout=PATIENT_S)
        second = p.expect("second", [2, 3], [1, 1], dest=via)  # served on a new connection
        gate = asyncio.Event()
        p.sink.gate = gate
        sending = asyncio.create_task(p.sender.send(second.ticket, chunks_of("second", [2, 3])))
        await until(lambda: len(frames(tap.stream(1))) >= 3, "HELLO, second's OPEN and CHUNK", timeout=PATIENT_S)
        chunk = next(data for kind, data in frames(tap.stream(1)) if kind is FrameType.CHUNK)
        tap.to_decode[1].write(chunk)  # an in-flight CHUNK injected a second time
        gate.set()
        outcome = await sending
        await until(lambda: p.recv_metric("kvguard_hmac_failures_total") == 2, "the injected CHUNK refused", timeout=PATIENT_S)
        tap.close()
    assert len(tap.recorded) == 2, "the connection the replay was sent on was not closed"
    assert p.sink.writes["first"] == 2, "a replayed chunk was applied"
    assert p.sink.writes["second"] <= 2, "the injected chunk was applied"
    # Decode read the copy after the transfer (then it had already answered) or within it.
    assert outcome.ok or outcome.reason is FailureReason.CONNECTION_LOST, outcome
    assert p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "late"}) == 0


async def test_replayed_frames_on_another_connection_fail_verification_and_leave_the_victim_alone_s9() -> None:
    gate = asyncio.Event()
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S), sink=RecordingSink(gate=gate)) as p:
        tap = Tap(p.dest)
        via = await tap.start()
        victim = p.expect("victim", [0, 1], [1, 1], dest=via)
        sending = asyncio.create_task(p.sender.send(victim.ticket, chunks_of("victim", [0, 1])))
        await until(lambda: len(frames(tap.stream())) >= 3, "HELLO, OPEN, first CHUNK recorded", timeout=PATIENT_S)
        reader, writer = await asyncio.open_connection(*p.dest)  # the attacker's own connection
        writer.write(tap.stream())  # the victim's HELLO, OPEN, CHUNK verbatim
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), PATIENT_S)  # WELCOME, then decode hangs up
        gate.set()
        assert (await sending).ok and (await victim.wait()).ok
        writer.close()
        tap.close()
    assert p.recv_metric("kvguard_hmac_failures_total") == 1  # the replayed OPEN, bound to another connection
    assert p.sink.writes["victim"] == 2


async def test_frames_captured_before_a_decode_restart_are_refused_after_it_epoch_s9() -> None:
    """Issue 11, item 4: generations restarted at 0 and ids were the client's, so frames of the
    previous boot could match again. The same request id, pages and generations on a new boot
    must not accept the old bytes, nor an old ticket."""
    recorded: bytes
    async with make_pair() as old_boot:
        tap = Tap(old_boot.dest)
        via = await tap.start()
        e = old_boot.expect("same-id", [0, 1], [1, 1], dest=via)
        assert (await old_boot.sender.send(e.ticket, chunks_of("same-id", [0, 1]))).ok
        recorded, old_ticket, old_epoch = tap.stream(), e.ticket, e.transfer.epoch
        tap.close()
    async with make_pair() as new_boot:
        assert new_boot.receiver.epoch != old_epoch
        again = new_boot.expect("same-id", [0, 1], [1, 1], open_timeout_s=STALL_S)  # only this timer may fire: nothing opens it
        reader, writer = await asyncio.open_connection(*new_boot.dest)
        writer.write(recorded)
        await writer.drain()
        await asyncio.wait_for(reader.read(), PATIENT_S)
        writer.close()
        # The old ticket, as if the restarted decode were back at the same address.
        moved = new_boot.tickets.issue("same-id", new_boot.dest, old_epoch, old_ticket.nonce, 32, (0, 1), (1, 1), 30)
        stale = await new_boot.sender.send(moved, chunks_of("same-id", [0, 1]))
        outcome = await again.wait()
    assert stale.reason is FailureReason.TICKET and "restarted" in stale.detail
    assert outcome.reason is FailureReason.TIMEOUT and "same-id" not in new_boot.sink.applied
    assert new_boot.recv_metric("kvguard_hmac_failures_total") == 1  # the replayed OPEN


async def test_old_ticket_reaching_a_restarted_decode_sends_nothing_epoch_s9() -> None:
    async with make_pair() as p:
        e = p.expect("r", [0], [1])
        stale_ticket = p.tickets.issue("r", p.dest, p.receiver.epoch + 1, e.transfer.nonce, 16, (0,), (1,), 30)
        outcome = await p.sender.send(stale_ticket, chunks_of("r", [0]))
    assert outcome.reason is FailureReason.TICKET and "restarted" in outcome.detail
    assert "r" not in p.sink.applied
    assert p.send_registry.get_sample_value("kvguard_kv_transfer_bytes_total", {"direction": "sent"}) in (None, 0.0)


# -- confidentiality: AES-GCM -------------------------------------------------------------------------


async def test_aes_gcm_keeps_kv_unreadable_on_the_wire_and_round_trips() -> None:
    for encryption in (Encryption.NONE, Encryption.AES_GCM):
        config = TransferConfig(stall_timeout_s=30, encryption=encryption)
        async with make_pair(config=config) as p:
            tap = Tap(p.dest)
            via = await tap.start()
            ids, gens = plan(8)
            e = p.expect("secret", ids, gens, dest=via)
            first = FirstToken(4242, -0.125, ((4242, -0.125),))
            assert (await p.sender.send(e.ticket, chunks_of("secret", ids, per_chunk=4), first)).ok
            assert (await e.wait()).ok
            tap.close()
        wire = tap.stream()
        assert p.sink.applied["secret"] == {pg: page_bytes("secret", pg) for pg in ids}
        assert p.sink.manifests["secret"].first == first
        readable = page_bytes("secret", 3)[:64] in wire
        assert readable is (encryption is Encryption.NONE), encryption


async def test_encryption_mismatch_fails_at_the_handshake_with_a_clear_reason() -> None:
    async with make_pair(config=TransferConfig(stall_timeout_s=30, encryption=Encryption.AES_GCM),
                         sender_config=FAST) as p:  # fmt: skip
        e = p.expect("r", [0], [1])
        outcome = await p.sender.send(e.ticket, chunks_of("r", [0]))
    assert outcome.reason is FailureReason.PROTOCOL_ERROR and "encryption" in outcome.detail
    assert "r" not in p.sink.applied


def test_frame_keys_are_bound_to_ticket_and_connection() -> None:
    """Unit view of the same property: one request's MAC key differs per ticket nonce and per
    connection, so no frame verifies anywhere but where it was sent."""
    a, b = os.urandom(32), os.urandom(32)
    nonce, other = os.urandom(16), os.urandom(16)
    keys = {KEYS.request(n, c).mac for n in (nonce, other) for c in (a, b)}
    assert len(keys) == 4
    head = encode_head(Abort("r", "x"))
    raw = RawFrame(FrameType.ABORT, 0, head, frame_tag(KEYS.request(nonce, a).mac, 0, head), b"")
    verify(raw, KEYS.request(nonce, a).mac)
    with pytest.raises(HmacError):
        verify(raw, KEYS.request(nonce, b).mac)


def test_a_peers_abort_is_counted_under_the_cause_it_names_s4() -> None:
    """The router tells both workers why it ends a request; decode heard it first from the router
    or from prefill's abort frame, and counted `timeout` or `peer_abort` by which came first (a CI
    run under load), and prefill likewise `timeout` or `transfer_failed` from decode's cancelled
    result. The named cause is counted, from the closed set only: a peer's free text never
    becomes a label value."""
    assert abort_cause(FailureReason.PEER_ABORT, "timeout") == AbortCause.TIMEOUT
    assert abort_cause(FailureReason.PEER_ABORT, "client_disconnect") == AbortCause.CLIENT_DISCONNECT
    assert abort_cause(FailureReason.CANCELLED, "timeout") == AbortCause.TIMEOUT  # decode's cancel, at prefill
    assert abort_cause(FailureReason.PEER_ABORT, "anything else") == AbortCause.PEER_ABORT
    assert abort_cause(FailureReason.PEER_ABORT, None) == AbortCause.PEER_ABORT
    assert abort_cause(FailureReason.CANCELLED, "receiver closed") == AbortCause.TRANSFER_FAILED
    assert abort_cause(FailureReason.CHECKSUM, "timeout") == AbortCause.INTEGRITY  # only a peer's end names a cause
