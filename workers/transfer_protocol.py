"""KV transfer wire format and per-request plan checking: pure logic, no I/O.

Prefill sends KV page payloads to decode over TCP; decode answers with credit (ACK) and a terminal
verdict (RESULT). Every frame in either direction has the same layout (little-endian)::

    | offset   | bytes | field                                                            |
    | -------- | ----- | ---------------------------------------------------------------- |
    | 0        | 4     | magic ``b"KVGT"`` (garbage on the port is detected at once)      |
    | 4        | 1     | version (1)                                                      |
    | 5        | 1     | frame type: 1 CHUNK, 2 MANIFEST, 3 ABORT, 4 ACK, 5 RESULT        |
    | 6        | 2     | flags (0; reserved)                                              |
    | 8        | 4     | header length H (bounded per type, see ``MAX_HEADER_BYTES``)     |
    | 12       | 4     | payload length P (CHUNK only, <= max_payload_bytes; else 0)      |
    | 16       | H     | type-specific header (below)                                     |
    | 16+H     | 32    | HMAC-SHA256(shared key, bytes[0 : 16+H]) -- prefix and header    |
    | 48+H     | P     | payload (opaque KV page bytes)                                   |

Type-specific headers. ``rid`` is the request id: u8 length (1..128) + UTF-8 bytes; ``text`` is
u16 length (<= 1024) + UTF-8 bytes; ``pages`` is u32 count N, N x u32 page ids, N x i64
generations (the generations decode granted for those pages at bootstrap)::

    CHUNK    (prefill->decode)  rid | u32 seq | 16 B xxh3_128(payload) | pages
    MANIFEST (prefill->decode)  rid | u32 chunk count | u64 total payload bytes | pages (all sent)
                                | i64 first token (sampled by prefill; -1 when none)
    ABORT    (prefill->decode)  rid | text reason
    ACK      (decode->prefill)  rid | u32 seq | u32 payload bytes credited back (coalesced: all
                                chunks consumed on this connection since the last ACK; rid/seq
                                name the last of them)
    RESULT   (decode->prefill)  rid | u8 ok | text reason code | text detail

The HMAC covers the header, and the header holds the payload's checksum, so a payload altered in
flight fails the checksum and a header altered in flight fails the HMAC (S3). xxh3 is not a
cryptographic hash: it detects corruption, not a deliberate on-path forgery of the payload; the
deployment's NetworkPolicy (only prefill reaches decode's transfer port) and TLS, if required,
cover that. Lengths are checked against fixed bounds *before* anything is allocated, so a
malicious length field cannot make a worker allocate gigabytes.
"""

from __future__ import annotations

import enum
import functools
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVGT"
VERSION = 1
PREFIX = struct.Struct("<4sBBHII")
TAG_BYTES = 32
CHECKSUM_BYTES = 16
MAX_REQUEST_ID_BYTES = 128
MAX_TEXT_BYTES = 1024
DEFAULT_MAX_PAYLOAD_BYTES = 64 << 20
_NO_TAG = bytes(TAG_BYTES)

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class FrameType(enum.IntEnum):
    CHUNK = 1
    MANIFEST = 2
    ABORT = 3
    ACK = 4
    RESULT = 5


MAX_HEADER_BYTES: dict[FrameType, int] = {
    FrameType.CHUNK: 64 << 10,  # ~5,400 pages per chunk
    FrameType.MANIFEST: 8 << 20,  # ~700,000 pages: a 1M-token context at page size 2
    FrameType.ABORT: 2 << 10,
    FrameType.ACK: 1 << 10,
    FrameType.RESULT: 4 << 10,
}


class ProtocolError(Exception):
    """The byte stream cannot be trusted any more; the connection must be closed."""


class HmacError(ProtocolError):
    """A frame's header HMAC did not verify (wrong key, tampering or corruption)."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    request_id: str
    seq: int
    checksum: bytes
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    request_id: str
    chunk_count: int
    total_bytes: int
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    first_token: int = -1  # authenticated with the rest: decode continues from it


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Ack:
    request_id: str
    seq: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    ok: bool
    reason: str
    detail: str


Frame = ChunkHeader | Manifest | Abort | Ack | Result
_TYPE_OF: dict[type, FrameType] = {
    ChunkHeader: FrameType.CHUNK,
    Manifest: FrameType.MANIFEST,
    Abort: FrameType.ABORT,
    Ack: FrameType.ACK,
    Result: FrameType.RESULT,
}


def payload_checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def validate_request_id(request_id: str) -> bytes:
    raw = request_id.encode("utf-8")
    if not 1 <= len(raw) <= MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


# ---------------------------------------------------------------------------------------------
# Encoding


def _rid(request_id: str) -> bytes:
    raw = validate_request_id(request_id)
    return _U8.pack(len(raw)) + raw


def _text(text: str) -> bytes:
    raw = text.encode("utf-8")[:MAX_TEXT_BYTES]
    # Truncation may split a multi-byte character; drop the partial tail so decode stays strict.
    raw = raw.decode("utf-8", errors="ignore").encode("utf-8")
    return _U16.pack(len(raw)) + raw


@functools.lru_cache(maxsize=256)
def _pages_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I{n}q")


def _pages(page_ids: Sequence[int], generations: Sequence[int]) -> bytes:
    n = len(page_ids)
    if len(generations) != n:
        raise ValueError(f"{n} page ids but {len(generations)} generations")
    try:
        return _U32.pack(n) + _pages_struct(n).pack(*page_ids, *generations)
    except struct.error as exc:
        raise ValueError(f"page id or generation out of range: {exc}") from None


def encode_header(frame: Frame) -> bytes:
    match frame:
        case ChunkHeader():
            if len(frame.checksum) != CHECKSUM_BYTES:
                raise ValueError("checksum must be 16 bytes (xxh3_128)")
            return (
                _rid(frame.request_id) + _U32.pack(frame.seq) + frame.checksum
                + _pages(frame.page_ids, frame.generations)
            )
        case Manifest():
            return (
                _rid(frame.request_id) + _U32.pack(frame.chunk_count) + _U64.pack(frame.total_bytes)
                + _pages(frame.page_ids, frame.generations) + _I64.pack(frame.first_token)
            )
        case Abort():
            return _rid(frame.request_id) + _text(frame.reason)
        case Ack():
            return _rid(frame.request_id) + _U32.pack(frame.seq) + _U32.pack(frame.nbytes)
        case Result():
            return (
                _rid(frame.request_id) + _U8.pack(1 if frame.ok else 0)
                + _text(frame.reason) + _text(frame.detail)
            )
    raise TypeError(f"not a frame: {frame!r}")


def seal(key: bytes | None, frame: Frame, payload_len: int = 0) -> bytes:
    """Prefix + header + HMAC tag for ``frame``; the payload (if any) is written after it.

    ``key=None`` writes an all-zero tag: only for benchmarking integrity off (both ends agree).
    """
    ftype = _TYPE_OF[type(frame)]
    header = encode_header(frame)
    if len(header) > MAX_HEADER_BYTES[ftype]:
        raise ValueError(f"{ftype.name} header of {len(header)} bytes exceeds the bound")
    if payload_len and ftype is not FrameType.CHUNK:
        raise ValueError(f"{ftype.name} frames carry no payload")
    head = PREFIX.pack(MAGIC, VERSION, ftype, 0, len(header), payload_len) + header
    return head + (hmac.digest(key, head, "sha256") if key is not None else _NO_TAG)


# ---------------------------------------------------------------------------------------------
# Decoding


def parse_prefix(prefix: bytes, max_payload_bytes: int) -> tuple[FrameType, int, int]:
    """Check the fixed 16-byte prefix; return (type, header length, payload length)."""
    magic, version, ftype, flags, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a kvguard transfer stream")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if flags:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if not 1 <= header_len <= MAX_HEADER_BYTES[kind]:
        raise ProtocolError(f"{kind.name} header length {header_len} out of bounds")
    limit = max_payload_bytes if kind is FrameType.CHUNK else 0
    if payload_len > limit:
        raise ProtocolError(f"{kind.name} payload length {payload_len} exceeds {limit}")
    return kind, header_len, payload_len


def open_header(
    key: bytes | None, prefix: bytes, header_and_tag: bytes, kind: FrameType
) -> Frame:
    """Verify the HMAC over prefix+header, then decode the header. ``key=None`` skips the HMAC."""
    header, tag = header_and_tag[:-TAG_BYTES], header_and_tag[-TAG_BYTES:]
    if key is not None:
        expected = hmac.digest(key, prefix + header, "sha256")
        if not hmac.compare_digest(expected, tag):
            raise HmacError(f"{kind.name} frame failed HMAC verification")
    return _decode_header(kind, header)


class _Cursor:
    """Bounds-checked reader over a header; any overrun is a ProtocolError, never an IndexError."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError("header truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> int:
        return st.unpack(self.take(st.size))[0]

    def utf8(self, n: int) -> str:
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid UTF-8 in header") from None

    def rid(self) -> str:
        n = self.unpack(_U8)
        if not 1 <= n <= MAX_REQUEST_ID_BYTES:
            raise ProtocolError(f"request id length {n} out of bounds")
        return self.utf8(n)

    def text(self) -> str:
        n = self.unpack(_U16)
        if n > MAX_TEXT_BYTES:
            raise ProtocolError(f"text length {n} out of bounds")
        return self.utf8(n)

    def pages(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = self.unpack(_U32)
        if 12 * n > len(self.data) - self.pos:
            raise ProtocolError(f"page count {n} exceeds the header")
        values = _pages_struct(n).unpack(self.take(12 * n))
        return values[:n], values[n:]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing header bytes")


def _decode_header(kind: FrameType, header: bytes) -> Frame:
    cur = _Cursor(header)
    rid = cur.rid()
    frame: Frame
    if kind is FrameType.CHUNK:
        seq, checksum = cur.unpack(_U32), bytes(cur.take(CHECKSUM_BYTES))
        ids, gens = cur.pages()
        frame = ChunkHeader(rid, seq, checksum, ids, gens)
    elif kind is FrameType.MANIFEST:
        count, total = cur.unpack(_U32), cur.unpack(_U64)
        ids, gens = cur.pages()
        frame = Manifest(rid, count, total, ids, gens, cur.unpack(_I64))
    elif kind is FrameType.ABORT:
        frame = Abort(rid, cur.text())
    elif kind is FrameType.ACK:
        frame = Ack(rid, cur.unpack(_U32), cur.unpack(_U32))
    else:
        ok = cur.unpack(_U8)
        if ok not in (0, 1):
            raise ProtocolError(f"RESULT ok flag {ok}")
        frame = Result(rid, bool(ok), cur.text(), cur.text())
    cur.end()
    return frame


# ---------------------------------------------------------------------------------------------
# Receiver-side plan checking (class D in pd-bug-classes: accounting mismatches)


class PlanTracker:
    """What decode planned for one request versus what has arrived so far (S3).

    Chunks must carry only planned pages with their planned generations, each page once, with
    strictly increasing sequence numbers. The manifest must match what arrived, and what arrived
    must cover the whole plan: decode never reads a page this transfer did not write.
    """

    def __init__(self, page_ids: Sequence[int], generations: Sequence[int]) -> None:
        if len(page_ids) != len(generations):
            raise ValueError(f"{len(page_ids)} page ids but {len(generations)} generations")
        self.plan: dict[int, int] = dict(zip(page_ids, generations))
        if len(self.plan) != len(page_ids):
            raise ValueError("planned page ids must be unique")
        self.written: dict[int, int] = {}
        self.chunks = 0
        self.bytes = 0
        self.last_seq = -1

    def check_chunk(self, chunk: ChunkHeader) -> str | None:
        """Why this chunk does not fit the plan, or None if it does."""
        if chunk.seq <= self.last_seq:
            return f"chunk seq {chunk.seq} repeats or precedes seq {self.last_seq}"
        if not chunk.page_ids:
            return "chunk carries no pages"
        seen: set[int] = set()
        for page, gen in zip(chunk.page_ids, chunk.generations):
            planned = self.plan.get(page)
            if planned is None:
                return f"page {page} is not in the plan"
            if gen != planned:
                return f"page {page} generation {gen} != planned generation {planned}"
            if page in self.written or page in seen:
                return f"page {page} written twice"
            seen.add(page)
        return None

    def record(self, chunk: ChunkHeader, nbytes: int) -> None:
        self.last_seq = chunk.seq
        self.chunks += 1
        self.bytes += nbytes
        self.written.update(zip(chunk.page_ids, chunk.generations))

    def check_manifest(self, manifest: Manifest) -> str | None:
        """Why the manifest disagrees with what arrived or with the plan, or None."""
        listed = dict(zip(manifest.page_ids, manifest.generations))
        if len(listed) != len(manifest.page_ids):
            return "manifest lists a page twice"
        if manifest.chunk_count != self.chunks:
            return f"manifest lists {manifest.chunk_count} chunks, {self.chunks} arrived"
        if manifest.total_bytes != self.bytes:
            return f"manifest lists {manifest.total_bytes} bytes, {self.bytes} arrived"
        if listed != self.written:
            missing = sorted(set(listed) - set(self.written))[:8]
            return f"manifest pages differ from pages received (missing e.g. {missing})"
        if self.written != self.plan:
            missing = sorted(set(self.plan) - set(self.written))[:8]
            return f"planned pages never written (e.g. {missing})"
        return None
