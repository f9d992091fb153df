"""KV transfer over real loopback sockets: integrity (S3), aborts and timeouts (S4), stale writes
(S5), back-pressure (S6), and the bug classes C, D, G, H, I of pd-bug-classes.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from kvguard.workers.faults import NO_FAULTS, Faults
from kvguard.workers.transfer import (
    DuplicateRequestError,
    FailureReason,
    KVChunk,
    KVReceiver,
    KVSender,
    PrefillCrashed,
    TransferConfig,
    TransferMetrics,
    WriteOutcome,
    abort_cause,
    read_frame,
    write_frame,
)
from kvguard.workers.transfer_protocol import ChunkHeader, Manifest, Result, payload_checksum

KEY = b"test-shared-key-0123456789abcdef"
PAGE = 512
# Timeouts that must fire are set per test (STALL_S); the rest are generous so that a transfer on a
# loaded machine never times out by chance, and the waits for an outcome are longer still.
FAST = TransferConfig(stall_timeout_s=30.0)
STALL_S = 0.3
PATIENT_S = 60.0


def page_bytes(rid: str, page: int) -> bytes:
    return (f"{rid}:{page}:".encode() * PAGE)[:PAGE]


@dataclass
class RecordingSink:
    """A KVSink that records what it applied; optional per-write delay and stale request ids."""

    delay_s: float = 0.0
    stale: set[str] = field(default_factory=set)
    gate: asyncio.Event | None = None
    applied: dict[str, dict[int, bytes]] = field(default_factory=lambda: defaultdict(dict))
    order: list[str] = field(default_factory=list)
    applied_bytes: int = 0
    on_write: list = field(default_factory=list)  # type: ignore[type-arg]

    async def write_pages(self, request_id: str, page_ids: Sequence[int],
                          generations: Sequence[int], payload: memoryview) -> WriteOutcome:
        for hook in self.on_write:
            hook()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if request_id in self.stale:
            return WriteOutcome.STALE  # S5: never applied
        for i, page in enumerate(page_ids):
            self.applied[request_id][page] = bytes(payload[i * PAGE : (i + 1) * PAGE])
        self.applied_bytes += len(payload)
        self.order.append(request_id)
        return WriteOutcome.APPLIED

    async def transfer_complete(self, request_id: str, manifest: Manifest) -> WriteOutcome:
        return WriteOutcome.APPLIED


@dataclass
class Pair:
    receiver: KVReceiver
    sender: KVSender
    sink: RecordingSink
    dest: tuple[str, int]
    recv_registry: CollectorRegistry
    send_registry: CollectorRegistry
    recv_metrics: TransferMetrics

    def recv_metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.recv_registry.get_sample_value(name, labels or {}) or 0.0


@contextlib.asynccontextmanager
async def make_pair(*, config: TransferConfig = FAST, sink: RecordingSink | None = None,
                    sender_faults: Faults = NO_FAULTS, receiver_faults: Faults = NO_FAULTS,
                    sender_key: bytes = KEY, on_crash=None) -> AsyncIterator[Pair]:  # type: ignore[no-untyped-def]
    sink = sink or RecordingSink()
    recv_reg, send_reg = CollectorRegistry(), CollectorRegistry()
    recv_metrics = TransferMetrics.create(recv_reg)
    receiver = KVReceiver(sink, KEY, recv_metrics, config, receiver_faults)
    dest = await receiver.start()
    kwargs = {"on_crash": on_crash} if on_crash else {}
    sender = KVSender(sender_key, TransferMetrics.create(send_reg), config, sender_faults, **kwargs)
    try:
        yield Pair(receiver, sender, sink, dest, recv_reg, send_reg, recv_metrics)
    finally:
        if sink.gate is not None:
            sink.gate.set()
        await sender.close()
        await receiver.close()


def plan(n_pages: int, first: int = 0, generation: int = 1) -> tuple[list[int], list[int]]:
    return list(range(first, first + n_pages)), [generation] * n_pages


async def chunks_of(rid: str, pages: list[int], per_chunk: int = 1,
                    pause_s: float = 0.0) -> AsyncIterator[KVChunk]:
    for i in range(0, len(pages), per_chunk):
        ids = pages[i : i + per_chunk]
        yield KVChunk(ids, b"".join(page_bytes(rid, p) for p in ids))
        await asyncio.sleep(pause_s)


async def test_round_trip_many_interleaved_requests_s3() -> None:
    config = TransferConfig(stall_timeout_s=30.0, max_connections_per_peer=1)
    async with make_pair(config=config) as p:
        handles, sends = [], []
        for r in range(16):
            rid = f"req-{r}"
            ids, gens = plan(6, first=r * 6, generation=r + 1)
            handles.append(p.receiver.expect(rid, ids, gens))
            sends.append(p.sender.send(rid, p.dest, ids, gens, chunks_of(rid, ids, per_chunk=2)))
        sent = await asyncio.gather(*sends)
        received = await asyncio.gather(*(h.wait() for h in handles))
    assert all(o.ok for o in sent), sent
    assert all(o.ok and o.chunks == 3 and o.bytes == 6 * PAGE for o in received), received
    for r in range(16):
        rid = f"req-{r}"
        assert p.sink.applied[rid] == {pg: page_bytes(rid, pg) for pg in range(r * 6, r * 6 + 6)}
    switches = sum(a != b for a, b in zip(p.sink.order, p.sink.order[1:]))
    assert switches > 16, "requests were not interleaved on the shared connection"
    assert p.recv_metric("kvguard_kv_transfers_total", {"role": "receiver", "outcome": "complete"}) == 16


class RawPeer:
    """Speaks the wire protocol by hand, to send what a buggy or hostile prefill would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
        self.reader, self.writer, self.key = reader, writer, key

    @classmethod
    async def connect(cls, dest: tuple[str, int], key: bytes = KEY) -> RawPeer:
        return cls(*await asyncio.open_connection(*dest), key)

    def chunk(self, rid: str, seq: int, pages: Sequence[int], gens: Sequence[int],
              payload: bytes | None = None, corrupt: bool = False) -> None:
        payload = payload if payload is not None else b"".join(page_bytes(rid, pg) for pg in pages)
        checksum = payload_checksum(payload)
        if corrupt:
            payload = bytes([payload[0] ^ 0x40]) + payload[1:]
        write_frame(self.writer, self.key, ChunkHeader(rid, seq, checksum, tuple(pages), tuple(gens)), payload)

    def manifest(self, rid: str, chunks: int, pages: Sequence[int], gens: Sequence[int]) -> None:
        write_frame(self.writer, self.key, Manifest(rid, chunks, len(pages) * PAGE, tuple(pages), tuple(gens)))

    async def results(self, *request_ids: str) -> dict[str, Result]:
        """The RESULT of each of `request_ids` (waiting for them all, whatever the machine's speed)."""
        out: dict[str, Result] = {}
        async with asyncio.timeout(PATIENT_S):
            while not set(request_ids) <= set(out):
                got = await read_frame(self.reader, self.key, 0)
                if got is None:  # the receiver hung up: what came is all there is
                    break
                if isinstance(got[0], Result):
                    out[got[0].request_id] = got[0]
        return out

    def close(self) -> None:
        self.writer.close()


async def test_corrupt_chunk_fails_only_that_request_on_the_same_connection_s3_class_i() -> None:
    async with make_pair() as p:
        handles = {rid: p.receiver.expect(rid, [i * 2, i * 2 + 1], [1, 1])
                   for i, rid in enumerate(("a", "b", "c"))}
        peer = await RawPeer.connect(p.dest)
        for seq in range(2):
            for i, rid in enumerate(("a", "b", "c")):
                peer.chunk(rid, seq, [i * 2 + seq], [1], corrupt=(rid == "b" and seq == 1))
        for i, rid in enumerate(("a", "b", "c")):
            peer.manifest(rid, 2, [i * 2, i * 2 + 1], [1, 1])
        outcomes = {rid: await h.wait() for rid, h in handles.items()}
        results = await peer.results("a", "b", "c")
        peer.close()
    assert outcomes["a"].ok and outcomes["c"].ok
    assert outcomes["b"].reason is FailureReason.CHECKSUM
    assert 3 not in p.sink.applied["b"], "a corrupted page was applied"
    assert results["b"].ok is False and results["a"].ok and results["c"].ok
    assert p.recv_metric("kvguard_checksum_failures_total") == 1


async def test_corrupt_chunk_fault_is_caught_and_no_checksum_lets_it_through() -> None:
    ids, gens = plan(3)
    async with make_pair(sender_faults=Faults(corrupt_chunk=1.0)) as p:
        handle = p.receiver.expect("r", ids, gens)
        sent = await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        assert (await handle.wait()).reason is FailureReason.CHECKSUM
        assert sent.reason is FailureReason.CHECKSUM
    async with make_pair(sender_faults=Faults(corrupt_chunk=1.0),
                         receiver_faults=Faults(no_checksum=True)) as p:
        handle = p.receiver.expect("r", ids, gens)
        await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        assert (await handle.wait()).ok  # the fault switch disables the S3 check: by design
        assert p.sink.applied["r"][0] != page_bytes("r", 0)


async def test_wrong_hmac_key_is_rejected_and_closes_only_that_connection_s3() -> None:
    ids, gens = plan(2)
    async with make_pair(sender_key=b"not-the-deployment-key-!!!!!!!!!") as p:
        handle = p.receiver.expect("r", ids, gens, stall_timeout_s=STALL_S)  # only r's timer may fire
        sent = await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
        good = KVSender(KEY, TransferMetrics.create(CollectorRegistry()), FAST)
        other = p.receiver.expect("ok", [7], [1])
        assert (await good.send("ok", p.dest, [7], [1], chunks_of("ok", [7]))).ok
        assert (await other.wait()).ok
        await good.close()
    assert sent.reason is FailureReason.CONNECTION_LOST
    assert outcome.reason is FailureReason.TIMEOUT  # its id was never trusted, so only the timer ends it
    assert p.recv_metric("kvguard_hmac_failures_total") == 1
    assert "r" not in p.sink.applied


async def test_dropped_chunk_fails_by_manifest_class_c_and_ignore_manifest_misses_it() -> None:
    ids, gens = plan(4)
    faults = Faults(drop_chunk=0.5, seed=1)
    async with make_pair(sender_faults=faults) as p:
        handle = p.receiver.expect("r", ids, gens)
        sent = await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        outcome = await handle.wait()
    assert 0 < len(p.sink.applied["r"]) < 4, "seed 1 should drop some but not all chunks"
    assert outcome.reason is FailureReason.MANIFEST_MISMATCH and sent.reason is outcome.reason
    async with make_pair(sender_faults=faults, receiver_faults=Faults(ignore_manifest=True)) as p:
        handle = p.receiver.expect("r", ids, gens)
        await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        assert (await handle.wait()).ok  # the canary suite must catch this switch


async def test_chunk_accounting_mismatches_fail_the_request_class_d() -> None:
    async with make_pair() as p:
        short = p.receiver.expect("short", [0, 1, 2], [1, 1, 1])
        extra = p.receiver.expect("extra", [10, 11], [1, 1])
        dup = p.receiver.expect("dup", [20, 21], [1, 1])
        order = p.receiver.expect("order", [30, 31], [1, 1])
        stale_gen = p.receiver.expect("gen", [40], [5])
        fine = p.receiver.expect("fine", [50], [1])
        peer = await RawPeer.connect(p.dest)
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
        outcomes = {h.request_id: await h.wait() for h in (short, extra, dup, order, stale_gen, fine)}
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
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", ids, gens, stall_timeout_s=STALL_S)
        task = asyncio.create_task(p.sender.send("r", p.dest, ids, gens, _stalling("r", ids)))
        loop = asyncio.get_running_loop()
        start = loop.time()
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)  # before the pair's own timer could fire
        elapsed = loop.time() - start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert outcome.reason is FailureReason.TIMEOUT
    assert elapsed >= 0.25  # by its own short timer, not before it
    assert p.receiver.active_requests == 0


async def test_stalled_receiver_times_out_on_the_sender_class_h() -> None:
    ids, gens = plan(8)
    config = TransferConfig(stall_timeout_s=STALL_S, max_transfer_batch=2 * PAGE)
    async with make_pair(config=config, sink=RecordingSink(gate=asyncio.Event())) as p:
        handle = p.receiver.expect("r", ids, gens)
        sent = await asyncio.wait_for(p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids)), PATIENT_S)
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
    assert sent.reason is FailureReason.TIMEOUT
    assert not outcome.ok


async def _failing(rid: str, pages: list[int]) -> AsyncIterator[KVChunk]:
    yield KVChunk(pages[:1], page_bytes(rid, pages[0]))
    raise RuntimeError("prefill forward failed")


async def test_prefill_error_sends_abort_and_decode_releases_at_once_s4() -> None:
    ids, gens = plan(3)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", ids, gens)
        with pytest.raises(RuntimeError, match="prefill forward failed"):
            await p.sender.send("r", p.dest, ids, gens, _failing("r", ids))
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT
    assert "prefill forward failed" in outcome.detail


async def test_client_disconnect_cancels_send_and_aborts_decode_s4() -> None:
    ids, gens = plan(3)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", ids, gens)
        task = asyncio.create_task(p.sender.send("r", p.dest, ids, gens, _stalling("r", ids)))
        await until(lambda: p.sink.applied["r"], "the first chunk applied")
        task.cancel()
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT


async def test_no_abort_propagation_leaves_decode_to_its_timeout() -> None:
    ids, gens = plan(3)
    async with make_pair(sender_faults=Faults(no_abort_propagation=True), config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", ids, gens, stall_timeout_s=STALL_S)
        with pytest.raises(RuntimeError):
            await p.sender.send("r", p.dest, ids, gens, _failing("r", ids))
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)  # before the pair's own timer could fire
    assert outcome.reason is FailureReason.TIMEOUT


async def test_decode_cancel_stops_prefill_s4() -> None:
    ids, gens = plan(20)
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", ids, gens)
        p.sink.on_write.append(lambda: handle.cancel("client of decode went away")
                               if len(p.sink.applied["r"]) >= 2 else None)
        sent = await asyncio.wait_for(
            p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids, pause_s=0.01)), PATIENT_S)
        outcome = await handle.wait()
    assert outcome.reason is FailureReason.CANCELLED
    assert sent.reason is FailureReason.CANCELLED and "went away" in sent.detail
    assert len(p.sink.applied["r"]) < 20


async def test_prefill_crash_mid_transfer_fails_decode_at_once_class_c() -> None:
    ids, gens = plan(4)
    async with make_pair(sender_faults=Faults(crash_prefill_after_chunks=2),
                         config=TransferConfig(stall_timeout_s=2 * PATIENT_S), on_crash=lambda: None) as p:
        handle = p.receiver.expect("r", ids, gens)
        with pytest.raises(PrefillCrashed):
            await p.sender.send("r", p.dest, ids, gens, chunks_of("r", ids))
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.CONNECTION_LOST


async def test_stale_write_is_counted_and_never_applied_s5_class_e() -> None:
    async with make_pair(sink=RecordingSink(stale={"old"})) as p:
        old = p.receiver.expect("old", [0, 1], [3, 3])
        new = p.receiver.expect("new", [2], [1])
        results = await asyncio.gather(
            p.sender.send("old", p.dest, [0, 1], [3, 3], chunks_of("old", [0, 1])),
            p.sender.send("new", p.dest, [2], [1], chunks_of("new", [2])))
        assert (await old.wait()).reason is FailureReason.STALE
        assert (await new.wait()).ok and results[1].ok
    assert "old" not in p.sink.applied
    assert p.recv_metric("kvguard_stale_writes_dropped_total") >= 1


async def test_late_and_unknown_frames_are_dropped_and_counted_class_g() -> None:
    async with make_pair() as p:
        done = p.receiver.expect("done", [0], [1])
        assert (await p.sender.send("done", p.dest, [0], [1], chunks_of("done", [0]))).ok
        assert (await done.wait()).ok
        peer = await RawPeer.connect(p.dest)
        peer.chunk("done", 5, [0], [1])
        peer.chunk("never-expected", 0, [1], [1])
        results = await peer.results("done", "never-expected")
        peer.close()
    assert results["never-expected"].reason == FailureReason.UNKNOWN_REQUEST
    assert results["done"].ok is False
    assert p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "late"}) == 1
    assert p.recv_metric("kvguard_kv_transfer_frames_dropped_total", {"reason": "unknown_request"}) == 1
    assert list(p.sink.applied) == ["done"]


async def test_duplicate_request_id_is_rejected_class_g() -> None:
    async with make_pair() as p:
        p.receiver.expect("r", [0], [1])
        with pytest.raises(DuplicateRequestError):
            p.receiver.expect("r", [1], [1])
        assert (await p.sender.send("r", p.dest, [0], [1], chunks_of("r", [0]))).ok
        with pytest.raises(DuplicateRequestError):
            p.receiver.expect("r", [2], [1])  # recently finished ids are not reusable either


async def test_in_flight_bytes_never_exceed_the_cap_with_a_slow_sink_s6() -> None:
    cap, chunk = 64 << 10, 8 << 10  # 8 KiB chunks = 16 pages of PAGE bytes
    config = TransferConfig(stall_timeout_s=30, max_transfer_batch=cap)
    async with make_pair(config=config, sink=RecordingSink(delay_s=0.002)) as p:
        observed: list[float] = []

        def in_flight() -> None:  # measured independently of the sender's own accounting
            sent = p.send_registry.get_sample_value(
                "kvguard_kv_transfer_bytes_total", {"direction": "sent"}) or 0.0
            observed.append(sent - p.sink.applied_bytes)

        p.sink.on_write.append(in_flight)
        handles, sends = [], []
        for r in range(4):
            ids, gens = plan(16 * 12, first=r * 1000)
            handles.append(p.receiver.expect(f"r{r}", ids, gens))
            sends.append(p.sender.send(f"r{r}", p.dest, ids, gens, chunks_of(f"r{r}", ids, 16)))
        assert all(o.ok for o in await asyncio.gather(*sends))
        assert all(o.ok for o in await asyncio.gather(*(h.wait() for h in handles)))
        credit = p.sender.credit(p.dest)
    assert max(observed) <= cap
    assert credit.max_in_use <= cap
    assert max(observed) >= cap - chunk, "the test never filled the pipe"
    assert credit.in_use == 0


async def test_garbage_on_the_port_closes_that_connection_only() -> None:
    async with make_pair() as p:
        for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n",
                     b"KVGT\x01\x01\x00\x00\xff\xff\xff\x7f\x00\x00\x00\x00", b"KVGT\x01"):
            reader, writer = await asyncio.open_connection(*p.dest)
            writer.write(junk)
            await writer.drain()
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), PATIENT_S) == b""  # the receiver hung up
            writer.close()
        handle = p.receiver.expect("r", [0], [1])
        assert (await p.sender.send("r", p.dest, [0], [1], chunks_of("r", [0]))).ok
        assert (await handle.wait()).ok


async def test_metrics_are_exposed_in_prometheus_text() -> None:
    async with make_pair() as p:
        handle = p.receiver.expect("r", [0, 1], [1, 1])
        await p.sender.send("r", p.dest, [0, 1], [1, 1], chunks_of("r", [0, 1]))
        await handle.wait()
        p.recv_metrics.count_abort(abort_cause(FailureReason.TIMEOUT))  # the servers' counter
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(p.recv_registry).decode())}
    for name in ("kvguard_checksum_failures", "kvguard_hmac_failures",
                 "kvguard_stale_writes_dropped", "kvguard_kv_transfer_bytes", "kvguard_aborts"):
        assert name in families, name
    received = [s for s in families["kvguard_kv_transfer_bytes"].samples
                if s.labels.get("direction") == "received"]
    assert received[0].value == 2 * PAGE
    counts = [s for s in families["kvguard_kv_transfer_chunk_bytes"].samples
              if s.name.endswith("_count")]
    assert counts[0].value == 2
    aborts = families["kvguard_aborts"].samples
    assert [(s.labels["cause"], s.value) for s in aborts if s.name == "kvguard_aborts_total"] == [
        ("transfer_timeout", 1.0)]


async def test_standalone_abort_releases_decode_before_any_chunk_s4() -> None:
    async with make_pair(config=TransferConfig(stall_timeout_s=2 * PATIENT_S)) as p:
        handle = p.receiver.expect("r", [0], [1])
        await p.sender.abort("r", p.dest, "prefill rejected the request")
        outcome = await asyncio.wait_for(handle.wait(), PATIENT_S)
    assert outcome.reason is FailureReason.PEER_ABORT and "rejected" in outcome.detail


async def test_unreachable_decode_is_a_failed_outcome_not_a_hang() -> None:
    async with make_pair() as p:
        port = p.dest[1]
    sender = KVSender(KEY, TransferMetrics.create(CollectorRegistry()), FAST)
    outcome = await sender.send("r", ("127.0.0.1", port), [0], [1], chunks_of("r", [0]))
    assert outcome.reason is FailureReason.CONNECTION_LOST
