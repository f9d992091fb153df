"""The router's end of decode's token channels (workers/token_channel.py has decode's end and why
they exist): one `ChannelReader` per decode worker, opened when a request first needs it and again
after it closed, read by one task that hands each event to its request's inbox. No torch here: the
router does not load the model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import aiohttp
from pydantic import ValidationError

from kvguard.workers.protocol import CHANNEL_EVENT, MAX_EVENT_TOKENS, ChannelOpened, ErrorEvent, FinishEvent, TokenEvent

log = logging.getLogger("kvguard.router")

# A sanity bound, not a size any legitimate line nears: one request's event is at most
# MAX_EVENT_TOKENS (1024) tokens with 20 logprob alternatives each, well under 1 MiB.
MAX_LINE_BYTES = 8 << 20

ChannelPayload = TokenEvent | FinishEvent | ErrorEvent


class ChannelLost(Exception):
    """The channel closed or broke while the request was on it."""


Inbox = asyncio.Queue[ChannelPayload | ChannelLost]


def coalesce(first: TokenEvent, inbox: Inbox) -> tuple[TokenEvent, ChannelPayload | ChannelLost | None]:
    """`first` and the token events already waiting behind it in `inbox` as one event, and the
    first waiting item that is not a token event (the caller's next, or None).

    Why: when the router falls behind decode (or behind its client), a request's tokens queue in
    its inbox; relaying them as one SSE chunk costs one write here and one parse at the client
    instead of one each, so a loaded path sheds per-token work instead of queueing it (vLLM's
    output collector merges a request's waiting deltas the same way). The tokens, text and
    logprobs are unchanged, only how many chunks carry them; a path that keeps up never merges.
    The work is linear in what is waiting, itself bounded by the request's max_tokens; one chunk
    carries at most MAX_EVENT_TOKENS tokens."""
    merged, tokens = [first], len(first.token_ids)
    while not inbox.empty():
        item = inbox.get_nowait()
        if not isinstance(item, TokenEvent) or tokens + len(item.token_ids) > MAX_EVENT_TOKENS:
            break  # a chunk carries at most what one event of decode's may
        merged.append(item)
        tokens += len(item.token_ids)
    else:
        item = None
    if len(merged) == 1:
        return first, item
    logprobs = [lp for event in merged for lp in event.logprobs or ()]
    event = TokenEvent.model_construct(  # every part was validated when it arrived
        token_ids=tuple(t for event in merged for t in event.token_ids),
        text="".join(event.text for event in merged),
        logprobs=tuple(logprobs) if any(event.logprobs is not None for event in merged) else None,
    )
    return event, item


@dataclass(eq=False)
class OpenChannel:
    """One channel while it is open: its id (decode's) and the inboxes of the requests on it. Each
    opening has its own, so a request that moves to a new channel is never ended by the old one."""

    id: str
    _inboxes: dict[str, Inbox] = field(default_factory=dict)
    _on_finish: dict[str, Callable[[], None]] = field(default_factory=dict)
    _lost: ChannelLost | None = None

    def subscribe(self, request_id: str, on_finish: Callable[[], None] | None = None) -> Inbox:
        """The request's inbox (before its decode call, so no event can come first). `on_finish`
        runs when decode's finish arrives, however far behind it the request's reader is."""
        inbox: Inbox = asyncio.Queue()
        if self._lost is not None:
            inbox.put_nowait(self._lost)
        else:
            self._inboxes[request_id] = inbox
            if on_finish is not None:
                self._on_finish[request_id] = on_finish
        return inbox

    def unsubscribe(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)
        self._on_finish.pop(request_id, None)

    @property
    def subscribed(self) -> int:
        return len(self._inboxes)

    def hand_over(self, line: bytes) -> None:
        routed = CHANNEL_EVENT.validate_json(line)
        if (inbox := self._inboxes.get(routed.request_id)) is not None:
            inbox.put_nowait(routed.event)
            if type(routed.event) is FinishEvent and (on_finish := self._on_finish.pop(routed.request_id, None)):
                on_finish()

    def lose(self, lost: ChannelLost) -> None:
        self._lost = lost
        for inbox in self._inboxes.values():
            inbox.put_nowait(lost)
        self._inboxes.clear()
        self._on_finish.clear()


@dataclass(eq=False)
class ChannelReader:
    """The router's end of its channel to one decode worker. `open_stream` makes the signed
    ``POST /internal/stream`` call. Events of a request nobody waits for (it ended at the router
    first) are dropped; a request's id is the router's own, never a client's."""

    open_stream: Callable[[], AbstractAsyncContextManager[aiohttp.ClientResponse]]
    _opened: asyncio.Future[OpenChannel] | None = None  # the channel, once decode named it
    _task: asyncio.Task[None] | None = None

    async def channel(self) -> OpenChannel:
        """The open channel, opening one first if there is none (the callers' bound applies)."""
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._opened))
        return await asyncio.shield(self._opened)

    @property
    def busy(self) -> bool:
        """A channel is being opened, or a request waits on the open one."""
        opened = self._opened
        if opened is None:
            return False
        if not opened.done():
            return True
        return not opened.cancelled() and opened.exception() is None and opened.result().subscribed > 0

    def forget(self, channel: OpenChannel) -> None:
        """Decode does not know `channel` (it restarted before this reader saw the old connection
        break): drop it, so the next `channel()` opens a new one."""
        if self._opened is not None and self._opened.done() and not self._opened.exception() and self._opened.result() is channel:
            self._opened = None
            if self._task is not None:
                self._task.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, opened: asyncio.Future[OpenChannel]) -> None:
        # What the clients hear is what happened, in words; the log has aiohttp's.
        reason = "the decode worker ended it"
        try:
            await self._read_again_if_unanswered(opened)
        except asyncio.CancelledError:
            reason = "the router is shutting down, or the decode worker restarted"
            raise
        except ChannelLost as exc:
            reason = str(exc)
        except (ValidationError, ValueError) as exc:
            reason = "the decode worker sent an unreadable event"
            log.warning("token channel: %s: %s", reason, exc)
        except (aiohttp.ClientError, OSError) as exc:
            reason = "the connection to the decode worker broke (it failed or restarted)"
            log.warning("token channel: %r", exc)
        except Exception:  # a bug here must still end the requests on the channel, not hang them
            reason = "the router failed reading it"
            log.exception("token channel: reading failed")
        finally:
            # `opened` is shielded from its waiters' cancellation: done means opened or refused.
            channel = opened.result() if opened.done() and opened.exception() is None else None
            if not opened.done():
                opened.set_exception(ChannelLost(f"no token channel to the decode worker: {reason}; try again"))
            if self._opened is opened:
                self._opened = None
            if channel is not None:
                channel.lose(ChannelLost(f"the decode worker's token channel closed: {reason}; try again"))

    async def _read_again_if_unanswered(self, opened: asyncio.Future[OpenChannel]) -> None:
        """`_read`, and once more if its connection closed before decode answered: a pooled
        connection to the process a restart replaced. Every request waiting for the channel failed
        with a 502 for about a second after a decode worker was killed (an outside probe). Opening
        it again is safe: nothing was opened."""
        try:
            await self._read(opened)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if opened.done() or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            log.info("token channel: the connection closed before decode answered (%r); opening it once more", exc)
            await self._read(opened)

    async def _read(self, opened: asyncio.Future[OpenChannel]) -> None:
        """One opening: decode's answer names the channel (`opened`), then each event goes to its
        request's inbox until the stream ends."""
        async with self.open_stream() as resp:
            if resp.status != 200:
                raise ChannelLost(f"the decode worker refused it (HTTP {resp.status})")
            lines = read_lines(resp.content)
            first = await anext(lines, b"")
            channel = OpenChannel(ChannelOpened.model_validate_json(first).channel)
            opened.set_result(channel)
            async for line in lines:
                channel.hand_over(line)


class LineTooLong(ValueError):
    pass


async def read_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A decode stream's non-empty lines, read in whatever chunks arrive (one read per write decode
    made, not one per line). A line longer than MAX_LINE_BYTES, or a stream that ends inside one,
    raises `LineTooLong` (a ValueError)."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
        if len(buffer) > MAX_LINE_BYTES:
            raise LineTooLong(f"a line over {MAX_LINE_BYTES} bytes")
    if buffer.strip():
        raise LineTooLong("the stream ended inside a line")
