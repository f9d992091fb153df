"""Frame I/O shared by both ends: each direction of a connection numbers its frames (wire v3:
`FrameWriter` and `FrameReader` are the only way frames are written and read), and
`RequestCodec` seals and opens one request's frames."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from kvguard.workers.keys import RequestKeys
from kvguard.workers.transfer.crypto import DecryptError, PayloadCipher
from kvguard.workers.transfer.wire import (
    FLAG_ENCRYPTED,
    GCM_TAG_BYTES,
    NO_CHECKSUM,
    PREFIX,
    TAG_BYTES,
    ChunkHeader,
    Encryption,
    FirstToken,
    Frame,
    FrameType,
    Manifest,
    ProtocolError,
    RawFrame,
    decode_first_token,
    encode_first_token,
    encode_head,
    frame_tag,
    parse_prefix,
    payload_checksum,
    verify,
)

_JOIN_BELOW = 64 << 10  # payloads smaller than this go out in one write() with their header


class FrameSource(Protocol):
    """asyncio.StreamReader (prefill reads replies) or BufferedStreamReader (decode reads KV)."""

    async def readexactly(self, n: int) -> bytes | memoryview: ...


class FrameSink(Protocol):
    """asyncio.StreamWriter or stream_buffer.TransportWriter."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def drain(self) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...

    @property
    def transport(self) -> asyncio.WriteTransport: ...


class FrameReader:
    """The receiving direction of one connection: counts the frames it reads, so each is verified
    as the frame of that number (a replayed or injected one then fails its HMAC).

    A frame is read in two steps, head (prefix, header, tag) then payload, so that its tag -- which
    covers the head only -- is checked before a byte of a payload of up to 64 MiB is buffered
    (`read_head`, verify, `read_payload`): a peer without the request's key (one that replayed a
    captured HELLO, which any connection can) cannot make decode hold more than one bounded
    header per connection. Once a frame has begun, the rest of it must arrive within
    `frame_timeout_s` (an idle connection between frames may wait: prefill pools them)."""

    def __init__(self, source: FrameSource, max_payload: int, frame_timeout_s: float | None = None,
                 max_pages: int | None = None) -> None:  # fmt: skip
        self.source = source
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self.max_pages = max_pages  # bounds the headers read before they verify (wire.header_bound)
        self.received = 0

    async def read(self, expect: FrameType | None = None) -> RawFrame | None:
        """The next frame whole, unverified; None on a clean end of stream between frames."""
        raw = await self.read_head(expect)
        return None if raw is None else await self.read_payload(raw)

    async def read_head(self, expect: FrameType | None = None) -> RawFrame | None:
        """The next frame's head and tag, unverified, its payload not yet read (`read_payload`);
        None on a clean end of stream between frames. Raises ProtocolError (also for a frame that
        stops half-way for `frame_timeout_s`). `expect`: the only type allowed here (a handshake), refused
        from its 16-byte prefix, before its header is read."""
        try:
            first = await self.source.readexactly(1)
        except asyncio.IncompleteReadError:
            return None
        try:
            async with asyncio.timeout(self.frame_timeout_s):
                prefix = bytes(first) + bytes(await self.source.readexactly(PREFIX.size - 1))
                kind, flags, header_len, payload_len = parse_prefix(prefix, self.max_payload, self.max_pages)
                if expect is not None and kind is not expect:
                    raise ProtocolError(f"expected {expect.name}, got {kind.name}")
                header_and_tag = bytes(await self.source.readexactly(header_len + TAG_BYTES))
        except asyncio.IncompleteReadError:
            raise ProtocolError("stream ended inside a frame") from None
        except TimeoutError:
            raise ProtocolError(f"a frame's head stopped half-way for {self.frame_timeout_s:g}s") from None
        number, self.received = self.received, self.received + 1
        return RawFrame(kind, flags, prefix + header_and_tag[:-TAG_BYTES], header_and_tag[-TAG_BYTES:], b"", number, payload_len)

    async def read_payload(self, raw: RawFrame) -> RawFrame:
        """`raw` with its payload, which may be a view into the source's buffer, valid until the
        next read."""
        if not raw.payload_len:
            return raw
        try:
            async with asyncio.timeout(self.frame_timeout_s):
                payload = await self.source.readexactly(raw.payload_len)
        except asyncio.IncompleteReadError:
            raise ProtocolError("stream ended inside a frame") from None
        except TimeoutError:
            raise ProtocolError(f"a {raw.kind.name} payload stopped half-way for {self.frame_timeout_s:g}s") from None
        return dataclasses.replace(raw, payload=payload)


class FrameWriter:
    """The sending direction of one connection: numbers each frame as it is written, and MACs the
    number with it. Tags are made here, at write time, because frames of concurrent requests are
    sealed in one order and may be written in another (a chunk waits for credit)."""

    def __init__(self, sink: FrameSink) -> None:
        self.sink = sink
        self.sent = 0

    def send(self, key: bytes | None, head: bytes, payload: bytes | memoryview = b"") -> None:
        """Queue one whole frame. Synchronous, so frames of concurrent requests never interleave."""
        tag = frame_tag(key, self.sent, head)
        self.sent += 1
        if len(payload) < _JOIN_BELOW:
            self.sink.write(head + tag + payload if payload else head + tag)
        else:
            # Two writes instead of writelines(): 3.11's writelines joins, copying the payload.
            self.sink.write(head + tag)
            self.sink.write(payload)

    def send_frame(self, key: bytes | None, frame: Frame) -> None:
        """A frame without payload (HELLO, WELCOME, ACK, OPEN, ABORT, RESULT)."""
        self.send(key, encode_head(frame))

    async def drain(self) -> None:
        await self.sink.drain()

    def buffered(self) -> int:
        """Bytes queued and not yet taken by the kernel."""
        return self.sink.transport.get_write_buffer_size()

    def is_closing(self) -> bool:
        return self.sink.is_closing()

    def close(self) -> None:
        self.sink.close()


class RequestCodec:
    """Seals and opens the frames of one request on one connection (its keys: workers/keys.py).

    ``keys=None``: integrity off (benchmark only) -- zero tags and checksums, nothing verified."""

    def __init__(self, keys: RequestKeys | None, encryption: Encryption = Encryption.NONE) -> None:
        self.mac = keys.mac if keys is not None else None
        self.cipher = PayloadCipher(keys.cipher) if keys is not None and encryption is Encryption.AES_GCM else None

    def write(self, writer: FrameWriter, frame: Frame) -> None:
        writer.send_frame(self.mac, frame)

    def seal_chunk(self, request_id: str, seq: int, page_ids: tuple[int, ...], generations: tuple[int, ...],
                   payload: memoryview) -> tuple[bytes, bytes | memoryview]:
        """(head, payload as it goes on the wire) of one CHUNK, checksummed or encrypted, for
        `send` (which adds the tag)."""
        if self.cipher is not None:
            header = ChunkHeader(request_id, seq, NO_CHECKSUM, page_ids, generations)
            head = encode_head(header, len(payload) + GCM_TAG_BYTES, FLAG_ENCRYPTED)
            return head, self.cipher.seal(FrameType.CHUNK, seq, head, payload)
        checksum = payload_checksum(payload) if self.mac is not None else NO_CHECKSUM
        return encode_head(ChunkHeader(request_id, seq, checksum, page_ids, generations), len(payload)), payload

    def send(self, writer: FrameWriter, head: bytes, payload: bytes | memoryview) -> None:
        """Write a frame sealed by `seal_chunk`."""
        writer.send(self.mac, head, payload)

    def write_manifest(self, writer: FrameWriter, manifest: Manifest) -> None:
        record = encode_first_token(manifest.first)
        if self.cipher is not None:
            head = encode_head(manifest, len(record) + GCM_TAG_BYTES, FLAG_ENCRYPTED)
            writer.send(self.mac, head, self.cipher.seal(FrameType.MANIFEST, 0, head, record))
        else:  # the record's checksum in the MAC'd header, as a CHUNK's (S3)
            manifest = dataclasses.replace(manifest, checksum=payload_checksum(record))
            writer.send(self.mac, encode_head(manifest, len(record)), record)

    def verify(self, raw: RawFrame) -> None:
        verify(raw, self.mac)

    def chunk_payload(self, raw: RawFrame, header: ChunkHeader) -> bytes | memoryview:
        """The plaintext of a verified CHUNK. DecryptError if its GCM tag fails."""
        self._check_mode(raw)
        if self.cipher is None:
            return raw.payload
        return self.cipher.open(FrameType.CHUNK, header.seq, raw.head, raw.payload)

    def first_token(self, raw: RawFrame) -> FirstToken | None:
        """The first-token record of a verified MANIFEST. DecryptError / ProtocolError if bad."""
        self._check_mode(raw)
        record = raw.payload if self.cipher is None else self.cipher.open(FrameType.MANIFEST, 0, raw.head, raw.payload)
        return decode_first_token(record)

    def _check_mode(self, raw: RawFrame) -> None:
        if raw.encrypted != (self.cipher is not None):
            raise ProtocolError(f"{raw.kind.name} is {'' if raw.encrypted else 'not '}encrypted, unlike this transfer")


__all__ = ["DecryptError", "FrameReader", "FrameSink", "FrameSource", "FrameWriter", "RequestCodec"]
