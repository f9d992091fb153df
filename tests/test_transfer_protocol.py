"""Pure framing and plan checks of the KV transfer protocol (S3, class D)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.workers.transfer_protocol import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    TAG_BYTES,
    Abort,
    Ack,
    ChunkHeader,
    FrameType,
    HmacError,
    Manifest,
    PlanTracker,
    ProtocolError,
    Result,
    open_header,
    parse_prefix,
    payload_checksum,
    seal,
)

KEY = b"0123456789abcdef0123456789abcdef"
MAX_PAYLOAD = 1 << 20


def _round_trip(frame, payload_len: int = 0, key: bytes | None = KEY):  # type: ignore[no-untyped-def]
    sealed = seal(key, frame, payload_len)
    prefix = sealed[: PREFIX.size]
    kind, header_len, plen = parse_prefix(prefix, MAX_PAYLOAD)
    assert plen == payload_len and len(sealed) == PREFIX.size + header_len + TAG_BYTES
    return open_header(key, prefix, sealed[PREFIX.size :], kind)


rids = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= 128)
pages = st.lists(st.integers(0, 2**32 - 1), max_size=50, unique=True)


@given(rid=rids, seq=st.integers(0, 2**32 - 1), ids=pages, data=st.data())
def test_chunk_and_manifest_round_trip(rid: str, seq: int, ids: list[int], data) -> None:  # type: ignore[no-untyped-def]
    gens = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=len(ids), max_size=len(ids)))
    chunk = ChunkHeader(rid, seq, payload_checksum(b"x" * (seq % 7)), tuple(ids), tuple(gens))
    assert _round_trip(chunk, 4096) == chunk
    manifest = Manifest(rid, seq, seq * 3, tuple(ids), tuple(gens), first_token=seq % 50_000 - 1)
    assert _round_trip(manifest) == manifest


def test_small_frames_round_trip() -> None:
    for frame in (Abort("r1", "client went away"), Ack("r1", 3, 4096),
                  Result("r1", False, "checksum", "seq 2"), Result("r1", True, "", "")):
        assert _round_trip(frame) == frame


@pytest.mark.parametrize("offset", [0, 5, 8, 16, 20, 40])
def test_any_flipped_header_byte_is_detected_s3(offset: int) -> None:
    sealed = bytearray(seal(KEY, ChunkHeader("req", 1, bytes(16), (1, 2), (5, 6)), 10))
    sealed[offset] ^= 0x01
    prefix = bytes(sealed[: PREFIX.size])
    with pytest.raises(ProtocolError):
        kind, _, _ = parse_prefix(prefix, MAX_PAYLOAD)
        open_header(KEY, prefix, bytes(sealed[PREFIX.size :]), kind)


def test_wrong_key_fails_hmac_s3() -> None:
    sealed = seal(KEY, Ack("r", 0, 1))
    kind, _, _ = parse_prefix(sealed[: PREFIX.size], MAX_PAYLOAD)
    with pytest.raises(HmacError):
        open_header(b"another key of 32 bytes........", sealed[: PREFIX.size], sealed[PREFIX.size :], kind)


def test_prefix_bounds_reject_before_allocating() -> None:
    huge_header = PREFIX.pack(MAGIC, 1, FrameType.CHUNK, 0, MAX_HEADER_BYTES[FrameType.CHUNK] + 1, 0)
    huge_payload = PREFIX.pack(MAGIC, 1, FrameType.CHUNK, 0, 10, MAX_PAYLOAD + 1)
    payload_on_ack = PREFIX.pack(MAGIC, 1, FrameType.ACK, 0, 10, 1)
    for bad, message in ((b"HTTP/1.1 200 OK\r\n", "bad magic"), (huge_header, "header length"),
                         (huge_payload, "payload length"), (payload_on_ack, "payload length"),
                         (PREFIX.pack(MAGIC, 2, 1, 0, 10, 0), "version"),
                         (PREFIX.pack(MAGIC, 1, 9, 0, 10, 0), "frame type")):
        with pytest.raises(ProtocolError, match=message):
            parse_prefix(bad[: PREFIX.size], MAX_PAYLOAD)


def test_lying_page_count_is_a_protocol_error() -> None:
    sealed = bytearray(seal(None, Manifest("r", 1, 1, (1,), (1,))))
    # page count sits after rid(2) + count(4) + total(8) in the header
    sealed[PREFIX.size + 2 + 12 : PREFIX.size + 2 + 16] = (10**6).to_bytes(4, "little")
    kind, _, _ = parse_prefix(bytes(sealed[: PREFIX.size]), MAX_PAYLOAD)
    with pytest.raises(ProtocolError, match="page count"):
        open_header(None, bytes(sealed[: PREFIX.size]), bytes(sealed[PREFIX.size :]), kind)


def _chunk(seq: int, ids: tuple[int, ...], gens: tuple[int, ...]) -> ChunkHeader:
    return ChunkHeader("r", seq, bytes(16), ids, gens)


def test_plan_tracker_accepts_the_plan_exactly() -> None:
    plan = PlanTracker([3, 4, 5], [7, 7, 8])
    for seq, ids, gens in ((0, (3, 4), (7, 7)), (1, (5,), (8,))):
        assert plan.check_chunk(_chunk(seq, ids, gens)) is None
        plan.record(_chunk(seq, ids, gens), 100)
    assert plan.check_manifest(Manifest("r", 2, 200, (3, 4, 5), (7, 7, 8))) is None


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (_chunk(1, (9,), (7,)), "not in the plan"),
        (_chunk(1, (4,), (6,)), "generation"),
        (_chunk(1, (3,), (7,)), "written twice"),
        (_chunk(1, (4, 4), (7, 7)), "written twice"),
        (_chunk(0, (4,), (7,)), "repeats or precedes"),
        (_chunk(1, (), ()), "no pages"),
    ],
)
def test_plan_tracker_rejects_out_of_plan_chunks_class_d(chunk: ChunkHeader, message: str) -> None:
    plan = PlanTracker([3, 4], [7, 7])
    plan.record(_chunk(0, (3,), (7,)), 10)
    assert message in (plan.check_chunk(chunk) or "")


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (Manifest("r", 2, 10, (3,), (7,)), "2 chunks"),
        (Manifest("r", 1, 11, (3,), (7,)), "11 bytes"),
        (Manifest("r", 1, 10, (3, 4), (7, 7)), "differ"),
        (Manifest("r", 1, 10, (3,), (7,)), "never written"),
        (Manifest("r", 1, 10, (3, 3), (7, 7)), "twice"),
    ],
)
def test_plan_tracker_checks_the_manifest_class_d(manifest: Manifest, message: str) -> None:
    plan = PlanTracker([3, 4], [7, 7])
    plan.record(_chunk(0, (3,), (7,)), 10)
    assert message in (plan.check_manifest(manifest) or "")
