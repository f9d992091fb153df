"""What sender and receiver share: their knobs and the terminal outcome of one transfer."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvguard.workers.transfer.wire import DEFAULT_MAX_PAYLOAD_BYTES, Encryption


@dataclass(frozen=True)
class TransferConfig:
    """Knobs shared by sender and receiver (both ends of a revision must agree on ``encryption``)."""

    max_transfer_batch: int = 16 << 20  # S6: bytes in flight per prefill->decode pair
    stall_timeout_s: float = 5.0  # no progress for this long ends the transfer, once OPEN (S4)
    # Decode: how long a request's granted pages wait for prefill's OPEN. Prefill opens only after
    # it has computed the prompt, and may queue first, so this is a bound on queue + compute (as
    # SGLang's decode-side waiting timeout), not a stall timeout; the router's --request-timeout
    # and its abort usually end such a request sooner (S4).
    open_timeout_s: float = 300.0
    connect_timeout_s: float = 2.0  # TCP connect and the HELLO/WELCOME handshake, each
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_connections_per_peer: int = 2
    remembered_per_connection: int = 1024  # finished requests whose late frames are still verified
    verify_integrity: bool = True  # False only for bench/transfer.py's cost measurement
    # Decode: the pages its pool holds. No ticket, chunk or manifest it accepts names more, so the
    # headers it reads before verifying them are bounded by it (wire.header_bound).
    max_pages: int | None = None
    # Decode: transfer connections at once (each holds a buffer and one header). Prefill pools
    # max_connections_per_peer to each decode; one past this bound makes another give way
    # (KVReceiver._make_room), never one carrying a transfer.
    max_inbound_connections: int = 256
    # Decode: connections still in their handshake (HELLO not yet verified); one past it makes
    # the oldest of them give way.
    max_handshaking_connections: int = 64
    encryption: Encryption = Encryption.NONE

    def __post_init__(self) -> None:
        if self.max_transfer_batch <= 0:
            raise ValueError("max_transfer_batch must be > 0 bytes")
        if min(self.stall_timeout_s, self.connect_timeout_s, self.open_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        if not 0 < self.max_payload_bytes <= 1 << 30:
            raise ValueError("max_payload_bytes must be in (0, 1 GiB]")
        if min(self.max_connections_per_peer, self.remembered_per_connection, self.max_inbound_connections,
               self.max_handshaking_connections) < 1:  # fmt: skip
            raise ValueError("max_connections_per_peer, remembered_per_connection, max_inbound_connections and "
                             "max_handshaking_connections must be >= 1")
        if self.encryption is not Encryption.NONE and not self.verify_integrity:
            raise ValueError("encryption needs integrity on (the request keys come with it)")


DEFAULT_CONFIG = TransferConfig()


class FailureReason(enum.StrEnum):
    CHECKSUM = "checksum"  # payload checksum or AES-GCM tag failed (S3)
    PLAN_MISMATCH = "plan_mismatch"
    MANIFEST_MISMATCH = "manifest_mismatch"
    STALE = "stale_lease"
    UNKNOWN_REQUEST = "unknown_request"
    TICKET = "ticket"  # forged, expired or foreign ticket; decode restarted; opened elsewhere (S9)
    PEER_ABORT = "peer_abort"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    CONNECTION_LOST = "connection_lost"
    PROTOCOL_ERROR = "protocol_error"
    SINK_ERROR = "sink_error"


@dataclass(frozen=True)
class TransferOutcome:
    """Terminal outcome of one request's transfer. ``ok`` means complete and verified (S3)."""

    request_id: str
    ok: bool
    reason: FailureReason | str | None = None
    detail: str = ""
    chunks: int = 0
    bytes: int = 0


def failure_reason(text: str) -> FailureReason | str:
    try:
        return FailureReason(text)
    except ValueError:
        return text
