"""Transfer tickets: the router's authorisation for one request's KV to go to one place (S9).

Decode allocates the destination pages and draws a fresh 16-byte nonce for the request; it reports
both, with its boot epoch and transfer address, to the router. The router issues the ticket::

    | bytes | field                                                       |
    | ----- | ----------------------------------------------------------- |
    | 4     | magic ``b"KVTK"``                                            |
    | 1     | version (1)                                                 |
    | 1+n   | request id (u8 length + UTF-8, the router's internal id)    |
    | 1+n   | decode transfer host (u8 length + UTF-8)                    |
    | 2     | decode transfer port                                        |
    | 8     | decode boot epoch (u64)                                     |
    | 16    | nonce (decode's, for this request)                          |
    | 8     | expiry, unix milliseconds on the router's clock (i64)       |
    | 4     | tokens of KV decode expects (u32)                           |
    | ...   | pages: u32 count N, N x u32 page ids, N x i64 generations   |
    | 32    | HMAC-SHA256(ticket key, every byte above)                   |

Prefill verifies it before computing or connecting anywhere, and sends only to its address;
decode accepts OPEN only with a ticket whose nonce, epoch, pages and generations are the ones it
granted for that request. A ticket expires (``expires_at_ms`` + the clock skew bound) so a
captured one is worthless soon after; it is checked when prefill receives it, when prefill opens
the transfer, and by decode at OPEN. Once OPEN is accepted the stall timeout governs the transfer.

The ticket is self-contained: prefill may receive it after it started computing (the router can
start both legs at once); it needs the ticket only to send.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from kvguard.workers.keys import MAX_CLOCK_SKEW_S
from kvguard.workers.transfer.wire import (
    I64,
    NONCE_BYTES,
    TAG_BYTES,
    U8,
    U16,
    U32,
    U64,
    Cursor,
    ProtocolError,
    encode_pages,
    encode_rid,
)

TICKET_MAGIC = b"KVTK"
TICKET_VERSION = 1
MAX_HOST_BYTES = 253
MAX_TICKET_TTL_S = 3600.0  # a ticket claiming to live longer than this is refused
MAX_TICKET_BYTES = 9 << 20


TicketRejection = Literal["malformed", "bad_mac", "expired", "too_long_lived", "mismatch", "epoch", "already_open"]
"""Why a ticket was refused (`kvguard_ticket_rejections_total{reason}`): mismatch is a valid ticket
for another request, pages or boot; epoch one decode granted before it restarted (its boot epoch
differs from the connection's); already_open one for
a transfer open on another connection."""
TICKET_REJECTIONS: tuple[TicketRejection, ...] = get_args(TicketRejection)


class TicketError(Exception):
    """A ticket prefill or decode must refuse, and why."""

    def __init__(self, reason: TicketRejection, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Ticket:
    request_id: str
    host: str
    port: int
    epoch: int
    nonce: bytes
    expires_at_ms: int
    num_tokens: int
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    blob: bytes = field(default=b"", compare=False, repr=False)  # the MAC'd encoding, verbatim

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def text(self) -> str:
        """The blob as JSON-safe text (router -> prefill)."""
        return base64.urlsafe_b64encode(self.blob).decode()


def _body(t: Ticket) -> bytes:
    host = t.host.encode("utf-8")
    if not 1 <= len(host) <= MAX_HOST_BYTES:
        raise ValueError(f"ticket host must be 1..{MAX_HOST_BYTES} bytes")
    if len(t.nonce) != NONCE_BYTES:
        raise ValueError(f"ticket nonce must be {NONCE_BYTES} bytes")
    return b"".join((
        TICKET_MAGIC, U8.pack(TICKET_VERSION), encode_rid(t.request_id), U8.pack(len(host)), host,
        U16.pack(t.port), U64.pack(t.epoch), t.nonce, I64.pack(t.expires_at_ms), U32.pack(t.num_tokens),
        encode_pages(t.page_ids, t.generations),
    ))  # fmt: skip


def _parse(body: bytes) -> Ticket:
    cur = Cursor(body)
    if bytes(cur.take(4)) != TICKET_MAGIC or cur.unpack(U8) != TICKET_VERSION:
        raise ProtocolError("not a version 1 ticket")
    rid = cur.rid()
    host = cur.utf8(cur.unpack(U8))
    port, epoch = cur.unpack(U16), cur.unpack(U64)
    nonce = bytes(cur.take(NONCE_BYTES))
    expires, tokens = cur.unpack(I64), cur.unpack(U32)
    ids, gens = cur.pages()
    cur.end()
    return Ticket(rid, host, port, epoch, nonce, expires, tokens, ids, gens)


class TicketAuthority:
    """Issues (router) and verifies (prefill, decode) tickets with the revision's ticket key."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._clock = clock

    def issue(
        self, request_id: str, address: tuple[str, int], epoch: int, nonce: bytes, num_tokens: int,
        page_ids: Sequence[int], generations: Sequence[int], ttl_s: float,
    ) -> Ticket:  # fmt: skip
        if not 0 < ttl_s <= MAX_TICKET_TTL_S:
            raise ValueError(f"ticket lifetime must be in (0, {MAX_TICKET_TTL_S:g}] s")
        expires = int((self._clock() + ttl_s) * 1000)
        ticket = Ticket(request_id, address[0], int(address[1]), epoch, nonce, expires, num_tokens,
                        tuple(page_ids), tuple(generations))  # fmt: skip
        body = _body(ticket)
        blob = body + hmac.digest(self._key, body, "sha256")
        if len(blob) > MAX_TICKET_BYTES:
            raise ValueError(f"ticket of {len(blob)} bytes exceeds {MAX_TICKET_BYTES}")
        return replace(ticket, blob=blob)

    def verify(self, blob: bytes) -> Ticket:
        """The ticket in ``blob`` if the router issued it and it has not expired; else TicketError."""
        ticket = self.authenticate(blob)
        self.check_time(ticket)
        return ticket

    def authenticate(self, blob: bytes) -> Ticket:
        """The ticket if this revision's router issued it (its MAC verifies), expired or not."""
        if not TAG_BYTES < len(blob) <= MAX_TICKET_BYTES:
            raise TicketError("malformed", f"a ticket is {TAG_BYTES + 1}..{MAX_TICKET_BYTES} bytes")
        body, tag = blob[:-TAG_BYTES], blob[-TAG_BYTES:]
        if not hmac.compare_digest(hmac.digest(self._key, body, "sha256"), tag):
            raise TicketError("bad_mac", "the ticket was not issued by this revision's router")
        try:
            ticket = _parse(body)
        except ProtocolError as exc:
            raise TicketError("malformed", f"ticket: {exc}") from None
        return replace(ticket, blob=bytes(blob))

    def check_time(self, ticket: Ticket) -> None:
        now_ms = self._clock() * 1000
        if now_ms > ticket.expires_at_ms + MAX_CLOCK_SKEW_S * 1000:
            raise TicketError("expired", f"the ticket expired {(now_ms - ticket.expires_at_ms) / 1000:.1f}s ago")
        if ticket.expires_at_ms > now_ms + (MAX_TICKET_TTL_S + MAX_CLOCK_SKEW_S) * 1000:
            raise TicketError("too_long_lived", "the ticket claims a lifetime beyond the bound")

    def verify_text(self, text: str) -> Ticket:
        try:
            blob = base64.urlsafe_b64decode(text.encode("ascii"))
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise TicketError("malformed", "the ticket is not base64") from None
        return self.verify(blob)
