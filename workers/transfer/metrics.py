"""Transfer metrics and abort causes (the ``kvguard_*`` names are a contract: docs/monitoring.md)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvguard.workers.metrics import zeroed
from kvguard.workers.transfer.config import FailureReason, TransferOutcome
from kvguard.workers.transfer.tickets import TICKET_REJECTIONS

FRAME_DROP_REASONS = ("late", "unknown_request")  # kvguard_kv_transfer_frames_dropped_total{reason}


class AbortCause(enum.StrEnum):
    """Label values of ``kvguard_aborts_total{cause}``, shared by the servers and the router: a
    closed set, each created at 0 (`zeroed`). The router sends its cause with each abort, and the
    workers count it, so one failure reads the same on every role."""

    CLIENT_DISCONNECT = "client_disconnect"
    PREFILL_ERROR = "prefill_error"
    DECODE_ERROR = "decode_error"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    INTEGRITY = "integrity"
    STALE_LEASE = "stale_lease"
    PEER_ABORT = "peer_abort"
    WORKER_DIED = "worker_died"
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # prefill: no ticket (decode's pages) within --bootstrap-timeout
    TIMEOUT = "timeout"  # router: no first token, or no progress, within --request-timeout
    SIBLING_FAILED = "sibling_failed"  # router: another choice of the same request failed
    REJECTED = "rejected"  # router: a worker refused the request itself (a 400 past the router's own checks)


_CAUSE_OF_REASON = {
    FailureReason.CHECKSUM: AbortCause.INTEGRITY,
    FailureReason.PROTOCOL_ERROR: AbortCause.INTEGRITY,
    FailureReason.TIMEOUT: AbortCause.TRANSFER_TIMEOUT,
    FailureReason.STALE: AbortCause.STALE_LEASE,
    FailureReason.PEER_ABORT: AbortCause.PEER_ABORT,
    FailureReason.CONNECTION_LOST: AbortCause.WORKER_DIED,
}


def abort_cause(reason: FailureReason | str | None, detail: str | None = None) -> AbortCause:
    """The ``kvguard_aborts_total`` cause a server should count for a failed transfer.

    A peer that ended the transfer names why in its frame (prefill's ABORT, decode's cancelled
    RESULT: the router's cause, or its own): that cause is counted, from the closed set only, so a
    peer's text never becomes a label value. The router tells both workers why it ends a request,
    so a worker heard it from the router or first from its peer, and counted the router's cause or
    `peer_abort` / `transfer_failed` by which arrived first (a CI run under load; for a client's
    disconnect the second would page on-call)."""
    if reason in _ENDED_BY_PEER and detail in _ABORT_CAUSES:
        return AbortCause(detail)
    return _CAUSE_OF_REASON.get(reason, AbortCause.TRANSFER_FAILED)  # type: ignore[arg-type]


_ENDED_BY_PEER = frozenset({FailureReason.PEER_ABORT, FailureReason.CANCELLED})
_ABORT_CAUSES = frozenset(cause.value for cause in AbortCause)

_CAUSE_OF_CODE = {
    "kv_tag_violation": AbortCause.INTEGRITY,  # a stale read caught at read time (S1)
    "timeout": AbortCause.TIMEOUT,
    "request_timeout": AbortCause.TIMEOUT,
    "bootstrap_timeout": AbortCause.BOOTSTRAP_TIMEOUT,
    "worker_failed": AbortCause.WORKER_DIED,
}


def router_abort_cause(code: str | None, status: int, from_prefill: bool) -> AbortCause:
    """The cause the router counts (and sends with its aborts) for a generation that ended with an
    error: the same name the workers count for that failure (a corrupt chunk is `integrity` on
    every role), never the error's own code, which a worker's event carries as any string."""
    if code and code.startswith("kv_transfer_"):
        return abort_cause(code.removeprefix("kv_transfer_"))
    if code in _CAUSE_OF_CODE:
        return _CAUSE_OF_CODE[code]
    if status == 400:
        return AbortCause.REJECTED
    return AbortCause.PREFILL_ERROR if from_prefill else AbortCause.DECODE_ERROR


_CHUNK_BUCKETS = tuple(float(1 << s) for s in range(10, 27, 2))  # 1 KiB .. 64 MiB


@dataclass(frozen=True)
class TransferMetrics:
    """Transfer metrics on a process's registry. ``aborts`` is shared with the servers: they
    count each aborted request once with ``count_abort``; the transfer layer itself never does."""

    checksum_failures: Counter
    hmac_failures: Counter
    ticket_rejections: Counter
    stale_writes_dropped: Counter
    transfer_bytes: Counter
    chunk_bytes: Histogram
    transfers: Counter
    frames_dropped: Counter
    aborts: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> TransferMetrics:
        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labelnames=labels, registry=registry)

        made = cls(
            checksum_failures=counter(
                "kvguard_checksum_failures_total",
                "KV chunks whose payload checksum (or AES-GCM tag) failed (S3)"),
            hmac_failures=counter(
                "kvguard_hmac_failures_total",
                "Transfer frames whose header HMAC failed: wrong key, connection or ticket (S3, S9)"),
            ticket_rejections=counter(
                "kvguard_ticket_rejections_total",
                "Transfer tickets refused (forged, expired, foreign, other boot), by reason (S9)", ["reason"]),
            stale_writes_dropped=counter(
                "kvguard_stale_writes_dropped_total",
                "KV writes for a lease no longer current: dropped, never applied (S5)"),
            transfer_bytes=counter(
                "kvguard_kv_transfer_bytes_total", "KV payload bytes moved", ["direction"]),
            chunk_bytes=Histogram(
                "kvguard_kv_transfer_chunk_bytes", "KV chunk payload sizes", ["direction"],
                buckets=_CHUNK_BUCKETS, registry=registry),
            transfers=counter(
                "kvguard_kv_transfers_total", "Terminal transfer outcomes", ["side", "outcome"]),
            frames_dropped=counter(
                "kvguard_kv_transfer_frames_dropped_total",
                "Late, unknown or refused transfer frames dropped (class G, S9)", ["reason"]),
            aborts=counter(
                "kvguard_aborts_total", "Requests aborted, by cause (S4)", ["cause"]),
        )  # fmt: skip
        zeroed(made.aborts, cause=AbortCause)
        zeroed(made.transfers, side=("sender", "receiver"), outcome=("complete", *FailureReason))
        zeroed(made.frames_dropped, reason=FRAME_DROP_REASONS)
        zeroed(made.ticket_rejections, reason=TICKET_REJECTIONS)
        zeroed(made.transfer_bytes, direction=("sent", "received"))
        return made

    def count_abort(self, cause: AbortCause | str) -> None:
        self.aborts.labels(cause=str(cause)).inc()

    def count_outcome(self, side: str, outcome: TransferOutcome) -> None:
        """`side`: sender or receiver. Not named `role`: the PodMonitor gives every series the
        pod's role (prefill, decode, router) under that name, and Prometheus would rename ours."""
        label = "complete" if outcome.ok else str(outcome.reason)
        self.transfers.labels(side=side, outcome=label).inc()
