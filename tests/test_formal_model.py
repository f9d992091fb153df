"""The SPIN model of the KV transfer and abort protocol (formal/kvtransfer.pml, formal/README.md).

- The model verifies exhaustively at its stated bounds (S1, S2, S3, S4, S5, S6, no replayed or
  foreign frame applied, no invalid end state).
- Every mutant mirroring a real bug produces a counterexample for the invariant it breaks, so the
  model cannot silently become vacuous; and so does every single-guard mutant, which removes
  exactly ONE check of the code (a mutant removing several at once would hide a guard that the
  model never exercises). Guards whose removal alone another guard covers are listed, with the
  guard that covers them, in formal/README.md; they have no mutant.
- The model's state and message names are the code's enums: a test fails if they drift.
- The interleaving the model found in the router (prefill dead before OPEN) is a deterministic test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.request import RequestState
from kvguard.workers.router import _next_event
from kvguard.workers.transfer.config import FailureReason
from kvguard.workers.transfer.lifecycle import TransferState
from kvguard.workers.transfer.wire import FrameType

FORMAL = Path(__file__).resolve().parent.parent / "formal"
MODEL = FORMAL / "kvtransfer.pml"
# Failure reasons the model does not produce, and why (a new reason in the code fails the test).
NOT_MODELED_REASONS = {"SINK_ERROR"}  # an exception inside decode's KV sink: a bug, not a protocol step


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvguard_formal_{name}", FORMAL / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load("check")
trail = _load("trail")


def missing_tools_verdict(missing: list[str], ci: bool) -> tuple[str, str] | None:
    """What the model-check tests do without spin or gcc: nothing when both are there; in CI (`CI`
    is `true`) fail, since a CI run that skipped the model would pass without checking S1-S6; on a
    developer's machine skip, saying why. Returns ("fail" | "skip", the reason) or None."""
    if not missing:
        return None
    reason = (f"{' and '.join(missing)} not installed: `make spin` (run by `make test` and `make model-check`) installs "
              "them with apt-get (Debian packages spin, gcc, libc6-dev); gcc compiles SPIN's verifier")  # fmt: skip
    if ci:
        return "fail", f"CI=true and the KV transfer model cannot be checked: {reason}"
    return "skip", reason


@pytest.fixture(scope="module")
def spin() -> None:
    verdict = missing_tools_verdict([tool for tool in ("spin", "gcc") if shutil.which(tool) is None],
                                    os.environ.get("CI", "").lower() == "true")  # fmt: skip
    if verdict is None:
        return
    action, reason = verdict
    if action == "fail":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def test_without_spin_or_gcc_ci_fails_and_a_developer_machine_skips() -> None:
    assert missing_tools_verdict([], ci=True) is None
    in_ci = missing_tools_verdict(["spin"], ci=True)
    assert in_ci is not None and in_ci[0] == "fail" and "spin not installed" in in_ci[1] and "CI=true" in in_ci[1]
    locally = missing_tools_verdict(["spin", "gcc"], ci=False)
    assert locally is not None and locally[0] == "skip"
    assert "spin and gcc not installed" in locally[1] and "make spin" in locally[1]


# -- names --------------------------------------------------------------------------------------


def test_model_names_equal_the_codes_enums() -> None:
    names = trail.mtype_names(MODEL.read_text())
    assert set(names["request_state"]) == {s.name for s in RequestState}
    # T_ prefix in the model: OPEN is both a transfer state and a frame type
    assert all(n.startswith("T_") for n in names["transfer_state"])
    assert {n.removeprefix("T_") for n in names["transfer_state"]} == {s.name for s in TransferState}
    assert set(names["frame"]) == {f.name for f in FrameType}
    assert set(names["failure_reason"]) == {r.name for r in FailureReason} - NOT_MODELED_REASONS


# -- the model and its mutants ------------------------------------------------------------------


# pan's bounded searches (memory-bound, ~15M states) cannot hang, and they slow down more than
# anything else on a loaded machine: the main model took 552 s of pytest's 900 s per-test limit on
# two loaded cores (35 s idle). The limit stays a guard against hangs, with room for that.
SEARCH_TIMEOUT_S = 2700


@pytest.mark.timeout(SEARCH_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(check.MODEL_RUNS))
def test_model_verifies_exhaustively_at_its_bounds_s1_to_s6(spin: None, tmp_path: Path, name: str) -> None:
    result = check.check(check.MODEL_RUNS[name], tmp_path)
    assert result.errors == 0, result.output[-3000:]
    assert result.complete, f"search not exhaustive:\n{result.output[-3000:]}"
    assert result.states > check.MODEL_RUNS[name].min_states  # the rows ran (row 1 alone is ~3,500 states)


@pytest.mark.timeout(SEARCH_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(check.MUTANTS))
def test_mutant_of_a_real_bug_has_a_counterexample(spin: None, tmp_path: Path, name: str) -> None:
    run = check.MUTANTS[name]
    result = check.check(run, tmp_path)
    assert result.errors > 0, f"mutant {name} verified: the model no longer catches {run.why}"
    assert result.violated == run.violates, result.output[-3000:]
    assert any(f"assert({run.violates})" in line for line in result.trail), "\n".join(result.trail)


# Mutants that remove exactly one guard: one -D switch (besides the row and the bounds: requests,
# pool size, running slots), and that switch turns off one check in the model.
SINGLE_GUARD_MUTANTS = ("no_generation_check", "decode_admits_overlength", "prefill_admits_overlength", "early_takes_every_slot",
                        "no_manifest_checksum", "no_decode_timers", "no_bootstrap_timer")
# Mutants whose counterexample must be the removed guard's alone: with the switch removed (the same
# row and bounds), the run verifies -- the timers are what catches the router's hang.
TIMER_MUTANTS = ("no_decode_timers", "no_bootstrap_timer")
BOUND_DEFINES = ("-DROW=", "-DNPP=", "-DNREQ=", "-DPRUN=", "-DDRUN=")


@pytest.mark.parametrize("name", SINGLE_GUARD_MUTANTS)
def test_single_guard_mutant_removes_exactly_one_guard(name: str) -> None:
    switches = [d for d in check.MUTANTS[name].defines if not d.startswith(BOUND_DEFINES)]
    assert len(switches) == 1, switches
    macro = switches[0].removeprefix("-D")
    conditionals = [line for line in MODEL.read_text().splitlines()
                    if line.startswith("#if") and re.search(rf"\b{macro}\b", line)]  # fmt: skip
    assert len(conditionals) == 1, conditionals  # it sets one guard's switch, nothing else


@pytest.mark.timeout(SEARCH_TIMEOUT_S)
@pytest.mark.parametrize("name", TIMER_MUTANTS)
def test_timer_mutant_verifies_with_its_timer_back(spin: None, tmp_path: Path, name: str) -> None:
    mutant = check.MUTANTS[name]
    bounds = tuple(d for d in mutant.defines if d.startswith(BOUND_DEFINES))
    assert len(bounds) == len(mutant.defines) - 1  # one switch: the timer
    result = check.check(check.Run(f"{name}_fixed", bounds, None, "the same row with the timer"), tmp_path)
    assert result.errors == 0 and result.complete, result.output[-3000:]
    assert result.states > 5_000  # the hang's row ran


def test_guards_listed_as_redundant_exist_in_the_model() -> None:
    """formal/README.md's table of guards whose removal alone the model does not detect names each
    by its -D switch: the switch must still exist (the table cannot drift from the model)."""
    readme = (FORMAL / "README.md").read_text()
    section = readme.split("whose removal alone the model does not detect", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    switches = [m.group(1) for line in rows if (m := re.match(r"\| `-D(\w+)`", line))]
    assert len(switches) >= 5, rows
    model = MODEL.read_text()
    for switch in switches:
        assert re.search(rf"^#if.*\b{switch}\b", model, flags=re.M), switch
        assert switch not in {d.removeprefix("-D") for run in check.MUTANTS.values() for d in run.defines}


# -- the interleaving the model found: a prefill leg that fails before its OPEN reaches decode -----


async def _decode_waiting_for_kv(started: asyncio.Event, closed: asyncio.Event) -> AsyncIterator[object]:
    """Decode's event stream after the bootstrap: nothing until the KV arrives (it never will)."""
    started.set()
    try:
        await asyncio.Event().wait()
        yield "unreachable"
    finally:
        closed.set()


async def test_router_ends_both_legs_when_prefill_fails_before_open_s4() -> None:
    """Model counterexample (mutant router_ignores_prefill): prefill died (or its connection reset)
    before OPEN reached decode. Decode waits for KV; the router must not wait with it for decode's
    stall timer: the prefill leg's failure comes first, the pending decode read is cancelled, and
    the router's abort of both legs follows (its `finally`)."""
    started, closed = asyncio.Event(), asyncio.Event()
    events = _decode_waiting_for_kv(started, closed)
    failure = OpenAIError(502, "a worker failed: prefill connection reset", code="worker_failed")
    prefill_may_fail = asyncio.Event()

    async def prefill_leg() -> None:
        await prefill_may_fail.wait()
        raise failure

    prefill_task = asyncio.create_task(prefill_leg())
    waiting = asyncio.create_task(_next_event(events, prefill_task))  # type: ignore[arg-type]
    await started.wait()  # the router is now blocked on decode's stream
    assert not waiting.done()
    prefill_may_fail.set()
    with pytest.raises(OpenAIError) as raised:
        await asyncio.wait_for(waiting, timeout=60)  # deadline against hangs only
    assert raised.value is failure
    assert closed.is_set()  # the decode read was cancelled, not left behind


async def test_router_raises_a_prefill_failure_that_came_before_it_looked_s4() -> None:
    """The same counterexample when prefill fails before the router's read starts (while it still
    waits for decode's response headers), or in the same loop turn as a decode event: the failure
    must come at the next read, not after decode's stall timer."""
    started, closed = asyncio.Event(), asyncio.Event()
    events = _decode_waiting_for_kv(started, closed)
    failure = OpenAIError(502, "prefill failed", code="prefill_error")

    async def prefill_leg() -> None:
        raise failure

    prefill_task = asyncio.create_task(prefill_leg())
    await asyncio.wait({prefill_task})  # failed already
    with pytest.raises(OpenAIError) as raised:
        await asyncio.wait_for(_next_event(events, prefill_task), timeout=60)  # type: ignore[arg-type]
    assert raised.value is failure and not started.is_set()  # decode's stream was never waited on


async def test_router_waits_for_decode_once_prefill_succeeded() -> None:
    async def stream() -> AsyncIterator[str]:
        await prefill_task
        yield "first token"

    async def prefill_leg() -> None:
        return None

    prefill_task = asyncio.create_task(prefill_leg())
    events = stream()
    assert await _next_event(events, prefill_task) == "first token"  # type: ignore[arg-type]
    assert await _next_event(events, prefill_task) is None  # type: ignore[arg-type]
