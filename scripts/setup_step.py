#!/usr/bin/env python3
"""One step of `make`'s setup, said out loud: what it installs and why, the command, its output
(pip's per-package chatter condensed), a line after every HEARTBEAT_S of silence with the time so
far, and how long it took. A first install takes minutes; none of them should pass in silence.

    setup_step.py N/M "what: why" -- command [args...]

Exit status: the command's. Plain lines, so it reads the same in a terminal, a pipe or a CI log.
Standard library only: it runs with the system python, before .venv holds anything.
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

HEARTBEAT_S = 10.0
# pip lines that say nothing a person needs while waiting (already there, cached, build plumbing).
PIP_NOISE = (
    "Requirement already satisfied",
    "Using cached",
    "Looking in indexes",
    "Looking in links",
    "Obtaining file:",
    "Preparing metadata",
    "Preparing editable metadata",
    "Installing build dependencies",
    "Checking if build backend",
    "Getting requirements to build",
    "Building editable for",
    "Created wheel for",
    "Stored in directory",
    "Building wheels for collected packages",
    "Building wheel for",
    "Processing ",
    "Attempting uninstall",
    "Found existing installation",
    "Uninstalling ",
    "Successfully uninstalled",
)
LONG_LINE = 160


def condensed(line: str) -> str | None:
    """What of one output line to show; None to leave it out (pure)."""
    text = line.rstrip()
    stripped = text.strip()
    if not stripped or stripped.startswith(PIP_NOISE):
        return None
    if stripped.startswith("Successfully installed "):
        return f"installed {len(stripped.split()) - 2} package(s)"
    if stripped.startswith("Installing collected packages: "):
        names = stripped.removeprefix("Installing collected packages: ").split(", ")
        return f"installing {len(names)} package(s): {', '.join(names)}"[:LONG_LINE]
    return text if len(text) <= LONG_LINE else text[: LONG_LINE - 3] + "..."


def lines_with_heartbeats(stream: Iterator[str], every: float) -> Iterator[str | None]:
    """The stream's lines as they come, and None after each `every` s without one."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=every)
        except queue.Empty:
            yield None
            continue
        if line is None:
            return
        yield line


def run(step: str, title: str, argv: list[str]) -> int:
    began = time.monotonic()
    print(f"== setup {step}: {title}", flush=True)
    print(f"   $ {shlex.join(argv)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # pip's lines as they happen, not at exit
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # noqa: S603
    except OSError as exc:
        print(f"== setup {step}: cannot run {argv[0]}: {exc}", flush=True)
        return 127
    assert child.stdout is not None
    try:
        _follow(child.stdout, began)
    except KeyboardInterrupt:  # Ctrl-C: one line and 130, as the kvguard commands end (not a traceback)
        child.terminate()  # the terminal's SIGINT reached it too; a `kill -INT` of this script did not
        child.wait()
        print(f"== setup {step}: interrupted", flush=True)
        return 130
    code = child.wait()
    took = time.monotonic() - began
    verdict = "done" if code == 0 else f"FAILED (exit {code})"
    print(f"== setup {step}: {verdict} in {took:.0f} s", flush=True)
    return code


def _follow(stream: Iterator[str], began: float) -> None:
    """Print the step's output condensed, with a heartbeat line while it is silent."""
    last = ""
    for line in lines_with_heartbeats(stream, HEARTBEAT_S):
        if line is None:
            print(f"   ... {time.monotonic() - began:.0f} s so far{f' (last: {last})' if last else ''}", flush=True)
            continue
        shown = condensed(line)
        if shown is not None:
            print(f"   {shown}", flush=True)
            last = shown[:80]


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return run(argv[0], argv[1], argv[3:])
    except KeyboardInterrupt:  # before the step's command started, or while it was being started
        print(f"== setup {argv[0]}: interrupted", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
