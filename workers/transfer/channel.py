"""Frame I/O shared by both ends: reading raw frames, and sealing/opening one request's frames."""

from __future__ import annotations

import asyncio
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
    parse_prefix,
    payload_checksum,
    seal_parts,
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


async def read_raw(reader: FrameSource, max_payload: int) -> RawFrame | None:
    """Read one frame, unverified; None on a clean end of stream between frames. Raises
    ProtocolError. The payload may be a view into the reader's buffer, valid until the next read."""
    try:
        prefix = bytes(await reader.readexactly(PREFIX.size))
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("stream ended inside a frame prefix") from None
    kind, flags, header_len, payload_len = parse_prefix(prefix, max_payload)
    try:
        header_and_tag = bytes(await reader.readexactly(header_len + TAG_BYTES))
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("stream ended inside a frame") from None
    return RawFrame(kind, flags, prefix + header_and_tag[:-TAG_BYTES], header_and_tag[-TAG_BYTES:], payload)


def write_sealed(writer: FrameSink, head: bytes, tag: bytes, payload: bytes | memoryview = b"") -> None:
    """Queue one whole frame. Synchronous, so frames of concurrent requests never interleave."""
    if len(payload) < _JOIN_BELOW:
        writer.write(head + tag + payload if payload else head + tag)
    else:
        # Two writes instead of writelines(): 3.11's writelines joins, copying the payload.
        writer.write(head + tag)
        writer.write(payload)


def write_frame(writer: FrameSink, key: bytes | None, frame: Frame) -> None:
    """A frame without payload (HELLO, WELCOME, ACK, OPEN, ABORT, RESULT)."""
    write_sealed(writer, *seal_parts(key, frame))


class RequestCodec:
    """Seals and opens the frames of one request on one connection (its keys: workers/keys.py).

    ``keys=None``: integrity off (benchmark only) -- zero tags and checksums, nothing verified."""

    def __init__(self, keys: RequestKeys | None, encryption: Encryption = Encryption.NONE) -> None:
        self.mac = keys.mac if keys is not None else None
        self.cipher = PayloadCipher(keys.cipher) if keys is not None and encryption is Encryption.AES_GCM else None

    def write(self, writer: FrameSink, frame: Frame) -> None:
        write_frame(writer, self.mac, frame)

    def seal_chunk(self, request_id: str, seq: int, page_ids: tuple[int, ...], generations: tuple[int, ...],
                   payload: memoryview) -> tuple[bytes, bytes, bytes | memoryview]:
        """(head, tag, payload as it goes on the wire) of one CHUNK: checksummed, or encrypted."""
        if self.cipher is not None:
            header = ChunkHeader(request_id, seq, NO_CHECKSUM, page_ids, generations)
            head, tag = seal_parts(self.mac, header, len(payload) + GCM_TAG_BYTES, FLAG_ENCRYPTED)
            return head, tag, self.cipher.seal(FrameType.CHUNK, seq, head, payload)
        checksum = payload_checksum(payload) if self.mac is not None else NO_CHECKSUM
        head, tag = seal_parts(self.mac, ChunkHeader(request_id, seq, checksum, page_ids, generations), len(payload))
        return head, tag, payload

    def write_manifest(self, writer: FrameSink, manifest: Manifest) -> None:
        record = encode_first_token(manifest.first)
        if self.cipher is not None:
            head, tag = seal_parts(self.mac, manifest, len(record) + GCM_TAG_BYTES, FLAG_ENCRYPTED)
            write_sealed(writer, head, tag, self.cipher.seal(FrameType.MANIFEST, 0, head, record))
        else:
            write_sealed(writer, *seal_parts(self.mac, manifest, len(record)), record)

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


__all__ = ["DecryptError", "FrameSink", "FrameSource", "RequestCodec", "read_raw", "write_frame", "write_sealed"]
