"""KV transfer wire format (version 4): pure encoding and decoding, no I/O.

Every frame in either direction has the same layout (little-endian)::

    | offset | bytes | field                                                                  |
    | ------ | ----- | ---------------------------------------------------------------------- |
    | 0      | 4     | magic ``b"KVGT"`` (garbage on the port is detected at once)            |
    | 4      | 1     | version (4)                                                            |
    | 5      | 1     | frame type (``FrameType``)                                             |
    | 6      | 2     | flags: bit 0 ENCRYPTED (CHUNK/MANIFEST payload is AES-GCM), rest 0     |
    | 8      | 4     | header length H (bounded per type, ``MAX_HEADER_BYTES``)               |
    | 12     | 4     | payload length P (CHUNK, MANIFEST only; bounded; else 0)               |
    | 16     | H     | type-specific header (below)                                           |
    | 16+H   | 32    | HMAC-SHA256(frame key, u64 frame number + bytes[0 : 16+H])             |
    | 48+H   | P     | payload                                                                |

Frame numbers (new in version 3). Every frame is numbered by its place in its direction of its
connection: 0 is HELLO (prefill->decode) and WELCOME (decode->prefill), then 1, 2, ... The number
is not sent -- both ends count -- but the HMAC covers it, so a frame replayed, dropped, reordered
or injected on the same connection fails verification and the connection closes. Version 2 tags
covered the bytes alone: a frame copied back into its own connection verified again, and an
on-path injector could earn transfer credit with it (S6; formal/README.md, ONPATH).

The frame key depends on the type (workers/keys.py): HELLO/WELCOME use the revision's hello key;
ACK the connection key; OPEN, CHUNK, MANIFEST, ABORT and RESULT the request key, derived from the
ticket nonce and the connection id, so they verify only for that ticket on that connection.

Type-specific headers. ``rid`` is u8 length (1..128) + UTF-8; ``text`` is u16 length (<= 1024) +
UTF-8; ``pages`` is u32 count N, N x u32 page ids, N x i64 generations; ``nonce`` is 16 bytes::

    HELLO    (prefill->decode) nonce_p | u8 encryption        first frame on a connection
    WELCOME  (decode->prefill) nonce_p | nonce_d | u64 epoch | u8 encryption   the reply
    OPEN     (prefill->decode) rid | u32 length + ticket (transfer/tickets.py, router-MAC'd)
    CHUNK    (prefill->decode) rid | u32 seq | 16 B checksum | pages        payload: KV bytes
    MANIFEST (prefill->decode) rid | u32 chunk count | u64 total bytes | 16 B checksum | pages (all sent)
                               payload: the first-token record (``FirstToken``), possibly empty
    ABORT    (prefill->decode) rid | text reason
    ACK      (decode->prefill) u64 ack number (1, 2, ... per connection) | u32 bytes credited
    RESULT   (decode->prefill) rid | u8 ok | text reason code | text detail

Integrity (S3): the HMAC covers the header, and a CHUNK or MANIFEST header holds the payload's
xxh3-128 (version 4: a MANIFEST's first-token record was covered by neither, so an on-path writer
could choose a request's first token, and so its whole answer, without encryption), so an altered
payload fails the checksum and an altered header fails the HMAC. With encryption the
checksum field is zero (a plaintext hash would leak) and the AES-GCM tag, over the payload with the
prefix and header as associated data, authenticates the payload instead. Lengths are checked
against fixed bounds *before* anything is allocated.
"""

from __future__ import annotations

import enum
import functools
import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVGT"
VERSION = 4
PREFIX = struct.Struct("<4sBBHII")
TAG_BYTES = 32
CHECKSUM_BYTES = 16
NONCE_BYTES = 16
GCM_TAG_BYTES = 16
MAX_REQUEST_ID_BYTES = 128
MAX_TEXT_BYTES = 1024
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_PAYLOAD_BYTES = 64 << 20
FLAG_ENCRYPTED = 1
_NO_TAG = bytes(TAG_BYTES)
NO_CHECKSUM = bytes(CHECKSUM_BYTES)

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")


class FrameType(enum.IntEnum):
    """The one authoritative list of transfer messages (the model of the protocol uses these)."""

    HELLO = 1
    WELCOME = 2
    OPEN = 3
    CHUNK = 4
    MANIFEST = 5
    ABORT = 6
    ACK = 7
    RESULT = 8


class Encryption(enum.StrEnum):
    """``kvTransfer.encryption`` / ``--transfer-encryption``: what protects KV payloads in flight."""

    NONE = "none"  # integrity only (HMAC + checksum): KV crosses the network readable
    AES_GCM = "aes-gcm"  # payloads encrypted with a per-request AES-256-GCM key

    @property
    def code(self) -> int:
        return _ENCRYPTION_CODES[self]


_ENCRYPTION_CODES = {Encryption.NONE: 0, Encryption.AES_GCM: 1}
_ENCRYPTION_OF_CODE = {v: k for k, v in _ENCRYPTION_CODES.items()}

# Frames whose header starts with a request id and that are MAC'd with the request key.
REQUEST_FRAMES = frozenset({FrameType.OPEN, FrameType.CHUNK, FrameType.MANIFEST, FrameType.ABORT, FrameType.RESULT})
_PAYLOAD_FRAMES = frozenset({FrameType.CHUNK, FrameType.MANIFEST})

MAX_HEADER_BYTES: dict[FrameType, int] = {
    FrameType.HELLO: 64,
    FrameType.WELCOME: 64,
    FrameType.OPEN: 9 << 20,  # a ticket with ~700,000 pages: a 1M-token context at page size 2
    FrameType.CHUNK: 64 << 10,  # ~5,400 pages per chunk
    FrameType.MANIFEST: 9 << 20,
    FrameType.ABORT: 2 << 10,
    FrameType.ACK: 64,
    FrameType.RESULT: 4 << 10,
}
MAX_FIRST_TOKEN_BYTES = 8 + 1 + 8 + 1 + MAX_TOP_LOGPROBS * 12
MAX_MANIFEST_PAYLOAD = MAX_FIRST_TOKEN_BYTES + GCM_TAG_BYTES


class ProtocolError(Exception):
    """The byte stream cannot be trusted any more; the connection must be closed."""


class HmacError(ProtocolError):
    """A frame's header HMAC did not verify (wrong key, wrong connection or ticket, tampering)."""


# ---------------------------------------------------------------------------------------------
# Frames


@dataclass(frozen=True, slots=True)
class Hello:
    nonce: bytes  # prefill's connection nonce
    encryption: Encryption


@dataclass(frozen=True, slots=True)
class Welcome:
    client_nonce: bytes  # echo of HELLO's nonce: this WELCOME is fresh
    nonce: bytes  # decode's connection nonce
    epoch: int  # decode's boot epoch: a ticket from another boot is refused at once
    encryption: Encryption

    @property
    def conn_id(self) -> bytes:
        return self.client_nonce + self.nonce


@dataclass(frozen=True, slots=True)
class Open:
    request_id: str
    ticket: bytes  # the encoded ticket, verbatim as the router issued it


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    request_id: str
    seq: int
    checksum: bytes
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token prefill sampled, with its log-probability data when the engine produced it."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), at most MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        if not 0 <= self.token_id < 1 << 32:
            raise ValueError(f"first token id {self.token_id} out of range")
        if len(self.top) > MAX_TOP_LOGPROBS:
            raise ValueError(f"at most {MAX_TOP_LOGPROBS} top logprobs, got {len(self.top)}")
        for value in [self.logprob, *(lp for _, lp in self.top)]:
            if value is not None and math.isnan(value):
                raise ValueError("a logprob is NaN")


@dataclass(frozen=True, slots=True)
class Manifest:
    request_id: str
    chunk_count: int
    total_bytes: int
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    first: FirstToken | None = None  # carried as the payload, authenticated with the rest
    checksum: bytes = NO_CHECKSUM  # the payload's xxh3-128 (zero when encrypted: the GCM tag covers it)


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Ack:
    number: int  # 1, 2, ... per connection: a replayed ACK is a protocol error
    nbytes: int


@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    ok: bool
    reason: str
    detail: str


Frame = Hello | Welcome | Open | ChunkHeader | Manifest | Abort | Ack | Result
_TYPE_OF: dict[type, FrameType] = {
    Hello: FrameType.HELLO, Welcome: FrameType.WELCOME, Open: FrameType.OPEN, ChunkHeader: FrameType.CHUNK,
    Manifest: FrameType.MANIFEST, Abort: FrameType.ABORT, Ack: FrameType.ACK, Result: FrameType.RESULT,
}  # fmt: skip


def frame_type(frame: Frame) -> FrameType:
    return _TYPE_OF[type(frame)]


def payload_checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def validate_request_id(request_id: str) -> bytes:
    raw = request_id.encode("utf-8")
    if not 1 <= len(raw) <= MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_rid(request_id: str) -> bytes:
    raw = validate_request_id(request_id)
    return U8.pack(len(raw)) + raw


def encode_text(text: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    raw = text.encode("utf-8")[:limit]
    # Truncation may split a multi-byte character; drop the partial tail so decode stays strict.
    raw = raw.decode("utf-8", errors="ignore").encode("utf-8")
    return U16.pack(len(raw)) + raw


@functools.lru_cache(maxsize=256)
def _pages_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I{n}q")


def encode_pages(page_ids: Sequence[int], generations: Sequence[int]) -> bytes:
    n = len(page_ids)
    if len(generations) != n:
        raise ValueError(f"{n} page ids but {len(generations)} generations")
    try:
        return U32.pack(n) + _pages_struct(n).pack(*page_ids, *generations)
    except struct.error as exc:
        raise ValueError(f"page id or generation out of range: {exc}") from None


def _nonce(value: bytes) -> bytes:
    if len(value) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(value)}")
    return value


def encode_header(frame: Frame) -> bytes:
    match frame:
        case Hello():
            return _nonce(frame.nonce) + U8.pack(frame.encryption.code)
        case Welcome():
            return _nonce(frame.client_nonce) + _nonce(frame.nonce) + U64.pack(frame.epoch) + U8.pack(frame.encryption.code)
        case Open():
            return encode_rid(frame.request_id) + U32.pack(len(frame.ticket)) + frame.ticket
        case ChunkHeader():
            if len(frame.checksum) != CHECKSUM_BYTES:
                raise ValueError("checksum must be 16 bytes (xxh3_128)")
            return (
                encode_rid(frame.request_id) + U32.pack(frame.seq) + frame.checksum
                + encode_pages(frame.page_ids, frame.generations)
            )  # fmt: skip
        case Manifest():
            if len(frame.checksum) != CHECKSUM_BYTES:
                raise ValueError("checksum must be 16 bytes (xxh3_128)")
            return (
                encode_rid(frame.request_id) + U32.pack(frame.chunk_count) + U64.pack(frame.total_bytes)
                + frame.checksum + encode_pages(frame.page_ids, frame.generations)
            )  # fmt: skip
        case Abort():
            return encode_rid(frame.request_id) + encode_text(frame.reason)
        case Ack():
            return U64.pack(frame.number) + U32.pack(frame.nbytes)
        case Result():
            return (
                encode_rid(frame.request_id) + U8.pack(1 if frame.ok else 0)
                + encode_text(frame.reason) + encode_text(frame.detail)
            )  # fmt: skip
    raise TypeError(f"not a frame: {frame!r}")


def encode_first_token(first: FirstToken | None) -> bytes:
    """The MANIFEST payload: empty when prefill sampled nothing."""
    if first is None:
        return b""
    out = [I64.pack(first.token_id), U8.pack(first.logprob is not None), F64.pack(first.logprob or 0.0)]
    out.append(U8.pack(len(first.top)))
    out += [U32.pack(token) + F64.pack(lp) for token, lp in first.top]
    return b"".join(out)


def encode_head(frame: Frame, payload_len: int = 0, flags: int = 0) -> bytes:
    """Prefix + header of ``frame``: what its tag covers, with its number (``frame_tag``)."""
    ftype = _TYPE_OF[type(frame)]
    header = encode_header(frame)
    if len(header) > MAX_HEADER_BYTES[ftype]:
        raise ValueError(f"{ftype.name} header of {len(header)} bytes exceeds the bound")
    if (payload_len or flags) and ftype not in _PAYLOAD_FRAMES:
        raise ValueError(f"{ftype.name} frames carry no payload")
    return PREFIX.pack(MAGIC, VERSION, ftype, flags, len(header), payload_len) + header


def frame_tag(key: bytes | None, number: int, head: bytes) -> bytes:
    """The HMAC of frame ``number`` of its direction of its connection, whose bytes are ``head``.

    ``key=None`` gives an all-zero tag: only for benchmarking integrity off (both ends agree).
    """
    return hmac.digest(key, U64.pack(number) + head, "sha256") if key is not None else _NO_TAG


def seal(key: bytes | None, frame: Frame, payload_len: int = 0, flags: int = 0, number: int = 0) -> bytes:
    """Head and tag of ``frame`` sent as frame ``number`` (the payload, if any, follows them)."""
    head = encode_head(frame, payload_len, flags)
    return head + frame_tag(key, number, head)


# ---------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True, slots=True)
class RawFrame:
    """A frame as read, not yet verified: which key verifies it depends on its type and rid."""

    kind: FrameType
    flags: int
    head: bytes  # prefix + header: what the HMAC (with `number`) and, encrypted, the GCM tag cover
    tag: bytes
    payload: bytes | memoryview
    number: int = 0  # its place on its connection, as the reader counted it (not sent: v3)
    payload_len: int = 0  # as its prefix says (the payload itself is read once its tag verified)

    @property
    def header(self) -> bytes:
        return self.head[PREFIX.size :]

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)


PAGE_LIST_SLACK_BYTES = 4096
"""What a page-listing header holds besides its pages (rid, counts, checksum; a ticket's host,
nonce, times and MAC): the bound `header_bound` adds to 12 bytes a page."""


def header_bound(kind: FrameType, max_pages: int | None) -> int:
    """The largest header of `kind` a receiver reads before it can verify it: MAX_HEADER_BYTES,
    or, when the receiver knows its pool has at most `max_pages` pages (no ticket, chunk or
    manifest it accepts names more), what that many pages take. A 9 MiB OPEN head from a peer
    that only replayed a HELLO cost decode 9 MiB a connection (an outside probe)."""
    if max_pages is None or kind not in (FrameType.OPEN, FrameType.CHUNK, FrameType.MANIFEST):
        return MAX_HEADER_BYTES[kind]
    return min(MAX_HEADER_BYTES[kind], PAGE_LIST_SLACK_BYTES + (U32.size + I64.size) * max_pages)


def parse_prefix(prefix: bytes, max_payload_bytes: int, max_pages: int | None = None) -> tuple[FrameType, int, int, int]:
    """Check the fixed 16-byte prefix; return (type, flags, header length, payload length)."""
    magic, version, ftype, flags, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a kvguard transfer stream")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if flags & ~FLAG_ENCRYPTED or (flags and kind not in _PAYLOAD_FRAMES):
        raise ProtocolError(f"flags {flags:#x} not allowed on {kind.name}")
    if not 1 <= header_len <= header_bound(kind, max_pages):
        raise ProtocolError(f"{kind.name} header length {header_len} out of bounds")
    limit = {FrameType.CHUNK: max_payload_bytes + GCM_TAG_BYTES, FrameType.MANIFEST: MAX_MANIFEST_PAYLOAD}.get(kind, 0)
    if payload_len > limit:
        raise ProtocolError(f"{kind.name} payload length {payload_len} exceeds {limit}")
    return kind, flags, header_len, payload_len


def verify(raw: RawFrame, key: bytes | None) -> None:
    """Check the HMAC over the frame's number and its prefix+header with ``key`` (None: integrity
    off, nothing checked). A frame that is authentic but out of its place on the connection
    (replayed, or one before it was dropped or injected) fails like a forged one."""
    if key is not None and not hmac.compare_digest(frame_tag(key, raw.number, raw.head), raw.tag):
        raise HmacError(f"{raw.kind.name} frame {raw.number} on this connection failed HMAC verification")


def decode(raw: RawFrame) -> Frame:
    """The header's fields, bounds-checked. Until ``verify`` passed nothing in them is trusted:
    the receiver reads only the request id (to pick the key) before verifying."""
    cur = Cursor(raw.header)
    frame: Frame
    kind = raw.kind
    if kind is FrameType.HELLO:
        frame = Hello(cur.nonce(), cur.encryption())
    elif kind is FrameType.WELCOME:
        frame = Welcome(cur.nonce(), cur.nonce(), cur.unpack(U64), cur.encryption())
    elif kind is FrameType.OPEN:
        rid = cur.rid()
        frame = Open(rid, bytes(cur.take(cur.unpack(U32))))
    elif kind is FrameType.CHUNK:
        rid = cur.rid()
        seq, checksum = cur.unpack(U32), bytes(cur.take(CHECKSUM_BYTES))
        ids, gens = cur.pages()
        frame = ChunkHeader(rid, seq, checksum, ids, gens)
    elif kind is FrameType.MANIFEST:
        rid = cur.rid()
        count, total, checksum = cur.unpack(U32), cur.unpack(U64), bytes(cur.take(CHECKSUM_BYTES))
        ids, gens = cur.pages()
        frame = Manifest(rid, count, total, ids, gens, checksum=checksum)
    elif kind is FrameType.ABORT:
        frame = Abort(cur.rid(), cur.text())
    elif kind is FrameType.ACK:
        frame = Ack(cur.unpack(U64), cur.unpack(U32))
    else:
        rid = cur.rid()
        ok = cur.unpack(U8)
        if ok not in (0, 1):
            raise ProtocolError(f"RESULT ok flag {ok}")
        frame = Result(rid, bool(ok), cur.text(), cur.text())
    cur.end()
    return frame


def decode_first_token(data: bytes | memoryview) -> FirstToken | None:
    if not len(data):
        return None
    cur = Cursor(bytes(data))
    token, has_logprob, logprob = cur.unpack(I64), cur.unpack(U8), cur.unpack(F64)
    n = cur.unpack(U8)
    if has_logprob not in (0, 1) or n > MAX_TOP_LOGPROBS:
        raise ProtocolError("malformed first-token record")
    top = tuple((cur.unpack(U32), cur.unpack(F64)) for _ in range(n))
    cur.end()
    try:
        return FirstToken(token, logprob if has_logprob else None, top)
    except ValueError as exc:
        raise ProtocolError(f"first-token record: {exc}") from None


class Cursor:
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
        n = self.unpack(U8)
        if not 1 <= n <= MAX_REQUEST_ID_BYTES:
            raise ProtocolError(f"request id length {n} out of bounds")
        return self.utf8(n)

    def text(self) -> str:
        n = self.unpack(U16)
        if n > MAX_TEXT_BYTES:
            raise ProtocolError(f"text length {n} out of bounds")
        return self.utf8(n)

    def nonce(self) -> bytes:
        return bytes(self.take(NONCE_BYTES))

    def encryption(self) -> Encryption:
        code = self.unpack(U8)
        if code not in _ENCRYPTION_OF_CODE:
            raise ProtocolError(f"unknown encryption mode {code}")
        return _ENCRYPTION_OF_CODE[code]

    def pages(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = self.unpack(U32)
        if 12 * n > len(self.data) - self.pos:
            raise ProtocolError(f"page count {n} exceeds the header")
        values = _pages_struct(n).unpack(self.take(12 * n))
        return values[:n], values[n:]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing header bytes")


