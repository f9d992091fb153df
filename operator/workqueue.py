"""A keyed work queue with delayed requeues, the backoff that spaces them, and how its workers stop
(asyncio, no I/O).

The controller's shape (as client-go's workqueue): events add a model's key; a key waits in the
queue at most once however many events arrive (bursts coalesce); a key being processed is never
handed to a second worker, and an event during its pass marks it dirty so it runs once more after.
`requeue` sets the one timer of a key (a newer pass replaces the older one's wish; None cancels):
how a model that waits for something is looked at again without any event.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: `base x 2^n`, capped, scaled by a random factor in
    [1 - jitter, 1 + jitter] so that many models failing together do not retry together."""

    base: float = 1.0
    cap: float = 300.0
    jitter: float = 0.2

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        raw = min(self.cap, self.base * 2 ** min(max(attempt, 0), 40))
        return self.spread(raw, rng)

    def spread(self, seconds: float, rng: Callable[[], float] = random.random) -> float:
        return max(0.0, seconds * (1.0 - self.jitter + 2.0 * self.jitter * rng()))


Key = TypeVar("Key", bound=Hashable)


class WorkQueue(Generic[Key]):
    """Keys to reconcile, each at most once in the queue and in process (see the module doc)."""

    def __init__(self) -> None:
        self._order: deque[Key] = deque()
        self._queued: set[Key] = set()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._ready = asyncio.Event()

    def add(self, key: Key) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._order.append(key)
            self._ready.set()

    def requeue(self, key: Key, delay: float | None) -> None:
        """Look at `key` again after `delay` seconds (replacing its earlier timer); None: don't."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if delay is None:
            return
        if delay <= 0:
            self.add(key)
            return
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> Key:
        while not self._order:
            self._ready.clear()
            await self._ready.wait()
        key = self._order.popleft()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Key) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def forget(self, key: Key) -> None:
        self.requeue(key, None)

    def clear(self) -> None:
        """Drop everything queued and every timer (keys in process finish their pass)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._order.clear()
        self._queued.clear()
        self._dirty.clear()

    def timer_of(self, key: Key) -> float | None:
        """Seconds until the key's timer fires (None: no timer)."""
        timer = self._timers.get(key)
        return None if timer is None else max(0.0, timer.when() - asyncio.get_running_loop().time())

    @property
    def pending(self) -> int:
        return len(self._order) + len(self._processing)

    @property
    def timers(self) -> int:
        return len(self._timers)


async def stop_workers(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel a queue's worker tasks and wait until each has ended (a pass in flight ends at its next await)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
