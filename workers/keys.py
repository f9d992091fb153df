"""The revision key and the keys derived from it: one secret, one purpose per derived key (S9).

Every process of a revision (router, prefill, decode) reads the same secret from
``KVGUARD_TRANSFER_KEY`` (the revision's Secret on Kubernetes; generated per deployment by the
local launcher and backend). Nothing uses it directly: HKDF-SHA256 (RFC 5869, the `cryptography`
library) derives a key per purpose, so a MAC made for one purpose never verifies for another::

    control  = HKDF(K, info="kvguard/v1/control")           internal HTTP calls (control_auth)
    ticket   = HKDF(K, info="kvguard/v1/ticket")            transfer tickets (transfer.tickets)
    hello    = HKDF(K, info="kvguard/v1/hello")             HELLO / WELCOME frames
    conn     = HKDF(K, salt=conn_id, info="kvguard/v1/connection")          ACK frames
    request  = HKDF(K, salt=ticket_nonce || conn_id, info="kvguard/v1/request", 64 bytes)
               -> 32 B frame MAC key (OPEN, CHUNK, MANIFEST, ABORT, RESULT) + 32 B AES-256-GCM key

``conn_id`` is prefill's 16-byte HELLO nonce followed by decode's 16-byte WELCOME nonce, fresh per
connection; ``ticket_nonce`` is the 16 bytes decode drew for the request. A request's frames
therefore verify only on the connection that opened it and only for the ticket it was opened with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

TRANSFER_KEY_ENV = "KVGUARD_TRANSFER_KEY"
MIN_KEY_BYTES = 16
NONCE_BYTES = 16
MAC_KEY_BYTES = 32
# Router, prefill and decode compare wall clocks (control-call timestamps, ticket expiry): they
# may disagree by this much. NTP keeps pods within milliseconds; 30 s leaves room for a bad node.
MAX_CLOCK_SKEW_S = 30.0


def load_revision_key(environ: dict[str, str] | None = None) -> bytes:
    """The revision's shared secret: hex when it parses as hex, else the raw text (16+ bytes)."""
    value = (os.environ if environ is None else environ).get(TRANSFER_KEY_ENV, "")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{TRANSFER_KEY_ENV} must hold the revision's key ({MIN_KEY_BYTES}+ bytes)")
    return key


def _hkdf(key: bytes, info: bytes, salt: bytes | None = None, length: int = MAC_KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(key)


@dataclass(frozen=True)
class RequestKeys:
    """The keys of one request on one connection: frame MACs and (aes-gcm mode) the payload key."""

    mac: bytes
    cipher: bytes


@dataclass(frozen=True, eq=False)
class RevisionKeys:
    """The derived keys of one revision. ``repr`` never shows key material."""

    root: bytes
    control: bytes
    ticket: bytes
    hello: bytes

    @classmethod
    def derive(cls, root: bytes) -> RevisionKeys:
        if len(root) < MIN_KEY_BYTES:
            raise ValueError(f"the revision key must be at least {MIN_KEY_BYTES} bytes")
        return cls(
            root=root,
            control=_hkdf(root, b"kvguard/v1/control"),
            ticket=_hkdf(root, b"kvguard/v1/ticket"),
            hello=_hkdf(root, b"kvguard/v1/hello"),
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RevisionKeys:
        return cls.derive(load_revision_key(environ))

    def connection(self, conn_id: bytes) -> bytes:
        """MAC key of a connection's own frames (ACK)."""
        return _hkdf(self.root, b"kvguard/v1/connection", salt=conn_id)

    def request(self, ticket_nonce: bytes, conn_id: bytes) -> RequestKeys:
        """Keys of one request's frames on one connection (the ticket nonce bound into every MAC)."""
        material = _hkdf(self.root, b"kvguard/v1/request", salt=ticket_nonce + conn_id, length=2 * MAC_KEY_BYTES)
        return RequestKeys(mac=material[:MAC_KEY_BYTES], cipher=material[MAC_KEY_BYTES:])

    def __repr__(self) -> str:
        return "RevisionKeys(<redacted>)"
