"""`bench/run_all.py` reads each benchmark's headline from its output: these run two benchmarks
for real, on tiny settings, and check that the names other people read (issue 14's JSON keys, the
transfer table) come out and parse. Nothing here asserts a speed: benchmarks measure that, and
print it. (The transfer parser once stopped matching when transfer.py gained its aes-gcm column,
and the run_all table silently lost its transfer rows and plot.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", BENCH / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def bench(script: str, *args: str, timeout_s: float = 600) -> str:
    done = subprocess.run([sys.executable, "-P", str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_transfer_table_parses_into_rows_and_a_plot(tmp_path: Path) -> None:
    parsers = run_all()
    output = bench("transfer.py", "--rounds", "1", "--mib", "1", "--chunk-kib", "16,64")
    rows = parsers.transfer_rows(output)
    assert [row.kib for row in rows] == [16, 64]
    assert all(row.aes_gcm and row.checked and row.unchecked and row.raw for row in rows)
    headlines = [head for head, _, _ in parsers.parse_transfer(output)]
    assert "KV transfer checked / raw socket, 16 KiB chunks" in headlines
    assert "KV transfer aes-gcm / checked, 64 KiB chunks" in headlines
    assert parsers.plot_transfer(output, tmp_path) == tmp_path / "transfer_goodput.png"


@pytest.mark.slow
def test_serving_prints_issue_14s_headline_keys_and_run_all_reads_them() -> None:
    output = bench("serving.py", "--backends", "hf,engine,http", "--scenarios", "closed-1,closed-16",
                   "--requests", "4", "--reps", "1")
    headline = json.loads(output.strip().splitlines()[-1])  # the last line: one JSON object
    for key in ("http_vs_hf", "http_vs_inprocess", "inprocess_vs_hf", "ttft_ratio", "inprocess_vs_hf_1",
                "http_vs_inprocess_bound", "ttft_ratio_floor"):
        assert isinstance(headline[key], float) and headline[key] > 0, key
    assert headline["parity"] == {"engine/closed-1": "4/4", "http/closed-1": "4/4",
                                  "engine/closed-16": "4/4", "http/closed-16": "4/4"}
    # Each engine reports its decode batch: one request at a time decodes alone.
    assert set(headline["decode_batch"]) >= {"engine", "http"}
    assert headline["startup_s"]["http_first_answer_s"] > 0
    assert headline["startup_s"]["serve_default_first_answer_s"] > 0  # `kvguard serve` as a user starts it
    rows = {head: (value, goal) for head, value, goal in run_all().parse_serving(output)}
    assert rows["`kvguard serve --model DIR`: start to first answer"][1] == "< 5 s"
    assert rows["kvguard serve (HTTP) / HF generate, mixed, 16 concurrent"][1] == ">= 2.0"
    assert rows["TTFT p50 HTTP / in-process, 16 concurrent"][1] == "<= 2.0"


def test_run_all_runs_every_benchmark_and_refuses_a_name_it_has_not() -> None:
    """bench/README.md says run_all runs every bench/*.py: three were missing, and `--only` with
    their names printed an empty table and exited 0."""
    scripts = {b.script for b in run_all().BENCHMARKS}
    assert scripts == {p.name for p in BENCH.glob("*.py")} - {"run_all.py"}
    done = subprocess.run([sys.executable, "-P", str(BENCH / "run_all.py"), "--only", "request_cost,nope"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2 and "no benchmark named nope" in done.stderr, done.stderr


def test_request_cost_runs_and_run_all_reads_it() -> None:
    """request_cost.py had stopped running (serving.py's helpers gained a device argument)."""
    output = bench("request_cost.py", "--concurrency", "1,2", "--rounds", "2", "--reps", "1")
    assert json.loads(output.strip().splitlines()[-1])["clients"] == 2
    heads = [head for head, _, _ in run_all().parse_request_cost(output)]
    assert heads == ["HTTP path CPU per request / the engine's, 2 clients", "HTTP TTFT / the CPU bound, 2 clients"]
