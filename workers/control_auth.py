"""Authenticated internal HTTP calls: only the revision's router may drive a worker (S9).

NetworkPolicies keep other pods away from a worker's internal control API where the cluster
enforces them; this check holds where it does not. Every router -> worker call carries::

    X-Kvguard-Auth: v4 ts=<unix ms> nonce=<32 hex> target=<32 hex | any> read=<unix ms> sha256=<64 hex> mac=<64 hex>
    sha256 = hex(SHA-256(body))
    mac = HMAC-SHA256(control key, "kvguard-control-v4" \\n METHOD \\n raw path+query \\n
                      sha256 \\n ts \\n nonce \\n target \\n read)

`target` is the worker process's own random id (`instance`, which it reports in
`/internal/info`): every pod of a revision holds the same key and keeps its own replay cache, so
a call captured on its way to one replica was taken by another (outside probe: a replayed prefill
call made a second replica compute the prompt and hold its pages). Only the reads a caller makes
before it knows the id (`GET /internal/info` and `/internal/health`, which change nothing) may
name `any`.

`read` is when the caller last read `target` (0 for `any`). A call signed for another instance,
from a read older than this worker's start and signed within PREVIOUS_INSTANCE_WINDOW_S of it, is
the router's view of the worker that ran here before (a restart keeps the address; the router
reads the new one within its refresh second, or at once on a refusal): refused all the same, but
counted `previous_instance`, not `wrong_target`, which is the S9 alert's. Restarts fired the alert
with no attacker. Every other call for another instance is `wrong_target`, whenever its read: a
replay of a captured call (the read is inside the MAC) is let off the alert only in that window.

The header names the body's digest, so the MAC is verified from the head alone, before a byte of
the body is read: a pod without the key cannot make a worker buffer an upload (v1 signed the
body itself, and anyone could write a well-formed v1 header and hold 32 MiB per connection until
the MAC failed). The body, once read, must match the digest.

The worker refuses (401, OpenAI-shaped, code ``unauthenticated``) a call whose header is missing
or malformed, whose MAC does not verify (wrong key, or method, path or body changed), whose
timestamp is more than ``MAX_CLOCK_SKEW_S`` from its own clock, or whose nonce it has already
seen within that window (a replay). Only calls whose MAC verified enter the replay cache, so
only a key holder can fill it; it is bounded and answers 503 when full rather than forget a
nonce that is still inside the window.

Pure logic (signing, verification, the cache) is separate from the aiohttp middleware.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import re
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter

from kvguard.workers.keys import MAX_CLOCK_SKEW_S
from kvguard.workers.metrics import zeroed
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.servers import mark_keyed

AUTH_HEADER = "X-Kvguard-Auth"
REPLAY_CACHE_ENTRIES = 1 << 20
INTERNAL_PREFIX = "/internal/"
_VERSION = "v4"
PREVIOUS_INSTANCE_WINDOW_S = MAX_CLOCK_SKEW_S
"""How long after a worker's start a call for another instance, read before it, may be its
predecessor's (above): the router reads a new instance within its refresh second, and the window
allows for the clocks' skew between it and the worker."""
_HEADER = re.compile(
    r"v4 ts=(\d{1,16}) nonce=([0-9a-f]{32}) target=([0-9a-f]{32}|any) read=(\d{1,16}) sha256=([0-9a-f]{64}) mac=([0-9a-f]{64})"
)
ANY_WORKER = "any"
UNBOUND_CALLS = frozenset({("GET", "/internal/info"), ("GET", "/internal/health")})
"""The calls that may be signed for any worker: reads, made before the caller knows the id."""


def new_instance_id() -> str:
    """A worker process's id, fresh at every start (a restarted worker is another target)."""
    return secrets.token_hex(16)


AuthFailure = Literal[
    "missing", "malformed", "bad_mac", "stale", "replay", "replay_cache_full", "wrong_target", "previous_instance", "queued_before_start"
]
"""Why a control call was refused (`kvguard_control_auth_failures_total{reason}`)."""
AUTH_FAILURES: tuple[AuthFailure, ...] = get_args(AuthFailure)


class AuthError(Exception):
    """The call is not from a holder of the revision key, or is a replay; `reason` is its label."""

    def __init__(self, reason: AuthFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _mac(key: bytes, method: str, path: str, digest: str, ts: str, nonce: str, target: str, read: str) -> str:
    message = "\n".join(("kvguard-control-v4", method.upper(), path, digest, ts, nonce, target, read))
    return hmac.new(key, message.encode(), "sha256").hexdigest()


@dataclass(frozen=True)
class SignedHead:
    """A well-formed, fresh header's fields."""

    ts: str
    nonce: str
    target: str  # the worker instance the call is for, or ANY_WORKER
    read: str  # unix ms at which the caller last read `target` ("0" for ANY_WORKER)
    digest: str  # hex SHA-256 of the body the caller signed
    mac: str


def sign(key: bytes, method: str, path: str, body: bytes = b"", *, target: str = ANY_WORKER, read_at: float | None = None,
         now: float | None = None, nonce: str | None = None) -> str:  # fmt: skip
    """The ``X-Kvguard-Auth`` value for one call to worker `target`, whose id the caller read at
    unix time `read_at` (default: now). ``path`` is the raw path with its query."""
    now = time.time() if now is None else now
    ts = str(int(now * 1000))
    read = str(int((now if read_at is None else read_at) * 1000)) if target != ANY_WORKER else "0"
    nonce = nonce or secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    mac = _mac(key, method, path, digest, ts, nonce, target, read)
    return f"{_VERSION} ts={ts} nonce={nonce} target={target} read={read} sha256={digest} mac={mac}"


def auth_headers(key: bytes, method: str, url: str, body: bytes = b"", target: str = ANY_WORKER,
                 read_at: float | None = None) -> dict[str, str]:  # fmt: skip
    """The header for a call to ``url`` (any HTTP client: the router's aiohttp, the launcher's
    requests, tests). Signs the path exactly as it goes on the request line."""
    parts = urllib.parse.urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return {AUTH_HEADER: sign(key, method, path, body, target=target, read_at=read_at)}


@dataclass
class ReplayCache:
    """Nonces seen within the skew window, oldest first. Bounded (see the module doc)."""

    window_s: float = 2 * MAX_CLOCK_SKEW_S
    capacity: int = REPLAY_CACHE_ENTRIES
    _seen: collections.OrderedDict[str, float] = field(default_factory=collections.OrderedDict)

    def add(self, nonce: str, now: float) -> None:
        """Record a nonce; AuthError if it was seen already (or the cache is full). An entry is
        forgotten once its arrival is more than the window from `now` either way: after the clock
        stepped back further than the window, every header it admitted is refused as stale, and
        keeping them until the clock caught up filled the cache (review: 503 for every call)."""
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if abs(now - at) <= self.window_s:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            raise AuthError("replay", "this request was already received (replayed nonce)")
        if len(self._seen) >= self.capacity:
            raise AuthError("replay_cache_full", "too many internal calls within the clock-skew window")
        self._seen[nonce] = now


@dataclass
class ControlVerifier:
    """Checks ``X-Kvguard-Auth`` on a worker. One per process (it owns the replay cache)."""

    key: bytes
    instance: str = field(default_factory=new_instance_id)
    """This worker's id: calls must be signed for it (or for ANY_WORKER, for UNBOUND_CALLS)."""
    max_skew_s: float = MAX_CLOCK_SKEW_S
    replay: ReplayCache = field(default_factory=ReplayCache)
    clock: Callable[[], float] = time.time
    started: float | None = None
    """Unix time this worker began (default: when the verifier was made, at its start)."""
    _started_ms: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._started_ms = (self.clock() if self.started is None else self.started) * 1000

    def verify_head(self, method: str, path: str, header: str | None) -> SignedHead:
        """The head of a call from a key holder: header present, well formed, fresh, its MAC
        valid for this method and path and the body digest it names. Checked before the body is
        read: nobody without the key makes a worker read a body. The nonce is checked against the
        replay cache, and entered, only by `verify_body`: a header seen on the wire and sent ahead
        with another body must not use up the real call's nonce."""
        if not header:
            raise AuthError("missing", f"internal endpoint: the {AUTH_HEADER} header is required")
        match = _HEADER.fullmatch(header.strip())
        if match is None:
            raise AuthError("malformed", f"malformed {AUTH_HEADER} header")
        head = SignedHead(*match.groups())
        if abs(self.clock() - int(head.ts) / 1000) > self.max_skew_s:
            raise AuthError(self._stale(method, path, head), f"{AUTH_HEADER} timestamp is more than {self.max_skew_s:g}s from this worker's clock")
        if not self._mac_verifies(method, path, head):
            raise AuthError("bad_mac", f"{AUTH_HEADER} does not verify for this method, path and body")
        if head.target != self.instance and not _unbound_read(method, path, head):
            if self._predecessors(head):
                raise AuthError("previous_instance", "this call was signed for the worker that ran here before this one started")
            raise AuthError("wrong_target", "this call was signed for another worker (or for any, which only reads may be)")
        return head

    def _stale(self, method: str, path: str, head: SignedHead) -> AuthFailure:
        """`stale`, or `queued_before_start` for a key holder's read (which changes nothing) signed
        before this worker started: the router's reads of a worker that was loading wait in the
        listen backlog its launcher holds, and a load longer than the skew window fired the S9 alert
        with no attacker (review)."""
        before = int(head.ts) < self._started_ms
        return "queued_before_start" if before and _unbound_read(method, path, head) and self._mac_verifies(method, path, head) else "stale"

    def _mac_verifies(self, method: str, path: str, head: SignedHead) -> bool:
        return hmac.compare_digest(_mac(self.key, method, path, head.digest, head.ts, head.nonce, head.target, head.read), head.mac)

    def _predecessors(self, head: SignedHead) -> bool:
        """Whether a call for another instance is the router's for the worker that ran here before:
        read before this one started, and signed within PREVIOUS_INSTANCE_WINDOW_S of that start."""
        started_ms = self._started_ms
        return head.target != ANY_WORKER and int(head.read) < started_ms and int(head.ts) < started_ms + PREVIOUS_INSTANCE_WINDOW_S * 1000

    def verify_body(self, head: SignedHead, body: bytes) -> None:
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), head.digest):
            raise AuthError("bad_mac", f"the body does not match the digest its {AUTH_HEADER} header signed")
        self.replay.add(head.nonce, self.clock())  # only calls that verified whole: only a key holder fills it

    def verify(self, method: str, path: str, body: bytes, header: str | None) -> None:
        """Head and body together (a call whose body is already in hand)."""
        self.verify_body(self.verify_head(method, path, header), body)


def _unbound_read(method: str, path: str, head: SignedHead) -> bool:
    """A read signed for any worker, as the caller may make before it knows the worker's id."""
    return head.target == ANY_WORKER and (method.upper(), path.split("?", 1)[0]) in UNBOUND_CALLS


def auth_failures_counter(registry: CollectorRegistry) -> Counter:
    return zeroed(Counter(
        "kvguard_control_auth_failures_total",
        "Internal control API calls refused: missing/bad authentication or replay (S9)",
        ["reason"], registry=registry,
    ), reason=AUTH_FAILURES)  # fmt: skip


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


INTERNAL_MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest /internal/* body: a prompt's token ids at a 1M-token context are ~8 MB of JSON."""
INTERNAL_BODY_TIMEOUT_S = 30.0


KEYLESS_FAILURES: frozenset[str] = frozenset({"missing", "malformed", "stale", "bad_mac"})
"""Refusals whose caller has not shown the key (a stale header's MAC is never checked): its
connection is closed once answered. Kept alive, 8,164 such connections (one refused health check
each, repeated every 20 s to outlast the keep-alive timer) held both workers' connection caps
without a reconnect, and 15 of 16 public requests got 503 (an outside probe). A key holder's
refused call (another worker's, a replay) keeps its connection: the router's pool reuses it."""


def control_auth_middleware(verifier: ControlVerifier, failures: Counter, body_timeout_s: float = INTERNAL_BODY_TIMEOUT_S,
                            max_body_bytes: int = INTERNAL_MAX_BODY_BYTES) -> Middleware:  # fmt: skip
    """aiohttp middleware: every ``/internal/*`` call must carry a valid header (see module doc).

    The head (form, freshness, MAC over the declared body digest, replay) is verified before a
    byte of the body is read, so only a key holder's upload is read at all; the body must then
    arrive within `body_timeout_s`, hold at most `max_body_bytes` (the app's client_max_size, for
    a body without Content-Length) and match its digest. Must sit inside
    ``error_middleware`` so the refusal is an OpenAI-shaped 401."""

    def refuse(exc: AuthError) -> OpenAIError:
        failures.labels(reason=exc.reason).inc()
        if exc.reason == "replay_cache_full":  # the worker's state, not the caller's fault
            return OpenAIError(503, str(exc), code="unauthenticated")
        return OpenAIError(401, str(exc), code="unauthenticated", close_connection=exc.reason in KEYLESS_FAILURES)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(INTERNAL_PREFIX):  # nothing else is served here
            raise OpenAIError(404, f"Invalid URL ({request.method} {request.path[:200]})", code="not_found",
                              close_connection=True)  # fmt: skip
        try:
            head = verifier.verify_head(request.method, request.raw_path, request.headers.get(AUTH_HEADER))
        except AuthError as exc:
            raise refuse(exc) from None
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise OpenAIError(413, f"the request body is larger than the limit of {max_body_bytes} bytes",
                              code="request_too_large")  # fmt: skip
        try:
            async with asyncio.timeout(body_timeout_s):
                body = await request.read()  # aiohttp caches it: the handler reads the same bytes
        except TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {body_timeout_s:g} s",
                              code="request_timeout") from None  # fmt: skip
        try:
            verifier.verify_body(head, body)
        except AuthError as exc:
            raise refuse(exc) from None
        mark_keyed(request)
        return await handler(request)

    return middleware
