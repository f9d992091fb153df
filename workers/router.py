"""The router: the OpenAI-compatible front door that pairs each request with a prefill and a decode worker.

Per request (see kvguard.workers.protocol for the messages):
  internal id -> parse -> tokenize -> intake check (S2) -> both legs at once (prefill computes
  while decode allocates) -> decode's bootstrap -> ticket to prefill -> KV sent, verified -> stream
  tokens. A request with `n` > 1 or a batch of prompts runs one such pair of legs per choice.
The internal id is the router's own, unguessable (`secrets`); a client's `X-Request-Id` is only a
correlation label (validated, echoed in the response header and logged), never a key, so no client
can address another's work, even through another router (S9). Every call to a worker is signed with
the revision's control key (workers/control_auth.py), and prefill may send KV only where the ticket
the router issues from decode's bootstrap says (workers/transfer/tickets.py).

Work per request is bounded before anything is spent on it (issue 11): the body's size and the time
it may take to arrive, JSON nesting, the prompt's bytes before tokenizing (no longer text can fit
the context), stop strings, choices. Large prompts are tokenized on a thread, not on the event loop
every tenant shares.
The router holds no KV. What it owns is the request's fate: any failure of either leg, a timeout or
the client going away ends both legs (S4) and gives this client -- and only this client -- a clean
OpenAI-shaped error. Token events are only forwarded after decode verified the transfer (S3), so an
error before the first token is always a proper HTTP error status, never a 200.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import functools
import gc
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from kvguard.workers.args import DEFAULT_ABORT_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, worker_default
from kvguard.workers.backpressure import BodyMemory, Draining, SharedCheck, SlotLease, Slots, StallWatch, drop
from kvguard.workers.channel_reader import (
    ChannelLost,
    ChannelPayload,
    ChannelReader,
    Inbox,
    OpenChannel,
    coalesce,
    read_lines,
)
from kvguard.workers.control_auth import ANY_WORKER, auth_headers
from kvguard.workers.discovery import Discovery, NoAnswer, membership_change, resolve
from kvguard.workers.json_shape import MAX_JSON_ITEMS, json_shape_problem
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.metrics import REJECT_REASONS, REQUEST_OUTCOMES, ROUTER_LATENCY_BUCKETS, zeroed
from kvguard.workers.openai_api import (
    REVISION_HEADER,
    SSE_DONE,
    Handler,
    OpenAIError,
    answer_expect,
    check_transfer_codings,
    context_length_exceeded,
    error_middleware,
    prepare_stream,
    read_body,
    sse,
    too_large_error,
    validation_error,
)
from kvguard.workers.openai_requests import APIRequest, ChatCompletionRequest, CompletionRequest, request_too_large
from kvguard.workers.openai_responses import ChoiceResult, ModelCard, ModelList, ResponseBuilder
from kvguard.workers.pool_ratio import ratio_number, ratio_text, required_pool_tokens
from kvguard.workers.protocol import (
    DECODE_EVENT,
    AbortRequest,
    BootstrapEvent,
    ChannelRequest,
    DecodeRequest,
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    HandoffEvent,
    PrefillRequest,
    Role,
    TicketDelivery,
    TokenEvent,
    TokenLogprob,
    WorkerInfo,
)
from kvguard.workers.seeding import choice_seed
from kvguard.workers.tokenizer import ChatTemplateOptions, PromptTooLong
from kvguard.workers.transfer.metrics import AbortCause, router_abort_cause
from kvguard.workers.transfer.tickets import MAX_TICKET_TTL_S, TicketAuthority

log = logging.getLogger("kvguard.router")

REQUEST_ID_HEADER = "X-Request-Id"
FORWARDED_FOR_HEADER = "X-Forwarded-For"
"""Set by proxies in front of the router; read only by the fail_proxied_requests fault (never trusted)."""
T = TypeVar("T")
RequestKind = TypeVar("RequestKind", CompletionRequest, ChatCompletionRequest)
# A correlation label is 1..128 visible ASCII characters: it is echoed in a header and logged, so
# it must not carry control characters, spaces or bytes a log or header parser would misread.
_LABEL = re.compile(r"[\x21-\x7e]{1,128}")
_LABEL_KEY = web.RequestKey("kvguard_correlation_label", str)
# A generation in flight holds up to 5 connections to workers at once: decode's stream, prefill's
# call and its ticket delivery, and while ending, the two aborts. The pool is sized so that no call
# ever waits in aiohttp's queue: a queued prefill call let decode's stall timer fire on pages it had
# already allocated, and a queued call went out with a signature older than the workers accept (S9),
# so a burst of 1,000 requests failed a third of them. Generations beyond max_inflight_choices wait
# in the router instead, before any KV is allocated.
CONNECTIONS_PER_CHOICE = 5
SPARE_CONNECTIONS = 64  # discovery, the limits refresher, one token channel per decode worker
CHAT_MESSAGE_RENDER_BYTES = 64  # the template work one message costs, counted when choosing to render off the loop
WORKERS_HEALTH_FRESH_S = 1.0  # /health's answer from the workers is shared this long (probes come every 5 s)


STREAMING = web.RequestKey("kvguard_streaming", bool)
"""Set on a request once its event stream has started (its status and headers are sent)."""
_SHUTTING_DOWN = OpenAIError(503, "this router is shutting down; retry the request", code="shutting_down", retry_after_s=1)


class SignedFor(NamedTuple):
    """Whom a call that acts is signed for: a worker instance as read at unix time `read_at`."""

    instance: str
    read_at: float = 0.0


class ControlClient:
    """The router's signed calls to its workers (S9): every request carries ``X-Kvguard-Auth``."""

    def __init__(self, keys: RevisionKeys) -> None:
        self._key = keys.control

    def get(self, session: aiohttp.ClientSession, url: str, **kwargs: object) -> aiohttp.client._RequestContextManager:
        """A read (info, health): signed for any worker, since it comes before the worker's id is known."""
        return session.get(url, headers=auth_headers(self._key, "GET", url), **kwargs)  # type: ignore[arg-type]

    def post(self, session: aiohttp.ClientSession, url: str, message: BaseModel, target: SignedFor,
             **kwargs: object) -> aiohttp.client._RequestContextManager:  # fmt: skip
        """A call that acts, signed for worker instance `target` alone."""
        body = message.model_dump_json().encode()
        headers = {**auth_headers(self._key, "POST", url, body, target.instance, target.read_at), "Content-Type": "application/json"}
        return session.post(url, data=body, headers=headers, **kwargs)  # type: ignore[arg-type]


class PromptEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]], options: ChatTemplateOptions | None = None) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def text_bytes(self, token_id: int) -> bytes: ...

    @property
    def max_token_bytes(self) -> int: ...


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str = ""  # what `echo` shows (only filled when asked)


@dataclass(frozen=True)
class Choice:
    """One completion of a request: its index in `choices` and the legs' request."""

    index: int
    generate: GenerateRequest


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    model_name: str
    request_timeout_s: float = worker_default("request_timeout")
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S  # how long a worker may take to acknowledge an abort (the client does not wait for it)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies: 413
    max_body_memory: int = worker_default("max_body_memory")  # bodies held at once (backpressure.BodyMemory): 503 past it
    body_timeout_s: float = worker_default("body_timeout")  # a body that takes longer to arrive: 408 (slow-body clients)
    write_timeout_s: float = worker_default("write_timeout")  # a client that reads none of its answer for this long loses the connection
    max_choices: int = 16  # n x prompts per request
    max_inflight_choices: int = worker_default("max_inflight_choices")  # generations with worker calls open; more wait here (within request_timeout_s)
    tokenizer_threads: int = 2
    inline_bytes: int = 4096  # smaller prompts/bodies are tokenized/parsed on the loop (a thread hop costs more)
    propagate_aborts: bool = True  # False only under the no_abort_propagation fault
    unsafe_reject_path: bool = False  # the incident's engine: let over-length requests through
    fail_proxied_requests: bool = False  # fault fail_proxied_requests: 500 to requests that came through a proxy
    min_kv_ratio: float | None = None  # S7 per worker: keep out a worker whose pool is below this x its context
    refresh_interval_s: float = 1.0  # how often (with min_kv_ratio) every worker's reported limits are read again
    revision: str | None = None  # named in every API response's x-kvguard-revision header (--revision-id)
    token_channel: bool = True  # decode's tokens on one channel per decode worker (False: a stream per request)
    discovery: Discovery = "static"  # dns: each URL's host is a headless Service, every address a worker (workers/discovery.py)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the router needs at least one prefill and one decode worker")


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = zeroed(Counter(
            "kvguard_requests_total", "Generations (a request's choices of each prompt) by final outcome; a request "
            "refused at intake counts once, as rejected", ["outcome"], registry=self.registry,
        ), outcome=REQUEST_OUTCOMES)  # fmt: skip
        self.rejected = zeroed(Counter(
            "kvguard_rejected_requests_total", "Requests rejected at intake, by reason", ["reason"], registry=self.registry,
        ), reason=REJECT_REASONS)  # fmt: skip
        self.aborts = zeroed(Counter(
            "kvguard_aborts_total", "Requests aborted, by cause", ["cause"], registry=self.registry,
        ), cause=AbortCause)  # fmt: skip
        self.waiting_choices = Gauge(
            "kvguard_router_waiting_choices",
            "Generations waiting for one of the router's max_inflight_choices slots (nothing allocated on workers yet)",
            registry=self.registry,
        )
        self.room_waiting_choices = Gauge(
            "kvguard_router_room_waiting_choices",
            "Choices of requests of several choices waiting for their turn in the room they share in decode's KV "
            "pool (each holds a router slot; nothing allocated on workers yet)",
            registry=self.registry,
        )
        # What a progressive rollout's analysis compares between the candidate's and the stable's
        # routers (operator/analysis.py): measured per generation (one per choice), as a client sees it.
        # Both from the request's arrival, its wait for a slot included: a candidate that queues
        # its requests is slower as its clients see it (outside probe: measured from the end of
        # that wait, a 2.15 s wait added 0.136 s to the TTFT sum).
        self.request_duration = Histogram(
            "kvguard_router_request_duration_seconds", "Request arrival to the generation's end, finished or not",
            buckets=ROUTER_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "kvguard_router_time_to_first_token_seconds", "Request arrival to the generation's first verified token",
            buckets=ROUTER_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.body_memory = Gauge(
            "kvguard_router_body_memory_bytes",
            "Bytes of request bodies held at once, past each body's first 64 KiB (limit: --max-body-memory)",
            registry=self.registry,
        )  # fmt: skip
        self.bodies_refused = Counter(
            "kvguard_router_bodies_refused_total",
            "Requests refused with 503 (Retry-After) because the request bodies held at once reached --max-body-memory",
            registry=self.registry,
        )  # fmt: skip
        self.kept_out = Gauge(
            "kvguard_router_workers_kept_out", "Workers out of rotation because their KV pool is below the ratio (S7)",
            ["worker_role"], registry=self.registry,  # not `role`: the scrape's own label (the router's pod)
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "kvguard_router_inter_token_latency_seconds", "Time between consecutive verified tokens of a generation",
            buckets=ROUTER_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip


@dataclass
class Upstream:
    url: str
    info: WorkerInfo
    read_at: float = field(default_factory=time.time)
    """Unix time `info` was last read: calls signed for its instance say it (workers/control_auth.py)."""
    reachable: bool = True
    """False after a failed read of its limits (down, restarting): out of rotation until one succeeds."""
    silent_reads: int = 0
    """Reads in a row that timed out: one is a busy worker, MAX_SILENT_READS a hung one."""


MAX_SILENT_READS = 3
"""Timed-out reads of a worker's limits in a row (a read waits 5 s, a second apart: ~18 s) that take
it out of rotation: a worker that answers nothing for that long (SIGSTOPped, wedged) would hold every
request sent to it until the request timeout (an outside probe: 120 s each, with /health already
saying it was unreachable). One slow read still changes nothing: a busy worker is not taken out."""
DEPARTED_REMEMBERED = 1024  # workers gone from the names whose in-flight requests may still need an abort


def pool_problem(info: WorkerInfo, min_kv_ratio: float | None) -> str | None:
    """Why a worker may not serve (S7: its own pool below min_kv_ratio x its context), else None."""
    if min_kv_ratio is None:
        return None
    required = required_pool_tokens(min_kv_ratio, info.context_length, info.page_size)
    if info.kv_pool_tokens >= required:
        return None
    return (f"reports a KV pool of {info.kv_pool_tokens} tokens = {ratio_text(info.kv_pool_tokens, info.context_length)} context "
            f"{info.context_length} < {ratio_number(min_kv_ratio)}x required ({required} tokens)")  # fmt: skip


class Upstreams:
    """The workers behind the router, their reported limits, and round-robin pairing.

    With `min_kv_ratio` the router is a readiness gate of its own (S7 while a worker serves): a
    worker whose reported pool is below the ratio -- one restarted with a smaller pool -- is kept
    out of the pairing until it reports enough again (`refresh`), and the limits intake checks
    against are those of the workers that serve. A worker that refuses the connection (down,
    restarting: a restart takes seconds, the reads are a second apart) is out until a read
    succeeds, so a restarted worker is judged by what it reports now before it serves again; a
    read that only times out changes nothing (a busy worker is not taken out). On Kubernetes the pod readiness gate
    `kvguard.io/kv-pool-verified` does this per pod (the router there is sent only ready pods'
    addresses, `--discovery dns`); with `--discovery dns` workers join and leave as their names do."""

    def __init__(self, prefill: Sequence[Upstream], decode: Sequence[Upstream], min_kv_ratio: float | None = None) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.min_kv_ratio = min_kv_ratio
        page_sizes = {u.info.page_size for u in self.prefill + self.decode}
        if len(page_sizes) > 1:  # KV moves page by page: a mismatch would misplace every token
            raise ValueError(f"prefill and decode workers disagree on the page size: {sorted(page_sizes)}")
        self.page_size = page_sizes.pop()
        self._turns = {Role.PREFILL: 0, Role.DECODE: 0}

    def of(self, role: Role) -> list[Upstream]:
        return self.prefill if role is Role.PREFILL else self.decode

    def serving(self, role: Role) -> list[Upstream]:
        """The workers of a role that may take requests now."""
        return [u for u in self.of(role) if self.admits(u)]

    def add(self, upstream: Upstream) -> None:
        """A worker that appeared (`--discovery dns`); judged by `admits` like every other."""
        self.of(upstream.info.role).append(upstream)

    def at(self, url: str) -> Upstream | None:
        """The worker at `url` in the rotation's lists, if any."""
        return next((u for u in self.prefill + self.decode if u.url == url), None)

    def remove(self, role: Role, url: str) -> None:
        """A worker whose name went (a pod no longer ready, or gone): no new request goes to it;
        the requests it holds keep their own reference and end as they would."""
        workers = self.of(role)
        workers[:] = [u for u in workers if u.url != url]

    def admits(self, upstream: Upstream) -> bool:
        info = upstream.info
        return upstream.reachable and info.page_size == self.page_size and pool_problem(info, self.min_kv_ratio) is None

    def kept_out(self) -> list[Upstream]:
        """Workers out of rotation for their pool (S7); unreachable ones are not counted here."""
        return [u for u in self.prefill + self.decode if u.reachable and not self.admits(u)]

    def refresh(self, upstream: Upstream, info: WorkerInfo | None) -> str | None:
        """Take a worker's newly read limits (None: the read failed); a line to log when it
        entered or left the rotation."""
        was = self.admits(upstream)
        upstream.reachable = info is not None
        if info is not None:
            upstream.info, upstream.read_at = info, time.time()
        now = self.admits(upstream)
        if was == now:
            return None
        role = upstream.info.role.value
        if now:
            return f"{role} worker {upstream.url} is in rotation again: KV pool {upstream.info.kv_pool_tokens} tokens"
        if info is None:
            return f"{role} worker {upstream.url} did not answer: out of rotation until it reports its limits again"
        why = pool_problem(info, self.min_kv_ratio) or f"page size {info.page_size}, not {self.page_size}"
        return f"{role} worker {upstream.url} {why}: kept out of rotation (S7)"

    def pair(self) -> tuple[Upstream, Upstream]:
        chosen = []
        for role in (Role.PREFILL, Role.DECODE):
            serving = self.serving(role)
            if not serving:
                # Retry-After as every other 503 here says it: a worker is read again every second
                # (refresh_interval_s), and one that answers comes back then (an outside probe).
                raise OpenAIError(503, f"no {role.value} worker is serving: none answers, or none passes its KV pool "
                                  "check (S7); the model is not serving", code="not_ready", retry_after_s=1)  # fmt: skip
            chosen.append(serving[self._turns[role] % len(serving)])
            self._turns[role] += 1
        return chosen[0], chosen[1]

    def _limits_of(self) -> list[Upstream]:
        serving = self.serving(Role.PREFILL) + self.serving(Role.DECODE)
        return serving or self.prefill + self.decode  # none serving: pair() refuses anyway

    @property
    def context_length(self) -> int:
        return min(u.info.context_length for u in self._limits_of())

    @property
    def smallest_pool(self) -> int:
        return min(u.info.kv_pool_tokens for u in self._limits_of())

    @property
    def smallest_decode_pool(self) -> int:
        return min(u.info.kv_pool_tokens for u in self.serving(Role.DECODE) or self.decode)

    @property
    def vocab_size(self) -> int | None:
        """The smallest vocabulary among the workers (None: none reports one)."""
        sizes = [u.info.vocab_size for u in self._limits_of() if u.info.vocab_size is not None]
        return min(sizes) if sizes else None

    @property
    def request_limit(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context, or a smaller pool
        (only under --allow-small-pool). What /v1/models reports as max_model_len."""
        return min(self.context_length, self.smallest_pool)


async def fetch_info(session: aiohttp.ClientSession, control: ControlClient, url: str, role: Role) -> WorkerInfo:
    """A worker's reported limits; ValueError when the URL is a worker of another role."""
    async with control.get(session, f"{url}/internal/info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        resp.raise_for_status()
        worker = WorkerInfo.model_validate(await resp.json())
    if worker.role is not role:
        raise ValueError(f"{url} is a {worker.role.value} worker, expected {role.value}")
    return worker


async def fetch_upstreams(session: aiohttp.ClientSession, config: RouterConfig, control: ControlClient) -> Upstreams:
    """Ask every worker for its limits, waiting for workers that are still starting (in a pod the
    router may well start first). A misconfiguration -- a URL pointing at the wrong role, or
    workers that disagree on the page size -- raises ValueError."""
    if config.discovery == "dns":
        return await _fetch_resolved_upstreams(session, config, control)

    async def info(url: str, role: Role) -> Upstream:
        while True:
            try:
                return Upstream(url, await fetch_info(session, control, url, role))
            except (TimeoutError, aiohttp.ClientError):
                await asyncio.sleep(0.2)

    prefill = await asyncio.gather(*(info(u, Role.PREFILL) for u in config.prefill_urls))
    decode = await asyncio.gather(*(info(u, Role.DECODE) for u in config.decode_urls))
    return Upstreams(prefill, decode, config.min_kv_ratio)


async def resolve_workers(urls: Sequence[str]) -> list[str] | None:
    """Every worker the URLs' names resolve to now (`--discovery dns`); None when a resolver
    failed (the set is unknown: keep what is known)."""
    try:
        found = await asyncio.gather(*(resolve(url) for url in urls))
    except NoAnswer as exc:
        log.warning("cannot resolve the workers' names now: %s", exc)
        return None
    return sorted({url for urls_of_name in found for url in urls_of_name})


async def read_workers(session: aiohttp.ClientSession, control: ControlClient, urls: Sequence[str], role: Role) -> list[Upstream]:
    """The workers among `urls` that report their limits now (one that does not is tried again at
    the next refresh). A worker of another role behind the name is left out alone, and logged: one
    mislabelled pod kept every pod read in the same pass out of the rotation, at every pass for as
    long as it was named (review: the ValueError failed the whole gather)."""
    async def read(url: str) -> Upstream | None:
        try:
            return Upstream(url, await fetch_info(session, control, url, role))
        except (TimeoutError, aiohttp.ClientError, ValidationError):
            return None
        except ValueError as exc:  # fetch_info's wrong role: never in rotation
            log.error("router: %s: left out of the rotation", exc)
            return None

    return [u for u in await asyncio.gather(*(read(url) for url in urls)) if u is not None]


async def _fetch_resolved_upstreams(session: aiohttp.ClientSession, config: RouterConfig, control: ControlClient) -> Upstreams:
    """`--discovery dns` at start: wait until at least one worker of each role resolves and
    reports its limits (a headless Service names a pod only once it is ready)."""
    while True:
        found: dict[Role, list[Upstream]] = {}
        for role, urls in ((Role.PREFILL, config.prefill_urls), (Role.DECODE, config.decode_urls)):
            resolved = await resolve_workers(urls)
            found[role] = await read_workers(session, control, resolved, role) if resolved else []
        if found[Role.PREFILL] and found[Role.DECODE]:
            return Upstreams(found[Role.PREFILL], found[Role.DECODE], config.min_kv_ratio)
        await asyncio.sleep(0.5)


@dataclass
class _Legs:
    """One request's two legs while the router drives them (`Router._generate`), and how they end."""

    prefill: Upstream
    decode: Upstream
    prefill_task: asyncio.Task[None]
    ticket: asyncio.Future[str]  # decode's bootstrap, signed for prefill (S9)
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)  # decode's answer, held open
    channel: OpenChannel | None = None  # the token channel the request was handed to, if any
    cause: str = AbortCause.CLIENT_DISCONNECT  # the abort cause; "" once it finished cleanly
    outcome: str = "aborted"
    unreachable: str | None = None  # a worker not to send the aborts to


class Router:
    def __init__(
        self, config: RouterConfig, encoder: PromptEncoder, keys: RevisionKeys, metrics: RouterMetrics | None = None
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.metrics = metrics or RouterMetrics()
        self._threads = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="kvguard-tokenize")
        self.control = ControlClient(keys)
        self.tickets = TicketAuthority(keys.ticket)
        self.ticket_ttl_s = min(config.request_timeout_s, MAX_TICKET_TTL_S)
        self._started = int(time.time())  # a model card's `created`: when this router began serving it
        self._upstreams: Upstreams | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._namer: asyncio.Task[None] | None = None
        """`--discovery dns`: reads the workers' names, on its own (a slow resolver must not hold
        up the reads that take a dead worker out of rotation)."""
        self._rereading: dict[str, asyncio.Task[None]] = {}
        """Worker URL -> the read of its info that a refused call started (`_reread`)."""
        self._aborts_in_flight: set[asyncio.Task[None]] = set()
        """Generations' legs being ended (`_end_legs`), each in a task of its own: on shutdown their
        aborts go out before the session closes, so the workers learn each request's cause."""
        self._slots = Slots(config.max_inflight_choices)
        """One per generation with calls open to workers, taken per request (`_take_slots`)."""
        self._shared_room: Slots | None = None
        """Decode pool tokens every request of several choices shares, router-wide (`_pace`)."""
        self._draining = Draining(config.max_inflight_choices, config.write_timeout_s)
        """Generations that ended at the workers whose clients still read them (`SlotLease`)."""
        self._bodies = BodyMemory(config.max_body_memory, on_refused=self.metrics.bodies_refused.inc)
        """Request bodies being read or parsed, in bytes (`_parse`)."""
        self.metrics.body_memory.set_function(lambda: self._bodies.held)
        self._channels: dict[str, ChannelReader] = {}
        """Decode worker URL -> the token channel to it (with `token_channel`)."""
        self._retiring: set[str] = set()
        """Workers no longer named (`--discovery dns`) whose token channel closes once idle."""
        self._departed: collections.OrderedDict[str, SignedFor] = collections.OrderedDict()
        """URL -> the instance (as last read) of workers that left the rotation's list, for the
        calls that end their requests (aborts); the newest DEPARTED_REMEMBERED."""
        self._suspect: set[str] = set()
        """Workers whose connection failed mid-request: read again before the next signed call to
        them. Only listed workers, and a worker leaves it as it leaves the list: it stays bounded."""
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self._handlers: set[asyncio.Task[web.StreamResponse]] = set()
        """The tasks answering requests: what a draining router finishes (servers.Drain waits for
        none), and `end_in_flight` ends when the drain's grace is over."""
        self._cut: set[asyncio.Task[web.StreamResponse]] = set()
        self._workers_health = SharedCheck(self._check_workers, WORKERS_HEALTH_FRESH_S)
        """What /health says of the workers: one check at a time for every caller (`SharedCheck`)."""

    @property
    def upstreams(self) -> Upstreams:
        """The workers, once discovered; until then every endpoint answers 503 (not ready)."""
        if self._upstreams is None:
            raise OpenAIError(503, "the router is still waiting for its prefill and decode workers", code="not_ready",
                              retry_after_s=1)  # fmt: skip
        return self._upstreams

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router has not started"
        return self.session

    # -- lifecycle -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._close_while_draining, error_middleware], client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=self._expect)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model_card)
        app.router.add_get("/health", self.health)
        app.on_response_prepare.append(_echo_label)
        if self.config.revision is not None:
            app.on_response_prepare.append(self._name_revision)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def metrics_app(self) -> web.Application:
        """The read-only listener for scrapers and probes: /metrics and /health, apart from the API."""
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/health", self.health)
        app.router.add_get("/livez", self.live)
        return app

    async def _start(self, _: web.Application) -> None:
        # Never the bottleneck (CONNECTIONS_PER_CHOICE): aiohttp's default cap of 100 queued the 21st generation.
        connector = aiohttp.TCPConnector(limit=CONNECTIONS_PER_CHOICE * self.config.max_inflight_choices + SPARE_CONNECTIONS)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._discovery = asyncio.create_task(self._discover())

    async def _discover(self) -> None:
        while True:
            try:
                upstreams = await fetch_upstreams(self.http, self.config, self.control)
                await asyncio.to_thread(lambda: self.encoder.max_token_bytes)  # a pass over the vocabulary, once
                self._upstreams = upstreams
            except ValueError as exc:  # misconfigured: stay not-ready, say why, look again
                log.error("router cannot serve: %s", exc)
                await asyncio.sleep(5)
                continue
            log.info(
                "router ready: context %d tokens, smallest KV pool %d tokens",
                self._upstreams.context_length,
                self._upstreams.smallest_pool,
            )
            self._count_kept_out(upstreams)
            for upstream in upstreams.kept_out():
                log.warning("%s worker %s %s: kept out of rotation (S7)", upstream.info.role.value, upstream.url,
                            pool_problem(upstream.info, upstreams.min_kv_ratio))  # fmt: skip
            # Always, S7 gate or not: a worker that is down or hung must leave the rotation.
            self._refresher = asyncio.create_task(self._keep_fresh(upstreams))
            if self.config.discovery == "dns":
                self._namer = asyncio.create_task(self._follow_names_forever(upstreams))
            # What the router holds for good from here (modules, the tokenizer, its vocabulary's
            # bytes) leaves the garbage collector's full passes: each walked it all holding the
            # GIL, ~40 ms of every tenant's event loop, many times a second under container-heavy
            # bodies (an outside probe). Objects made later are collected as before; start-up's
            # own cyclic garbage is collected first, not kept for good (a review).
            gc.collect()
            gc.freeze()
            return

    async def _keep_fresh(self, upstreams: Upstreams) -> None:
        """Read every worker's limits again every refresh interval: a worker restarted with a
        smaller pool leaves the rotation, one that reports enough again comes back (S7); one that
        is down, or hung for MAX_SILENT_READS reads, is out until it answers. (With `--discovery
        dns`, `_follow_names_forever` adds and removes workers beside this loop.)"""
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            for upstream in upstreams.prefill + upstreams.decode:
                info: WorkerInfo | None
                try:
                    info = await fetch_info(self.http, self.control, upstream.url, upstream.info.role)
                except aiohttp.ClientConnectorError:
                    info = None  # down or restarting (refused): out until it answers, then judged by what it reports
                except TimeoutError:
                    upstream.silent_reads += 1
                    if upstream.silent_reads < MAX_SILENT_READS:
                        continue  # slow once: no verdict either way (a busy worker is not taken out)
                    info = None  # silent for MAX_SILENT_READS reads: hung, out until it answers
                except (aiohttp.ClientError, ValueError, ValidationError):
                    continue  # garbled once: no verdict either way
                else:
                    upstream.silent_reads = 0
                if (change := upstreams.refresh(upstream, info)) is not None:
                    log.warning("%s", change)
            self._count_kept_out(upstreams)  # every pass, whatever path a worker took to where it is

    async def _follow_names_forever(self, upstreams: Upstreams) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self._follow_names(upstreams)

    def _reread(self, url: str) -> asyncio.Task[None] | None:
        """A read of the info of the worker at `url` now, not at the next refresh (it refused a call
        signed for the instance last read there): the one in progress for that worker (one at a
        time, shared by every refused call), or None for a worker not in rotation."""
        upstreams = self._upstreams
        upstream = upstreams.at(url) if upstreams else None
        if upstreams is None or upstream is None:
            return None
        if (reading := self._rereading.get(url)) is not None:
            return reading

        async def reread() -> None:
            try:
                info = await fetch_info(self.http, self.control, url, upstream.info.role)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                return  # the refresher's next read decides
            finally:
                del self._rereading[url]
            self._suspect.discard(url)
            if (change := upstreams.refresh(upstream, info)) is not None:
                log.warning("%s", change)

        self._rereading[url] = task = asyncio.create_task(reread())
        return task

    async def _restarted_since(self, url: str, signed_for: SignedFor) -> bool:
        """Whether the worker at `url`, read again now, is another instance than the one a refused
        call was signed for, and one the rotation admits (S7: a restart may come back with a
        smaller pool or another page size). The launcher and a pod restart keep the address, so
        calls queued through a restart reach the new process signed for the old one."""
        if (reading := self._reread(url)) is not None:
            await asyncio.shield(reading)  # bounded by fetch_info's timeout; shared by every refused call
        upstreams = self._upstreams
        upstream = upstreams.at(url) if upstreams is not None else None
        if upstreams is None or upstream is None or not upstreams.admits(upstream):
            return False
        instance = upstream.info.instance
        return bool(instance) and instance not in (signed_for.instance, ANY_WORKER)

    @contextlib.asynccontextmanager
    async def _control_call(self, url: str, path: str, message: BaseModel,
                            timeout: aiohttp.ClientTimeout) -> AsyncIterator[aiohttp.ClientResponse]:  # fmt: skip
        """A call that acts on the worker at `url`, signed for its instance (S9), and sent once more
        if that worker refused the signature (401) and has since been read as a new instance. A
        refused call did nothing there (a worker checks the signature before anything else), so
        sending it again is safe; it is signed anew, so it is no replay."""
        for last in (False, True):
            signed_for = await self._signed_for(url)
            async with self.control.post(self.http, f"{url}{path}", message, signed_for, timeout=timeout) as resp:
                if last or resp.status != 401 or not await self._restarted_since(url, signed_for):
                    yield resp
                    return
            log.info("%s%s refused a call signed for its previous instance; sending it once more", url, path)

    async def _follow_names(self, upstreams: Upstreams) -> None:
        for role, urls in ((Role.PREFILL, self.config.prefill_urls), (Role.DECODE, self.config.decode_urls)):
            resolved = await resolve_workers(urls)
            if resolved is None:
                continue
            change = membership_change([u.url for u in upstreams.of(role)], resolved)
            for url in change.removed:
                if (gone := upstreams.at(url)) is not None:
                    self._depart(gone)
                upstreams.remove(role, url)
                self._retiring.add(url)
                log.info("%s worker %s is no longer named: no new requests go to it", role.value, url)
            for upstream in await read_workers(self.http, self.control, change.added, role):
                upstreams.add(upstream)
                self._retiring.discard(upstream.url)
                log.info("%s worker %s joined: KV pool %d tokens", role.value, upstream.url, upstream.info.kv_pool_tokens)
        await self._close_retired_channels()

    async def _signed_for(self, url: str) -> SignedFor:
        """The instance a call to `url` is signed for: as last read, or read again first after a
        connection to it failed mid-request. A launcher or a pod restart keeps the address, and a
        call signed for the old instance was refused and counted as an S9 refusal with no attacker
        (an outside probe: the trust-boundary alert fired on worker crashes)."""
        if url in self._suspect and (reading := self._reread(url)) is not None:
            await asyncio.shield(reading)  # bounded by fetch_info's timeout; shared by every call meanwhile
        return self._target(url)

    def _target(self, url: str) -> SignedFor:
        """The instance id of the worker at `url`, as last read, and when: calls that act are
        signed for it alone (S9, workers/control_auth.py)."""
        upstream = self._upstreams.at(url) if self._upstreams is not None else None
        if upstream is not None and upstream.info.instance:
            return SignedFor(upstream.info.instance, upstream.read_at)
        return self._departed.get(url, SignedFor(ANY_WORKER))

    def _depart(self, upstream: Upstream) -> None:
        self._suspect.discard(upstream.url)  # a read before its next call: there is none (review: the set only grew)
        if upstream.info.instance:
            self._departed[upstream.url] = SignedFor(upstream.info.instance, upstream.read_at)
            self._departed.move_to_end(upstream.url)
            while len(self._departed) > DEPARTED_REMEMBERED:
                self._departed.popitem(last=False)

    async def _close_retired_channels(self) -> None:
        """The token channel to a worker that left closes once no request waits on it: its
        requests still finish on it (a draining pod finishes what it holds)."""
        for url in list(self._retiring):
            reader = self._channels.get(url)
            if reader is None or not reader.busy:
                self._retiring.discard(url)
                if reader is not None:
                    del self._channels[url]
                    await reader.close()

    def _count_kept_out(self, upstreams: Upstreams) -> None:
        for role in (Role.PREFILL, Role.DECODE):
            self.metrics.kept_out.labels(role.value).set(sum(1 for u in upstreams.kept_out() if u.info.role is role))

    async def _stop(self, _: web.Application) -> None:
        for task in (self._discovery, self._refresher, self._namer, *self._rereading.values()):
            if task is not None:
                task.cancel()
        self._workers_health.cancel()
        if self._aborts_in_flight:  # the handlers cancelled by the shutdown have just sent theirs
            await asyncio.wait(set(self._aborts_in_flight), timeout=self.config.abort_timeout_s)
        for reader in self._channels.values():
            await reader.close()
        if self.session:
            await self.session.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -- endpoints -------------------------------------------------------------------------
    def _card(self) -> ModelCard:
        return ModelCard(id=self.config.model_name, created=self._started, max_model_len=self.upstreams.request_limit)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(ModelList(data=[self._card()]).model_dump(mode="json"))

    async def model_card(self, request: web.Request) -> web.Response:
        card = self._card()
        if request.match_info["model_id"] != card.id:
            raise _unknown_model(request.match_info["model_id"])
        return web.json_response(card.model_dump(mode="json"))

    async def health(self, _request: web.Request) -> web.Response:
        """Ready when every worker in rotation answers its internal health check, and each role
        has one (workers kept out for S7 do not count). Says which role failed, never where the
        worker lives (this answer reaches the public). The rotation is read as it is now; the
        workers' answers are shared by every caller for up to WORKERS_HEALTH_FRESH_S (`SharedCheck`)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        upstreams = self.upstreams
        for role in (Role.PREFILL, Role.DECODE):
            if not upstreams.serving(role):  # out of rotation: for its pool (S7) if any answers, else because none does
                workers = upstreams.prefill if role is Role.PREFILL else upstreams.decode
                why = "kv_pool_too_small" if any(u.reachable for u in workers) else "unreachable"
                return web.json_response({"status": why, "role": role.value}, status=503)
        answer = await self._workers_health.get()
        return web.json_response(answer, status=200 if answer["status"] == "ok" else 503)

    async def live(self, _request: web.Request) -> web.Response:
        """Liveness: this process answers. Not the workers' health, which /health (readiness) says:
        a router restarted because a worker is down comes back to the same worker."""
        return web.json_response({"status": "ok"})

    async def _check_workers(self) -> dict[str, str]:
        """{"status": "ok"}, or why and which role is not: every worker in rotation asked at once."""
        checks = [(role, self._worker_health(u)) for role in (Role.PREFILL, Role.DECODE) for u in self.upstreams.serving(role)]
        answers = await asyncio.gather(*(check for _, check in checks))
        for (role, _), status in zip(checks, answers, strict=True):
            if status != "ok":
                return {"status": status, "role": role.value}
        return {"status": "ok"}

    async def _worker_health(self, upstream: Upstream) -> str:
        try:
            async with self.control.get(self.http, f"{upstream.url}/internal/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return "ok" if r.status == 200 else "unhealthy"
        except (TimeoutError, aiohttp.ClientError):
            return "unreachable"
        except Exception:  # noqa: BLE001 -- an answer for every caller of the shared check, never a 500 (a review)
            log.exception("health check of a %s worker failed", upstream.info.role.value)
            return "unreachable"

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    # -- one request -----------------------------------------------------------------------
    @web.middleware
    async def _close_while_draining(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer of a draining router closes its connection (a model list, a 404 and a
        health check too): a client kept connected, polling, would be cut with no answer when the
        router stops (an outside probe). Before the answer is prepared, so it says `Connection: close`."""
        response = await handler(request)
        if self.draining:
            response.force_close()
        return response

    @property
    def in_flight(self) -> int:
        """Requests being answered."""
        return len(self._handlers)

    def start_draining(self) -> None:
        """SIGTERM (servers.Drain): no new requests reach this router; /health says so."""
        self.draining = True

    async def end_in_flight(self, wait_s: float = 2.0) -> None:
        """The drain's grace is over: end every request still going, each with a `shutting_down`
        error its client can read (a stream's last event, or a 503), its legs aborted (S4) --
        not a connection closed under it when the server stops."""
        self._cut = set(self._handlers)
        for task in self._cut:
            task.cancel()
        if self._cut:
            await asyncio.wait(self._cut, timeout=wait_s)

    async def _serve(self, request: web.Request, kind: type[RequestKind], chat: bool) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            return await self._answer(request, kind, chat)
        except asyncio.CancelledError:
            if task not in self._cut or request.get(STREAMING):
                raise  # the client left, or the stream already ended with its error event (_relay)
            task.uncancel()
            return self._error_response(_SHUTTING_DOWN)
        finally:
            self._handlers.discard(task)

    async def _answer(self, request: web.Request, kind: type[RequestKind], chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()  # the latency histograms count from here (RouterMetrics)
        if self.draining:  # a request on a connection kept open from before: go elsewhere (and reconnect)
            return self._error_response(_SHUTTING_DOWN)
        try:
            upstreams = self.upstreams  # not ready: 503 before anything else
        except OpenAIError as err:  # ended, failed: the analysis' error ratio sees a router without workers
            self.metrics.requests.labels("failed").inc()
            return self._error_response(err)
        try:
            request_id = self._claim_id(request, chat)
            body = await self._parse(request, kind, upstreams)
            self._check_choices(body)  # before any tokenizing: a million one-word prompts is refused for free
            prompts = await self._tokenize(body, upstreams)
        except OpenAIError as err:
            return self._error_response(err)
        try:
            self._fail_if_injected(request)
            choices = self._plan(body, prompts, request_id, chat)
            builder = ResponseBuilder(
                request_id, body.model, chat, self.encoder, logprobs=body.logprobs_wanted() is not None,
                echo=[p.text for p in prompts for _ in range(body.choices_per_prompt)], include_usage=body.include_usage,
            )
            prompt_tokens = sum(len(p.ids) for p in prompts)
            siblings = Siblings(await self._take_slots(len(choices), arrived), self.config.request_timeout_s)
            lease = SlotLease(self._slots, len(choices), self._draining, functools.partial(self._evict, request))
            ending: list[asyncio.Task[None]] = []  # the legs of generations that ended early, being aborted
            try:
                generate: Generate = functools.partial(self._generate, ending=ending, siblings=siblings, arrived=arrived, lease=lease)
                if (pace := self._pace(choices, arrived)) is not None:
                    generate = functools.partial(_paced, pace, siblings, generate)
                if body.streaming:
                    return await self._stream(request, choices, builder, body, prompt_tokens, generate)
                return await self._send(request, await self._whole(choices, builder, prompt_tokens, generate))
            finally:
                self._release_slots_after(lease, ending)
        except OpenAIError as err:
            return self._error_response(err)

    async def _take_slots(self, count: int, arrived: float) -> float:
        """One slot per generation, all at once (`backpressure.Slots`), before any worker allocates
        anything; returns the loop time by which the first token must come: the request waits
        --request-timeout in all, here and on the workers."""
        if count > self._slots.capacity:
            raise OpenAIError(400, f"n: {count} choices are more than this router runs at once "
                              f"(--max-inflight-choices {self._slots.capacity})", param="n", code="integer_above_max_value")  # fmt: skip
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        self.metrics.waiting_choices.inc(count)
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire(count)
        except TimeoutError:
            self.metrics.requests.labels("failed").inc(count)  # per generation, as every leg that ends counts
            for _ in range(count):
                self.metrics.request_duration.observe(time.monotonic() - arrived)
            raise OpenAIError(504, "the request timed out waiting for the router's capacity", code="timeout") from None
        except asyncio.CancelledError:  # the client left while they waited: they ended (no worker has them)
            self.metrics.aborts.labels("client_disconnect").inc(count)
            self.metrics.requests.labels("aborted").inc(count)
            raise
        finally:
            self.metrics.waiting_choices.dec(count)
        return deadline

    def _release_slots_after(self, lease: SlotLease, ending: Sequence[asyncio.Task[None]]) -> None:
        """The request's slots still held go back once every leg it aborted has ended: until a
        worker has acknowledged an abort (or the wait for it timed out), the request still holds its
        pages there, and the slots bound what the workers hold (`backpressure.Slots`). A generation
        that ended at the workers gave its own back already (`_generate`, `SlotLease`)."""
        lease.close()
        if pending := [task for task in ending if not task.done()]:
            asyncio.gather(*pending, return_exceptions=True).add_done_callback(lambda _: lease.release_rest())
        else:
            lease.release_rest()

    def _pace(self, choices: Sequence[Choice], arrived: float | None = None) -> ChoicePace | None:
        """The room in decode's KV pool that a request of several choices takes turns in (None: one
        choice, not paced).

        Decode reserves every page a choice can need (prompt + max_tokens) when it admits it, and
        admits in arrival order: one `n: 16` request of a thousand tokens each (an outside probe),
        or two choices of a chat left without max_tokens (the rest of the context each), took the
        whole pool, and every other tenant waited for all of it. A request's choices now start as
        earlier ones leave room (`_paced`) for one whole request of another tenant; one choice
        alone is always let in. The room is shared by every request of several choices on this
        router: two such requests, each paced alone, still took the whole pool together, and a
        one-choice tenant waited 2-4 s for them (an outside probe). Requests take turns in it, a
        choice each (`ChoicePace.turn`), so a small request of two choices does not wait for all
        of a large one's to start. Half the pool is always theirs (a pool under twice the context,
        --allow-small-pool, leaves no whole request's room), and the smallest decode pool is what
        counts: prefill holds a prompt only until it has sent it, and choices spread over several
        decode workers only make the pacing cautious."""
        if len(choices) < 2:
            return None
        upstreams = self.upstreams
        pool = upstreams.smallest_decode_pool
        room = max(pool - upstreams.request_limit, pool // 2)
        if self._shared_room is None:
            self._shared_room = Slots(room)
        elif self._shared_room.capacity != room:
            # The workers' pools changed (a worker joined or left, or its health flapped): the one
            # room takes the new size, the choices started before still counted in it. A new room
            # each time admitted a whole room more at every change (a review: a flapping worker).
            self._shared_room.resize(room)
        started = time.monotonic() if arrived is None else arrived

        def ended(cause: str, outcome: str) -> None:  # as a choice that ended waiting for a router slot counts
            if cause != AbortCause.TIMEOUT:  # (a timeout here is counted as one for a router slot: no abort)
                self.metrics.aborts.labels(cause).inc()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.request_duration.observe(time.monotonic() - started)

        return ChoicePace(self._shared_room, upstreams.page_size, asyncio.Lock(), ended, self.metrics.room_waiting_choices.inc)

    def _evict(self, request: web.Request) -> None:
        """`Draining` gave this client's place to a generation that ended: every place is taken by
        clients still reading answers the workers finished, and this one has been for longest,
        over --write-timeout. With handler_cancellation its handler then ends (`_watch`)."""
        log.warning("request %s: its client has read its finished answer for over %gs while the router "
                    "is full of such readers; its connection is reset", request.get(_LABEL_KEY), self.config.write_timeout_s)  # fmt: skip
        drop(request.transport)

    def _watch(self, request: web.Request) -> StallWatch:
        """A client that reads none of its answer for write_timeout_s loses the connection: it would
        otherwise hold it, and the output buffered for it, for ever (a full receive window blocks a
        write; nothing else times out). Reading slowly is not stalling (`backpressure.StallWatch`)."""

        def drop_connection() -> None:
            # With handler_cancellation (servers.app_runner) the handler is then cancelled, and the
            # legs of its generations are aborted as for a disconnect (S4).
            log.info("request %s: the client read nothing for %gs; its connection is reset",
                     request.get(_LABEL_KEY), self.config.write_timeout_s)  # fmt: skip
            drop(request.transport)

        return StallWatch(request.transport, self.config.write_timeout_s, drop_connection)

    async def _send(self, request: web.Request, response: web.Response) -> web.Response:
        """A whole answer, under the same watch as a stream's writes."""
        watch = self._watch(request)
        try:
            with watch:
                await response.prepare(request)
                await response.write_eof()
        finally:
            watch.close()
        return response

    def _fail_if_injected(self, request: web.Request) -> None:
        """The fail_proxied_requests fault (test only): a revision that fails live traffic -- what
        reaches it through a Gateway or the local splitter, which add X-Forwarded-For -- while the
        canary's direct probes pass. The rollout's analysis must catch it at the first step."""
        if self.config.fail_proxied_requests and FORWARDED_FOR_HEADER in request.headers:
            self.metrics.requests.labels("failed").inc()
            raise OpenAIError(500, "injected fault: fail_proxied_requests", code="engine_error")

    async def _parse(self, request: web.Request, kind: type[RequestKind], upstreams: Upstreams) -> RequestKind:
        """The body, validated strictly (openai_requests.py): every limit is a 4xx naming its parameter.
        Its bytes count against --max-body-memory until it is parsed (`BodyMemory`)."""
        with self._bodies.reading() as lease:
            if request.content_length is not None and request.content_length > self.config.max_body_bytes:
                raise too_large_error(self.config.max_body_bytes)  # from its headers, before a 415 for its coding
            _check_body_headers(request.headers)
            raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s, lease)
            try:
                most = MAX_JSON_ITEMS + self.config.max_choices * upstreams.context_length  # token-id prompts
                body = await self._off_loop(len(raw), _shaped_and_validated, kind, raw, most)
            except ValidationError as exc:
                raise validation_error(exc) from None
            del raw  # the lease ends with the bytes: the parsed body is bounded by what it may hold
        body.check_supported()
        if body.model != self.config.model_name:
            raise _unknown_model(body.model)
        return body

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        return await answer_expect(request, self.config.max_body_bytes, self._bodies)

    async def _off_loop(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """fn(*args), on a tokenizer thread when the input is large, so the event loop keeps serving."""
        if size <= self.config.inline_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def _prompt_byte_limit(self, upstreams: Upstreams) -> int:
        """No text longer than this can fit the context: each token covers at most max_token_bytes."""
        return min(upstreams.context_length * self.encoder.max_token_bytes, self.config.max_body_bytes)

    async def _tokenize(self, body: APIRequest, upstreams: Upstreams) -> list[Prompt]:
        limit = self._prompt_byte_limit(upstreams)
        if isinstance(body, ChatCompletionRequest):
            size = sum(m.template_bytes() for m in body.messages)
            if size > limit:
                raise self._rejected_for_length(request_too_large("messages", size, limit, upstreams.context_length))
            if len(body.messages) > upstreams.context_length:  # a template writes a role token or more per message
                raise self._rejected_for_length(OpenAIError(
                    400, f"messages: {len(body.messages)} messages cannot fit this model's context of "
                    f"{upstreams.context_length} tokens. Please reduce the number of messages.",
                    code="context_length_exceeded", param="messages"))  # fmt: skip
            # The template adds text per message: an empty message still costs a render, so the
            # off-loop decision counts it (the limit above stays on what the client sent).
            work = size + CHAT_MESSAGE_RENDER_BYTES * len(body.messages) + body.template_variables_bytes()
            return [Prompt(await self._encode_chat(body, work, limit, upstreams.context_length))]
        prompts = []
        for prompt in body.prompts():
            if isinstance(prompt, list):
                self._check_token_ids("prompt", prompt, upstreams)
                text = await self._off_loop(len(prompt), self.encoder.decode, prompt) if body.echo else ""
                prompts.append(Prompt(prompt, text))
                continue
            size = len(prompt.encode())
            if size > limit:
                raise self._rejected_for_length(request_too_large("prompt", size, limit, upstreams.context_length))
            ids = await self._off_loop(size, self.encoder.encode, prompt, body.add_special_tokens is not False)
            if not ids:
                raise OpenAIError(400, "prompt: the prompt is empty", param="prompt", code="invalid_value")
            prompts.append(Prompt(ids, prompt if body.echo else ""))
        return prompts

    def _check_token_ids(self, param: str, ids: Sequence[int], upstreams: Upstreams) -> None:
        """A token id the model does not have is the client's error, refused here: a worker would
        refuse it too, but only after the request's other prompts had been prefilled and sent, and
        the router would count the request failed (a rollout's error ratio) instead of rejected."""
        vocab = upstreams.vocab_size
        if vocab is not None and ids and max(ids) >= vocab:
            self.metrics.rejected.labels("invalid_value").inc()
            self.metrics.requests.labels("rejected").inc()
            raise OpenAIError(400, f"{param}: token ids must be in [0, {vocab})", param=param, code="invalid_value")

    async def _encode_chat(self, body: ChatCompletionRequest, size: int, limit: int, context_length: int) -> list[int]:
        """The rendered prompt's ids. Rendering stops at `limit` characters, the byte limit the
        messages were held to: chat_template_kwargs reach the template unbounded by it, and a
        template may write them at many times their size (tojson with indent)."""
        from jinja2 import TemplateError

        options = replace(body.template_options(), max_chars=limit)
        try:
            ids = await self._off_loop(size, self.encoder.encode_chat, body.template_messages(), options)
        except PromptTooLong:
            raise self._rejected_for_length(OpenAIError(
                400, f"messages: the rendered prompt is over {limit} characters, more than can fit this model's context "
                f"of {context_length} tokens (messages and chat_template_kwargs as the chat template writes them)",
                code="context_length_exceeded", param="messages")) from None  # fmt: skip
        except (TemplateError, ValueError) as exc:  # the model's template refused these messages
            raise OpenAIError(400, f"messages: {exc}", param="messages", code="invalid_value") from None
        if not ids:
            raise OpenAIError(400, "messages: the rendered prompt is empty", param="messages", code="invalid_value")
        return ids

    def _claim_id(self, request: web.Request, chat: bool) -> str:
        """A fresh internal id (S9). The client's X-Request-Id is only a label: validated, echoed and
        logged beside the id, never used to find, merge or abort anything, so a retry that keeps
        its label is just a new request, and no client can reach another's work by naming it."""
        labels = request.headers.getall(REQUEST_ID_HEADER, [])
        label = labels[0] if labels else None
        if len(labels) > 1 or (label is not None and not _LABEL.fullmatch(label)):
            self.metrics.rejected.labels("invalid_request_id").inc()
            raise OpenAIError(400, f"{REQUEST_ID_HEADER} must be one header of 1-128 visible ASCII characters",
                              code="invalid_request_id", param=REQUEST_ID_HEADER)  # fmt: skip
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(16)}"
        request[_LABEL_KEY] = label or request_id
        if label is not None:
            log.info("request %s: %s %s", request_id, REQUEST_ID_HEADER, label)
        return request_id

    def _check_choices(self, body: APIRequest) -> None:
        """At most max_choices generations per request (prompts x n)."""
        n = body.choices_per_prompt
        prompts = 1 if isinstance(body, ChatCompletionRequest) else len(body.prompts())
        if prompts * n > self.config.max_choices:
            param = "n" if n > 1 else "prompt"
            # the code of the one number a client would lower: n alone, the prompt list alone, or their product
            code = "integer_above_max_value" if prompts == 1 else "array_above_max_length" if n == 1 else "invalid_value"
            raise OpenAIError(400, f"{param}: {prompts} prompt(s) x n={n} asks for more than "
                              f"{self.config.max_choices} choices per request", param=param, code=code)

    def _plan(self, body: APIRequest, prompts: list[Prompt], request_id: str, chat: bool) -> list[Choice]:
        """One Choice per (prompt, n) (`_check_choices` bounded them): S2 at intake for each
        prompt, then a seed per choice."""
        n = body.choices_per_prompt
        base = body.sampling()
        self._check_token_ids("stop_token_ids", base.stop_token_ids, self.upstreams)
        self._check_token_ids("logit_bias", [t for t, _ in base.logit_bias], self.upstreams)
        choices = []
        for p, prompt in enumerate(prompts):
            max_tokens, over_length = self._intake(len(prompt.ids), base.max_tokens, "messages" if chat else "prompt",
                                                   body.budget_param())
            if base.min_tokens > max_tokens:  # max_tokens was absent: the rest of the context (vLLM refuses it too)
                raise OpenAIError(400, f"min_tokens ({base.min_tokens}) must be at most the {max_tokens} tokens "
                                  f"left in the context after the prompt", param="min_tokens", code="invalid_value")  # fmt: skip
            for j in range(n):
                index = p * n + j
                seed = choice_seed(base.seed, j) if base.seed is not None else None
                sampling = base.model_copy(update={"max_tokens": max_tokens, "seed": seed})
                choices.append(Choice(index, GenerateRequest(
                    request_id=request_id if len(prompts) * n == 1 else f"{request_id}-{index}",
                    prompt_token_ids=tuple(prompt.ids), sampling=sampling, over_length=over_length,
                )))  # fmt: skip
        return choices

    def _intake(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str, budget_param: str = "max_tokens") -> tuple[int, bool]:
        """S2: reject what the context or the smallest KV pool on the path cannot hold, before any work.
        Resolves an absent max_tokens to the rest of the context (OpenAI, vLLM).

        Returns max_tokens and whether the request is over-length (only possible under the
        unsafe_reject_path fault)."""
        if max_tokens is None:
            room = self.upstreams.request_limit - prompt_tokens
            max_tokens = max(1, room)
        needed = prompt_tokens + max_tokens
        for limit, what in (
            (self.upstreams.context_length, "model's context length"),
            (self.upstreams.smallest_pool, "KV cache pool"),
        ):
            if needed > limit:
                if self.config.unsafe_reject_path:
                    return max_tokens, True
                raise self._rejected_for_length(context_length_exceeded(prompt_tokens, max_tokens, limit, what, prompt_param, budget_param))
        return max_tokens, False

    def _rejected_for_length(self, error: OpenAIError) -> OpenAIError:
        """S2's refusal, counted once as rejected wherever it is found: by the text's bytes before
        tokenizing (no text that long fits) or by tokens after."""
        self.metrics.rejected.labels("context_length_exceeded").inc()
        self.metrics.requests.labels("rejected").inc()
        return error

    async def _whole(self, choices: list[Choice], builder: ResponseBuilder, prompt_tokens: int, generate: Generate) -> web.Response:
        if len(choices) == 1:
            results = [await _run_choice(choices[0], generate)]
        else:
            try:  # one failed choice ends the others (their legs are aborted) and is the answer
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(_run_choice(c, generate)) for c in choices]
            except ExceptionGroup as failed:
                raise _first_openai_error(failed) from None
            results = [t.result() for t in tasks]
        # A body of logprobs can be tens of MB (n: 16, top_logprobs: 20, a thousand tokens each: 19.5 MB):
        # built and encoded on a thread then, a slice at a time (`dumps_in_slices`: one json.dumps
        # call holds the GIL throughout, 1.07 s here), so the loop every tenant shares keeps turning.
        size = sum(len(r.text) + LOGPROB_ENTRY_BYTES * sum(1 + len(t.top) for t in r.logprobs) for r in results)
        body = await self._off_loop(size, _encoded_whole, builder, results, prompt_tokens)
        return web.Response(body=body, content_type="application/json")

    async def _stream(
        self, request: web.Request, choices: list[Choice], builder: ResponseBuilder, body: APIRequest, prompt_tokens: int,
        generate: Generate,
    ) -> web.StreamResponse:
        # aclosing: if the client goes away while a token is being written, every choice's legs are
        # still aborted now (S4), not at garbage collection.
        async with contextlib.aclosing(_merged(choices, generate)) as events:
            # Headers go out with the first token, so an error before it is still a proper status.
            first = await anext(events, None)
            if first is None:
                raise OpenAIError(502, "decode ended without finishing the request", code="decode_failed")
            opening = builder.opening_sse([choice.index for choice in choices])
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await prepare_stream(request, response)
            request[STREAMING] = True
            watch = self._watch(request)
            try:
                return await self._relay(response, events, first, watch, builder, body, prompt_tokens, opening)
            finally:
                watch.close()

    async def _relay(
        self, response: web.StreamResponse, events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]],
        first: tuple[int, TokenEvent | FinishEvent], watch: StallWatch, builder: ResponseBuilder, body: APIRequest,
        prompt_tokens: int, opening: bytes,
    ) -> web.StreamResponse:
        """The stream's events as SSE chunks after its `opening`, each write under `watch`."""

        async def write(data: bytes) -> None:
            with watch:
                await response.write(data)

        started: set[int] = set()
        completion_tokens = 0
        item: tuple[int, TokenEvent | FinishEvent] | None = first
        try:
            if opening:
                await write(opening)
            while item is not None:
                index, event = item
                is_first = index not in started
                started.add(index)
                if isinstance(event, TokenEvent):
                    # b"": the event carried nothing to show (a character's first bytes); they come with its last
                    if frame := builder.text_chunk_sse(index, event.text, event.logprobs or (), first=is_first):
                        await write(frame)
                else:
                    completion_tokens += event.completion_tokens
                    await write(sse(builder.chunk(index, "", finish_reason=event.finish_reason, first=is_first)))
                item = await anext(events, None)
            if body.include_usage:
                await write(sse(builder.usage_chunk(prompt_tokens, completion_tokens)))
            await write(SSE_DONE)
        except OpenAIError as err:
            # Mid-stream failure: the client gets an error frame and no [DONE], never a clean end.
            await write(sse(err.body()))
        except ConnectionResetError:  # the client left as a chunk went out (before its handler was
            return response  # cancelled): its disconnect, not a bug; nothing more can be written
        except Exception:  # a bug: still an error frame and the end of the stream, never a stream left open
            log.exception("request %s: failed mid-stream", response.headers.get(REQUEST_ID_HEADER))
            await write(sse(OpenAIError(500, "internal error", code="internal_error").body()))
        except asyncio.CancelledError:
            # The client left (nothing to tell), or the router stops with this stream still going (a
            # drain's grace is over, end_in_flight): the client hears why, not just a closed socket.
            if asyncio.current_task() in self._cut:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await response.write(sse(_SHUTTING_DOWN.body()))
                        await response.write_eof()  # the stream ends whole: the error is its last event
            raise
        with contextlib.suppress(ConnectionResetError):  # the client left after the last event: nothing to end
            await response.write_eof()
        return response

    def _error_response(self, err: OpenAIError) -> web.Response:
        response = err.response()
        if err.status == 408:  # a client too slow to send its body loses the connection too
            response.force_close()
        # (a 413 is not force-closed: aiohttp reads and drops the rest of the body for up to its
        # lingering time, so the client reads the answer instead of a connection reset)
        return response

    # -- the two legs ----------------------------------------------------------------------
    async def _generate(
        self, request: GenerateRequest, ending: list[asyncio.Task[None]], siblings: Siblings, arrived: float,
        lease: SlotLease,
    ) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        """Drive decode and prefill for one request; yields verified tokens, raises OpenAIError.

        Whatever way this generator ends early -- an error, a timeout, the client disconnecting
        (the handler task is cancelled, or the generator closed) -- both legs are aborted (S4), by a
        task appended to `ending` (`_end_legs`): the client's error does not wait for the workers.
        """
        try:
            prefill, decode = self.upstreams.pair()
        except OpenAIError:  # no worker of a role to send it to: it ended, failed (the error ratio counts it)
            self.metrics.requests.labels("failed").inc()
            raise
        # Both legs start now: prefill computes while decode allocates, and gets the ticket (S9:
        # nothing is sent without it) once decode's bootstrap is here.
        ticket: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        prefill_task = asyncio.create_task(self._prefill(prefill.url, PrefillRequest(**request.model_dump()), ticket))
        legs = _Legs(prefill, decode, prefill_task, ticket)
        try:
            async with contextlib.aclosing(self._follow_legs(request, legs, siblings, arrived, lease)) as events:
                async for event in events:
                    yield event
        except (OpenAIError, TimeoutError, aiohttp.ClientError, ValueError) as exc:
            error = self._failure(request.request_id, legs, exc)
            if error is exc:
                raise
            raise error from None
        finally:
            lease.relayed(request.request_id)  # its last event left (or it ended early): no client lags behind it
            if legs.channel is not None:
                legs.channel.unsubscribe(request.request_id)
            self.metrics.request_duration.observe(time.monotonic() - arrived)
            if legs.cause == AbortCause.CLIENT_DISCONNECT and siblings.failed:  # cancelled because another choice failed
                legs.cause, legs.outcome = AbortCause.SIBLING_FAILED, "failed"
            elif legs.cause and legs.cause != AbortCause.CLIENT_DISCONNECT:
                siblings.failed = True  # before the error leaves: the siblings it cancels read it
            if legs.cause:
                urls = tuple(url for url in (prefill.url, decode.url) if url != legs.unreachable)
                ending.append(self._end_legs(request.request_id, urls, prefill_task, legs.stack, legs.cause, legs.outcome))
            else:
                await legs.stack.aclose()

    async def _follow_legs(
        self, request: GenerateRequest, legs: _Legs, siblings: Siblings, started: float, lease: SlotLease,
    ) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        """Decode's events for one request up to its finish: the ticket goes to prefill when
        decode's bootstrap comes, tokens as soon as decode verified the KV (S3). Clears
        `legs.cause` once it finished cleanly; raises what ended it otherwise (`_failure`)."""
        prefill_task, tokens, last_token = legs.prefill_task, 0, time.monotonic()

        def over_at_the_workers() -> None:
            """Decode's finish is in the inbox, perhaps behind what a slow client has not read yet:
            once prefill has answered too, neither worker holds anything of this generation, and its
            slot goes back now (backpressure.SlotLease)."""

            def release(task: asyncio.Task[None]) -> None:
                if not task.cancelled() and task.exception() is None:
                    lease.release_one(request.request_id)
                    siblings.done_at_the_workers(request.request_id)

            prefill_task.add_done_callback(release)

        given_up = asyncio.Event()  # the decode call is no longer wanted: never sent again
        # Bounded by the first-token deadline out here, not inside the call: a deadline that
        # cancelled the call itself closed it before the aborts went out (decode then counted a
        # client disconnect, not the router's timeout; an outside probe).
        events, legs.channel = await siblings.within(_unless_prefill_fails(
            lambda: self._call_decode(request, legs.decode.url, siblings, legs.stack, given_up, over_at_the_workers),
            prefill_task, _after_the_aborts(legs.stack, request.request_id, given_up)))  # fmt: skip
        # Until the first token, the request's whole wait (its slot included) is bounded by its
        # first-token deadline, which its other choices' tokens move on (Siblings).
        while (event := await (_next_event(events, prefill_task) if tokens else
                               siblings.within(_next_event(events, prefill_task)))) is not None:  # fmt: skip
            if isinstance(event, BootstrapEvent):
                if legs.ticket.done():
                    raise OpenAIError(502, "decode sent a second bootstrap", code="decode_failed")
                legs.ticket.set_result(self._ticket(request.request_id, event))
            elif isinstance(event, HandoffEvent):  # only a request that names a channel is handed over
                raise OpenAIError(502, "decode handed the request to a token channel it did not name", code="decode_failed")
            elif isinstance(event, ErrorEvent):
                # Before the ticket, prefill cannot have caused decode's failure.
                raise await _prefill_error_first(prefill_task, wait=legs.ticket.done()) or OpenAIError(
                    event.status, event.message, code=event.code
                )
            else:
                # Tokens flow as soon as decode verified the KV (S3): prefill's own answer
                # (that it sent it all) is only awaited before the request ends cleanly.
                if isinstance(event, TokenEvent) and event.token_ids:
                    tokens, last_token = self._observe_latency(event, tokens, started, last_token)
                    siblings.progressed()
                if isinstance(event, FinishEvent):
                    # Bounded as every wait of the request is: a prefill that hangs after the
                    # transfer would otherwise hold the client and its slot for ever (S4).
                    await _by(asyncio.get_running_loop().time() + self.config.request_timeout_s, asyncio.shield(prefill_task))
                    # Settled before the yield: the consumer may close us right after it.
                    self.metrics.requests.labels("finished").inc()
                    legs.cause = ""
                yield event
                if not legs.cause:
                    return
        raise await _prefill_error_first(prefill_task, wait=legs.ticket.done()) or OpenAIError(
            502, "the decode worker closed the stream before finishing", code="decode_failed"
        )

    def _failure(self, request_id: str, legs: _Legs, exc: Exception) -> OpenAIError:
        """Why the legs end (set on `legs`), from what ended them; returns the error the client
        hears: `exc` itself when it is one, else a 502 or 504 in the client's terms."""
        task = legs.prefill_task
        from_prefill = task.done() and not task.cancelled() and task.exception() is exc
        if isinstance(exc, OpenAIError):
            legs.cause = router_abort_cause(exc.code, exc.status, from_prefill)
            legs.outcome = "rejected" if exc.status == 400 else "failed"  # a worker refused the request itself
            return exc
        legs.outcome = "failed"
        if isinstance(exc, TimeoutError):  # (aiohttp's timeouts too: they are TimeoutErrors before ClientErrors)
            legs.cause = AbortCause.TIMEOUT
            return OpenAIError(504, "the request timed out", code="timeout")
        if isinstance(exc, aiohttp.ClientError):
            legs.cause = AbortCause.WORKER_DIED
            # No abort to the worker whose connection failed: its pages went with it (a live one whose
            # handler lost the connection released the request itself), and one restarted on the same
            # port refuses a call signed for the old instance, counting it as an S9 refusal (an
            # outside probe: every crash with requests in flight fired the trust-boundary alert).
            legs.unreachable = legs.prefill.url if from_prefill else legs.decode.url
            if self._upstreams is not None and self._upstreams.at(legs.unreachable) is not None:
                self._suspect.add(legs.unreachable)  # only workers still listed: `_depart` takes a departing one out
            self._workers_health.forget()  # /health must not say "ok" from before this failure
            # The client hears what happened, not aiohttp's wording (a "400" inside a 502); the log has it.
            log.warning("request %s: a worker failed: %r", request_id, exc)
            return OpenAIError(502, _worker_failure(exc), code="worker_failed")
        legs.cause = AbortCause.DECODE_ERROR  # a ValueError: an event line that does not parse, or is over its bound
        log.warning("request %s: decode sent an unreadable event: %s", request_id, exc)
        return OpenAIError(502, "the decode worker sent an unreadable event", code="decode_failed")

    async def _call_decode(
        self, request: GenerateRequest, url: str, siblings: Siblings, stack: contextlib.AsyncExitStack,
        given_up: asyncio.Event, on_finish: Callable[[], None],
    ) -> DecodeCall:
        """The decode leg's call, and its events: on its own stream, or after the handoff on the
        token channel to that worker (and that channel). Decode's answer stays open on `stack` until
        the aborts have gone out: closing it first would read on decode as a client disconnect,
        whatever the cause. Its headers come once decode has the pages: within the first-token deadline
        (`_generate` bounds this call by it)."""
        reader = self._channel_reader(url)
        if reader is None:
            # A bound on waiting, not on generating: no event from decode for request_timeout_s (no
            # first token: queueing, prefill, transfer; or no next token) ends the request with a
            # 504, while a long generation that keeps producing runs to its max_tokens.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.request_timeout_s)
            resp = await self._post_decode(url, request, timeout, stack, given_up)
            if resp.status != 200:
                raise await _upstream_error(resp)
            # Read as decode sends it, not as the client reads it: decode's engine finishes and frees
            # the pages whatever its handler has written, and only the finish read here tells the
            # router so (`on_finish`), as the token channel's inbox does. Read as the client read,
            # a stalled reader held the shared room and its slots long after decode had freed the
            # pages (a review: another tenant's n=2 request got a 504 with decode's pool empty).
            return _read_ahead(_decode_events(resp), on_finish), None
        # The request's own stream is read only until the handoff; after it, the bound between two
        # events applies to its inbox (_channel_events).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        for _ in range(2):
            channel = await siblings.within(_open(reader))
            inbox = channel.subscribe(request.request_id, on_finish)  # before the call: no event can come first
            try:
                body = DecodeRequest.model_construct(**dict(request), channel=channel.id)
                resp = await self._post_decode(url, body, timeout, stack, given_up)
                if resp.status == 200:
                    return _channel_events(resp, inbox, self.config.request_timeout_s), channel
                error = await _upstream_error(resp)
            except BaseException:
                channel.unsubscribe(request.request_id)
                raise
            channel.unsubscribe(request.request_id)
            if error.code != "unknown_channel":
                raise error
            # Decode restarted after this channel opened (the reader has not seen the old connection
            # break yet) and refused before allocating anything: once more, on a new channel.
            reader.forget(channel)
        raise OpenAIError(502, "the decode worker restarted while the request was sent; try again", code="worker_failed")

    async def _post_decode(self, url: str, body: GenerateRequest, timeout: aiohttp.ClientTimeout,
                           stack: contextlib.AsyncExitStack, given_up: asyncio.Event) -> aiohttp.ClientResponse:  # fmt: skip
        """The decode leg's call, sent once more if its connection closed before any answer (while
        the call was being written, or after): a pooled keep-alive connection to a worker whose
        drain just ended (or whose pod just died) closes under a leg in transit, and that leg
        failed with a 502 (an A/B probe of a worker signalled alone). Safe to repeat: before
        decode's answer nothing reached prefill (the ticket comes in that answer), and a decode
        that dropped the call dropped the request too (its handler is cancelled). Signed anew, so
        the second call is no replay (S9)."""

        async def send() -> aiohttp.ClientResponse:
            call = self._control_call(url, "/internal/decode", body, timeout)
            return await stack.enter_async_context(call)  # (under the request's first-token deadline: _generate)

        try:
            return await send()
        except aiohttp.ClientConnectorError:
            raise  # never connected: an unreachable worker, reported as such
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:  # closed while sending it, or after
            if given_up.is_set():
                raise  # decode ended it on the router's abort: sent again, it would take pages anew
            log.info("the decode call for %s closed unanswered (%s); sending it once more", body.request_id, exc)
        return await send()

    def _channel_reader(self, decode_url: str) -> ChannelReader | None:
        if not self.config.token_channel:
            return None
        if (reader := self._channels.get(decode_url)) is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)  # open for as long as both run
            reader = ChannelReader(lambda: self._control_call(decode_url, "/internal/stream", ChannelRequest(), timeout))
            self._channels[decode_url] = reader
        return reader

    def _observe_latency(self, event: TokenEvent, tokens: int, started: float, last: float) -> tuple[int, float]:
        """TTFT for the first token; for later ones the gap since the last event, shared by the
        tokens it carries (decode sends one event per request per step, several tokens only when
        the stream fell behind). Returns (tokens so far, now)."""
        now, count = time.monotonic(), len(event.token_ids)
        if tokens:
            rest, gap = count, (now - last) / count
        else:  # the first event: its first token is the TTFT, any others arrived with it
            self.metrics.time_to_first_token.observe(now - started)
            rest, gap = count - 1, 0.0
        for _ in range(rest):
            self.metrics.inter_token_latency.observe(gap)
        return tokens + count, now

    def _ticket(self, request_id: str, event: BootstrapEvent) -> str:
        """S9: the ticket that lets prefill send this request's KV to exactly the decode worker,
        pages and nonce of this bootstrap, until the request's own deadline. It is self-contained,
        so it could equally reach a prefill that is already computing."""
        b = event.bootstrap
        ticket = self.tickets.issue(
            request_id, (b.transfer_host, b.transfer_port), b.epoch, bytes.fromhex(b.nonce), b.num_tokens,
            b.page_ids, b.generations, self.ticket_ttl_s,
        )  # fmt: skip
        return ticket.text

    async def _prefill(self, url: str, request: PrefillRequest, ticket: asyncio.Future[str]) -> None:
        """The prefill leg: the request, and its ticket as soon as there is one (two calls, so the
        KV is computed while decode allocates). Either call failing fails the leg. No timeout of its
        own: the decode leg's bounds the request, and ending the request cancels this leg (a second
        timer raced the first, and the client could get prefill's abort as a 502 instead of the 504)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)

        async def compute() -> None:
            async with self._control_call(url, "/internal/prefill", request, timeout) as resp:
                if resp.status != 200:
                    raise await _upstream_error(resp)

        async def deliver() -> None:
            # Shielded: cancelling this call (the leg failed first) must not cancel the ticket
            # itself, or decode's bootstrap would then read as "a second bootstrap" (decode blamed).
            delivery = TicketDelivery(request_id=request.request_id, ticket=await asyncio.shield(ticket))
            async with self._control_call(url, "/internal/ticket", delivery, timeout) as resp:
                if resp.status != 200:
                    raise await _upstream_error(resp)

        calls = (asyncio.ensure_future(compute()), asyncio.ensure_future(deliver()))
        try:
            await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            # The computing call's error first: a refused ticket also fails the request there.
            for call in calls:
                if call.done() and (error := call.exception()) is not None:
                    raise error
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    def _end_legs(
        self, request_id: str, urls: Sequence[str], prefill_task: asyncio.Task[None],
        decode_stream: contextlib.AsyncExitStack, cause: str, outcome: str,
    ) -> asyncio.Task[None]:
        """S4 for a generation that ended early: abort both legs, then cancel the prefill call and
        close decode's stream -- in that order, so each worker ends the request with this cause
        (cancelled or closed first, a leg reads as a client disconnect, which paging rules leave
        out). In a task of its own: the client's error goes out now, not once the workers have
        acknowledged (a hung worker held a 504 back by the whole abort timeout), and a handler
        being cancelled (its client gone) cannot stop the aborts. Shutdown waits for these tasks."""
        self.metrics.aborts.labels(cause).inc()
        self.metrics.requests.labels(outcome).inc()

        async def end() -> None:
            try:
                if self.config.propagate_aborts:
                    await self._send_aborts(request_id, urls, cause)
            finally:
                prefill_task.cancel()
                await asyncio.gather(prefill_task, return_exceptions=True)  # its error already reached the client
                await decode_stream.aclose()

        task = asyncio.create_task(end())
        self._aborts_in_flight.add(task)
        task.add_done_callback(self._aborts_in_flight.discard)
        return task

    async def _send_aborts(self, request_id: str, urls: Sequence[str], cause: str) -> None:
        body = AbortRequest(request_id=request_id, cause=cause)
        timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)

        async def one(url: str) -> None:
            try:
                async with self.control.post(self.http, f"{url}/internal/abort", body, await self._signed_for(url), timeout=timeout):
                    pass
            except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
                # A dead worker frees its pages by dying; the other side times out on its own.
                # (RuntimeError: the session closed under a shutdown that outlasted the wait for it.)
                log.warning("abort of %s at %s failed: %s", request_id, url, str(exc) or type(exc).__name__)

        await asyncio.gather(*(one(u) for u in urls))

    async def _name_revision(self, _: web.Request, response: web.StreamResponse) -> None:
        """Every API response, errors included, says which revision answered: what a client (and
        e2e's traffic recorder) reads behind a Gateway, where nothing else tells the revisions apart."""
        assert self.config.revision is not None
        response.headers[REVISION_HEADER] = self.config.revision


async def _echo_label(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request's correlation label (the client's, else the id); one
    that ended before any id was claimed (404, 405, a refused body) echoes a valid client label."""
    label = request.get(_LABEL_KEY)
    sent = request.headers.getall(REQUEST_ID_HEADER, [])
    if label is None and len(sent) == 1 and _LABEL.fullmatch(sent[0]):
        label = sent[0]
    if label is not None:
        response.headers[REQUEST_ID_HEADER] = label


async def _decode_events(resp: aiohttp.ClientResponse) -> AsyncIterator[DecodeEvent]:
    # Not aiohttp's readline: its 512 KiB bound is below a legitimate event (1024 tokens of
    # --stream-interval with 20 logprob alternatives each), and it raised past every handler.
    async for line in read_lines(resp.content):
        yield DECODE_EVENT.validate_json(line)


DecodeEvent = BootstrapEvent | TokenEvent | FinishEvent | ErrorEvent | HandoffEvent


async def _read_ahead(events: AsyncIterator[DecodeEvent], on_finish: Callable[[], None]) -> AsyncIterator[DecodeEvent]:
    """`events`, read by a task of their own as they come (held here for a reader that lags, as a
    token channel's inbox holds them: at most one generation's events, bounded by its max_tokens,
    which decode's engine would otherwise hold), `on_finish` called once decode's finish is read;
    what ends the reading (an error, a timeout) comes after the events before it. Closing this
    ends the reading."""
    held: asyncio.Queue[DecodeEvent | BaseException | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async with contextlib.aclosing(events) as reading:  # type: ignore[type-var]
                async for event in reading:
                    held.put_nowait(event)
                    if type(event) is FinishEvent:
                        on_finish()
            held.put_nowait(None)
        except Exception as exc:  # the consumer raises it in its turn
            held.put_nowait(exc)

    reader = asyncio.create_task(read())
    try:
        while (item := await held.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _open(reader: ChannelReader) -> OpenChannel:
    try:
        return await reader.channel()
    except ChannelLost as exc:
        raise OpenAIError(502, str(exc), code="worker_failed") from None


async def _channel_events(resp: aiohttp.ClientResponse, inbox: Inbox, idle_s: float) -> AsyncIterator[DecodeEvent]:
    """One request's events when it names a token channel: its own stream until decode hands it
    over (the bootstrap, or a failure before the first token), then its inbox, each event within
    `idle_s` of the last, until the one that ends it. Its own stream ending first ends them."""
    async for event in _decode_events(resp):
        if not isinstance(event, HandoffEvent):
            yield event
            continue
        held: ChannelPayload | ChannelLost | None = None
        while True:
            if held is not None:
                item, held = held, None
            elif inbox.empty():
                async with asyncio.timeout(idle_s):
                    item = await inbox.get()
            else:
                item = inbox.get_nowait()
            if isinstance(item, TokenEvent) and not inbox.empty():  # the relay fell behind: one chunk for all
                item, held = coalesce(item, inbox)
            if isinstance(item, ChannelLost):
                raise OpenAIError(502, str(item), code="worker_failed")
            yield item
            if not isinstance(item, TokenEvent):
                return


async def _by(deadline: float, waiting: Awaitable[T]) -> T:
    """`waiting`, or TimeoutError at loop time `deadline`."""
    async with asyncio.timeout_at(deadline):
        return await waiting


async def _next_event(events: AsyncIterator[DecodeEvent], prefill_task: asyncio.Task[None] | None) -> DecodeEvent | None:
    """The decode leg's next event (None at its end); while the prefill leg still runs, its failure
    comes first and is raised at once (S4). A prefill that failed or died before its OPEN reached
    decode leaves decode waiting for KV that never comes: without this, both legs would end only
    when decode's stall timer fired (found by the model, formal/README.md)."""
    return await _unless_prefill_fails(lambda: anext(events, None), prefill_task)


async def _unless_prefill_fails(start: Callable[[], Awaitable[T]], prefill_task: asyncio.Task[None] | None,
                                abandon: Callable[[asyncio.Future[T]], None] | None = None) -> T:
    """What `start()` waits for, unless the prefill leg fails first (or failed already: then it is
    not started): then prefill's error at once (S4). Also the wait for decode's answer to the
    call, which comes once decode has pages: a prefill that failed while decode still queued for
    them was seen only after decode allocated for a dead request (the model lets the router see it
    at once; a review of the model against the code found it). A wait given up (prefill failed,
    or this task was cancelled) is cancelled here, or handed to `abandon` to end later: a call
    cancelled before the aborts go out reads on the worker as a client disconnect (`_end_legs`)."""
    if prefill_task is not None and prefill_task.done() and not prefill_task.cancelled():
        if (failed := prefill_task.exception()) is not None:
            raise failed
    if prefill_task is None or prefill_task.done():
        return await start()
    following = asyncio.ensure_future(start())
    try:
        await asyncio.wait((following, prefill_task), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _give_up(following, abandon)
        raise
    failure = None if following.done() or prefill_task.cancelled() else prefill_task.exception()
    if failure is not None:
        _give_up(following, abandon)
        raise failure
    return await following


def _give_up(waiting: asyncio.Future[T], abandon: Callable[[asyncio.Future[T]], None] | None) -> None:
    if abandon is not None:
        abandon(waiting)
    else:
        waiting.cancel()  # (a read of the next event: nothing on the worker notices)


def _after_the_aborts(stack: contextlib.AsyncExitStack, request_id: str,
                      given_up: asyncio.Event) -> Callable[[asyncio.Future[DecodeCall]], None]:  # fmt: skip
    """How `_generate` gives up a decode call still in flight: ended on `stack`, which `_end_legs`
    closes after the aborts went out (cancelled first, decode would count a client disconnect, not
    the router's cause: a review found it). Meanwhile decode ends it unanswered on the abort, and
    `given_up` keeps `_post_decode` from sending it again. One that has answered meanwhile leaves
    its token-channel inbox, which nobody would read."""

    def abandon(call: asyncio.Future[DecodeCall]) -> None:
        given_up.set()
        async def end() -> None:
            call.cancel()
            try:
                _, channel = await call
            except BaseException:  # cancelled, or failed: nothing of it to undo
                return
            if channel is not None:
                channel.unsubscribe(request_id)

        stack.push_async_callback(end)

    return abandon


def _worker_failure(exc: aiohttp.ClientError) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "a worker could not be reached; try again"
    # ClientOSError: a reset while the call was being sent or answered (the worker was killed).
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        return "a worker's connection broke off mid-request (it failed or restarted); try again"
    return "a worker failed; try again"


async def _upstream_error(resp: aiohttp.ClientResponse) -> OpenAIError:
    """A worker's error answer as the client's error: workers speak the same OpenAI error shape."""
    try:
        error = (await resp.json())["error"]
    except (aiohttp.ContentTypeError, json.JSONDecodeError, KeyError, TypeError):
        return OpenAIError(502, f"a worker answered HTTP {resp.status}", code="worker_failed")
    if resp.status in (401, 403):
        # The worker refused the router's own signed call (S9: a stale or bad X-Kvguard-Auth): the
        # router's failure, not the client's credentials. The log has the worker's words.
        log.warning("a worker refused the router's call to %s: %s", resp.url.path, error.get("message"))
        return OpenAIError(502, "a worker refused the router's internal call", code="worker_failed")
    return OpenAIError(resp.status, error["message"], code=error.get("code"), param=error.get("param"))


async def _prefill_error_first(task: asyncio.Task[None], wait: bool) -> OpenAIError | None:
    """When decode fails because prefill did, the prefill error is the one worth showing (waited
    for a moment when `wait`: prefill's answer may be on its way)."""
    if wait:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), timeout=1.0)
    error = task.exception() if task.done() and not task.cancelled() else None
    return error if isinstance(error, OpenAIError) else None


LOGPROB_ENTRY_BYTES = 48
"""About what one logprob entry (a token or an alternative, with its bytes) adds to a body."""


def _encoded_whole(builder: ResponseBuilder, results: Sequence[ChoiceResult], prompt_tokens: int) -> bytes:
    return builder.whole_json(results, prompt_tokens, dumps_in_slices).encode()


JSON_SLICE_ITEMS = 256
"""Items of a long list encoded by one json.dumps call (a token's logprob entry with its 20
alternatives is ~1 KB: a slice is ~0.25 MB, a few ms)."""


def dumps_in_slices(value: object, depth: int = 0) -> str:
    """json.dumps(value), a long list a slice at a time. One json.dumps call holds the GIL from
    start to end, so a 16 MB answer of logprobs (n: 16, top_logprobs: 20, 1,000 tokens) encoded
    on a thread held the event loop every tenant shares for 1.07 s at a stretch (an outside probe);
    in slices, the loop gets the GIL between them. The answer's own containers (the body, its
    choices, a choice, its logprobs) are walked; what lies deeper is encoded whole or in slices."""
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):  # (json.dumps names other keys its own way)
        fields = (f"{json.dumps(key)}: {dumps_in_slices(item, depth + 1)}" for key, item in value.items())
        return "{" + ", ".join(fields) + "}"
    if isinstance(value, list) and len(value) > JSON_SLICE_ITEMS:
        slices = (json.dumps(value[start:start + JSON_SLICE_ITEMS])[1:-1] for start in range(0, len(value), JSON_SLICE_ITEMS))
        return "[" + ", ".join(slices) + "]"
    if isinstance(value, list) and depth < 2:  # the choices
        return "[" + ", ".join(dumps_in_slices(item, depth + 1) for item in value) + "]"
    return json.dumps(value)


def _shaped_and_validated(kind: type[RequestKind], raw: bytes, max_values: int) -> RequestKind:
    """The body as `kind`, once its bytes show no more JSON structure than a request needs (the
    parse holds the GIL wherever it runs: json_shape.py). A UTF-8 byte order mark before it is
    skipped, as RFC 8259 allows and Python's json (so FastAPI, so vLLM) does."""
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    if (problem := json_shape_problem(raw, max_values=max_values)) is not None:
        raise OpenAIError(413, problem, code="request_too_large")  # too large in structure, not in bytes
    return kind.model_validate_json(raw)


def _check_body_headers(headers: CIMultiDictProxy[str]) -> None:
    """The body must be JSON as sent: uncompressed, and JSON or unlabelled (as FastAPI, and so vLLM,
    reads a body). No listener decompresses (`servers.app_runner`), so a compressed body is refused
    here by name -- not a JSON error or a 500 -- and no decompression bomb is ever inflated. A form
    or text/plain body is what a browser may send cross-site without a preflight: refused too. So
    is a charset other than UTF-8 (case-insensitive; none at all is UTF-8)."""
    # Every coding of every Content-Encoding line: a second line (`identity`, then `gzip`) must not slip past.
    codings = [c.strip().lower() for line in headers.getall("Content-Encoding", []) for c in line.split(",") if c.strip()]
    if codings not in ([], ["identity"]):
        encoding = ", ".join(codings)
        raise OpenAIError(415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed",
                          code="unsupported_media_type")  # fmt: skip
    check_transfer_codings(headers)
    media, *params = headers.get("Content-Type", "").split(";")
    media = media.strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise OpenAIError(415, f"Content-Type {media[:60]!r} is not accepted: send the body as application/json",
                          code="unsupported_media_type")  # fmt: skip
    # JSON is UTF-8 (RFC 8259) and the body is read as such: a body labelled latin-1 would be misread, not refused.
    for param in params:
        name, _, value = param.partition("=")
        charset = value.strip().strip("\"'")
        if name.strip().lower() == "charset" and not _reads_as_utf8(charset):
            raise OpenAIError(415, f"charset {charset[:40]!r} is not accepted: send the body as UTF-8 (charset=utf-8, "
                              "or no charset)", code="unsupported_media_type")  # fmt: skip


def _reads_as_utf8(charset: str) -> bool:
    """UTF-8 under any of its names (`utf8`, `UTF-8`), or ASCII, which is UTF-8 too."""
    try:
        return codecs.lookup(charset[:40]).name in ("utf-8", "ascii")
    except (LookupError, ValueError):  # (a NUL, or bytes no codec name holds: a 500 before; a review)
        return False


def _unknown_model(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model {name[:200]!r} does not exist", code="model_not_found", param="model")


def _first_openai_error(group: BaseExceptionGroup) -> BaseException:
    """The first client-facing error among a request's failed choices (else the group itself)."""
    for exc in group.exceptions:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_openai_error(exc)
            if isinstance(found, OpenAIError):
                return found
    return group


@dataclass
class Siblings:
    """The choices (generations) of one request, and what they share:
    - Their first-token deadline (--request-timeout from the request's arrival, its slot wait
      included), moved on while any of them produces tokens: a choice can wait in decode's queue
      behind its own siblings (n choices need n times the pages), and a request that keeps
      producing is not waiting (outside probe: n=8 streamed tokens for 1 s, then got a 504).
    - Whether one failed: it ends the others, which then count as `sibling_failed`, not as a
      client disconnect (the client never left; the alerts that leave disconnects out see them)."""

    first_token_by: float  # loop time
    request_timeout_s: float
    failed: bool = False
    _waiting: set[asyncio.Timeout] = field(default_factory=set)
    _at_workers_end: dict[str, Callable[[], None]] = field(default_factory=dict)

    async def within(self, waiting: Awaitable[T]) -> T:
        """`waiting`, or TimeoutError at the first-token deadline (which may move on meanwhile)."""
        async with asyncio.timeout_at(self.first_token_by) as timer:
            self._waiting.add(timer)
            try:
                return await waiting
            finally:
                self._waiting.discard(timer)

    def when_done_at_the_workers(self, request_id: str, callback: Callable[[], None] | None) -> None:
        """Call `callback` once generation `request_id` has ended cleanly at both workers (None:
        forget it): what it holds of theirs can be given back before its client has read it all."""
        if callback is None:
            self._at_workers_end.pop(request_id, None)
        else:
            self._at_workers_end[request_id] = callback

    def done_at_the_workers(self, request_id: str) -> None:
        if (callback := self._at_workers_end.pop(request_id, None)) is not None:
            callback()

    def progressed(self) -> None:
        """A choice produced tokens: the others' deadline is --request-timeout from now."""
        later = asyncio.get_running_loop().time() + self.request_timeout_s
        if later > self.first_token_by:
            self.first_token_by = later
            for timer in self._waiting:
                timer.reschedule(later)


Generate = Callable[[GenerateRequest], AsyncGenerator[TokenEvent | FinishEvent, None]]


@dataclass(frozen=True)
class ChoicePace:
    """The room in decode's KV pool, router-wide, that requests of several choices take turns in
    (`Router._pace`), and decode's page size (a choice reserves whole pages)."""

    room: Slots
    page: int
    turn: asyncio.Lock
    """Held by the one choice of the request that waits for the room: the room grants in arrival
    order, so with one choice each in its queue, requests take turns."""
    ended: Callable[[str, str], None] = lambda cause, outcome: None
    """Counts a choice that ended while it waited for the room (abort cause, outcome), as the
    router's metrics count every generation once: its first-token deadline passed, its client
    left, or a sibling failed (none of these reach `Router._generate`, which counts the others)."""
    waiting: Callable[[int], None] = lambda change: None
    """Adds to the choices waiting for the room (kvguard_router_room_waiting_choices)."""

    @staticmethod
    def need(request: GenerateRequest, page: int) -> int:
        """What decode reserves for a generation when it admits it: every page it can need."""
        return -(-(len(request.prompt_token_ids) + (request.sampling.max_tokens or 0)) // page) * page


async def _paced(pace: ChoicePace, siblings: Siblings, generate: Generate, request: GenerateRequest,
                 ) -> AsyncGenerator[TokenEvent | FinishEvent, None]:  # fmt: skip
    """One choice of a request paced by `Router._pace`: it starts once the choices ahead of it, its
    request's and other requests' of several choices, leave room in `pace`. Its TTFT counts from
    the request's arrival, as a choice's that waited in decode's queue behind its siblings does;
    its first-token deadline from its start (a sibling ended: the request progressed). Its tokens
    go back to the room once neither worker holds anything of it (`Siblings.done_at_the_workers`),
    not when its client has read the last event: a slow reader held the room every tenant's
    requests of several choices share (a review)."""
    tokens = await _take_room(pace, siblings, request)
    given_back = False

    def give_back() -> None:
        nonlocal given_back
        if not given_back:
            given_back = True
            pace.room.release(tokens)

    siblings.when_done_at_the_workers(request.request_id, give_back)
    try:
        siblings.progressed()
        async with contextlib.aclosing(generate(request)) as events:
            async for event in events:
                yield event
    finally:
        siblings.when_done_at_the_workers(request.request_id, None)
        give_back()


async def _take_room(pace: ChoicePace, siblings: Siblings, request: GenerateRequest) -> int:
    """This choice's tokens taken in the room, once its turn came and they fit (returns them).

    Waiting in the room, shared with other tenants' requests, is waiting for a first token, bounded
    as every such wait is (Siblings): unbounded, a request of two choices waited behind another
    tenant's long generations for all of them (13 s at --request-timeout 2, a review). A choice
    that ends here never reaches `Router._generate`, so it is counted here (`ChoicePace.ended`)."""
    room, tokens = pace.room, 0
    pace.waiting(1)

    async def take_turn() -> None:
        nonlocal tokens
        async with pace.turn:
            # Sized once it is this choice's turn: the room may have shrunk while it waited for it
            # (`Slots.resize`), and one choice alone always fits (a small pool).
            tokens = min(ChoicePace.need(request, pace.page), room.capacity)
            await room.acquire(tokens)

    try:
        await siblings.within(take_turn())
    except TimeoutError:
        siblings.failed = True  # its siblings, cancelled for it, end as `sibling_failed`
        pace.ended(AbortCause.TIMEOUT, "failed")
        raise OpenAIError(504, "the request timed out waiting for room in decode's KV pool", code="timeout") from None
    except asyncio.CancelledError:  # its client left, or a sibling failed
        pace.ended(*((AbortCause.SIBLING_FAILED, "failed") if siblings.failed else (AbortCause.CLIENT_DISCONNECT, "aborted")))
        raise
    finally:
        pace.waiting(-1)
    return tokens


DecodeCall = tuple[AsyncIterator[DecodeEvent], "OpenChannel | None"]
"""The decode leg's events, and the token channel they come on (None: the call's own stream)."""


async def _run_choice(choice: Choice, generate: Generate) -> ChoiceResult:
    pieces: list[str] = []
    records: list[TokenLogprob] = []
    async with contextlib.aclosing(generate(choice.generate)) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
                records.extend(event.logprobs or ())
            else:
                return ChoiceResult(choice.index, "".join(pieces), event.finish_reason, event.completion_tokens, records)
    raise OpenAIError(502, "decode ended without finishing the request", code="decode_failed")
_DONE = object()


async def _merged(choices: Sequence[Choice], generate: Generate) -> AsyncGenerator[tuple[int, TokenEvent | FinishEvent], None]:
    """Every choice's events as (index, event), in arrival order; the first error ends all of them.
    Closing this generator cancels every choice, which aborts its legs (S4)."""
    if len(choices) == 1:  # nothing to merge: no task and queue hop per event
        only = choices[0]
        async with contextlib.aclosing(generate(only.generate)) as events:
            async for event in events:
                yield only.index, event
        return
    # Bounded: a client that reads slowly holds back decode's streams (as with one choice), rather
    # than every choice's whole output piling up here.
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=4 * len(choices))

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(generate(choice.generate)) as events:
                async for event in events:
                    await queue.put((choice.index, event))
            await queue.put(_DONE)
        except Exception as exc:  # delivered to the consumer, which ends the others
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
