"""Decode's token channel: one long-lived stream per router and decode worker that carries, after
their bootstraps, the events of every request the router sent there (workers/protocol.py, step 4).

Why (issue 14): with a stream per request, decode's event loop woke a coroutine and wrote a socket
once per request per engine step, and the router read each of those sockets -- per-token work on
the GIL decode's engine thread needs. On a channel an engine step is one hand-off, one encoding
pass and one write for all of its requests, and one read at the router.

What does not change: a request's own stream stays open until it ends, so a router that closes it
or calls /internal/abort still aborts the request (S4); the bootstrap and any failure before the
first token still go on it. A channel that closes ends every request on it, on both sides (S4).

This is decode's end (`TokenChannel`); workers/channel_reader.py is the router's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvguard.workers.async_engine import RequestStream
from kvguard.workers.protocol import MAX_EVENT_TOKENS, ChannelEvent, ErrorEvent
from kvguard.workers.request import RequestOutput
from kvguard.workers.stream_events import StreamInterval, step_events
from kvguard.workers.transfer import AbortCause

MAX_CHANNELS = 64  # per decode worker: one per router replica is the expected number

log = logging.getLogger("kvguard.decode")


def _event_groups(outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """Consecutive outputs in groups of at most MAX_EVENT_TOKENS tokens, one event each: held
    while the router read slowly, a request's outputs can be any number."""
    groups: list[list[RequestOutput]] = [[]]
    tokens = 0
    for output in outputs:
        count = len(output.token_ids)
        if groups[-1] and tokens + count > MAX_EVENT_TOKENS:
            groups.append([])
            tokens = 0
        groups[-1].append(output)
        tokens += count
    return groups


def _failed(request_id: str) -> bytes:
    event = ErrorEvent(status=500, code="internal_error", message="decode could not encode the request's tokens")
    return ChannelEvent(request_id=request_id, event=event).model_dump_json().encode() + b"\n"


@dataclass
class _Route:
    interval: StreamInterval
    prompt_tokens: int
    ended: asyncio.Future[str]  # "" when the engine ended the request, else the cause to abort it with
    sent: int = 0  # completion tokens sent so far


@dataclass(eq=False)
class TokenChannel:
    """Decode's end of one channel: the requests routed to it and which of them have outputs due,
    encoded and written by `serve` in one write per step. Outputs are encoded when written, not
    when the engine hands them over: when the router reads slowly (a write waits on it) or the
    event loop falls behind the engine, a request's outputs of several steps go out as one event.
    A `StepRelay` for the requests' streams."""

    id: str
    stream_interval: int = 1
    _routes: dict[str, _Route] = field(default_factory=dict)
    _due: dict[str, None] = field(default_factory=dict)  # requests with outputs to send, in order
    _pending: bytes = b""  # encoded at close, written by `serve` before it returns
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: str | None = None  # the cause, once closed

    def attach(self, stream: RequestStream, prompt_tokens: int) -> asyncio.Future[str]:
        """Route `stream`'s outputs here from now on. The future resolves once the request ended:
        "" if the engine ended it (finished, or failed and freed), else the cause to abort it with
        (the channel closed)."""
        ended = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            ended.set_result(self._closed)
            return ended
        self._routes[stream.request_id] = _Route(StreamInterval(self.stream_interval), prompt_tokens, ended)
        stream.forward_to(self)
        return ended

    def detach(self, request_id: str) -> None:
        """Its handler is done with the request: later outputs of it (its abort) are dropped."""
        self._routes.pop(request_id, None)

    def add(self, stream: RequestStream, output: RequestOutput) -> None:
        route = self._routes.get(stream.request_id)
        if route is not None and route.interval.due((output,), time.monotonic()):
            self._due[stream.request_id] = None

    def flush(self) -> None:
        if self._due:
            self._wake.set()

    def close(self, cause: str) -> None:
        """What is due goes out; every request still routed here then ends with `cause`; `serve`
        writes the last bytes, then returns."""
        if self._closed is None:
            self._pending = self._encode_due()
        self._closed = self._closed or cause
        for request_id in list(self._routes):
            self._end(request_id, cause)
        self._wake.set()

    async def serve(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        """Whenever steps made outputs due: encode them and write them in one write; until closed
        (or a write fails: the router is gone)."""
        while self._closed is None:
            await self._wake.wait()
            self._wake.clear()
            if self._closed is None and (data := self._encode_due()):
                await write(data)
        if self._pending:  # what was due when it closed (also when that was during a write)
            await write(self._pending)

    def _encode_due(self) -> bytes:
        """The events of every request with outputs due, each request's held outputs as one event
        (a request detached since has no handler left to hear it: dropped)."""
        parts = []
        for request_id in self._due:
            if (route := self._routes.get(request_id)) is None:
                continue
            try:
                ended = False
                for group in _event_groups(route.interval.take()):
                    data, route.sent, ended = step_events(group, route.prompt_tokens, route.sent, channel_request=request_id)
                    parts.append(data)
            except Exception:  # a bug on this request's outputs ends it alone, not the channel's others
                log.exception("request %s: its outputs could not be encoded", request_id)
                parts.append(_failed(request_id))
                self._end(request_id, AbortCause.DECODE_ERROR)
                continue
            if ended:
                self._end(request_id, "")
        self._due.clear()
        return b"".join(parts)

    def _end(self, request_id: str, cause: str) -> None:
        route = self._routes.pop(request_id)
        if not route.ended.done():  # its handler may have been cancelled while waiting on it
            route.ended.set_result(cause)
