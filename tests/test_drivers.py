"""What the drivers share around the pure machine: the controller's requeue, and how a RunCanary
decision becomes a canary run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from waiting import until

from kvguard.operator import controller
from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.backends.base import CanaryRunner, ModelRef, RevisionEndpoints, RevisionRequest, execute
from kvguard.operator.canary.spec import CanarySpec
from kvguard.operator.planner import plan
from kvguard.operator.rollout import RunCanary

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def test_a_requeue_reconciles_once_after_its_delay_and_a_newer_one_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    async def reconcile_model(kube: Any, body: dict[str, Any], **_: Any) -> None:
        calls.append(body)

    monkeypatch.setattr(controller, "reconcile_model", reconcile_model)
    key = ("models", "tiny")
    controller._schedule_requeue(None, None, None, key, 0.2)  # type: ignore[arg-type]
    controller._schedule_requeue(None, None, None, key, 0.05)  # type: ignore[arg-type]  # a newer reconcile's delay wins
    # Sleeping past the delays is the behaviour under test, and it holds at any speed: the requeues
    # and this sleep are timers of one event loop, which runs them in deadline order.
    await asyncio.sleep(0.4)
    assert calls == [{"metadata": {"namespace": "models", "name": "tiny"}}]
    controller._schedule_requeue(None, None, None, key, 0.05)  # type: ignore[arg-type]
    controller._schedule_requeue(None, None, None, key, None)  # type: ignore[arg-type]  # at rest: nothing pending
    await asyncio.sleep(0.15)
    assert len(calls) == 1 and key not in controller._loop_state().requeues


class Routers:
    """The endpoints part of a backend: each revision's router URL."""

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        return RevisionEndpoints(router_url=f"http://{revision}.test:8000")


@pytest.mark.parametrize("compare_outputs", [True, False])
async def test_a_canary_against_other_numerics_does_not_require_the_baselines_text(compare_outputs: bool) -> None:
    runs: list[tuple[str, CanarySpec, str | None]] = []

    async def suite(url: str, spec: CanarySpec, *, baseline_url: str | None, **_: Any) -> Any:
        runs.append((url, spec, baseline_url))
        raise asyncio.CancelledError  # nothing to run against: only the call matters here

    runner = CanaryRunner(suite=suite)
    run = RunCanary("r2", "r1", "", compare_outputs=compare_outputs)
    spec = InferenceModelSpec.model_validate(yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"])
    request = RevisionRequest(ModelRef("models", "tiny"), "r2", spec, plan(spec))
    await execute(Routers(), request, [run], runner, CanarySpec())  # type: ignore[arg-type]
    await until(lambda: runs, "the canary suite to be called")
    ((url, spec, baseline_url),) = runs
    assert url == "http://r2.test:8000" and baseline_url == "http://r1.test:8000"  # the stable still serves as baseline
    assert spec.golden.compare_baseline is compare_outputs and spec.golden.enabled
