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

from kvguard.workers.protocol import CHANNEL_EVENT, ChannelOpened, ErrorEvent, FinishEvent, TokenEvent

log = logging.getLogger("kvguard.router")

MAX_LINE_BYTES = 1 << 20  # a channel line is one request's event; far below this with every limit applied

ChannelPayload = TokenEvent | FinishEvent | ErrorEvent


class ChannelLost(Exception):
    """The channel closed or broke while the request was on it."""


@dataclass(eq=False)
class ChannelReader:
    """The router's end of its channel to one decode worker. `open_stream` makes the signed
    ``POST /internal/stream`` call. Events of a request nobody waits for (it ended at the router
    first) are dropped; a request's id is the router's own, never a client's."""

    open_stream: Callable[[], AbstractAsyncContextManager[aiohttp.ClientResponse]]
    _inboxes: dict[str, asyncio.Queue[ChannelPayload | ChannelLost]] = field(default_factory=dict)
    _opened: asyncio.Future[str] | None = None  # the channel's id, once decode named it
    _task: asyncio.Task[None] | None = None

    async def channel(self) -> str:
        """The open channel's id, opening it first if there is none (the callers' bound applies)."""
        if self._opened is None or (self._opened.done() and self._opened.exception() is not None):
            self._opened = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._opened))
        return await asyncio.shield(self._opened)

    def subscribe(self, request_id: str) -> asyncio.Queue[ChannelPayload | ChannelLost]:
        inbox: asyncio.Queue[ChannelPayload | ChannelLost] = asyncio.Queue()
        self._inboxes[request_id] = inbox
        return inbox

    def unsubscribe(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, opened: asyncio.Future[str]) -> None:
        # What the clients hear is what happened, in words; the log has aiohttp's.
        reason = "the decode worker ended it"
        try:
            async with self.open_stream() as resp:
                if resp.status != 200:
                    raise ChannelLost(f"the decode worker refused it (HTTP {resp.status})")
                lines = _lines(resp.content)
                first = await anext(lines, b"")
                opened.set_result(ChannelOpened.model_validate_json(first).channel)
                async for line in lines:
                    self._hand_over(line)
        except asyncio.CancelledError:
            reason = "the router is shutting down"
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
            if not opened.done():
                opened.set_exception(ChannelLost(f"no token channel to the decode worker: {reason}; try again"))
            self._opened = None if self._opened is opened else self._opened
            lost = ChannelLost(f"the decode worker's token channel closed: {reason}; try again")
            for inbox in self._inboxes.values():
                inbox.put_nowait(lost)
            self._inboxes.clear()

    def _hand_over(self, line: bytes) -> None:
        routed = CHANNEL_EVENT.validate_json(line)
        if (inbox := self._inboxes.get(routed.request_id)) is not None:
            inbox.put_nowait(routed.event)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stream's lines, read in whatever chunks arrive (one read per write decode made, not one
    per line); a line longer than MAX_LINE_BYTES fails the channel."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line:
                yield line
        if len(buffer) > MAX_LINE_BYTES:
            raise ChannelLost("the decode worker sent a line over the size bound")
    if buffer.strip():
        raise ChannelLost("it ended inside a line")
