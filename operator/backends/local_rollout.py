"""Drive one rollout on the local backend to a resting state, with the shared state machine.

The loop is the operator's reconcile in miniature: observe the local processes, call
`rollout.step`, scrape the candidate's workers when it asks, execute the actions with the shared
`backends.base.execute` (and its `CanaryRunner`), record the decision in the status kept in the
state folder, and look again - until the rollout rests (Stable, RolledBack, Blocked or Paused).
Every decision is saved before the next observation, so a driver killed anywhere is resumed by
the next `roll_out` on the same folder from the recorded `status.rollout` (S8).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvguard.operator import conditions as cond
from kvguard.operator.api import InferenceModelSpec, InferenceModelStatus, InferencePolicy, KVPlan, Phase, RevisionRecord
from kvguard.operator.backends.base import CanaryRunner, ModelRef, RevisionRequest, execute, scrape_workers
from kvguard.operator.backends.local import LocalBackend, LocalBackendError, model_dir_for, runnable_problems
from kvguard.operator.canary.report import CanaryReport
from kvguard.operator.canary.suite import ProgressEvent, run_suite
from kvguard.operator.planner import plan
from kvguard.operator.policy import evaluate
from kvguard.operator.revision import numerics_of, revision_of
from kvguard.operator.rollout import (
    Decision,
    PolicyGate,
    RecordEvent,
    RolloutState,
    ScrapeMetrics,
    SetCondition,
    World,
    previous_stables,
    step,
    with_reports,
)

HISTORY_LIMIT = 10
POLL_SECONDS = 0.3
RESTING = (RolloutState.STABLE, RolloutState.ROLLED_BACK, RolloutState.BLOCKED, RolloutState.PAUSED)
LOCAL_NAMESPACE = "default"

Say = Callable[[str], None]


@dataclass
class RolloutResult:
    """Where one `roll_out` left the model."""

    revision: str
    """The spec's revision."""
    state: RolloutState
    stable: str | None
    serving_url: str | None
    """The API base (…/v1) user traffic goes to, None when nothing serves."""
    plan: KVPlan
    status: InferenceModelStatus
    canary_reports: dict[str, CanaryReport] = field(default_factory=dict)
    """Full canary reports of this run, by revision (status keeps the summary)."""
    events: list[RecordEvent] = field(default_factory=list)

    @property
    def promoted(self) -> bool:
        return self.state == RolloutState.STABLE and self.stable == self.revision


def load_status(backend: LocalBackend) -> InferenceModelStatus:
    return InferenceModelStatus.model_validate(backend.state.status or {})


def save_status(backend: LocalBackend, status: InferenceModelStatus) -> None:
    backend.state.status = status.to_wire()
    backend.save()


def phase_of(state: RolloutState, stable: str | None) -> Phase:
    if state == RolloutState.STABLE:
        return Phase.READY
    if state == RolloutState.BLOCKED:
        return Phase.BLOCKED
    if state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
        return Phase.DEGRADED
    return Phase.PROGRESSING if stable is None or state != RolloutState.PAUSED else Phase.READY


def record_decision(
    status: InferenceModelStatus, decision: Decision, target: str, kv_plan: KVPlan, generation: int | None, now: dt.datetime
) -> InferenceModelStatus:
    """The status after a decision: rollout record, stable revision, conditions, history (pure)."""
    new = status.model_copy(deep=True)
    new.rollout, new.revision, new.target_revision, new.plan = decision.rollout, decision.stable, target, kv_plan
    new.kv_ratio = min((r.ratio for r in kv_plan.roles.values()), default=None)
    new.phase, new.message = phase_of(decision.state, decision.stable), decision.rollout.message
    new.canary = decision.rollout.canary.verdict if decision.rollout.canary else None
    for action in decision.of_type(SetCondition):
        made = cond.make_condition(action.type, action.status, action.reason, action.message, now=now, generation=generation)
        new.conditions = cond.set_condition(new.conditions, made)
    candidate = decision.rollout.revision
    history = list(new.history)

    def put(revision: str, state: str, message: str | None) -> None:
        nonlocal history
        if history and history[0].revision == revision and history[0].state == state:
            return
        entry = RevisionRecord(revision=revision, state=state, since=cond.rfc3339(now), generation=generation,  # type: ignore[arg-type]
                               message=message)  # fmt: skip
        history = [entry, *[h for h in history if h.revision != revision or h.state in ("Stable", "Superseded")]]

    if decision.promoted_from:
        put(decision.promoted_from, "Superseded", f"replaced by {decision.stable}")
    if candidate and decision.state == RolloutState.STABLE and decision.stable == candidate:
        put(candidate, "Stable", None)
    elif candidate and decision.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
        put(candidate, "Failed", decision.rollout.message)
    elif candidate and decision.state == RolloutState.BLOCKED:
        put(candidate, "Blocked", decision.rollout.message)
    elif candidate and decision.state in (RolloutState.CANARY_DEPLOYING, RolloutState.CANARY_VERIFYING):
        put(candidate, "Candidate", None)
    new.history = history[:HISTORY_LIMIT]
    return new


def plan_gate(kv_plan: KVPlan) -> tuple[bool, str]:
    from kvguard.operator.reconcile import describe_fixes, describe_pools

    if kv_plan.verdict == "pass":
        return True, describe_pools(kv_plan)
    return False, describe_pools(kv_plan) + ". " + describe_fixes(kv_plan)


async def roll_out(
    backend: LocalBackend,
    name: str,
    spec: InferenceModelSpec,
    *,
    policies: Sequence[InferencePolicy] = (),
    namespace: str = LOCAL_NAMESPACE,
    annotations: Mapping[str, str] | None = None,
    faults: str = "",
    say: Say | None = None,
    on_canary_progress: Callable[[ProgressEvent], None] | None = None,
    generation: int | None = None,
    max_seconds: float | None = None,
) -> RolloutResult:
    """Roll `spec` out on `backend` (opened) until the rollout rests; raises PlanInputError,
    LocalBackendError, or TimeoutError after `max_seconds`."""
    say = say or (lambda _line: None)
    kv_plan = plan(spec)
    target = revision_of(spec, faults)
    plan_ok, plan_message = plan_gate(kv_plan)
    verdict = evaluate(spec, namespace, list(policies), kv_plan=kv_plan)
    model = ModelRef(namespace, name)
    if plan_ok:  # refuse what cannot run here before anything is recorded or started
        problems = runnable_problems(spec)
        if problems:
            raise LocalBackendError("; ".join(problems))
        model_dir = model_dir_for(spec, backend.models_root)
        if not (model_dir / "config.json").is_file():
            raise LocalBackendError(f"spec.model.source.pvc.path: {model_dir} has no config.json")
    backend.claim(name)
    reports: dict[str, CanaryReport] = {}

    async def suite(url: str, canary: object, **kwargs: object) -> CanaryReport:
        report = await run_suite(url, canary, progress=on_canary_progress, **kwargs)  # type: ignore[arg-type]
        revision = next((r for r, rec in backend.state.revisions.items() if rec.router.url == url.rstrip("/")), url)
        reports[revision] = report
        (backend.store.revision_dir(revision) / "canary.json").write_text(report.to_json())
        return report

    runner = CanaryRunner(suite=suite)
    result_events: list[RecordEvent] = []
    status = load_status(backend)
    deadline = None if max_seconds is None else asyncio.get_running_loop().time() + max_seconds
    while True:
        now = dt.datetime.now(dt.UTC)
        observation = await backend.observe(model)
        rollout = status.rollout
        candidate_attempt = (rollout.revision or "", rollout.attempt) if rollout else ("", "")
        world = World(
            target=target, numerics=numerics_of(spec), now=now, plan_ok=plan_ok, plan_message=plan_message,
            policy=PolicyGate.from_verdict(verdict), revisions=observation.revisions, serving=observation.serving,
            previous_stables=previous_stables(status.history, status.revision), annotations=dict(annotations or {}),
            canary=runner.result(model.key), canary_running=runner.running(model.key, *candidate_attempt),
        )  # fmt: skip
        decision = step(spec, status.rollout, status.revision, world)
        scrape = decision.of_type(ScrapeMetrics)
        if scrape:
            worker_reports = await scrape_workers(await backend.endpoints(model, scrape[0].revision))
            decision = step(spec, status.rollout, status.revision, with_reports(world, worker_reports))
        request = RevisionRequest(model, target, spec, kv_plan, faults) if plan_ok else None
        await execute(backend, request, decision.actions, runner, spec.canary)
        previous_state = status.rollout.state if status.rollout else None
        status = record_decision(status, decision, target, kv_plan, generation, now)
        save_status(backend, status)
        for event in decision.of_type(RecordEvent):
            result_events.append(event)
            say(f"[{event.type}] {event.reason}: {event.message}")
        if decision.state != previous_state:
            say(f"rollout: {previous_state.value if previous_state else '-'} -> {decision.state.value}")
        canary_busy = runner.running(model.key, decision.rollout.revision or "", decision.rollout.attempt)
        if decision.state in RESTING and not canary_busy:
            return RolloutResult(
                revision=target, state=decision.state, stable=decision.stable, serving_url=backend.serving_url(),
                plan=kv_plan, status=status, canary_reports=reports, events=result_events,
            )  # fmt: skip
        if deadline is not None and asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"rollout of revision {target} still {decision.state.value} after {max_seconds:g} s")
        await asyncio.sleep(POLL_SECONDS)
