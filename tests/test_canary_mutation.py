"""Mutation testing of the canary suite against our own engine (`kvguard serve`, tiny model).

With no faults the default suite passes; with each fault switch it fails, and a probe that
explains that fault is among the failing ones. The stable revision (no faults) runs beside it as
the baseline URL, as in a rollout. The fault list and the expectations are shared with
`bench/canary_detection.py`, which also reports the time to verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.operator.canary import CanarySpec, Verdict

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "canary_detection.py"
_spec = importlib.util.spec_from_file_location("canary_detection", _BENCH)
assert _spec is not None and _spec.loader is not None
detection = importlib.util.module_from_spec(_spec)
sys.modules["canary_detection"] = detection
_spec.loader.exec_module(detection)

CONTEXT_LENGTH, POOL_TOKENS = 2048, 8192
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return detection.ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def stable(tiny_model: Path) -> Iterator[object]:
    with detection.ServeProcess(tiny_model, context_length=CONTEXT_LENGTH, kv_pool_tokens=POOL_TOKENS) as serve:
        yield serve


# no_abort_propagation: the generation an ignored abort leaves running must outlast the abort
# probe's fixed 5 s timeout on any machine. Unpaced, the tiny model's ~1960 remaining tokens took
# 3.5-5 s, about the timeout, so the verdict hung on the speed deadline (half the natural time the
# probe estimates from the cut stream's first three chunk gaps, measured through router and client):
# on a loaded machine that estimate came out up to 3x the real time (11.2 s for 3.9 s), the deadline
# was capped at 5 s, the pages came back at 3.9 s "in time", and the mid-decode cut passed (1 in ~10
# cuts under two busy loops); a prefill cut that lands before decode allocates passes too. Paced at
# 4 ms a step, the pages stay held past the timeout (>= 7.8 s) however fast or loaded the machine,
# and the probe fails whatever its estimate. Since then the probe also reads the workers' generation
# counters and fails a cut request that generated on (unpaced, here: "1804 tokens generated after the
# disconnect ... (it had 1804 left)", 3 of 3 runs); the pacing keeps the timing rules' verdict sure
# as well, for a first scrape after the cut that load delays past most of the generation. The
# deadline's arithmetic is tested alone (test_canary_units.py) and against fake servers that hold
# pages for a set time, with and without generating on (test_canary.py).
ABANDONED_STEP_MS = 4

# `ignore_manifest` alone is left out: while every chunk arrives, decode's output is byte-identical
# to a correct engine's, so no black-box probe can tell (the bench reports it, uncounted).
OBSERVABLE_MODES = [m for m in detection.FAULT_MODES if m.observable]


@pytest.mark.parametrize("mode", OBSERVABLE_MODES, ids=lambda m: m.faults or "no-faults")
def test_suite_detects_each_fault_with_the_right_probe(
    mode: object, tiny_model: Path, stable: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = CanarySpec()
    if not mode.faults:  # type: ignore[attr-defined]
        # The abort probe's recovery deadline is max(1 s, half the request's natural time), capped
        # at 5 s: the healthy engine's router, prefill or decode descheduled for a second on a
        # loaded machine missed it. The healthy run shows no fault is reported; no_abort_propagation
        # keeps the default deadline and timeout (its sharpness is tested against fake servers).
        from kvguard.operator.canary import abort

        monkeypatch.setattr(abort, "MIN_RECOVERY_SECONDS", 60.0)
        spec = CanarySpec.model_validate({"abort": {"poolRecoveryTimeoutSeconds": 60.0}})
    if mode.faults == "no_abort_propagation":  # type: ignore[attr-defined]
        mode = dataclasses.replace(mode, faults=f"{mode.faults},delay_step_ms={ABANDONED_STEP_MS}")  # type: ignore[call-overload]
    report = asyncio.run(
        detection.run_mode(mode, tiny_model, stable.url, spec, CONTEXT_LENGTH, POOL_TOKENS)  # type: ignore[attr-defined]
    )
    failing = {p.value for p in report.failed_probes()}
    if not mode.faults:  # type: ignore[attr-defined]
        assert report.verdict == Verdict.PASS, report.to_json()
        return
    assert report.verdict == Verdict.FAIL, report.to_json()
    assert failing & mode.expected_probes, (failing, report.to_json())  # type: ignore[attr-defined]
    for name in failing:  # every failing probe says why, with evidence
        probe = next(p for p in report.probes if p.name.value == name)
        assert probe.reason and probe.evidence, probe
