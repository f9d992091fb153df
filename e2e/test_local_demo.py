"""`kvguard demo` end to end (the README's main job): exit 0, every step as described, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_every_step_and_cleans_up(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "kvguard", "demo", "--keep"], capture_output=True, text=True,
                          timeout=840, cwd=tmp_path)  # fmt: skip  # within pytest's 900 s per test
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "verdict: BLOCKED" in out  # 1. the incident's plan
    assert "gibberish by design" in out  # the tiny model's random weights are said to be random
    assert "about 40 s on 2 CPU cores" in out.splitlines()[0]  # it says how long it takes, up front
    assert "tiny model written in " in out and "... revision " in out  # every wait is said (no silent steps)
    assert "canary passed" in out and "RevisionPromoted" in out  # 2. promoted after the canary
    assert "CanaryFailed" in out and "over_length" in out and "RolledBack" in out  # 3. the faulty build
    assert "same greedy outputs as before" in out  # S8: stable unchanged
    assert "every step behaved as described" in out
    work = Path(out.split("everything runs under ", 1)[1].split()[0])
    try:
        state = json.loads((work / "state" / "state.json").read_text())
        pids = [w["pid"] for r in state["revisions"].values() for w in r["workers"]]
        assert pids and all(pid is None for pid in pids)  # every recorded process stopped
        running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert str(work) not in running
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
