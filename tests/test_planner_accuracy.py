"""Guard for bench/planner_accuracy.py: the planner against logged public SGLang/vLLM pools (S7).

Runs the same comparison as the benchmark (it is an accuracy check, not a timing test). Skipped
when the shared reference CSV is not present on this machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "planner_accuracy.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    module = load_bench()
    if not module.csv_path(None).exists():
        pytest.skip(f"reference CSV not present: {module.csv_path(None)}")
    return module


def test_s7_planner_meets_accuracy_goals_per_engine(bench: ModuleType) -> None:
    results = [bench.evaluate(row) for row in bench.read_rows(bench.csv_path(None))]
    summary = bench.summarize(results)
    assert set(summary) == {"SGLang", "vLLM"}
    for engine, (count, median, worst) in summary.items():
        assert count >= 2, engine
        assert median <= bench.MEDIAN_GOAL and worst <= bench.MAX_GOAL, (engine, median, worst)


def test_bytes_per_token_matches_every_logged_row(bench: ModuleType) -> None:
    results = [bench.evaluate(row) for row in bench.read_rows(bench.csv_path(None))]
    checked = [r for r in results if r.bytes_per_token_ok is not None]
    assert checked and all(r.bytes_per_token_ok for r in checked), [r.row_id for r in checked if not r.bytes_per_token_ok]


def test_incomplete_rows_are_skipped_with_a_reason(bench: ModuleType) -> None:
    results = {r.row_id: r for r in (bench.evaluate(row) for row in bench.read_rows(bench.csv_path(None)))}
    assert "weights_GiB" in results["V04"].skipped  # the log gave no weight memory
    assert not results["S03"].skipped and results["S03"].unit == "tokens"


def test_bench_main_exits_zero_with_check(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "SGLang" in out and "median |error|" in out
