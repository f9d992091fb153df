"""Ctrl-C / SIGTERM at any moment of `kvguard apply --local` and `kvguard demo`: the Ctrl-C path
runs, and nothing half-made prints a traceback on the way out (kvguard.interrupts)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import pytest

from kvguard.interrupts import run_interruptible, sigterm_as_interrupt


class _LoopStoppedWhileBuilt(asyncio.SelectorEventLoop):
    """A SIGTERM lands while the event loop is being built, as CI saw once under load."""

    def __init__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        super().__init__()


def test_a_sigterm_while_the_loop_is_built_is_one_keyboard_interrupt_and_nothing_half_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(asyncio.events, "new_event_loop", _LoopStoppedWhileBuilt)
    ran: list[str] = []
    made: list[Any] = []

    async def rollout() -> str:
        ran.append("rollout")
        return "done"

    def make() -> Any:
        made.append(rollout())
        return made[-1]

    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        run_interruptible(make)
    import gc

    gc.collect()  # a half-built loop or an unawaited coroutine reports itself when collected
    assert ran == [] and made and made[0].cr_frame is None  # made, never ran, closed
    assert unraisable == [], [u.exc_value for u in unraisable]
    assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_signal_it_runs_the_coroutine_to_its_result() -> None:
    async def rollout() -> str:
        await asyncio.sleep(0)
        return "done"

    assert run_interruptible(rollout) == "done"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are put back


def test_a_sigterm_while_it_runs_cancels_the_rollout_which_cleans_up(caplog: pytest.LogCaptureFixture) -> None:
    """The signal lands while the loop waits in select: closing the runner cancels the task, whose
    cleanup runs; nothing closes the coroutine under the task first ("cannot reuse already awaited
    coroutine", logged by asyncio, was what an early version of run_interruptible did)."""
    import threading

    waiting, cleaned_up = threading.Event(), []

    async def rollout() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        finally:
            cleaned_up.append(True)

    def signal_once_waiting() -> None:
        waiting.wait(timeout=60)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_once_waiting)
    sender.start()
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt), caplog.at_level("ERROR", logger="asyncio"):
        run_interruptible(rollout)
    sender.join()
    assert cleaned_up == [True]
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
