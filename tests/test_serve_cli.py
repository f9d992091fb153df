"""`kvguard serve` as a user runs it: one JSON line first, a working API, and SIGTERM/SIGINT stop
all three processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from waiting import wait_for


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_its_urls_and_stops_every_process_on_a_signal(tiny_model_dir: Path, signum: int) -> None:
    serve = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(tiny_model_dir),
         "--kv-pool-tokens", "2048", "--context-length", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert serve.stdout is not None
        urls = json.loads(serve.stdout.readline())
        assert set(urls["metrics"]) == {"router", "prefill", "decode"}
        answer = requests.post(f"{urls['router']}/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        workers = _children(serve.pid)
        assert len(workers) == 3
        serve.send_signal(signum)
        assert serve.wait(timeout=120) == 0
        wait_for(lambda: not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "every worker process gone",
                 detail=lambda: [pid for pid in workers if Path(f"/proc/{pid}").exists()])  # fmt: skip
    finally:
        if serve.poll() is None:
            serve.kill()


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
