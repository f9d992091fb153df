"""What the drivers share around the pure machine: the work queue, backoff and requeue rules, and
how a RunCanary decision becomes a canary run."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from waiting import until

from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.backends.base import CanaryRunner, ModelRef, RevisionEndpoints, RevisionRequest, execute
from kvguard.operator.canary.spec import CanarySpec
from kvguard.operator.driver import DriverMemory, StatusConflict, requeue_delay, run_pass
from kvguard.operator.kube import KubeError, TransportError
from kvguard.operator.planner import plan
from kvguard.operator.reconcile import Observed, Outcome
from kvguard.operator.rollout import RunCanary
from kvguard.operator.workqueue import Backoff, WorkQueue

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def test_the_queue_coalesces_bursts_and_never_hands_a_key_to_two_workers() -> None:
    queue = WorkQueue()
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    assert await queue.get() == "a"
    queue.add("a")  # an event during a's pass: run once more after it, not in parallel
    assert await queue.get() == "b"
    assert queue.pending == 2
    queue.done("a")
    assert await queue.get() == "a"
    queue.done("a")
    queue.done("b")
    assert queue.pending == 0


async def test_a_requeue_replaces_the_older_timer_and_none_cancels_it() -> None:
    queue = WorkQueue()
    queue.requeue("m", 30.0)
    queue.requeue("m", 0.05)  # a newer pass's wish wins
    # No await since the requeue, so the timer cannot have fired; 0.0 once 50 ms passed (load).
    remaining = queue.timer_of("m")
    assert remaining is not None and remaining < 1
    assert await asyncio.wait_for(queue.get(), 5) == "m"
    queue.done("m")
    queue.requeue("m", 0.05)
    queue.requeue("m", None)  # at rest: nothing pending
    assert queue.timers == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), 0.2)


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    backoff = Backoff(base=1.0, cap=60.0, jitter=0.2)
    assert [backoff.delay(n, rng=lambda: 0.5) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff.delay(3, rng=lambda: 0.0) == pytest.approx(6.4) and backoff.delay(3, rng=lambda: 1.0) == pytest.approx(9.6)


def test_requeue_delay_waits_only_for_what_is_awaited_and_never_past_the_deadline() -> None:
    def delay(requeue: float | None, waits: int, deadline: float | None = None) -> float | None:
        outcome = Outcome(status={}, requeue_after=requeue, deadline_in=deadline)
        return requeue_delay(outcome, waits, base=5.0, cap=60.0, jitter=lambda s: s)

    assert delay(None, 3) is None  # at rest: no timer at all
    assert delay(0.0, 3) == 0.0  # a scrape is the next observation
    assert [delay(5.0, n) for n in range(6)] == [5, 10, 20, 40, 60, 60]
    assert delay(5.0, 5, deadline=12.0) == 13.0  # the rollout fails on time


class Routers:
    """The endpoints part of a backend: each revision's router URL."""

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        return RevisionEndpoints(router_url=f"http://{revision}.test:8000")


@pytest.mark.parametrize(("match", "compared", "by", "baseline"), [
    ("exact", True, "exact", "http://r1.test:8000"),
    ("tolerant", True, "tolerant", "http://r1.test:8000"),
    # Another model: no baseline at all, or the isolation probe would judge the new model's answers
    # by the old one's (a healthy weights change rolled back, e2e under load).
    ("none", False, "exact", None),
    # An older operator's fingerprint: maybe the same model, so isolation still judges by it.
    ("unknown", False, "exact", "http://r1.test:8000"),
])  # fmt: skip
async def test_the_canary_compares_with_the_baseline_as_the_rollout_decided(match: str, compared: bool, by: str,
                                                                           baseline: str | None) -> None:
    runs: list[tuple[str, CanarySpec, str | None]] = []

    async def suite(url: str, spec: CanarySpec, *, baseline_url: str | None, **_: Any) -> Any:
        runs.append((url, spec, baseline_url))
        raise asyncio.CancelledError  # nothing to run against: only the call matters here

    runner = CanaryRunner(suite=suite)
    run = RunCanary("r2", "r1", "", baseline_match=match)  # type: ignore[arg-type]
    spec = InferenceModelSpec.model_validate(yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"])
    request = RevisionRequest(ModelRef("models", "tiny"), "r2", spec, plan(spec))
    await execute(Routers(), request, [run], runner, CanarySpec())  # type: ignore[arg-type]
    await until(lambda: runs, "the canary started")
    ((url, spec, baseline_url),) = runs
    assert url == "http://r2.test:8000" and baseline_url == baseline
    assert spec.golden.compare_baseline is compared and spec.golden.enabled
    assert spec.golden.baseline_match == by


class ConflictingStore:
    """A ModelStore whose first write loses to another writer that paused the model meanwhile."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.writes, self.refused = body, [], 0

    async def write_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.body["metadata"]["resourceVersion"]:
            raise StatusConflict("stale")
        if not self.refused:  # someone else wrote first: the model moved on under this decision
            self.refused += 1
            self.body = {**self.body, "metadata": {**self.body["metadata"], "resourceVersion": "2",
                                                   "annotations": {"kvguard.io/pause": "true"}}}  # fmt: skip
            raise StatusConflict("stale")
        self.writes.append(status)
        self.body = {**self.body, "status": status, "metadata": {**self.body["metadata"], "resourceVersion": "3"}}
        return self.body

    async def reread(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.body

    async def record_event(self, *_: Any) -> None:
        return None


class NoWorkloads:
    async def observe(self, model: ModelRef) -> Any:
        from kvguard.operator.backends.base import Observation

        return Observation()

    async def ensure_revision(self, *_: Any) -> None:
        raise AssertionError("a paused rollout deploys nothing")


async def test_a_stale_status_write_is_re_read_and_decided_again_on_the_latest_model() -> None:
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"].update(namespace="models", uid="u", resourceVersion="1")
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "m", "path": "tiny"}}
    store = ConflictingStore(body)
    result = await run_pass(body, Observed(), store, NoWorkloads(), CanaryRunner(), DriverMemory())  # type: ignore[arg-type]
    assert result is not None and store.refused == 1 and len(store.writes) == 1
    assert store.writes[0]["rollout"]["state"] == "Paused"  # decided on what the other writer left, not on the stale read


class FlakyEvents:
    """A ModelStore that keeps every write and whose Event posts fail `failures` times first
    (with `status`: 500 the API server unavailable, 422 refused)."""

    def __init__(self, body: dict[str, Any], failures: int, status: int = 500) -> None:
        self.body, self.failures, self.status, self.events = body, failures, status, []

    async def write_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        self.body = {**body, "status": status}
        return self.body

    async def reread(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.body

    async def record_event(self, body: dict[str, Any], event: Any, now: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise KubeError(self.status, "etcd timeout" if self.status >= 500 else "refused")
        self.events.append(event.reason)


class FailingWorkloads(NoWorkloads):
    async def ensure_revision(self, *_: Any) -> None:
        raise KubeError(500, "the API server is restarting")


def _tiny_body() -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"].update(namespace="models", uid="u", resourceVersion="1")
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "m", "path": "tiny"}}
    return body


async def test_a_recorded_decisions_events_and_counts_survive_a_failed_action_or_post() -> None:
    """Outside probe: one failed Event post (or a failed action before it) lost the first
    continuous-canary failure's Event and its count for good (the retried pass finds the run
    already in status and does not decide it again), so the alert could miss it."""
    body = _tiny_body()
    memory, recorded = DriverMemory(), []
    store = FlakyEvents(body, failures=0)
    with pytest.raises(KubeError):  # the action fails after the decision was recorded ...
        await run_pass(body, Observed(), store, FailingWorkloads(), CanaryRunner(), memory, on_recorded=recorded.append)  # type: ignore[arg-type]
    decided = [e.reason for e in recorded[0].events]
    assert decided and store.events == decided  # ... and its Events still went out, and it was counted
    flaky = FlakyEvents(_tiny_body(), failures=1)
    memory = DriverMemory()
    with pytest.raises(KubeError):
        await run_pass(_tiny_body(), Observed(), flaky, FailingWorkloads(), CanaryRunner(), memory)  # type: ignore[arg-type]
    assert flaky.events == [] and [e.event.reason for e in memory.outbox[("models", "tiny-cpu")]] == decided
    with pytest.raises(KubeError):  # the next pass (its action failing again) posts them, in order
        await run_pass(flaky.body, Observed(), flaky, FailingWorkloads(), CanaryRunner(), memory)  # type: ignore[arg-type]
    assert flaky.events[: len(decided)] == decided
    assert memory.outbox[("models", "tiny-cpu")] == []


async def test_an_event_the_api_server_refuses_is_dropped_not_retried_before_the_rest() -> None:
    """Outside review: an Event refused every time (a 4xx) would block every later one of its model."""
    refusing = FlakyEvents(_tiny_body(), failures=1, status=422)
    memory, recorded = DriverMemory(), []
    with pytest.raises(KubeError):
        await run_pass(_tiny_body(), Observed(), refusing, FailingWorkloads(), CanaryRunner(), memory, on_recorded=recorded.append)  # type: ignore[arg-type]
    decided = [e.reason for e in recorded[0].events]
    assert memory.outbox[("models", "tiny-cpu")] == [] and refusing.events == decided[1:]  # the first dropped, the rest posted


async def test_a_continuous_run_is_stopped_even_when_the_passes_action_fails() -> None:
    """Outside review: the stop came after the actions, so the pass that left rest (the one that
    deploys the new revision, likeliest to fail) left the run going, and no later pass stops it."""
    from kvguard.operator import driver

    stopped: list = []

    class Continuous(CanaryRunner):
        def cancel(self, model: Any, revision: Any = None) -> None:
            stopped.append(model)

    decide = driver.reconcile

    def leaving_rest(*args: Any, **kwargs: Any) -> Outcome:
        return dataclasses.replace(decide(*args, **kwargs), continuous_stop=True)

    driver.reconcile = leaving_rest  # type: ignore[assignment]
    try:
        with pytest.raises(KubeError):
            await run_pass(_tiny_body(), Observed(), FlakyEvents(_tiny_body(), 0), FailingWorkloads(), CanaryRunner(), DriverMemory(),  # type: ignore[arg-type]
                           continuous=Continuous())  # fmt: skip
    finally:
        driver.reconcile = decide
    assert stopped == [("models", "tiny-cpu")]


@pytest.mark.parametrize(("error", "kept"), [(KubeError(503, "unavailable"), True), (KubeError(429, "slow down"), True),
                                             (TransportError("connection refused"), True), (KubeError(422, "refused"), False),
                                             (KubeError(0, "not sent: not the leader"), False), (ValueError("a bug"), False)])  # fmt: skip
async def test_an_event_is_kept_for_another_try_only_when_another_try_can_succeed(error: Exception, kept: bool) -> None:
    """A review: an unreachable API server (TransportError, status 0) was read as a refusal and its
    Events dropped, which the outbox exists to keep; a bug's exception was retried for ever."""
    from kvguard.operator.driver import UnpostedEvent, _post_events
    from kvguard.operator.reconcile import EventSpec

    class Failing:
        async def record_event(self, *_: Any) -> None:
            raise error

    outbox = [UnpostedEvent(_tiny_body(), EventSpec("Warning", "ContinuousCanaryFailed", "m"), None)]  # type: ignore[arg-type]
    await _post_events(Failing(), outbox)  # type: ignore[arg-type]
    assert (len(outbox) == 1) is kept


async def test_a_cancelled_revisions_canary_result_is_dropped_with_its_run() -> None:
    """An outside probe: the runner kept a model's last result until the model was deleted, so a
    revision rolled out again was judged by its earlier verdict (CanaryFailed at once, or promoted on
    an old pass after a rollback-to) without a canary. The rollout cancels the revision's canary when
    it starts one (rollout._on_planning), and a cancel drops that revision's result too."""

    async def suite(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no target here")  # a finished run with a result (cannot_run)

    runner, model = CanaryRunner(suite=suite), ("models", "tiny")
    runner.start(model, RunCanary("r2", "r1", ""), "http://r2.test:8000", spec=CanarySpec(), baseline_url=None, metrics_urls=[])
    await until(lambda: runner.result(model) is not None, "the run finished")
    runner.cancel(model, "r3")
    assert runner.result(model) is not None and runner.result(model).revision == "r2"  # another revision's cancel
    runner.cancel(model, "r2")
    assert runner.result(model) is None
