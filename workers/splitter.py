"""`kvguard splitter`: the local backend's weighted traffic splitter (what a Gateway is on a cluster).

On Kubernetes an HTTPRoute splits user traffic between the stable and the candidate revision's
routers (operator/traffic.py). On one machine this process does it: it listens on one port for
the whole life of a state folder -- promotions, steps and rollbacks change where requests go, never
the URL a client uses -- and forwards each OpenAI API request (`/v1/...`) to one revision's router,
chosen by the weights in a split table (`split.json`) that the local backend writes
(`LocalBackend.route` and `split_traffic`).

What it does and does not do:
- The table is re-read when the file changes (its stat), on the next request: a weight the driver
  wrote is in force for every request that arrives after the write. A table that does not parse,
  or a file emptied or removed once a table was read, is ignored (the last good one stays, and the
  error is logged): a half-written file never sends traffic anywhere new. Writers replace it
  atomically anyway.
- Backends are picked by smooth weighted round-robin (nginx's): over any run of 100 requests a
  10% backend gets 10, not 10 on average -- the analysis' minimum request counts are reached at a
  predictable rate, and tests count exactly.
- A request whose chosen router refuses the connection (it has not started, or has just been
  stopped) is sent to the next backend with weight: it never reached anyone, so it is safe to
  send again. Once a router answered, its answer -- status, end-to-end headers, streamed body --
  is the client's, byte for byte, as the client's request is the router's (hop-by-hop headers,
  and those a `Connection` header names, are dropped both ways; nothing is added to the request
  that the client left out). The splitter adds `x-kvguard-revision` naming who served it (as the
  router itself does when started with `--revision-id`: behind a Gateway, too), and
  `X-Forwarded-For` on the way in, as every proxy does (the router never trusts it).
- A client that disconnects closes the splitter's connection to the router, which aborts the
  request on both prefill and decode (S4), exactly as a direct disconnect would.
- Bounded work per request: the body is read in full (so that a refused connection can be
  retried) up to `max_body_bytes` (413) within `body_timeout_s` (408), and the bodies held at once
  up to `max_body_memory` (503), like the router's own limits.
- One audience per port: the API port serves `/v1/...` and `/health` (is anything routable); the
  metrics port serves `/metrics` (`kvguard_splitter_requests_total{revision,code}`) and `/health`.

The splitter holds no key and sees no KV; the routers behind it are the trust boundary they are
without it (docs/threat-model.md).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvguard.workers.args import DEFAULT_MAX_BODY_BYTES, worker_default
from kvguard.workers.backpressure import BodyLease, BodyMemory, StallWatch, drop
from kvguard.workers.field_messages import field_message
from kvguard.workers.openai_api import (
    REVISION_HEADER,
    OpenAIError,
    answer_expect,
    check_transfer_codings,
    error_middleware,
    prepare_stream,
    read_body,
)

log = logging.getLogger("kvguard.splitter")

SPLIT_FILE = "split.json"
FORWARDED_FOR = "X-Forwarded-For"
MAX_HEADER_VALUE_BYTES = 8190
"""aiohttp's limit on one header value, the router's too: an X-Forwarded-For the router would take
from the client becomes one it refuses, in plain text, once the splitter appends its entry."""
MAX_BACKENDS = 8
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself for the forwarded message.
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                            "transfer-encoding", "upgrade", "host", "content-length", "x-forwarded-for"})  # fmt: skip
# What aiohttp's client would add to a request that lacks them: the router must see the client's
# request (an unlabelled body is JSON to it; labelled application/octet-stream it would be a 415).
_NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


# --- the table: pure ------------------------------------------------------------------------------


class SplitBackend(BaseModel):
    """One revision's router and its share of the traffic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    revision: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$")
    url: str = Field(pattern=r"^http://127\.0\.0\.1:[0-9]{1,5}$")
    """The router's base URL. Loopback only: the table names local processes, nothing else."""
    weight: int = Field(ge=0, le=100)


class SplitTable(BaseModel):
    """split.json: where user traffic goes (written by the local backend, read by the splitter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backends: tuple[SplitBackend, ...] = Field(default=(), max_length=MAX_BACKENDS)

    @model_validator(mode="after")
    def _one_entry_per_revision(self) -> SplitTable:
        revisions = [b.revision for b in self.backends]
        if len(set(revisions)) != len(revisions):
            raise ValueError(f"a revision appears twice: {revisions}")
        if self.backends and sum(b.weight for b in self.backends) == 0:
            raise ValueError("every weight is 0: nothing would receive traffic")
        return self

    def weights(self) -> dict[str, int]:
        return {b.revision: b.weight for b in self.backends}


@dataclass
class WeightedTurns:
    """Smooth weighted round-robin over a table's backends with weight > 0 (nginx's algorithm):
    each pick adds every backend's weight to its running score, takes the highest, and subtracts
    the total from the winner. Exact shares over every window of sum(weights) picks, well mixed."""

    table: SplitTable
    _score: dict[str, int] = field(default_factory=dict)

    def order(self) -> list[SplitBackend]:
        """The backend for the next request first, then the others with weight as fallbacks
        (heaviest first) for a connection that is refused; empty when nothing has weight."""
        live = [b for b in self.table.backends if b.weight > 0]
        if not live:
            return []
        total = sum(b.weight for b in live)
        for b in live:
            self._score[b.revision] = self._score.get(b.revision, 0) + b.weight
        chosen = max(live, key=lambda b: self._score[b.revision])
        self._score[chosen.revision] -= total
        return [chosen] + sorted((b for b in live if b is not chosen), key=lambda b: -b.weight)


# --- the table on disk ----------------------------------------------------------------------------


def write_table(path: Path, table: SplitTable) -> None:
    """Replace split.json atomically (write, fsync, rename), 0600: the splitter never sees half a table."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(table.model_dump_json(indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def parse_table(path: Path, raw: bytes) -> SplitTable:
    """The table in `raw` (the bytes of `path`); ValueError naming `path` when it does not parse."""
    try:
        return SplitTable.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]  # named by its field: "Extra inputs are not permitted" said of which?
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"{path}: {f'{where}: ' if where else ''}{field_message(error)}") from None


def table_problem(path: Path) -> str | None:
    """Why the table at `path` cannot be followed now (missing, unreadable, empty, not a table),
    or None: what `kvguard splitter` says once when it starts. The local backend starts the
    splitter before it writes the first table, so a missing one is not refused: until a table is
    written every request is answered 503 no_backend."""
    try:
        raw = _read_own_file(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:  # PermissionError included: a table someone else could write
        return f"cannot be read ({exc.strerror if exc.filename else exc})"
    if not raw:
        return "is empty"
    try:
        parse_table(path, raw)
    except ValueError as exc:
        return f"is not a split table ({str(exc).removeprefix(f'{path}: ')})"
    return None


def _read_own_file(path: Path) -> bytes:
    """The file's bytes, if this user owns it and nobody else may write it: the table decides where
    every client's request goes, so a table another local user could have written (group- or
    world-writable, or theirs) is refused (PermissionError) and the last good one stays."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())  # of the file read, not of whatever the name points at later
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{path}: must be owned by uid {os.geteuid()} and writable by it alone "
                                  f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})")  # fmt: skip
        return fh.read()


class TableSource:
    """The split table, re-read whenever the file's bytes change. Not by its (inode, size,
    mtime): each atomic rewrite's new file can take the inode number the one before it freed, a
    table naming another revision has the same size, and two rewrites can land within one tick of
    the filesystem's clock, so a changed table could look like the one already followed. The file
    is a few hundred bytes: reading it on each request costs microseconds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw: bytes | None = None
        self.turns = WeightedTurns(SplitTable())

    def current(self) -> WeightedTurns:
        try:
            raw = _read_own_file(self.path)
        except FileNotFoundError:
            raw = b""
        except OSError as exc:  # PermissionError included: a table someone else could write
            log.error("split table unreadable, the last good one stays: %s", exc)
            return self.turns
        if raw != self._raw:
            self._raw = raw
            try:
                table = parse_table(self.path, raw) if raw else self._no_table()
            except ValueError as exc:
                log.error("split table ignored, the last good one stays: %s", exc)
            else:
                if table != self.turns.table:
                    log.info("split table: %s", table.weights() or "no backends")
                    self.turns = WeightedTurns(table)
        return self.turns


    def _no_table(self) -> SplitTable:
        """A missing or empty file: nothing yet before the first table (the splitter starts before
        the backend writes one); after it, a file emptied or removed by hand, or the first moment
        of an in-place rewrite, is no table at all (the backend's own "no traffic" is a table with
        no backends): the last good one stays (an outside probe saw every request get 503)."""
        if self.turns.table.backends:
            raise ValueError(f"{self.path}: missing or empty")
        return SplitTable()


# --- the proxy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitterConfig:
    table_path: Path
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # as the router's --max-body-bytes default
    max_body_memory: int = worker_default("max_body_memory")  # as the router's: bodies held at once (503 past it)
    body_timeout_s: float = worker_default("body_timeout")  # as the router's
    connect_timeout_s: float = 5.0
    write_timeout_s: float = worker_default("write_timeout")  # as the router's: a client that reads nothing for this long is dropped


@dataclass
class HeldBody:
    """A request's body, held until a router answers (a refused connection sends it to the next
    revision) and counted against max_body_memory until then -- not while the answer streams: a
    few dozen slow streams of 7 MiB bodies, mostly whitespace, filled the room for as long as
    they ran (a review)."""

    data: bytes | None
    lease: BodyLease

    def drop(self) -> None:
        self.data = None
        self.lease.release()


class Splitter:
    """The aiohttp applications of `kvguard splitter`: the API port and the metrics port."""

    def __init__(self, config: SplitterConfig) -> None:
        self.config = config
        self.source = TableSource(config.table_path)
        self.registry = CollectorRegistry()
        self.requests = Counter("kvguard_splitter_requests_total", "Requests forwarded, by revision and HTTP status",
                                ["revision", "code"], registry=self.registry)  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self._bodies = BodyMemory(config.max_body_memory, on_refused=self.requests.labels(revision="none", code="503").inc)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=self.config.max_body_bytes)
        app.router.add_route("*", "/v1/{tail:.*}", self.forward, expect_handler=self._expect)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def metrics_app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        return app

    async def _start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # force_close: a fresh loopback connection per request (a fraction of a millisecond), so a
        # refused connection always means "never reached a router" and a router that restarted
        # never leaves a dead pooled connection behind to fail the next request.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def _stop(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, _: web.Request) -> web.Response:
        weights = self.source.current().table.weights()
        ok = any(w > 0 for w in weights.values())
        return web.json_response({"status": "ok" if ok else "no_backend", "weights": weights}, status=200 if ok else 503)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        check_transfer_codings(request.headers)  # the router's check too: forwarded de-chunked, it would not see it
        with self._bodies.reading() as lease:
            body = HeldBody(await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s, lease), lease)
            return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: HeldBody) -> web.StreamResponse:
        candidates = self.source.current().order()
        if not candidates:
            raise OpenAIError(503, "no revision of this model is serving", code="no_backend", retry_after_s=1)
        for backend in candidates:
            try:
                return await self._relay(request, body, backend)
            except aiohttp.ClientConnectorError as exc:  # never reached the router: safe to send elsewhere
                log.warning("revision %s refused the connection (%s); trying the next backend", backend.revision, exc.os_error)
            except aiohttp.ClientError as exc:  # reached it, no answer: sending again could run it twice
                self.requests.labels(revision=backend.revision, code="502").inc()
                raise OpenAIError(502, f"revision {backend.revision} did not answer ({type(exc).__name__})", code="bad_gateway") from None
        self.requests.labels(revision="none", code="503").inc()
        raise OpenAIError(503, "no revision of this model accepted the connection", code="no_backend", retry_after_s=1)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        return await answer_expect(request, self.config.max_body_bytes, self._bodies)

    async def _relay(self, request: web.Request, body: HeldBody, backend: SplitBackend) -> web.StreamResponse:
        assert self.session is not None, "the splitter has not started"
        headers = forwarded_headers(request.headers.items())
        peer = request.remote or "unknown"
        prior = request.headers.get(FORWARDED_FOR)
        forwarded_for = f"{prior}, {peer}" if prior else peer  # what every proxy adds
        if len(forwarded_for.encode()) > MAX_HEADER_VALUE_BYTES:
            raise OpenAIError(431, f"{FORWARDED_FOR}: over {MAX_HEADER_VALUE_BYTES} bytes once this proxy adds its entry",
                              code="request_header_fields_too_large")  # fmt: skip
        headers.append((FORWARDED_FOR, forwarded_for))
        async with self.session.request(request.method, backend.url + request.rel_url.raw_path_qs, headers=headers,
                                        data=body.data or None, allow_redirects=False,
                                        skip_auto_headers=_NOT_ADDED) as upstream:  # fmt: skip
            body.drop()  # a router answered: no retry sends it again, and a long stream holds no room
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            response.headers.extend(forwarded_headers(upstream.headers.items()))
            response.headers[REVISION_HEADER] = backend.revision
            if upstream.headers.get("content-length") is not None:
                response.content_length = int(upstream.headers["content-length"])
            self.requests.labels(revision=backend.revision, code=str(upstream.status)).inc()
            await prepare_stream(request, response)
            # A client that reads nothing loses its connection, as at the router (whose own watch
            # sees the splitter reading): otherwise it held the splitter's buffers for ever.
            watch = StallWatch(request.transport, self.config.write_timeout_s, lambda: drop(request.transport))
            try:
                async for chunk in upstream.content.iter_any():
                    with watch:
                        await response.write(chunk)  # a client gone raises here; leaving closes the router's stream (S4)
                with watch:
                    await response.write_eof()
            except aiohttp.ClientError as exc:  # the router broke off mid-answer: so does the client's answer
                log.warning("revision %s broke off a response (%s)", backend.revision, type(exc).__name__)
                if request.transport is not None:
                    request.transport.close()  # not a clean end: the client must not take a cut stream as whole
            finally:
                watch.close()
            return response


def forwarded_headers(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The end-to-end headers of a message: the hop-by-hop ones, those its `Connection` header
    names (RFC 9110 7.6.1: hop-by-hop too), and the framing aiohttp sets, dropped."""
    pairs = list(items)
    named = {token.strip().lower() for k, v in pairs if k.lower() == "connection" for token in v.split(",")}
    return [(k, v) for k, v in pairs if k.lower() not in _NOT_FORWARDED and k.lower() not in named]
