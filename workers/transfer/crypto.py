"""AES-256-GCM for KV payloads (``kvTransfer.encryption: aes-gcm``), from the `cryptography` library.

Key: the request key's cipher half (workers/keys.py: HKDF of the revision key, the ticket nonce
and the connection id), so every request on every connection has its own key. IV (12 bytes): the
frame type (u32) and the CHUNK's sequence number (u64; 0 for the MANIFEST). The sender writes each
sequence number once per request, so an IV never repeats under a key. Associated data: the frame's
prefix and header, so a payload cannot be moved to another frame, request or position.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvguard.workers.transfer.wire import GCM_TAG_BYTES, FrameType

_IV = struct.Struct("<IQ")
assert _IV.size == 12

__all__ = ["GCM_TAG_BYTES", "DecryptError", "PayloadCipher"]


class DecryptError(Exception):
    """The payload's GCM tag did not verify: altered in flight, or not for this request."""


class PayloadCipher:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, kind: FrameType, seq: int, head: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
        """Ciphertext followed by the 16-byte tag (``len(plaintext) + GCM_TAG_BYTES`` bytes)."""
        return self._aead.encrypt(_IV.pack(kind, seq), plaintext, head)

    def open(self, kind: FrameType, seq: int, head: bytes, sealed: bytes | bytearray | memoryview) -> bytes:
        try:
            return self._aead.decrypt(_IV.pack(kind, seq), sealed, head)
        except InvalidTag:
            raise DecryptError(f"{kind.name} seq {seq}: payload failed AES-GCM authentication") from None
