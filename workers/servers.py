"""`kvguard worker`: build one process -- prefill, decode or router -- from its flags and run it.

Each process serves one aiohttp application per audience (workers/args.py has the table): the
router's public OpenAI API or a worker's internal control API on `--port`, and read-only
`/metrics` + `/health` on `--metrics-port`. Every listening socket is opened before the model is
loaded, so a busy port is reported in a second, not after the weights are in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import signal
import socket
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvguard.workers.args import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, LIFELINE_FD_ENV, WorkerArgs
from kvguard.workers.faults import Faults, FaultSpecError, active_faults
from kvguard.workers.keys import RevisionKeys

log = logging.getLogger("kvguard.worker")

@dataclass
class Listeners:
    """The process's listening sockets, one per audience."""

    main: socket.socket  # router: public API; prefill/decode: internal control API
    metrics: socket.socket
    transfer: socket.socket | None = None  # decode only

    @classmethod
    def open(cls, args: WorkerArgs) -> Listeners:
        opened: list[socket.socket] = []
        wanted = [("--port", args.port), ("--metrics-port", args.metrics_port)]
        if args.role == "decode":
            wanted.append(("--transfer-port", args.transfer_port or type(args.port)()))
        for flag, listen in wanted:
            try:
                opened.append(listen.open(args.host))
            except OSError as exc:
                for sock in opened:
                    sock.close()
                raise OSError(f"cannot listen on {args.host}:{listen} ({flag}): {exc.strerror or exc}") from None
        return cls(*opened)

    def close(self) -> None:
        for sock in (self.main, self.metrics, self.transfer):
            if sock is not None:
                sock.close()


def run_worker(args: WorkerArgs) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(name)s %(levelname)s %(message)s")
    try:
        faults = active_faults()
        listeners = Listeners.open(args)
    except (ValueError, FaultSpecError, OSError) as exc:
        print(f"kvguard worker: {exc}", file=sys.stderr)
        return 2
    try:
        served = build_router(args, faults) if args.role == "router" else build_engine_worker(args, faults, listeners)
    except (ValueError, OSError) as exc:
        listeners.close()
        print(f"kvguard worker: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve([(served.main, listeners.main), (served.metrics, listeners.metrics)], header_timeout_s=args.header_timeout,
                      drain=served.drain, max_connections=args.max_connections, registry=served.registry))  # fmt: skip
    return 0


class Served(NamedTuple):
    """A process's applications, one per audience, and what it finishes on SIGTERM."""

    main: web.Application
    metrics: web.Application
    drain: Drain
    registry: CollectorRegistry  # what /metrics serves: the listeners' connection counts join it (ListenerMetrics)


SHUTDOWN_GRACE_S = 5.0
"""How long a worker takes at most to stop once it stops serving: aiohttp waits its
shutdown_timeout for the handlers, cancels them, then waits up to that again, so it gets half."""


@dataclass(frozen=True)
class Drain:
    """What a process finishes before it stops on SIGTERM: the generations it holds (SIGINT, or
    the local launcher's death, stops it at once, as before, also in the middle of a drain).

    Why: a revision taken out of traffic (superseded mid-shift, rolled back, scaled down after a
    promotion) is stopped while its last requests are still streaming; stopped at once, each of
    them broke with a 502 (an outside probe of a spec change mid-shift). The kubelet sends SIGTERM
    to a revision's router, prefill and decode pods together; the local backend stops the router
    first. Either way the router stops taking requests at once and finishes those it has, and
    prefill and decode keep their listeners up and serve until the requests they hold are done
    (a draining router's generations still need them), each for at most its `--drain-timeout`.
    Another signal during the drain (Ctrl-C) ends it at once."""

    idle: Callable[[], bool]
    """No request held: nothing left to finish."""
    stop_accepting: bool = False
    """Close the main listener first (the router: new requests go to another revision)."""
    begin: Callable[[], None] | None = None
    """Called once draining starts (the router's /health says so; workers answer `Connection: close`)."""
    expire: Callable[[], Awaitable[None]] | None = None
    """Called when it stops with requests still held: ends them, each with an error its client can
    read (the router's), before the server's shutdown closes their connections."""
    grace_s: float = DEFAULT_DRAIN_TIMEOUT_S  # `--drain-timeout`
    poll_s: float = 0.05

    async def run(self, site: web.BaseSite, interrupted: asyncio.Event) -> None:
        """Until idle, the grace is over, or `interrupted` (another signal: stop now)."""
        if self.begin is not None:
            self.begin()
        if self.stop_accepting:
            await site.stop()
        deadline = time.monotonic() + self.grace_s
        while not self.idle() and not interrupted.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
        if not self.idle():
            log.warning("stopping with requests in flight after %.1f s of draining", self.grace_s - max(0.0, deadline - time.monotonic()))
            if self.expire is not None:
                await self.expire()


class MalformedRequestFilter(logging.Filter):
    """Drops aiohttp's log record of a client's malformed HTTP (oversized or too many headers,
    Content-Length with Transfer-Encoding, a bad request line): the client got its 400 and nothing
    here failed, yet aiohttp logs each at ERROR with a traceback -- ~570 bytes of log for a
    ~60-byte request, a cheap way to flood the logs. Anything else it logs is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        return not (record.exc_info and isinstance(record.exc_info[1], BadHttpMessage))


_MALFORMED_REQUESTS = MalformedRequestFilter()


def quiet_malformed_requests() -> None:
    logging.getLogger("aiohttp.server").addFilter(_MALFORMED_REQUESTS)  # a filter it holds is not added twice


def app_runner(app: web.Application, header_timeout_s: float) -> web.AppRunner:
    """The runner every listener uses.

    handler_cancellation: a client (or the router) that goes away cancels its handler, which is
    how a disconnect reaches the request's cleanup (S4).
    keepalive_timeout: aiohttp arms it when a connection opens and re-arms it only after a
    response, and closes a connection still waiting for a complete request when it fires -- so it
    bounds how long a client may take to send its headers (slowloris) as well as idle keep-alive
    time. aiohttp's own default is an hour. Bodies are bounded by the handlers (the router: 408).
    auto_decompress off: no listener inflates a Content-Encoding body (a gzip bomb, or a parser
    error before any handler runs); the router refuses one with a 415 (router._check_body_headers).
    shutdown_timeout: on SIGTERM, requests in flight get this long to end before their handlers are
    cancelled (which aborts them, S4). aiohttp's 60 s kept a prefill whose requests wait for their
    tickets alive past a pod's termination grace, to be SIGKILLed."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=header_timeout_s,
                         auto_decompress=False, shutdown_timeout=SHUTDOWN_GRACE_S / 2)  # fmt: skip


async def serve(sites: Sequence[tuple[web.Application, socket.socket]], header_timeout_s: float = 30.0,
                drain: Drain | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                registry: CollectorRegistry | None = None) -> None:  # fmt: skip
    """Run every (application, socket) pair until SIGTERM or SIGINT, then clean up in reverse.
    On SIGTERM, `drain` (if any) runs first: the requests held are finished (see Drain). Each
    listener keeps at most `max_connections` open (CappedSockSite), fewer if the open-file limit
    would not hold them all. With a `registry`, the listeners' open and refused connections are
    in it (ListenerMetrics; the first pair is the `main` listener, the second `metrics`)."""
    quiet_malformed_requests()
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    watch_lifeline(loop, stop)
    runners: list[web.AppRunner] = []
    main_site: web.BaseSite | None = None
    cap = connection_cap(max_connections, len(sites))
    capped: list[CappedSockSite] = []
    listener_metrics = ListenerMetrics(capped)
    if registry is not None:
        registry.register(listener_metrics)
    try:
        for app, sock in sites:
            runner = app_runner(app, header_timeout_s)
            await runner.setup()
            runners.append(runner)
            site = CappedSockSite(runner, sock, cap)
            await site.start()
            capped.append(site)
            main_site = main_site or site
            log.info("listening on %s:%s", *sock.getsockname()[:2])
        await stop.wait()
        if drain is not None and main_site is not None and received and set(received) == {signal.SIGTERM}:
            stop.clear()  # another signal (Ctrl-C) or the launcher's death ends the drain at once
            await drain.run(main_site, stop)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        if registry is not None:
            registry.unregister(listener_metrics)


RESERVED_FDS = 256
"""File descriptors kept out of every listener's cap: the process's own calls (the router's to its
workers, the transfer's connections, the model's files) need them when clients hold the rest."""
_REFUSED_BODY = json.dumps({"error": {"message": "too many open connections to this server; retry", "type": "server_error",
                                      "param": None, "code": "too_many_connections"}}).encode()  # fmt: skip
REFUSED_CONNECTION = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                      b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))  # fmt: skip
"""What a connection over the cap gets, before any of its request is read (an OpenAI-shaped error)."""


def connection_cap(requested: int, listeners: int) -> int:
    """`requested` connections per listener, fewer if the soft open-file limit cannot hold them all
    beside RESERVED_FDS. Why: an outside probe's 19,990 slow-header connections filled the router's
    20,000 descriptors; its accept loop failed with EMFILE, and every tenant waited 5-10 s."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, (soft - RESERVED_FDS) // max(1, listeners)))


MALFORMED_MESSAGE_CHARS = 200
"""How much of the HTTP parser's complaint a malformed request's 400 quotes (its first line only)."""


class ListenerConnection(RequestHandler):
    """aiohttp's connection handler, with two things a capped listener needs of it:
    - a request its HTTP parser refuses (a control character in a header, a header line over 8 KiB,
      Content-Length with Transfer-Encoding, a duplicated Content-Type) is answered with an
      OpenAI-shaped error body, as every other client error is. aiohttp answered these with plain
      text quoting the client's bytes (an outside probe; issue 11: every client input gets a 4xx
      OpenAI error). Status and logging stay aiohttp's;
    - it says whether it has a request in hand (`waiting`, `requests_read`, `answered`, `body_since`):
      one without is what CappedSockSite closes to make room at its cap."""

    __slots__ = ("answered", "answered_at", "body_since", "keyed", "made_at")

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self.made_at = loop.time()
        self.answered = 0
        """Requests it has answered: as many as it has read (`requests_read`), none is in hand."""
        self.answered_at = self.made_at
        """Event-loop time its last answer was sent (when it was made, before its first)."""
        self.body_since: float | None = None
        """Event-loop time its request began reading its body (`reading_body`), None if it does not."""
        self.keyed = False
        """It carried a call signed with the control key, whole and fresh (`mark_keyed`): the router's."""

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:  # fmt: skip
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.answered += 1
            self.answered_at = self._loop.time()

    @property
    def waiting(self) -> bool:
        """No request of this connection is being handled or queued: it is idle between requests,
        or still reading a request's head. Read the way aiohttp's own keep-alive timer reads it (its
        loop awaits `_waiter` for the next message); a request whose head has arrived is in
        `_messages`, and one being handled (its body read included) holds no waiter."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages and not self._force_close

    @property
    def closing(self) -> bool:
        """Its transport is closed (CappedSockSite made room with it): it ends next loop pass."""
        return self.transport is None or self.transport.is_closing()

    @property
    def requests_read(self) -> int:
        """Requests whose head this connection has read (0: a client that never sent one)."""
        return self._request_count

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:  # fmt: skip
        plain = super().handle_error(request, status, exc, message)  # logs; raises if a response began
        if status >= 500:
            error = {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}
        else:
            said = getattr(exc, "message", None) or message or ""
            first = (str(said).strip().splitlines() or [""])[0].rstrip(":")[:MALFORMED_MESSAGE_CHARS]
            error = {"message": f"malformed HTTP request: {first}" if first else "malformed HTTP request",
                     "type": "invalid_request_error", "param": None, "code": "malformed_http"}  # fmt: skip
        response = web.json_response({"error": error}, status=plain.status)
        response.force_close()
        return response


class CappedSockSite(web.SockSite):
    """A listener that keeps at most `cap` connections open. At the cap, a new connection takes the
    place of one that has no request in hand (`_room_to_make`: one that never sent a request head,
    or whose body is still arriving, for at least MIN_AGE_S; last, a kept-alive one idle for at
    least KEPT_IDLE_S), which is closed; else it is answered 503 (code `too_many_connections`,
    Retry-After: 1) and closed before any of it is read. Refusing every newcomer instead, 4,096
    half-sent request lines (or bodies sent a byte at a time) held every other tenant off for as
    long as their sender kept reconnecting (an outside probe, issue 11); now such a flood holds
    the places only while it opens more than `cap` connections every MIN_AGE_S. Requests in hand,
    and kept-alive connections in use, keep being served."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, cap: int) -> None:
        super().__init__(runner, sock)
        self.cap = cap
        self.refused = 0
        self.evicted = 0  # connections without a request in hand closed to make room for a new one
        self._unmade = 0  # handed out since the loop last ran its callbacks: not yet in server.connections
        self._closing = 0  # closed to make room since then: still in server.connections, their sockets still open
        self._no_room_until = -math.inf  # event-loop time until which a newcomer is refused without a search
        self.min_age_s = MIN_AGE_S
        self.kept_idle_s = KEPT_IDLE_S
        self.rescan_s = RESCAN_S
        self.lingering = 0  # refused connections reading what their clients still send (_RefusedConnection)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner; SockSite.start would serve uncapped
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._protocol(server), sock=self._sock, backlog=self._backlog)

    def _protocol(self, server: web.Server) -> asyncio.BaseProtocol:
        # The loop accepts up to the backlog at once and makes each one's protocol before any
        # connection_made (the next pass, after the `_made` scheduled here): without the ones handed
        # out meanwhile, a burst of 60 at a cap of 5 had all 60 open (an outside review).
        if len(server.connections) - self._closing + self._unmade < self.cap or self._make_room(server):
            if not self._unmade and not self._closing:
                asyncio.get_running_loop().call_soon(self._made)
            self._unmade += 1
            # What server() makes (the runner's handler arguments), as a ListenerConnection
            return ListenerConnection(server, loop=asyncio.get_running_loop(), **server._kwargs)
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, ...: a flood is told, not logged per connection
            log.warning("%d connection(s) refused: %d open, none to close (requests in hand, kept-alive in use, or "
                        "younger than %g s), the cap (--max-connections or the open-file limit)", self.refused, self.cap,
                        self.min_age_s)  # fmt: skip
        return _RefusedConnection(self)

    def _make_room(self, server: web.Server) -> bool:
        """Close the connection `_room_to_make` names; False if it names none. At most MAX_CLOSING
        per loop pass: a closed socket is released on the next pass, and what is still open then
        comes out of RESERVED_FDS. A search that found none is not repeated for `rescan_s`: with
        every place holding a request in hand, searching for each refused newcomer cost 0.45 ms of
        the event loop per refusal at 4,096 places (0.11 ms before there was a search), so a
        flood of 2,000 connections a second stalled every stream (a review)."""
        now = asyncio.get_running_loop().time()
        if self._closing >= MAX_CLOSING or now < self._no_room_until:
            return False
        chosen = _room_to_make(server.connections, now - self.min_age_s, now - self.kept_idle_s)
        if chosen is None:
            self._no_room_until = now + self.rescan_s
            return False
        # Its transport only: aiohttp's force_close would also drop the handler's hold on it at once,
        # and a body read woken in this pass (or aiohttp dropping the rest of an unread one) then
        # raised RuntimeError("Connection closed."), logged as an unexpected error with its
        # traceback (a review). connection_lost, next pass, ends it as a client's hang-up does.
        assert chosen.transport is not None
        chosen.transport.close()
        if not self._unmade and not self._closing:
            asyncio.get_running_loop().call_soon(self._made)  # after the close's connection_lost
        self._closing += 1
        self.evicted += 1
        if self.evicted & (self.evicted - 1) == 0:  # 1, 2, 4, ...
            log.warning("%d connection(s) without a request in hand (a request head or body still arriving, or idle "
                        "kept alive) closed to make room at the cap of %d (--max-connections or the open-file limit)",
                        self.evicted, self.cap)  # fmt: skip
        return True

    def _made(self) -> None:
        # Their connection_made and connection_lost callbacks come right after this one.
        self._unmade = 0
        self._closing = 0

    def open_connections(self) -> int:
        server = self._runner.server
        return 0 if server is None else len(server.connections)


def _room_to_make(connections: Iterable[RequestHandler], old_since: float,
                  idle_since: float) -> ListenerConnection | None:  # fmt: skip
    """Which connection a new one takes the place of at a listener's cap: the oldest one that never
    sent a whole request head (a slow or idle client); else the one answered longest ago whose
    answer aiohttp is still following by reading and dropping, for up to 10 s, the rest of a body
    its handler did not read (a 401, 404, or 413 by its Content-Length); else the one whose
    request has read its body longest (a body sent slowly, as a flood of them would: a request
    whose body has not arrived is not yet taken on); last, the kept-alive connection idle longest,
    if since `idle_since`. None when no connection is to be closed: the new one is refused.

    Left alone: a connection made, answered, or whose body began after `old_since`, since a
    client whose request is already in the socket, not yet read by the loop, would otherwise lose
    it to a flood of newcomers; and a kept-alive connection answered after `idle_since`, whose
    client may be sending its next request on the heels of the answer (three reviews). Never
    closed at all, idle keep-alive connections were the cheapest flood: each request re-arms the
    keep-alive timer, so one GET /v1/models per connection every 20 s (~205 a second, no new
    connection) held all 4,096 places for as long as it ran, and every new tenant got 503 (an
    outside probe). Now it must use each connection every KEPT_IDLE_S. A kept-alive client closed
    while idle opens a new connection for its next request, as HTTP clients do (a flood of more
    than the cap in MIN_AGE_S may then refuse it). Never closed for a newcomer: a `keyed`
    connection, the router's pool to a worker (`mark_keyed`)."""
    draining: ListenerConnection | None = None
    drained_since = old_since
    slow_body: ListenerConnection | None = None
    slow_since = old_since
    kept: ListenerConnection | None = None
    kept_since = idle_since
    for connection in connections:  # oldest first
        if not isinstance(connection, ListenerConnection) or connection._force_close or connection.closing:
            continue
        if not connection.requests_read:
            if connection.waiting and connection.made_at <= old_since:
                return connection
        elif connection.answered == connection.requests_read:
            if not connection.waiting and connection.answered_at <= drained_since:
                draining, drained_since = connection, connection.answered_at
            elif connection.waiting and not connection.keyed and connection.answered_at <= kept_since:
                kept, kept_since = connection, connection.answered_at
        elif connection.body_since is not None and connection.body_since <= slow_since:
            slow_body, slow_since = connection, connection.body_since
    return draining or slow_body or kept


def mark_keyed(request: web.BaseRequest) -> None:
    """The request's connection carried a call signed with the control key, verified whole (its
    nonce fresh: a replayed header marks nothing). Kept alive, it is the router's pool to a worker:
    never closed to make room (`_room_to_make`). Closed there, the router's next call met a full
    listener and got 503, and only two of its calls are sent again (a review); exempting the whole
    internal listener instead let a client without the key hold it with kept-alive connections
    that aiohttp answers before any check (`Expect: x`, 417: a review)."""
    if isinstance(connection := request.protocol, ListenerConnection):
        connection.keyed = True


@contextlib.contextmanager
def reading_body(request: web.BaseRequest) -> Iterator[None]:
    """While a request's body is read (openai_api.read_body): its connection is one a new one may
    take the place of at the listener's cap (`_room_to_make`)."""
    connection = request.protocol
    if not isinstance(connection, ListenerConnection):
        yield
        return
    connection.body_since = asyncio.get_running_loop().time()
    try:
        yield
    finally:
        connection.body_since = None


LISTENER_NAMES = ("main", "metrics")


class ListenerMetrics(Collector):
    """Each listener's open connections and the connections it refused at its cap, read from the
    sites when scraped. Why metered, not only logged: the log says so at 1, 2, 4, ... refusals, and
    an operator's alert needs the rate (a cap too low for the traffic, or a flood of idle clients)."""

    def __init__(self, sites: Sequence[CappedSockSite]) -> None:
        self.sites = sites

    def collect(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily("kvguard_refused_connections", "Connections answered 503 too_many_connections and "
                                      "closed, because the listener held its cap (--max-connections or the open-file limit)",
                                      labels=["listener"])  # fmt: skip
        evicted = CounterMetricFamily("kvguard_evicted_connections", "Connections without a request in hand (a "
                                      "request head or body still arriving) closed to make room for a new one at "
                                      "the listener's cap", labels=["listener"])  # fmt: skip
        open_now = GaugeMetricFamily("kvguard_open_connections", "Connections the listener holds open now",
                                     labels=["listener"])  # fmt: skip
        for name, site in zip(LISTENER_NAMES, self.sites, strict=False):
            refused.add_metric([name], site.refused)
            evicted.add_metric([name], site.evicted)
            open_now.add_metric([name], site.open_connections())
        return [refused, evicted, open_now]


REFUSED_LINGER_S = 1.0
"""How long a refused connection is kept to read what its client sends after the 503."""
MAX_LINGERING = 32
"""Refused connections lingering at once per listener: taken from RESERVED_FDS, so a flood of
them cannot take the descriptors the process needs for its own calls."""
MAX_CLOSING = 32
"""Connections closed to make room at a listener's cap in one loop pass (their sockets are released
on the next), likewise taken from RESERVED_FDS."""
MIN_AGE_S = 1.0
"""How long a connection that has not sent a request head, a request whose body is arriving, or an
answer whose unread body aiohttp is dropping, is left alone at a listener's cap: a flood of
newcomers cannot close a client whose request the loop has not read yet."""
KEPT_IDLE_S = 2.0
"""How long a kept-alive connection must have been idle since its last answer before a newcomer at
a listener's cap may take its place (`_room_to_make`, last of all): a client sends its next
request on the heels of an answer, or leaves the connection idle."""
RESCAN_S = 0.05
"""How long a listener at its cap refuses newcomers without a search after one found nothing to
close: at most 20 searches a second, whatever the rate of connections."""


class _RefusedConnection(asyncio.Protocol):
    """Writes the 503, shuts its side, and reads (discarding) until the client closes, for at most
    REFUSED_LINGER_S: closed at once with the request unread, the kernel resets the connection,
    and a client whose request arrived before the 503 lost it to the reset (a CI run under load).
    Past MAX_LINGERING of them at once on the listener, one is closed at once."""

    def __init__(self, site: CappedSockSite) -> None:
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(REFUSED_CONNECTION)
        if self.site.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()  # after the write is flushed
            return
        self.site.lingering += 1
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        del data  # read and dropped: the client learns from the 503 it already has

    def eof_received(self) -> bool:
        assert self.transport is not None
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.site.lingering -= 1


def watch_lifeline(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stop when the local launcher that started this process dies (`LIFELINE_FD_ENV`).

    `kvguard serve` stops its workers on SIGINT/SIGTERM/SIGHUP, but a launcher killed outright
    (SIGKILL, OOM) cannot: without this its workers would keep serving and holding every port.
    The launcher never writes to the pipe, so the first readable event is EOF. Pods have no
    lifeline (the variable is unset): the kubelet owns their lifetime.
    """
    raw = os.environ.pop(LIFELINE_FD_ENV, None)
    if raw is None:
        return
    try:
        fd = int(raw)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"descriptor {fd} is not a pipe")
    except (ValueError, OSError) as exc:
        log.warning("ignoring %s=%r: %s", LIFELINE_FD_ENV, raw, exc)
        return

    def launcher_gone() -> None:
        loop.remove_reader(fd)
        log.warning("the launcher that started this worker is gone; stopping")
        stop.set()

    loop.add_reader(fd, launcher_gone)


def build_router(args: WorkerArgs, faults: Faults) -> Served:
    from kvguard.workers.router import Router, RouterConfig
    from kvguard.workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(args.model)
    if tokenizer is None:
        raise ValueError(f"--model {args.model} has no tokenizer.json; the router needs it to count tokens")
    config = RouterConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        model_name=args.served_model_name(),
        request_timeout_s=args.request_timeout,
        abort_timeout_s=args.abort_timeout,
        body_timeout_s=args.body_timeout,
        write_timeout_s=args.write_timeout,
        max_body_bytes=args.max_body_bytes,
        max_body_memory=args.max_body_memory,
        max_inflight_choices=args.max_inflight_choices,
        propagate_aborts=not faults.no_abort_propagation,
        unsafe_reject_path=faults.unsafe_reject_path,
        fail_proxied_requests=faults.fail_proxied_requests,
        min_kv_ratio=args.min_kv_ratio,
        revision=args.revision_id,
        token_channel=args.token_channel == "on",
        discovery=args.discovery,
    )
    router = Router(config, tokenizer, RevisionKeys.from_env())
    drain = Drain(idle=lambda: router.in_flight == 0, stop_accepting=True, begin=router.start_draining,
                  expire=router.end_in_flight, grace_s=args.drain_timeout)  # fmt: skip
    return Served(router.app(), router.metrics_app(), drain, router.metrics.registry)


def build_engine_worker(args: WorkerArgs, faults: Faults, listeners: Listeners) -> Served:
    from prometheus_client import CollectorRegistry

    from kvguard.workers.async_engine import AsyncEngine
    from kvguard.workers.config import EngineConfig
    from kvguard.workers.control_auth import (
        INTERNAL_MAX_BODY_BYTES,
        ControlVerifier,
        auth_failures_counter,
        control_auth_middleware,
    )
    from kvguard.workers.decode_server import DecodeServer
    from kvguard.workers.engine import Engine
    from kvguard.workers.openai_api import error_middleware
    from kvguard.workers.prefill_server import PrefillServer
    from kvguard.workers.protocol import Role
    from kvguard.workers.serving import WorkerRuntime
    from kvguard.workers.transfer import Encryption, TransferConfig, TransferMetrics

    keys = RevisionKeys.from_env()
    registry = CollectorRegistry()
    config = EngineConfig(
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_pool_tokens=args.kv_pool_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        device_share=args.device_share,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        tags=not faults.no_tags,
    )
    engine = AsyncEngine(Engine(config, registry), step_delay_s=faults.delay_step_ms / 1000)
    runtime = WorkerRuntime(
        role=Role(args.role),
        model_name=args.served_model_name(),
        engine=engine,
        registry=registry,
        transfer_metrics=TransferMetrics.create(registry),
        faults=faults,
    )
    transfer = TransferConfig(max_transfer_batch=args.max_transfer_batch, stall_timeout_s=args.transfer_timeout,
                              open_timeout_s=args.bootstrap_timeout, encryption=Encryption(args.transfer_encryption))  # fmt: skip
    # S9: /internal/* answers only calls signed with the revision's control key (the router).
    auth = control_auth_middleware(ControlVerifier(keys.control, instance=runtime.instance), auth_failures_counter(registry))
    app = web.Application(middlewares=[error_middleware, auth], client_max_size=INTERNAL_MAX_BODY_BYTES)
    if runtime.role is Role.DECODE:
        assert listeners.transfer is not None
        decode = DecodeServer(runtime, keys, transfer, advertise_host=args.advertise_host or args.host,
                              stream_interval=args.stream_interval)  # fmt: skip
        runtime.internal_routes(app, lambda: runtime.info(decode.transfer_address))
        app.router.add_post("/internal/decode", decode.decode)
        app.router.add_post("/internal/stream", decode.stream)
        transfer_socket = listeners.transfer

        async def start_receiver(_: web.Application) -> None:
            await decode.start(transfer_socket)
            log.info("decode worker: KV transfer port %s", decode.transfer_address)

        app.on_startup.append(start_receiver)
        app.on_shutdown.append(lambda _: decode.close_channels())
        app.on_cleanup.append(lambda _: decode.close())
    else:
        prefill = PrefillServer(runtime, keys, transfer, bootstrap_timeout_s=args.bootstrap_timeout)
        runtime.internal_routes(app, runtime.info)
        app.router.add_post("/internal/prefill", prefill.prefill)
        app.router.add_post("/internal/ticket", prefill.ticket)
        app.on_cleanup.append(lambda _: prefill.close())

    async def start_engine(_: web.Application) -> None:
        engine.start()
        log.info(
            "%s worker ready: KV pool %d tokens, context %d tokens, faults: %s",
            args.role, engine.engine.pool.capacity_tokens, engine.engine.context_length, faults.to_spec() or "none",
        )

    app.on_startup.append(start_engine)
    app.on_shutdown.append(lambda _: engine.stop())
    drain = Drain(idle=lambda: not runtime.jobs.by_id, begin=close_connections_once_draining(app), grace_s=args.drain_timeout)
    return Served(app, runtime.metrics_app(), drain, runtime.registry)


def close_connections_once_draining(app: web.Application) -> Callable[[], None]:
    """The Drain's `begin` for a prefill or decode worker: from then on, every answer it prepares
    says `Connection: close`. A worker signalled alone (its node drained) keeps its listener up,
    since a draining router may still need it, and kept serving the legs that the router sent over
    its pooled keep-alive connections, long after the pod had left its Service's endpoints.
    Streams started then ran past the grace and ended `worker_failed`. Now each pooled connection
    carries at most one more leg, and the next one opens a connection that the Service sends to a
    pod that is not leaving. Idle connections are not cut: a leg sent on one at that moment would
    fail, where it is served now."""
    draining = False

    async def say_close(_request: web.Request, response: web.StreamResponse) -> None:
        if draining:
            response.force_close()  # closed after this answer
            response.headers[hdrs.CONNECTION] = "close"  # and said so: the hook runs after aiohttp wrote its headers' values

    def begin() -> None:
        nonlocal draining
        draining = True

    app.on_response_prepare.append(say_close)
    return begin
