"""SIGTERM handled as Ctrl-C by the long-running local commands (`kvguard demo`, `kvguard apply`):
the same cleanup, one line and exit 130, not death by the signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside, so the Ctrl-C path runs either way."""

    def handler(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """A SIGINT or SIGTERM that comes inside is remembered, not acted on, and acted on at the end
    by the handler that was in place. (Python-level handlers, not a signal mask: a process-directed
    signal goes to any thread that does not block it, and the backend has threads.)"""
    came: list[int] = []
    previous = {number: signal.signal(number, lambda number, _: came.append(number)) for number in _STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    for first in came[:1]:
        handler = previous[signal.Signals(first)]
        if callable(handler):
            handler(first, None)  # default_int_handler or ours: raises KeyboardInterrupt
        else:
            signal.raise_signal(first)  # SIG_DFL: ends the process as the signal would have


def run_interruptible(make_coroutine: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run, for a main thread whose Ctrl-C / SIGTERM may come at any moment.

    A KeyboardInterrupt raised while asyncio.run was still building its event loop left a
    half-made loop whose __del__ printed a traceback, and a coroutine never awaited (CI saw both
    on a SIGTERM sent right after the first line). The loop is built and the coroutine made with
    the stop signals held; one that came meanwhile is raised as soon as both exist, and the
    coroutine is closed if it never ran."""
    coroutine: Coroutine[Any, Any, T] | None = None
    try:
        with contextlib.ExitStack() as closing:
            with _stop_signals_held():
                runner = closing.enter_context(asyncio.Runner())  # builds the loop
                coroutine = make_coroutine()
            return runner.run(coroutine)
    finally:
        if coroutine is not None:  # after the runner closed (it cancels a task that started)
            coroutine.close()  # a no-op once it ran; quiets "never awaited" when it did not
