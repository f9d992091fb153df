"""The router: the OpenAI-compatible front door that pairs each request with a prefill and a decode worker.

Per request (see kvguard.workers.protocol for the messages):
  internal id -> parse -> tokenize -> intake check (S2) -> decode bootstrap -> ticket -> prefill ->
  stream tokens.
The internal id is the router's own, unguessable (`secrets`); a client's `X-Request-Id` is only a
correlation label (validated, echoed in the response header and logged), never a key, so no client
can address another's work, even through another router (S9). Every call to a worker is signed with
the revision's control key (workers/control_auth.py), and prefill may send KV only where the ticket
the router issues from decode's bootstrap says (workers/transfer/tickets.py).
The router holds no KV. What it owns is the request's fate: any failure of either leg, a timeout or
the client going away ends both legs (S4) and gives this client -- and only this client -- a clean
OpenAI-shaped error. Token events are only forwarded after decode verified the transfer (S3), so an
error before the first token is always a proper HTTP error status, never a 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError

from kvguard.workers.control_auth import auth_headers
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.openai_api import (
    SSE_DONE,
    APIRequest,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    ResponseBuilder,
    context_length_exceeded,
    error_middleware,
    sse,
    validation_error,
)
from kvguard.workers.protocol import (
    DECODE_EVENT,
    AbortRequest,
    BootstrapEvent,
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    PrefillRequest,
    Role,
    SamplingParams,
    TokenEvent,
    WorkerInfo,
)
from kvguard.workers.transfer.tickets import MAX_TICKET_TTL_S, TicketAuthority

log = logging.getLogger("kvguard.router")

REQUEST_ID_HEADER = "X-Request-Id"
# A correlation label is 1..128 visible ASCII characters: it is echoed in a header and logged, so
# it must not carry control characters, spaces or bytes a log or header parser would misread.
_LABEL = re.compile(r"[\x21-\x7e]{1,128}")
_LABEL_KEY = "kvguard.correlation_label"


class ControlClient:
    """The router's signed calls to its workers (S9): every request carries ``X-Kvguard-Auth``."""

    def __init__(self, keys: RevisionKeys) -> None:
        self._key = keys.control

    def get(self, session: aiohttp.ClientSession, url: str, **kwargs: object) -> aiohttp.client._RequestContextManager:
        return session.get(url, headers=auth_headers(self._key, "GET", url), **kwargs)  # type: ignore[arg-type]

    def post(self, session: aiohttp.ClientSession, url: str, message: BaseModel, **kwargs: object) -> aiohttp.client._RequestContextManager:
        body = message.model_dump_json().encode()
        headers = {**auth_headers(self._key, "POST", url, body), "Content-Type": "application/json"}
        return session.post(url, data=body, headers=headers, **kwargs)  # type: ignore[arg-type]


class PromptEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    model_name: str
    request_timeout_s: float = 120.0
    abort_timeout_s: float = 2.0
    default_max_tokens: int = 16
    propagate_aborts: bool = True  # False only under the no_abort_propagation fault
    unsafe_reject_path: bool = False  # the incident's engine: let over-length requests through

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the router needs at least one prefill and one decode worker")


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = Counter(
            "kvguard_requests_total", "Requests by final outcome", ["outcome"], registry=self.registry
        )
        self.rejected = Counter(
            "kvguard_rejected_requests_total",
            "Requests rejected at intake, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.aborts = Counter(
            "kvguard_aborts_total", "Requests aborted, by cause", ["cause"], registry=self.registry
        )


@dataclass
class Upstream:
    url: str
    info: WorkerInfo


class Upstreams:
    """The workers behind the router, their reported limits, and round-robin pairing."""

    def __init__(self, prefill: Sequence[Upstream], decode: Sequence[Upstream]) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        page_sizes = {u.info.page_size for u in self.prefill + self.decode}
        if len(page_sizes) > 1:  # KV moves page by page: a mismatch would misplace every token
            raise ValueError(f"prefill and decode workers disagree on the page size: {sorted(page_sizes)}")
        self._prefill_turn = itertools.cycle(self.prefill)
        self._decode_turn = itertools.cycle(self.decode)

    def pair(self) -> tuple[Upstream, Upstream]:
        return next(self._prefill_turn), next(self._decode_turn)

    @property
    def context_length(self) -> int:
        return min(u.info.context_length for u in self.prefill + self.decode)

    @property
    def smallest_pool(self) -> int:
        return min(u.info.kv_pool_tokens for u in self.prefill + self.decode)


async def fetch_upstreams(session: aiohttp.ClientSession, config: RouterConfig, control: ControlClient) -> Upstreams:
    """Ask every worker for its limits, waiting for workers that are still starting (in a pod the
    router may well start first). A misconfiguration -- a URL pointing at the wrong role, or
    workers that disagree on the page size -- raises ValueError."""

    async def info(url: str, role: Role) -> Upstream:
        while True:
            try:
                async with control.get(session, f"{url}/internal/info") as resp:
                    resp.raise_for_status()
                    worker = WorkerInfo.model_validate(await resp.json())
                if worker.role is not role:
                    raise ValueError(f"{url} is a {worker.role.value} worker, expected {role.value}")
                return Upstream(url, worker)
            except (TimeoutError, aiohttp.ClientError):
                await asyncio.sleep(0.2)

    prefill = await asyncio.gather(*(info(u, Role.PREFILL) for u in config.prefill_urls))
    decode = await asyncio.gather(*(info(u, Role.DECODE) for u in config.decode_urls))
    return Upstreams(prefill, decode)


class Router:
    def __init__(
        self, config: RouterConfig, encoder: PromptEncoder, keys: RevisionKeys, metrics: RouterMetrics | None = None
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.metrics = metrics or RouterMetrics()
        self.control = ControlClient(keys)
        self.tickets = TicketAuthority(keys.ticket)
        self.ticket_ttl_s = min(config.request_timeout_s, MAX_TICKET_TTL_S)
        self._upstreams: Upstreams | None = None
        self._discovery: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None

    @property
    def upstreams(self) -> Upstreams:
        """The workers, once discovered; until then every endpoint answers 503 (not ready)."""
        if self._upstreams is None:
            raise OpenAIError(503, "the router is still waiting for its prefill and decode workers", code="not_ready")
        return self._upstreams

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router has not started"
        return self.session

    # -- lifecycle -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_response_prepare.append(_echo_label)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def metrics_app(self) -> web.Application:
        """The read-only listener for scrapers and probes: /metrics and /health, apart from the API."""
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/health", self.health)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._discovery = asyncio.create_task(self._discover())

    async def _discover(self) -> None:
        while True:
            try:
                self._upstreams = await fetch_upstreams(self.http, self.config, self.control)
            except ValueError as exc:  # misconfigured: stay not-ready, say why, look again
                log.error("router cannot serve: %s", exc)
                await asyncio.sleep(5)
                continue
            log.info(
                "router ready: context %d tokens, smallest KV pool %d tokens",
                self._upstreams.context_length,
                self._upstreams.smallest_pool,
            )
            return

    async def _stop(self, _: web.Application) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        if self.session:
            await self.session.close()

    # -- endpoints -------------------------------------------------------------------------
    async def models(self, _: web.Request) -> web.Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvguard",
            "max_model_len": self.upstreams.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, _: web.Request) -> web.Response:
        """Ready when every worker answers its internal health check. Says which role failed,
        never where the worker lives (this answer reaches the public)."""
        for role, upstreams in (("prefill", self.upstreams.prefill), ("decode", self.upstreams.decode)):
            for upstream in upstreams:
                try:
                    async with self.control.get(self.http, f"{upstream.url}/internal/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status != 200:
                            return web.json_response({"status": "unhealthy", "role": role}, status=503)
                except (TimeoutError, aiohttp.ClientError):
                    return web.json_response({"status": "unreachable", "role": role}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    # -- one request -----------------------------------------------------------------------
    async def _serve(self, request: web.Request, kind: type[APIRequest], chat: bool) -> web.StreamResponse:
        try:
            request_id = self._claim_id(request, chat)
            body = await self._parse(request, kind)
            prompt_ids = self._tokenize(body)
        except OpenAIError as err:
            return self._error_response(err)
        try:
            sampling = body.sampling(self.config.default_max_tokens)
            over_length = self._intake(len(prompt_ids), sampling)
            generate = GenerateRequest(
                request_id=request_id,
                prompt_token_ids=tuple(prompt_ids),
                sampling=sampling,
                over_length=over_length,
            )
            builder = ResponseBuilder(request_id, body.model or self.config.model_name, chat)
            # aclosing: if the client goes away while a token is being written, the generator's
            # cleanup (abort both legs, S4) still runs now rather than at garbage collection.
            async with contextlib.aclosing(self._generate(generate)) as events:
                if body.stream:
                    return await self._stream(request, events, builder, body)
                return await self._whole(events, builder)
        except OpenAIError as err:
            return self._error_response(err)

    async def _parse(self, request: web.Request, kind: type[APIRequest]) -> APIRequest:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise OpenAIError(400, "the request body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            body = kind.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if body.model not in (None, self.config.model_name):
            raise OpenAIError(404, f"model {body.model!r} is not served here", code="model_not_found", param="model")
        return body

    def _tokenize(self, body: APIRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return self.encoder.encode_chat(messages)
        if isinstance(body.prompt, str):
            return self.encoder.encode(body.prompt)
        return list(body.prompt)

    def _claim_id(self, request: web.Request, chat: bool) -> str:
        """A fresh internal id (S9). The client's X-Request-Id is only a label: validated, echoed and
        logged beside the id, never used to find, merge or abort anything, so a retry that keeps
        its label is just a new request, and no client can reach another's work by naming it."""
        label = request.headers.get(REQUEST_ID_HEADER)
        if label is not None and not _LABEL.fullmatch(label):
            self.metrics.rejected.labels("invalid_request_id").inc()
            raise OpenAIError(400, f"{REQUEST_ID_HEADER} must be 1-128 visible ASCII characters", code="invalid_request_id",
                              param=REQUEST_ID_HEADER)  # fmt: skip
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(16)}"
        request[_LABEL_KEY] = label or request_id
        if label is not None:
            log.info("request %s: %s %s", request_id, REQUEST_ID_HEADER, label)
        return request_id

    def _intake(self, prompt_tokens: int, sampling: SamplingParams) -> bool:
        """S2: reject what the context or the smallest KV pool on the path cannot hold, before any work.

        Returns whether the request is over-length (only possible under the unsafe_reject_path fault).
        """
        needed = prompt_tokens + sampling.max_tokens
        for limit, what in (
            (self.upstreams.context_length, "model's context length"),
            (self.upstreams.smallest_pool, "KV cache pool"),
        ):
            if needed > limit:
                if self.config.unsafe_reject_path:
                    return True
                self.metrics.rejected.labels("context_length_exceeded").inc()
                self.metrics.requests.labels("rejected").inc()
                raise context_length_exceeded(prompt_tokens, sampling.max_tokens, limit, what)
        return False

    async def _whole(self, events: AsyncIterator[TokenEvent | FinishEvent], builder: ResponseBuilder) -> web.Response:
        pieces: list[str] = []
        async for event in events:
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
            else:
                body = builder.whole("".join(pieces), event.finish_reason, event.prompt_tokens, event.completion_tokens)
                return web.json_response(body)
        raise OpenAIError(502, "decode ended without finishing the request", code="decode_failed")

    async def _stream(
        self,
        request: web.Request,
        events: AsyncIterator[TokenEvent | FinishEvent],
        builder: ResponseBuilder,
        body: APIRequest,
    ) -> web.StreamResponse:
        # Headers go out with the first token, so an error before it is still a proper status.
        first = await anext(events, None)
        if first is None:
            raise OpenAIError(502, "decode ended without finishing the request", code="decode_failed")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        event: TokenEvent | FinishEvent = first
        is_first = True
        try:
            while True:
                if isinstance(event, TokenEvent):
                    await response.write(sse(builder.chunk(event.text, first=is_first)))
                    is_first = False
                else:
                    await response.write(sse(builder.chunk("", event.finish_reason, first=is_first)))
                    if body.stream_options and body.stream_options.get("include_usage"):
                        await response.write(sse(builder.usage_chunk(event.prompt_tokens, event.completion_tokens)))
                    await response.write(SSE_DONE)
                    break
                event = await anext(events)
        except OpenAIError as err:
            # Mid-stream failure: the client gets an error frame and no [DONE], never a clean end.
            await response.write(sse(err.body()))
        await response.write_eof()
        return response

    def _error_response(self, err: OpenAIError) -> web.Response:
        return web.json_response(err.body(), status=err.status)

    # -- the two legs ----------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Drive decode and prefill for one request; yields verified tokens, raises OpenAIError.

        Whatever way this generator ends early -- an error, a timeout, the client disconnecting
        (the handler task is cancelled, or the generator closed) -- both legs are aborted (S4).
        """
        prefill, decode = self.upstreams.pair()
        prefill_task: asyncio.Task[None] | None = None
        cause = "client_disconnect"
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=5)
        try:
            async with self.control.post(self.http, f"{decode.url}/internal/decode", request, timeout=timeout) as resp:
                if resp.status != 200:
                    raise await _upstream_error(resp)
                async for event in _decode_events(resp):
                    if isinstance(event, BootstrapEvent):
                        prefill_request = PrefillRequest(**request.model_dump(), ticket=self._ticket(request.request_id, event))
                        prefill_task = asyncio.create_task(self._prefill(prefill.url, prefill_request))
                    elif isinstance(event, ErrorEvent):
                        raise await _prefill_error_first(prefill_task) or OpenAIError(
                            event.status, event.message, code=event.code
                        )
                    else:
                        if prefill_task is not None:
                            await prefill_task  # decode verified the KV; prefill must agree it sent it all
                        if isinstance(event, FinishEvent):
                            # Settled before the yield: the consumer may close us right after it.
                            self.metrics.requests.labels("finished").inc()
                            cause = ""
                        yield event
                        if not cause:
                            return
                raise await _prefill_error_first(prefill_task) or OpenAIError(
                    502, "the decode worker closed the stream before finishing", code="decode_failed"
                )
        except OpenAIError as err:
            cause = err.code or "error"
            raise
        except TimeoutError:
            cause = "timeout"
            raise OpenAIError(504, "the request timed out", code="timeout") from None
        except aiohttp.ClientError as exc:
            cause = "worker_unreachable"
            raise OpenAIError(502, f"a worker failed: {exc}", code="worker_failed") from None
        finally:
            if cause:
                await self._abort_both(request.request_id, prefill.url, decode.url, prefill_task, cause)

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

    async def _prefill(self, url: str, request: PrefillRequest) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=5)
        async with self.control.post(self.http, f"{url}/internal/prefill", request, timeout=timeout) as resp:
            if resp.status != 200:
                raise await _upstream_error(resp)

    async def _abort_both(
        self, request_id: str, prefill_url: str, decode_url: str, prefill_task: asyncio.Task[None] | None, cause: str
    ) -> None:
        self.metrics.aborts.labels(cause).inc()
        self.metrics.requests.labels("aborted" if cause == "client_disconnect" else "failed").inc()
        if prefill_task is not None:
            prefill_task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.shield(prefill_task)  # retrieve its outcome; the error already reached the client
        if not self.config.propagate_aborts:
            return
        # Shielded: the handler may be being cancelled (client gone) and the aborts must still go out.
        await asyncio.shield(self._send_aborts(request_id, (prefill_url, decode_url), cause))

    async def _send_aborts(self, request_id: str, urls: Sequence[str], cause: str) -> None:
        body = AbortRequest(request_id=request_id, cause=cause)
        timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)

        async def one(url: str) -> None:
            try:
                async with self.control.post(self.http, f"{url}/internal/abort", body, timeout=timeout):
                    pass
            except (TimeoutError, aiohttp.ClientError) as exc:
                # A dead worker frees its pages by dying; the other side times out on its own.
                log.warning("abort of %s at %s failed: %s", request_id, url, exc)

        await asyncio.gather(*(one(u) for u in urls))


async def _echo_label(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request's correlation label (the client's, else the id)."""
    if (label := request.get(_LABEL_KEY)) is not None:
        response.headers[REQUEST_ID_HEADER] = label


async def _decode_events(resp: aiohttp.ClientResponse) -> AsyncIterator[BootstrapEvent | TokenEvent | FinishEvent | ErrorEvent]:
    async for line in resp.content:
        if line.strip():
            yield DECODE_EVENT.validate_json(line)


async def _upstream_error(resp: aiohttp.ClientResponse) -> OpenAIError:
    """A worker's error answer as the client's error: workers speak the same OpenAI error shape."""
    try:
        error = (await resp.json())["error"]
        return OpenAIError(resp.status, error["message"], code=error.get("code"), param=error.get("param"))
    except (aiohttp.ContentTypeError, json.JSONDecodeError, KeyError, TypeError):
        return OpenAIError(502, f"a worker answered HTTP {resp.status}", code="worker_failed")


async def _prefill_error_first(task: asyncio.Task[None] | None) -> OpenAIError | None:
    """When decode fails because prefill did, the prefill error is the one worth showing."""
    if task is None:
        return None
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), timeout=1.0)
    error = task.exception() if task.done() and not task.cancelled() else None
    return error if isinstance(error, OpenAIError) else None
