"""What one client can hold in the router: generation slots, and writes that must make progress.

`Slots`: the router runs at most N generations at once. A request takes the slots of all its
generations together, first come first served: taken one by one, a request of `n: 4` behind
three free slots held three while its fourth waited for a slot that only its own three could
free (a regression probe: a 504 mid-stream), and a big request could starve behind small ones.

`SlotLease`: the slots one request took. A generation's slot goes back as soon as neither worker
holds anything of it (decode has finished it, prefill has answered), even while its client is
still reading what was generated: slots bound the workers' work, and a client that read slowly
but steadily held them for as long as it liked while decode sat idle and every other tenant got
a 504 (an outside probe: two sockets reading 400 B/s). What such a client still holds is its
connection and its own answer, buffered here.

`Draining`: those generations, ended at the workers while their clients still read them, are
at most as many as the slots, so the answers buffered for slow readers stay bounded as they were
when slots held them. When it is full, a generation that ends takes the place of the one that
has drained longest, if that one has for more than the grace (its client loses the connection);
otherwise it keeps its slot until its request ends. A reader that keeps up is in it for
moments; only slow readers age in it.

`StallWatch`: a write to a client may take as long as it likes while the client reads;
the client loses its connection only once it has read nothing for the timeout. A timeout around
each write cut off steady slow readers (1-16 KB/s) after 30 s: one write of a chunk can wait that
long while the buffers drain slowly. Progress is the bytes still to deliver -- the transport's
buffer and, on Linux, the kernel's unsent queue (SIOCOUTQ) -- going down.

`BodyMemory`: the request bodies the router (and the local splitter) holds at once, in bytes. Each body is bounded
(--max-body-bytes), their number was not: 300 connections each holding an 8 MiB body one byte
short of its end took the router from 68 MB to 2.7 GB (a probe), so a few thousand would have it
killed for memory, and every tenant with it. Bounded at the default 256 MiB: 0.39 GB with 300 such
connections, 0.51 GB with 1,000.

`SharedCheck`: an answer that costs calls to other processes (the workers' health behind the
router's public /health), made at most once at a time for every caller, and reused while fresh.
Each /health used to send a signed call to every worker: 1,500 clients flooding it made a flood
of internal calls (and of entries in the workers' replay caches), and another tenant's requests
stalled for 10 s (an outside probe).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Slots:
    """A counting semaphore whose holders take several units at once, in arrival order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Units asked for by the holders still waiting."""
        return sum(count for count, _ in self._queue)

    async def acquire(self, count: int) -> None:
        assert 0 < count <= self.capacity, (count, self.capacity)
        if not self._queue and self.free >= count:
            self.free -= count
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((count, granted))
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release(count)  # granted just as the waiter was cancelled: give it back
            else:
                with contextlib.suppress(ValueError):  # `_grant` already dropped it (cancelled)
                    self._queue.remove((count, granted))
                self._grant()  # the head may have been this waiter: the next ones may fit now
            raise

    def release(self, count: int) -> None:
        self.free += count
        self._grant()

    def resize(self, capacity: int) -> None:
        """A new capacity, the units held kept: they come back as they are released (`free` is below 0
        until enough have, when it shrank). A holder still waiting for more than the new capacity is
        granted once every unit is free (one holder alone is always let in)."""
        self.free += capacity - self.capacity
        self.capacity = capacity
        self._grant()

    def _grant(self) -> None:
        while self._queue:
            count, granted = self._queue[0]
            if granted.done():
                # Cancelled while it waited, its own clean-up not run yet: a release in between
                # gave it the units, set_result raised, and they were lost for good (a review).
                self._queue.popleft()
                continue
            if count > self.free and self.free < self.capacity:  # (more than all of it: alone, `resize`)
                return
            self._queue.popleft()
            self.free -= count
            granted.set_result(None)


class Draining:
    """Generations that ended at the workers while their clients still read them (module doc)."""

    def __init__(self, capacity: int, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.grace_s = grace_s
        self._clock = clock
        self._entries: collections.OrderedDict[str, tuple[float, Callable[[], None]]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def enter(self, key: str, drop: Callable[[], None]) -> bool:
        """Room for `key` (whose client `drop` disconnects): False when there is none to make."""
        now = self._clock()
        if len(self._entries) >= self.capacity:
            oldest, (since, drop_oldest) = next(iter(self._entries.items()))
            if now - since <= self.grace_s:
                return False
            del self._entries[oldest]
            drop_oldest()
        self._entries[key] = (now, drop)
        return True

    def leave(self, key: str) -> None:
        self._entries.pop(key, None)


class SlotLease:
    """The `count` slots one request took from `slots`, each given back once: a generation's own
    when it ends at the workers and `draining` has room for it (`release_one`, keyed so a second
    call for it is a no-op), the rest when the request ends (`release_rest`).

    A generation is in `draining` from its end at the workers until its last event has left it for
    the client (`relayed`), so its age there is how long its client has lagged behind it, not how
    long its siblings ran. `close` (the request's handler ended) takes them all out at once, even
    while the slots wait for aborts to end: an eviction then would reset the connection's next
    request (a review)."""

    def __init__(self, slots: Slots, count: int, draining: Draining, drop: Callable[[], None]) -> None:
        self._slots = slots
        self._draining = draining
        self._drop = drop  # disconnects this request's client (`Draining` made room)
        self.held = count
        self._released: list[str] = []
        self._relayed: set[str] = set()
        self._closed = False

    def release_one(self, key: str) -> None:
        if self._closed or not self.held or key in self._released:
            return
        # Relayed already (the release runs a loop turn after decode's finish arrived, and a client
        # that keeps up can have it by then): nothing waits on its client, so it needs no place.
        if key not in self._relayed and not self._draining.enter(key, self._drop):
            return
        self._released.append(key)
        self.held -= 1
        self._slots.release(1)

    def relayed(self, key: str) -> None:
        self._relayed.add(key)
        self._draining.leave(key)

    def close(self) -> None:
        self._closed = True
        for key in self._released:
            self._draining.leave(key)

    def release_rest(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._slots.release(held)


FREE_BODY_BYTES = 64 * 1024
"""What each body holds of its own before it draws on the shared room: as much as aiohttp buffers
per connection anyway, and more than almost every chat or completion request, which therefore
never waits on, or is refused for, the large bodies of others."""


class BodyMemory:
    """Bytes of request bodies held at once, past each body's first `free_bytes`, at most
    `capacity`. A body that would take the total past it is refused (the router's 503, which
    clients retry) instead of waiting for room: bodies that each hold part of their bytes while
    waiting for the others' would wait on each other until the body timeout. A body is charged
    for bytes that arrived, not for the Content-Length it announced, so holding the room costs an
    attacker the bytes it sends; none of it outlives the body's use (at the router its parse, at the
    splitter a router's answer). The one owner of the count, and of counting refusals
    (`on_refused`, the server's metric)."""

    def __init__(self, capacity: int, free_bytes: int = FREE_BODY_BYTES, on_refused: Callable[[], None] = lambda: None) -> None:
        self.capacity = capacity
        self.free_bytes = free_bytes
        self.held = 0
        self.on_refused = on_refused

    @contextlib.contextmanager
    def reading(self) -> Iterator[BodyLease]:
        """A lease for one body, whose bytes all come back when the block ends."""
        lease = BodyLease(self)
        try:
            yield lease
        finally:
            lease.release()

    def admits(self, size: int) -> bool:
        """Whether a body of `size` bytes would fit now (an `Expect: 100-continue` is answered by
        it); a refusal is counted."""
        if max(0, size - self.free_bytes) <= self.capacity - self.held:
            return True
        self.on_refused()
        return False


class BodyLease:
    """What one body has been charged of a `BodyMemory`."""

    def __init__(self, memory: BodyMemory) -> None:
        self._memory = memory
        self.charged = 0

    @property
    def capacity(self) -> int:
        return self._memory.capacity

    def release(self) -> None:
        """The body is no longer held: its bytes come back now (once; at the lease's end, nothing more)."""
        self._memory.held -= self.charged
        self.charged = 0

    def grow_to(self, size: int) -> bool:
        """The body now holds `size` bytes: charge what lies past its free bytes. False, and
        nothing charged, when the room has no space for it."""
        need = max(0, size - self._memory.free_bytes) - self.charged
        if need <= 0:
            return True
        if self._memory.held + need > self._memory.capacity:
            self._memory.on_refused()
            return False
        self._memory.held += need
        self.charged += need
        return True


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to `transport` that the peer has not received yet (its buffer, plus the
    kernel's send queue where the platform says)."""
    pending = transport.get_write_buffer_size() if isinstance(transport, asyncio.WriteTransport) else 0
    sock = transport.get_extra_info("socket")
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        with contextlib.suppress(OSError):
            pending += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return pending


class StallWatch:
    """Drops a client's connection once a write to it has waited `timeout_s` with nothing of what
    was written delivered (checked every half timeout: dropped within 1.5x). Costs a flag per write
    and a timer per connection, not a timer per write: a stream writes once per token."""

    def __init__(self, transport: asyncio.BaseTransport | None, timeout_s: float, on_stall: Callable[[], None]) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.write_began: float | None = None  # loop time the write in progress began; None: none is
        self._seen: tuple[float, int, float] | None = None  # (that write's start, bytes undelivered, since when)
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s / 2, self._check)

    def __enter__(self) -> StallWatch:
        self.write_began = self._loop.time()
        return self

    def __exit__(self, *_: object) -> None:
        self.write_began = None

    def close(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        began = self.write_began
        if began is not None and self.transport is not None:
            now, undelivered = self._loop.time(), unsent_bytes(self.transport)
            if self._seen is None or self._seen[0] != began:  # a write this check has not seen yet
                self._seen = (began, undelivered, began)
            elif undelivered < self._seen[1]:  # the client read some: the clock starts again
                self._seen = (began, undelivered, now)
            if now - self._seen[2] >= self.timeout_s:
                self.on_stall()
                return
        self._timer = self._loop.call_later(self.timeout_s / 2, self._check)


def drop(transport: asyncio.Transport | None) -> None:
    """Close at once, discarding what the client did not read: a reset (SO_LINGER 0), not a FIN
    behind megabytes the kernel would keep sending."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class SharedCheck(Generic[T]):
    """`check()`'s latest answer, younger than `fresh_s` seconds; else one run of it that every
    caller waits on (a caller that leaves does not cancel it for the others)."""

    def __init__(self, check: Callable[[], Awaitable[T]], fresh_s: float) -> None:
        self._check, self._fresh_s = check, fresh_s
        self._last: tuple[float, T] | None = None  # (loop time it was made, answer)
        self._running: asyncio.Task[T] | None = None

    async def get(self) -> T:
        loop = asyncio.get_running_loop()
        if self._last is not None and loop.time() - self._last[0] < self._fresh_s:
            return self._last[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)

    async def _run(self) -> T:
        answer = await self._check()
        self._last = (asyncio.get_running_loop().time(), answer)
        return answer

    def forget(self) -> None:
        """The last answer is not to be reused: what it judged has changed (a check in flight still
        answers its callers)."""
        self._last = None

    def cancel(self) -> None:
        if self._running is not None:
            self._running.cancel()

