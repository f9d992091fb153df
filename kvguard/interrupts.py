"""Ctrl-C and SIGTERM for the long-running local commands (`kvguard apply --local` and its
`--delete`, `kvguard demo`, `kvguard canary`): the same cleanup either way, one line and exit 130,
not death by the signal and not a traceback. `kvguard.cli.main` takes them up for those commands
before it imports any command module, so a signal during the imports is exit 130 too (only the
interpreter's own start, before any of kvguard runs, is left to the default action). It does the
same for `kvguard serve` until serve's own handlers are in place, with SIGHUP too, and there the
interrupt is exit 0 ("stopped during start-up"), as serve promises."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _heeded_stop_signals(signals: tuple[signal.Signals, ...] = _STOP_SIGNALS) -> list[signal.Signals]:
    """The stop signals this process does not ignore. A shell starts a background job (`cmd &` in
    a script, nohup) with SIGINT ignored, and Python then leaves it ignored; so do these handlers
    (a suite run as such a job saw SIGINT as SIG_IGN)."""
    return [number for number in signals if signal.getsignal(number) is not signal.SIG_IGN]


@contextlib.contextmanager
def stop_signals_as_one_interrupt(ending_the_process: bool = True,
                                  signals: tuple[signal.Signals, ...] = _STOP_SIGNALS) -> Iterator[None]:  # fmt: skip
    """Inside, the first SIGINT or SIGTERM (or any of `signals`) raises KeyboardInterrupt, so the Ctrl-C path runs
    either way; later ones are ignored while that path cleans up (a second signal 0.2 s after the
    first killed `apply` mid-cleanup with 143, an outside probe found). Wrap the whole command,
    its `except KeyboardInterrupt` included. The cleanup is bounded; SIGKILL still ends it.

    After an interrupt, a command ends its process, whose finalization (garbage collection) takes
    a few hundred ms more: with `ending_the_process`, the signals stay ignored past the block
    rather than letting a second one turn exit 130 into death by the signal. Without an
    interrupt, or with it False, the handlers in place before are put back."""
    stopping = False

    def handler(_number: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    previous = {number: signal.signal(number, handler) for number in _heeded_stop_signals(signals)}
    try:
        yield
    finally:
        for number, former in previous.items():
            if stopping and ending_the_process:
                signal.signal(number, signal.SIG_IGN)
            elif signal.getsignal(number) is handler:
                signal.signal(number, former)
            # else the command put its own in place (`serve`'s, which stop it with 0): it stays until the
            # process ends, as it did before this handler came first; putting the default back let a
            # second signal, after serve had stopped its workers, end it with 143 or a traceback


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """A SIGINT or SIGTERM that comes inside is remembered, not acted on, and acted on at the end
    by the handler that was in place. (Python-level handlers, not a signal mask: a process-directed
    signal goes to any thread that does not block it, and the backend has threads.)"""
    came: list[int] = []
    previous = {number: signal.signal(number, lambda number, _: came.append(number)) for number in _heeded_stop_signals()}
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


@contextlib.contextmanager
def _stop_signals_wake(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Inside, a signal wakes the loop from select, wherever it lands. Python runs a signal's
    handler only between bytecodes; one that lands after the loop's last check but before its
    select sleeps (no timer due: no timeout) was lost until something else woke it. Under load a
    thread that signals when the loop is about to wait hit that window in 14 of 300 runs, and a
    test waited 767 s. The interpreter's own handler writes a byte to the wakeup fd at once; the
    loop watches the other end, which is all the wakeup needs (asyncio's add_signal_handler does
    this too, but its handlers run as callbacks, not in the interrupted frame)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach Python handlers on the main thread only: nothing to wake here
        return
    woken, waker = socket.socketpair()
    with woken, waker:
        woken.setblocking(False)
        waker.setblocking(False)
        loop.add_reader(woken.fileno(), _drain, woken)
        previous = signal.set_wakeup_fd(waker.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)
            loop.remove_reader(woken.fileno())


def _drain(woken: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while woken.recv(4096):
            pass


@dataclass
class _InterruptReportedOnce:
    """The loop's exception handler: the stop signal's KeyboardInterrupt, raised in whatever frame
    ran (a helper task of aiohttp's), is also kept by that task as its exception, and asyncio logged
    it with a traceback ("Task exception was never retrieved") after the command's one line. After
    an interrupt, so is a task collected pending once the loop closed: the runner cancels every task
    it knows of, and only the stop signal landing inside `runner.run`'s start of the main task
    leaves one ("Task was destroyed but it is pending!" after the one line, CI under load)."""

    interrupted: bool = False

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), KeyboardInterrupt):
            self.interrupted = True
            return
        if self.interrupted and loop.is_closed() and "task" in context and \
                str(context.get("message", "")).startswith("Task was destroyed but it is pending"):
            return
        loop.default_exception_handler(context)


def run_interruptible(make_coroutine: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run, for a main thread whose Ctrl-C / SIGTERM may come at any moment.

    A KeyboardInterrupt raised while asyncio.run was still building its event loop left a
    half-made loop whose __del__ printed a traceback, and a coroutine never awaited (CI saw both
    on a SIGTERM sent right after the first line). The loop is built and the coroutine made with
    the stop signals held; one that came meanwhile is raised as soon as both exist, and the
    coroutine is closed if it never ran."""
    coroutine: Coroutine[Any, Any, T] | None = None
    handler = _InterruptReportedOnce()
    try:
        with contextlib.ExitStack() as closing:
            with _stop_signals_held():
                runner = closing.enter_context(asyncio.Runner())  # builds the loop
                runner.get_loop().set_exception_handler(handler)
                closing.enter_context(_stop_signals_wake(runner.get_loop()))
                coroutine = make_coroutine()
            try:
                return runner.run(coroutine)
            except KeyboardInterrupt:
                handler.interrupted = True
                raise
    finally:
        if coroutine is not None:  # after the runner closed (it cancels a task that started)
            # A no-op once it ran; quiets "never awaited" when it did not. A signal that lands
            # inside runner.run's create_task, after the task was scheduled but before it was
            # registered, leaves a task the runner's close does not cancel but still steps: its
            # coroutine is suspended in an await, and closing it may raise "coroutine ignored
            # GeneratorExit", which replaced the KeyboardInterrupt (exit 1 and a traceback; CI).
            with contextlib.suppress(RuntimeError):
                coroutine.close()
