"""KV transfer between a prefill worker (``KVSender``) and a decode worker (``KVReceiver``).

One request's transfer, end to end (states: ``TransferState`` in lifecycle.py; messages:
``FrameType`` in wire.py; keys: workers/keys.py; tickets: tickets.py)::

    router -> decode   POST /internal/decode            decode allocates pages, draws a nonce
    decode -> router   bootstrap {address, pages, generations, nonce, epoch}     EXPECTED
    router -> prefill  POST /internal/prefill {ticket}  the router MACs the ticket (expiry)
    prefill            verifies the ticket before computing or connecting        CONNECTING
    prefill -> decode  HELLO(nonce_p)                   connection setup, once per pooled connection
    decode -> prefill  WELCOME(nonce_p, nonce_d, epoch) epoch must equal the ticket's
    prefill -> decode  OPEN(ticket)                     decode checks nonce, epoch, pages    OPEN
    prefill -> decode  CHUNK x n                        checksum or AES-GCM; plan-checked (S3, S5)
    decode -> prefill  ACK                              credit back after the sink consumed (S6)
    prefill -> decode  MANIFEST(first token)            matches what arrived    SEALED / COMPLETE
    decode -> prefill  RESULT(ok | reason)              the verdict              COMPLETE / FAILED
    prefill -> decode  ABORT (any time, own connection) prefill gave up (S4)

A failure of one request never touches another on the same connection; a frame that cannot be
trusted closes its connection only. Modules: wire (format), tickets, crypto (AES-GCM), channel
(frame I/O), plan (what decode expects), receiver, sender, config, metrics, lifecycle.
"""

from kvguard.workers.transfer.config import FailureReason, TransferConfig, TransferOutcome
from kvguard.workers.transfer.lifecycle import TRANSITIONS, TransferState
from kvguard.workers.transfer.metrics import AbortCause, TransferMetrics, abort_cause
from kvguard.workers.transfer.receiver import (
    DuplicateRequestError,
    InboundTransfer,
    KVReceiver,
    KVSink,
    TransferLookup,
    WriteOutcome,
)
from kvguard.workers.transfer.sender import CRASH_EXIT_CODE, ByteCredit, KVChunk, KVSender, OutboundTransfer, PrefillCrashed
from kvguard.workers.transfer.tickets import Ticket, TicketAuthority, TicketError
from kvguard.workers.transfer.wire import Encryption, FirstToken, FrameType, Manifest

__all__ = [
    "CRASH_EXIT_CODE", "TRANSITIONS", "AbortCause", "ByteCredit", "DuplicateRequestError", "Encryption",
    "FailureReason", "FirstToken", "FrameType", "InboundTransfer", "KVChunk", "KVReceiver", "KVSender", "KVSink",
    "Manifest", "OutboundTransfer", "PrefillCrashed", "Ticket", "TicketAuthority", "TicketError", "TransferConfig",
    "TransferLookup", "TransferMetrics", "TransferOutcome", "TransferState", "WriteOutcome", "abort_cause",
]  # fmt: skip
