"""No silent waits: the wait lines of `kvguard apply` / `kvguard demo` (WaitReporter, on a clock
the test drives) and `make`'s setup steps (scripts/setup_step.py, as real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.operator.backends.local_progress import WaitReporter

REPO = Path(__file__).resolve().parent.parent
SETUP_STEP = REPO / "scripts" / "setup_step.py"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reporter() -> tuple[WaitReporter, Clock, list[str]]:
    lines: list[str] = []
    clock = Clock()
    return WaitReporter(lines.append, clock=clock, every=5.0, quiet_below=1.0), clock, lines


def test_a_wait_is_announced_repeated_after_silence_and_timed_when_it_ends() -> None:
    waits, clock, lines = reporter()
    waits.waiting("CanaryDeploying", "revision r1: waiting for decode-0 not ready")
    assert lines == ["... revision r1: waiting for decode-0 not ready"]
    clock.now += 4.9
    waits.waiting("CanaryDeploying", "revision r1: waiting for decode-0 not ready")
    assert len(lines) == 1  # under `every` seconds of silence: nothing more
    clock.now += 0.2
    waits.waiting("CanaryDeploying", "revision r1: waiting for decode-0 not ready")
    assert lines[-1] == "... revision r1: waiting for decode-0 not ready (5 s)"
    clock.now += 2.0
    waits.waiting("CanaryRunning", "revision r1: canary suite running")
    assert lines[-2:] == ["... CanaryDeploying: waited 7.1 s", "... revision r1: canary suite running"]
    assert waits.current == "CanaryRunning"


def test_other_lines_count_as_signs_of_life() -> None:
    waits, clock, lines = reporter()
    waits.waiting("CanaryRunning", "canary suite running")
    for _ in range(3):  # a probe finishes every 4 s: the wait is never repeated
        clock.now += 4.0
        waits.heard()
        waits.waiting("CanaryRunning", "canary suite running")
    clock.now += 4.0
    waits.tell("[Normal] CanaryPassed: ...")
    waits.waiting("CanaryRunning", "canary suite running")
    assert lines == ["... canary suite running", "[Normal] CanaryPassed: ..."]


def test_a_short_wait_ends_without_a_line_and_none_means_nothing_waits() -> None:
    waits, clock, lines = reporter()
    waits.waiting("ScrapingMetrics", "reading every worker's KV pool")
    clock.now += 0.5
    waits.waiting(None)
    assert lines == ["... reading every worker's KV pool"] and waits.current is None and waits.waited() == 0.0
    clock.now += 60.0
    waits.waiting(None)  # nothing waits: nothing to repeat
    assert len(lines) == 1


def run_step(*argv: str) -> subprocess.CompletedProcess[str]:
    # -S -I: no site-packages at all, as the system python that runs it before .venv exists.
    return subprocess.run([sys.executable, "-S", "-I", str(SETUP_STEP), *argv], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_a_setup_step_says_what_and_why_condenses_pip_and_says_how_long() -> None:
    child = (
        "print('Looking in indexes: https://pypi.org/simple');"
        "print('Requirement already satisfied: pip in ./.venv');"
        "print('Collecting kopf==1.37');"
        "print('Installing collected packages: kopf, aiohttp');"
        "print('Successfully installed aiohttp-3.9 kopf-1.37')"
    )
    done = run_step("4/6", "kvguard and its extras: what it needs", "--", sys.executable, "-c", child)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "== setup 4/6: kvguard and its extras: what it needs"
    assert lines[1].startswith("   $ ") and "-c" in lines[1]
    shown = [line.strip() for line in lines[2:-1]]
    assert shown == ["Collecting kopf==1.37", "installing 2 package(s): kopf, aiohttp", "installed 2 package(s)"]
    assert lines[-1].startswith("== setup 4/6: done in ") and lines[-1].endswith(" s")


def test_a_failed_setup_step_exits_with_its_command_status() -> None:
    done = run_step("2/6", "pip", "--", sys.executable, "-c", "import sys; print('ERROR: no network'); sys.exit(3)")
    assert done.returncode == 3
    assert "ERROR: no network" in done.stdout and "== setup 2/6: FAILED (exit 3) in " in done.stdout
    missing = run_step("1/6", "venv", "--", "/nonexistent/python3", "-m", "venv")
    assert missing.returncode == 127 and "cannot run /nonexistent/python3" in missing.stdout
    assert run_step("1/6", "no separator").returncode == 2


def test_ctrl_c_during_a_setup_step_is_one_line_and_130_and_stops_its_command(tmp_path: Path) -> None:
    """A new user's report: Ctrl-C during `make demo`'s install printed a KeyboardInterrupt traceback."""
    started = tmp_path / "started"
    child = (f"import os, pathlib, signal; pathlib.Path({str(started)!r}).write_text(str(os.getpid()));"
             "print('working', flush=True); signal.pause()")
    # SIGINT as a terminal's foreground job has it: an xdist worker in which a command ran
    # in-process and was interrupted ignores it from then on (interrupts.stop_signals_as_one_interrupt),
    # and children inherit an ignored signal (CI: the step slept on through the SIGINT).
    step = subprocess.Popen([sys.executable, str(SETUP_STEP), "4/7", "pip", "--", sys.executable, "-c", child],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert step.stdout is not None
    assert [step.stdout.readline() for _ in range(3)][2].strip() == "working"  # the command runs
    step.send_signal(signal.SIGINT)  # only to the script: it must stop its command itself
    out, err = step.communicate(timeout=60)
    assert step.returncode == 130 and err == "", err
    assert out.strip().splitlines()[-1] == "== setup 4/7: interrupted"
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left sleeping
        os.kill(int(started.read_text()), 0)


def test_silence_becomes_a_line_with_the_time_so_far() -> None:
    """A command that prints nothing for a while still gets lines; the stream waits on an event,
    so a heartbeat is certain before the next line comes (no timing guess)."""
    sys.path.insert(0, str(SETUP_STEP.parent))
    try:
        from setup_step import lines_with_heartbeats
    finally:
        sys.path.remove(str(SETUP_STEP.parent))
    release = threading.Event()

    def stream() -> Iterator[str]:
        yield "Collecting torch==2.13.0\n"
        release.wait(60)
        yield "Successfully installed torch-2.13.0\n"

    lines = lines_with_heartbeats(stream(), every=0.05)
    assert next(lines) == "Collecting torch==2.13.0\n"
    assert next(lines) is None  # the stream is blocked: only a heartbeat can come
    release.set()
    assert [line for line in lines if line is not None] == ["Successfully installed torch-2.13.0\n"]
