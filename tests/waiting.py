"""How tests wait for something another thread or process does: on the condition, never for a
fixed time.

A fixed sleep is a guess at how fast the machine is; on a loaded CI machine (`make test-stress`)
the guess is wrong and the test fails by chance. Instead, poll the condition until it holds, with a
deadline generous enough for a machine several times slower than a quiet one: the deadline only
matters when the code is broken, so making it long costs nothing on a passing run.

The one thing a condition cannot prove is that something never happens. `stays` checks a
condition over a window instead, after everything that should happen has been waited for; a slow
machine can only make such a window weaker (the wrong write lands after it), never make a correct
run fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 60.0
"""Default deadline: what takes a second on a quiet machine can take ten on a busy one."""
INTERVAL_S = 0.05
QUIET_WINDOW_S = 1.0
"""Default window of a negative check ("nothing else happens")."""


def _timed_out(what: str, timeout: float, detail: Callable[[], object] | None, last_error: BaseException | None) -> AssertionError:
    message = f"timed out after {timeout:g} s waiting for {what}"
    if detail is not None:
        message += f"; {detail()}"
    if last_error is not None:
        message += f"; last error: {last_error!r}"
    return AssertionError(message)


def wait_for(
    condition: Callable[[], T],
    what: str,
    timeout: float = DEADLINE_S,
    interval: float = INTERVAL_S,
    *,
    detail: Callable[[], object] | None = None,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """The first truthy value of `condition()`, polled every `interval` s. After `timeout` s an
    AssertionError names `what` (and `detail()`, if given). Exceptions of the `ignoring` types
    count as "not yet" (e.g. a connection refused while a server starts)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except ignoring as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, detail, last_error)
        time.sleep(interval)


async def until(
    condition: Callable[[], T],
    what: str,
    timeout: float = DEADLINE_S,
    detail: Callable[[], object] | None = None,
    interval: float = INTERVAL_S,
) -> T:
    """`wait_for` for a coroutine: yields to the event loop between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if loop.time() > deadline:
            raise _timed_out(what, timeout, detail, None)
        await asyncio.sleep(interval)


async def stays(condition: Callable[[], object], what: str, window: float = QUIET_WINDOW_S, interval: float = INTERVAL_S) -> None:
    """A negative check: `condition()` stays truthy for `window` s (AssertionError at the first
    poll where it does not). Wait for everything that should happen first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window
    while True:
        assert condition(), what
        if loop.time() > deadline:
            return
        await asyncio.sleep(interval)
