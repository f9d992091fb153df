"""Pure framing, ticket and plan checks of the KV transfer protocol (S3, S9, class D)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.workers.keys import RevisionKeys
from kvguard.workers.transfer.crypto import DecryptError, PayloadCipher
from kvguard.workers.transfer.plan import PlanTracker
from kvguard.workers.transfer.tickets import TicketAuthority, TicketError
from kvguard.workers.transfer.wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_TOP_LOGPROBS,
    PREFIX,
    TAG_BYTES,
    VERSION,
    Abort,
    Ack,
    ChunkHeader,
    Encryption,
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
    decode_first_token,
    encode_first_token,
    parse_prefix,
    payload_checksum,
    seal,
    verify,
)

KEY = b"0123456789abcdef0123456789abcdef"
MAX_PAYLOAD = 1 << 20
NONCE = bytes(range(16))


def _raw(sealed: bytes, payload: bytes = b"") -> RawFrame:
    kind, flags, header_len, _ = parse_prefix(sealed[: PREFIX.size], MAX_PAYLOAD)
    head = sealed[: PREFIX.size + header_len]
    return RawFrame(kind, flags, head, sealed[len(head) : len(head) + TAG_BYTES], payload)


def _round_trip(frame, payload_len: int = 0, key: bytes | None = KEY):  # type: ignore[no-untyped-def]
    sealed = seal(key, frame, payload_len)
    _, _, header_len, plen = parse_prefix(sealed[: PREFIX.size], MAX_PAYLOAD)
    assert plen == payload_len and len(sealed) == PREFIX.size + header_len + TAG_BYTES
    raw = _raw(sealed)
    verify(raw, key)
    return decode(raw)


rids = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= 128)
pages = st.lists(st.integers(0, 2**32 - 1), max_size=50, unique=True)


@given(rid=rids, seq=st.integers(0, 2**32 - 1), ids=pages, data=st.data())
def test_chunk_and_manifest_round_trip(rid: str, seq: int, ids: list[int], data) -> None:  # type: ignore[no-untyped-def]
    gens = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=len(ids), max_size=len(ids)))
    chunk = ChunkHeader(rid, seq, payload_checksum(b"x" * (seq % 7)), tuple(ids), tuple(gens))
    assert _round_trip(chunk, 4096) == chunk
    manifest = Manifest(rid, seq, seq * 3, tuple(ids), tuple(gens))
    assert _round_trip(manifest) == manifest


def test_small_frames_round_trip() -> None:
    for frame in (Hello(NONCE, Encryption.AES_GCM), Welcome(NONCE, NONCE[::-1], 2**64 - 1, Encryption.NONE),
                  Open("r1", b"ticket bytes"), Abort("r1", "client went away"), Ack(3, 4096),
                  Result("r1", False, "checksum", "seq 2"), Result("r1", True, "", "")):  # fmt: skip
        assert _round_trip(frame) == frame


@given(token=st.integers(0, 2**32 - 1), logprob=st.none() | st.floats(allow_nan=False),
       top=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.floats(allow_nan=False)), max_size=MAX_TOP_LOGPROBS))
def test_first_token_record_round_trips_with_logprobs(token: int, logprob: float | None, top: list) -> None:  # type: ignore[type-arg]
    first = FirstToken(token, logprob, tuple(top))
    assert decode_first_token(encode_first_token(first)) == first
    assert decode_first_token(encode_first_token(None)) is None


def test_first_token_record_is_bounded() -> None:
    with pytest.raises(ValueError, match="at most"):
        FirstToken(1, None, tuple((i, -1.0) for i in range(MAX_TOP_LOGPROBS + 1)))
    with pytest.raises(ValueError, match="NaN"):
        FirstToken(1, math.nan)
    record = bytearray(encode_first_token(FirstToken(1, -0.5, ((2, -1.0),))))
    record[17] = MAX_TOP_LOGPROBS + 1  # the top count
    with pytest.raises(ProtocolError):
        decode_first_token(bytes(record))


@pytest.mark.parametrize("offset", [0, 5, 8, 16, 20, 40])
def test_any_flipped_header_byte_is_detected_s3(offset: int) -> None:
    sealed = bytearray(seal(KEY, ChunkHeader("req", 1, bytes(16), (1, 2), (5, 6)), 10))
    sealed[offset] ^= 0x01
    with pytest.raises(ProtocolError):
        verify(_raw(bytes(sealed)), KEY)


def test_a_frame_verifies_only_as_its_own_number_on_the_connection_s6_s9() -> None:
    """Wire v3: the tag covers the frame's place on its connection (counted, not sent), so the
    same bytes read as any other frame of the connection -- replayed, or after a dropped or an
    injected one -- fail like a forged frame."""
    chunk = ChunkHeader("req", 1, bytes(16), (1, 2), (5, 6))
    sealed = seal(KEY, chunk, 10, number=7)
    verify(replace(_raw(sealed), number=7), KEY)
    for elsewhere in (0, 6, 8, 2**64 - 1):
        with pytest.raises(HmacError, match=f"frame {elsewhere} on this connection"):
            verify(replace(_raw(sealed), number=elsewhere), KEY)


@pytest.mark.parametrize("old", [2, 3])
def test_older_peers_are_refused_at_the_first_frame(old: int) -> None:
    """A v2 peer's tags would not verify under v3's numbering, and a v3 MANIFEST has no checksum
    of its first-token record (v4): say so at the prefix instead."""
    assert VERSION == 4
    with pytest.raises(ProtocolError, match=f"unsupported protocol version {old}"):
        parse_prefix(PREFIX.pack(MAGIC, old, FrameType.HELLO, 0, 17, 0), MAX_PAYLOAD)


def test_wrong_key_fails_hmac_s3() -> None:
    with pytest.raises(HmacError):
        verify(_raw(seal(KEY, Ack(1, 1))), b"another key of 32 bytes........")


def test_prefix_bounds_reject_before_allocating() -> None:
    huge_header = PREFIX.pack(MAGIC, VERSION, FrameType.CHUNK, 0, MAX_HEADER_BYTES[FrameType.CHUNK] + 1, 0)
    huge_payload = PREFIX.pack(MAGIC, VERSION, FrameType.CHUNK, 0, 10, MAX_PAYLOAD + 17)
    payload_on_ack = PREFIX.pack(MAGIC, VERSION, FrameType.ACK, 0, 10, 1)
    encrypted_abort = PREFIX.pack(MAGIC, VERSION, FrameType.ABORT, 1, 10, 0)
    for bad, message in ((b"HTTP/1.1 200 OK\r\n", "bad magic"), (huge_header, "header length"),
                         (huge_payload, "payload length"), (payload_on_ack, "payload length"),
                         (encrypted_abort, "flags"),
                         (PREFIX.pack(MAGIC, 1, 1, 0, 10, 0), "version"),
                         (PREFIX.pack(MAGIC, VERSION, 99, 0, 10, 0), "frame type")):  # fmt: skip
        with pytest.raises(ProtocolError, match=message):
            parse_prefix(bad[: PREFIX.size], MAX_PAYLOAD)


def test_lying_page_count_is_a_protocol_error() -> None:
    sealed = bytearray(seal(None, Manifest("r", 1, 1, (1,), (1,))))
    # page count sits after rid(2) + count(4) + total(8) + checksum(16) in the header
    sealed[PREFIX.size + 2 + 28 : PREFIX.size + 2 + 32] = (10**6).to_bytes(4, "little")
    with pytest.raises(ProtocolError, match="page count"):
        decode(_raw(bytes(sealed)))


# -- tickets (S9) ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _issue(authority: TicketAuthority, ttl_s: float = 10.0):  # type: ignore[no-untyped-def]
    return authority.issue("cmpl-1", ("10.0.0.7", 9000), 42, NONCE, 30, (3, 4), (7, 8), ttl_s)


def test_ticket_round_trips_and_binds_every_field() -> None:
    clock = Clock()
    authority = TicketAuthority(RevisionKeys.derive(KEY).ticket, clock)
    ticket = _issue(authority)
    again = authority.verify_text(ticket.text)
    assert again == ticket and again.address == ("10.0.0.7", 9000) and again.epoch == 42
    for offset in range(len(ticket.blob)):  # every byte, the MAC included, is covered
        forged = bytearray(ticket.blob)
        forged[offset] ^= 0x01
        with pytest.raises(TicketError):
            authority.verify(bytes(forged))


def test_ticket_from_another_revision_or_purpose_is_refused() -> None:
    keys = RevisionKeys.derive(KEY)
    ticket = _issue(TicketAuthority(RevisionKeys.derive(b"another revision key....").ticket))
    with pytest.raises(TicketError) as caught:
        TicketAuthority(keys.ticket).verify(ticket.blob)
    assert caught.value.reason == "bad_mac"
    with pytest.raises(TicketError):  # a MAC made with the control-API key is not a ticket MAC
        TicketAuthority(keys.control).verify(_issue(TicketAuthority(keys.ticket)).blob)


def test_ticket_expires_after_its_lifetime_plus_the_skew_bound() -> None:
    clock = Clock()
    authority = TicketAuthority(b"k" * 32, clock)
    ticket = _issue(authority, ttl_s=5.0)
    clock.now += 5.0 + 29.0
    authority.verify(ticket.blob)
    clock.now += 2.0
    with pytest.raises(TicketError) as caught:
        authority.verify(ticket.blob)
    assert caught.value.reason == "expired"
    assert authority.authenticate(ticket.blob) == ticket  # authentic, only late
    with pytest.raises(TicketError, match="not base64"):
        authority.verify_text("not base64 at all!")


# -- AES-GCM -------------------------------------------------------------------------------------


def test_payload_cipher_binds_header_and_position() -> None:
    cipher = PayloadCipher(b"c" * 32)
    sealed = cipher.seal(FrameType.CHUNK, 3, b"head", b"secret kv bytes")
    assert b"secret" not in sealed and len(sealed) == len(b"secret kv bytes") + 16
    assert cipher.open(FrameType.CHUNK, 3, b"head", sealed) == b"secret kv bytes"
    for kind, seq, head in ((FrameType.CHUNK, 4, b"head"), (FrameType.MANIFEST, 3, b"head"), (FrameType.CHUNK, 3, b"hea")):
        with pytest.raises(DecryptError):
            cipher.open(kind, seq, head, sealed)
    with pytest.raises(DecryptError):
        PayloadCipher(b"d" * 32).open(FrameType.CHUNK, 3, b"head", sealed)


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


def test_plan_tracker_names_the_ticket_pages_in_order() -> None:
    plan = PlanTracker([3, 4], [7, 8])
    assert plan.is_plan((3, 4), (7, 8))
    assert not plan.is_plan((4, 3), (8, 7)) and not plan.is_plan((3, 4), (7, 9)) and not plan.is_plan((3,), (7,))


async def test_a_handshake_refuses_another_frame_type_from_its_prefix_s9() -> None:
    """Before the HELLO is verified nothing about the peer is known: a CHUNK prefix declaring a
    64 MiB payload is refused from its 16 bytes, not buffered first (16 such connections once held
    1.4 GB on decode for the handshake's 2 s)."""
    import asyncio

    from kvguard.workers.transfer.channel import FrameReader

    source = asyncio.StreamReader()
    source.feed_data(PREFIX.pack(MAGIC, VERSION, FrameType.CHUNK, 0, 10, 64 << 20))  # the payload never comes
    with pytest.raises(ProtocolError, match="expected HELLO, got CHUNK"):
        await asyncio.wait_for(FrameReader(source, 64 << 20).read(expect=FrameType.HELLO), timeout=10)
