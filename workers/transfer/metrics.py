"""Transfer metrics and abort causes (the ``kvguard_*`` names are a contract: docs/monitoring.md)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvguard.workers.transfer.config import FailureReason, TransferOutcome


class AbortCause(enum.StrEnum):
    """Label values of ``kvguard_aborts_total{cause}``, shared by the servers and the router."""

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


_CAUSE_OF_REASON = {
    FailureReason.CHECKSUM: AbortCause.INTEGRITY,
    FailureReason.PROTOCOL_ERROR: AbortCause.INTEGRITY,
    FailureReason.TIMEOUT: AbortCause.TRANSFER_TIMEOUT,
    FailureReason.STALE: AbortCause.STALE_LEASE,
    FailureReason.PEER_ABORT: AbortCause.PEER_ABORT,
    FailureReason.CONNECTION_LOST: AbortCause.WORKER_DIED,
}


def abort_cause(reason: FailureReason | str | None) -> AbortCause:
    """The ``kvguard_aborts_total`` cause a server should count for a failed transfer."""
    return _CAUSE_OF_REASON.get(reason, AbortCause.TRANSFER_FAILED)  # type: ignore[arg-type]


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

        return cls(
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

    def count_abort(self, cause: AbortCause | str) -> None:
        self.aborts.labels(cause=str(cause)).inc()

    def count_outcome(self, side: str, outcome: TransferOutcome) -> None:
        """`side`: sender or receiver. Not named `role`: the PodMonitor gives every series the
        pod's role (prefill, decode, router) under that name, and Prometheus would rename ours."""
        label = "complete" if outcome.ok else str(outcome.reason)
        self.transfers.labels(side=side, outcome=label).inc()
