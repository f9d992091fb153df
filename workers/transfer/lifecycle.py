"""The lifecycle of one request's KV transfer: the one authoritative state enum (both ends).

Decode (``InboundTransfer``)::

    EXPECTED --OPEN with a matching ticket, on one connection--> OPEN
    OPEN --MANIFEST matching the plan, every planned page written (S3)--> COMPLETE
    EXPECTED --no OPEN within the open timeout, local cancel, peer ABORT--> FAILED
    OPEN --checksum/plan/manifest mismatch, stale lease, peer ABORT, local cancel,
           stall timeout, connection lost/protocol error--> FAILED

Prefill (``OutboundTransfer``)::

    CONNECTING --HELLO/WELCOME done, epoch matches the ticket, OPEN written--> OPEN
    OPEN --every CHUNK and the MANIFEST written--> SEALED
    SEALED --RESULT ok--> COMPLETE
    CONNECTING | OPEN | SEALED --RESULT failed, stall timeout, connection lost, local error--> FAILED

COMPLETE and FAILED are terminal: a transfer never leaves them, and every transition is checked
against ``TRANSITIONS`` (a later model of this protocol compares its states with these names).
"""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    EXPECTED = "expected"  # decode: pages granted, ticket nonce drawn; waiting for OPEN
    CONNECTING = "connecting"  # prefill: ticket verified; connecting to the ticket's address
    OPEN = "open"  # OPEN written (prefill) / accepted on exactly one connection (decode)
    SEALED = "sealed"  # prefill: MANIFEST written; waiting for decode's RESULT
    COMPLETE = "complete"  # decode: verified (S3); prefill: decode's RESULT said ok
    FAILED = "failed"  # either end; the reason is in the outcome


TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.EXPECTED: frozenset({TransferState.OPEN, TransferState.FAILED}),
    TransferState.CONNECTING: frozenset({TransferState.OPEN, TransferState.FAILED}),
    TransferState.OPEN: frozenset({TransferState.SEALED, TransferState.COMPLETE, TransferState.FAILED}),
    TransferState.SEALED: frozenset({TransferState.COMPLETE, TransferState.FAILED}),
    TransferState.COMPLETE: frozenset(),
    TransferState.FAILED: frozenset(),
}
RECEIVER_STATES = frozenset({TransferState.EXPECTED, TransferState.OPEN, TransferState.COMPLETE, TransferState.FAILED})
SENDER_STATES = frozenset(
    {TransferState.CONNECTING, TransferState.OPEN, TransferState.SEALED, TransferState.COMPLETE, TransferState.FAILED}
)
TERMINAL = frozenset({TransferState.COMPLETE, TransferState.FAILED})


class IllegalTransition(RuntimeError):
    """A bug: code tried a transition the lifecycle does not have."""


def advance(current: TransferState, new: TransferState) -> TransferState:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"transfer cannot go from {current.name} to {new.name}")
    return new
