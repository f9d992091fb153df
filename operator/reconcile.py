"""One idempotent, level-based reconcile of an InferenceModel: (spec, observed) -> desired.

Every trigger (the model's events, its children's, a policy change, a finished canary or scrape,
a requeue) runs the same `reconcile`; it looks only at the resource and what exists, never at what
triggered it, so running it twice changes nothing. One pass parses, plans and renders once:

    parse spec -> resolve architecture -> engine support -> revision -> plan (S7 gate) -> render
      -> policy (on the resolved spec, its plan and the rendered command lines)
      -> `rollout.step` (canary-gated state machine), once -> status + workload actions
      blocked plan:  KVPoolSufficient=False (numbers + fixes), Warning event, nothing of the stable
      revision changes (S8); an unfinished canary of an older spec is removed

The Kubernetes controller and the local backend both call it (through `driver.run_pass`), so both
write the same status for the same story.

Pure: no kopf, no kubernetes client, no clock, no randomness (time and key are arguments).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvguard.operator import conditions as cond
from kvguard.operator.api import (
    InferenceModelSpec,
    InferenceModelStatus,
    InferencePolicy,
    KVPlan,
    Phase,
    RevisionRecord,
    field_path,
    model_name_problem,
)
from kvguard.operator.continuous import rollback_pin
from kvguard.operator.continuous import step as continuous_step
from kvguard.operator.engine_support import engine_problems
from kvguard.operator.hf_config import HFConfigError, architecture_from_hf_config
from kvguard.operator.pd_parity import parity_problem
from kvguard.operator.planner import PlanInputError, plan
from kvguard.operator.policy import evaluate
from kvguard.operator.pool_gate import GATED_ROLES, PodPool, describe_kept_out, kept_out, status_pools
from kvguard.operator.render import (
    Owner,
    RenderedRevision,
    RenderError,
    render_rollout_revision,
)
from kvguard.operator.revision import numerics_of, revision_of
from kvguard.operator.rollout import (
    NEVER_PROMOTED,
    NEVER_SERVED,
    ROLLBACK_ANNOTATION,
    Action,
    AnalysisOutcome,
    CanaryResult,
    Decision,
    MeasureAnalysis,
    PolicyGate,
    RecordEvent,
    RevisionView,
    RolloutState,
    RolloutStatus,
    ScrapeMetrics,
    SetCondition,
    WorkerReport,
    World,
    previous_stables,
    step,
)
from kvguard.operator.suggestions import change_summary
from kvguard.operator.workloads import DeploymentState, deployment_state, owned_by, revision_views
from kvguard.workers.field_messages import field_message
from kvguard.workers.pool_ratio import ratio_number, ratio_text

__all__ = ["DeploymentState", "Observed", "Outcome", "deployment_state", "owned_by", "pool_gate_degraded", "reconcile",
           "revision_views", "with_pool_gate"]

HISTORY_LIMIT = 10
FAULTS_ANNOTATION = "kvguard.io/faults"
"""Test clusters only: KVGUARD_FAULTS for the spec's revision, honoured when the operator runs with
KVGUARD_ALLOW_FAULT_INJECTION=true (manifests/testing/fault-injection); ignored otherwise."""
POD_POOL_REASON = "PodKVPoolTooSmall"
"""Degraded reason while the readiness gate keeps a pod out of rotation (pool_gate.py)."""
FOREIGN_RECHECK_SECONDS = 10.0
"""How soon to look again at an object that blocks the rollout because someone else owns it."""
ARCHITECTURE_RECHECK_SECONDS = 10.0
"""How soon to look again for the architecture ConfigMap a spec names when it is missing or
unreadable: ConfigMaps are not watched, so without a timer a model created before its ConfigMap
stayed Degraded until the next resync (outside probe: ~12 minutes of a false "not found")."""


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """The world as read by a driver just before reconcile (once per pass)."""

    revisions: Mapping[str, RevisionView] = field(default_factory=dict)
    """Every revision that has workloads or other children, with its readiness."""
    architecture_config: Mapping[str, Any] | None = None
    """The config.json from spec.model.architectureConfigMap, when the spec names one."""
    architecture_config_error: str | None = None
    """Why that config.json could not be read (missing ConfigMap or key, bad JSON)."""
    serving: str | None = None
    """The revision the model's Service selects (None: no Service yet)."""
    policies: Sequence[InferencePolicy] = ()
    """Every InferencePolicy; reconcile evaluates those that apply to the model's namespace."""
    worker_reports: tuple[WorkerReport, ...] | None = None
    """A fresh scrape of the candidate's workers, when the previous pass asked for one."""
    canary: CanaryResult | None = None
    """The last finished canary run of this model held in memory by the driver."""
    canary_running: bool = False
    """A canary run for the candidate's current attempt is in progress."""
    analysis: AnalysisOutcome | None = None
    """A fresh measurement of the candidate's live traffic, when the previous pass asked for one."""
    fault_injection_allowed: bool = False
    """The operator runs with KVGUARD_ALLOW_FAULT_INJECTION=true (test clusters only)."""
    foreign_objects: tuple[str, ...] = ()
    """Objects with the names of this model's children that it does not own (a squatted
    Deployment or Service name): each one blocks the rollout, named."""
    refused_object: str | None = None
    """The API server's 422 for a child object this spec renders (a node selector, toleration or
    resource it refuses): the rollout halts, Degraded names it, until the spec changes."""
    continuous: CanaryResult | None = None
    """The last finished continuous-canary run of this model held in memory by the driver."""
    continuous_running: bool = False
    """A continuous-canary run of the current schedule is in progress."""
    pools: tuple[PodPool, ...] = ()
    """The readiness gate's verdict on every engine pod of the model that exists (S7 while pods
    serve, backends/pod_gate.py); empty where no gate runs."""


# --- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    """What the I/O layer must do. Applying it twice is the same as applying it once."""

    status: dict[str, Any]
    """The whole status to write, BEFORE the actions run (record intent, then act: a restart
    re-issues whatever the recorded state still needs)."""
    actions: list[Action] = field(default_factory=list)
    """Workload actions of the rollout decision, for a backend (`backends.base.execute`)."""
    spec: InferenceModelSpec | None = None
    """The parsed spec with its architecture resolved (what DeployRevision deploys)."""
    revision: str | None = None
    rendered: RenderedRevision | None = None
    """The spec's revision rendered once (what the Kubernetes backend applies)."""
    scrape: str | None = None
    """Revision whose workers the driver scrapes before the next pass (`ScrapeMetrics`)."""
    measure: MeasureAnalysis | None = None
    """Candidate and stable whose live traffic the driver measures before the next pass."""
    faults: str = ""
    """Test-only KVGUARD_FAULTS for the spec's revision (only with fault injection allowed)."""
    events: list[EventSpec] = field(default_factory=list)
    requeue_after: float | None = None
    """Something is awaited: look again after this long (0: at once). None: at rest."""
    deadline_in: float | None = None
    """Seconds until the awaited thing's progress deadline (a backing-off driver looks by then)."""
    plan: KVPlan | None = None
    blocked_reason: str | None = None
    continuous_start: tuple[str, str] | None = None
    """(revision, attempt) of a continuous-canary run to start (continuous.py)."""
    continuous_verdict: str | None = None
    """The verdict of a continuous-canary run recorded by this pass."""
    continuous_stop: bool = False
    """Stop the model's continuous-canary run in flight (continuous.ContinuousDecision.stop)."""


# --- reconcile ---------------------------------------------------------------------------------


@dataclass
class _Run:
    """Mutable scratch for one reconcile call."""

    body: Mapping[str, Any]
    observed: Observed
    now: dt.datetime
    previous: InferenceModelStatus
    generation: int | None
    status: InferenceModelStatus = field(init=False)

    def __post_init__(self) -> None:
        self.status = self.previous.model_copy(deep=True)
        self.status.observed_generation = self.generation

    def set(self, type_: str, status: cond.ConditionStatus, reason: str, message: str) -> None:
        new = cond.make_condition(type_, status, reason, message, now=self.now, generation=self.generation)
        self.status.conditions = cond.set_condition(self.status.conditions, new)

    def record(self, revision: str, state: str, message: str | None = None, kv_ratio: float | None = None) -> bool:
        """Put `revision` in `state` at the head of history; False when it already was."""
        head = self.status.history[0] if self.status.history else None
        if head is not None and head.revision == revision and head.state == state:
            return False
        entry = RevisionRecord(
            revision=revision, state=state, since=cond.rfc3339(self.now),
            generation=self.generation, kv_ratio=kv_ratio, message=message,
        )  # fmt: skip
        rest = [h for h in self.status.history if not (h.revision == revision and h.state in ("Candidate", "Blocked"))]
        self.status.history = [entry, *rest][:HISTORY_LIMIT]
        return True

    def outcome(self, **kwargs: Any) -> Outcome:
        events = self.apply_pool_gate()
        self.status.conditions = cond.observed_at(self.status.conditions, self.generation)
        return Outcome(status=status_patch(self.status), **{**kwargs, "events": [*kwargs.get("events", []), *events]})

    def apply_pool_gate(self) -> list[EventSpec]:
        """status.pools and, while any pod is kept out of rotation for its pool, Degraded naming
        each pod and node (S7 while pods serve). Idempotent: the event is for a new message only."""
        pools = self.observed.pools
        self.status.pools = status_pools(pools)
        change = pool_gate_degraded(pools, cond.find_condition(self.status.conditions, cond.DEGRADED))
        if change is None:
            return []
        self.set(cond.DEGRADED, *change)
        if change[0] != "True":
            return []
        before = cond.find_condition(self.previous.conditions, cond.DEGRADED)
        repeated = before is not None and before.reason == POD_POOL_REASON and before.message == change[2]
        return [] if repeated else [EventSpec("Warning", POD_POOL_REASON, change[2])]


def pool_gate_degraded(pools: Sequence[PodPool], degraded: cond.Condition | None) -> tuple[cond.ConditionStatus, str, str] | None:
    """The Degraded condition the readiness gate's verdicts call for, as (status, reason, message):
    True naming every pod (or local worker) kept out of rotation for its pool; False again once
    none is, if the gate had set it; None: leave Degraded as it is (another cause owns it)."""
    out = kept_out(pools)
    if out:
        return "True", POD_POOL_REASON, describe_kept_out(out)
    if degraded is not None and degraded.reason == POD_POOL_REASON and degraded.status == "True":
        return "False", "AsExpected", "every serving pod's KV pool meets the ratio"
    return None


def roles_out_of_rotation(pools: Sequence[PodPool], revision: str) -> list[str]:
    """The engine roles of `revision` with no worker in rotation (each one down, starting or kept
    out): the revision answers nothing (its router says 503) until one is back."""
    mine = [p for p in pools if p.revision == revision]
    return [role for role in GATED_ROLES if mine and not any(p.role == role and p.verified for p in mine)]


NO_WORKER_REASON = "NoWorkerInRotation"
NOT_LISTENING_REASON = "NotListening"  # local: the splitter or the serving revision's router is not running


def with_pool_gate(status: Mapping[str, Any], pools: Sequence[PodPool], now: dt.datetime, serving: str | None = None,
                   front_door: str | None = None) -> dict[str, Any]:  # fmt: skip
    """`status` (as stored) with `pools` and the Degraded condition they call for, by the rule
    reconcile applies (`pool_gate_degraded`): what `kvguard status --local` shows from a live scrape
    while no driver runs (a worker restarted after `kvguard apply` returned is seen at once). And if
    the `serving` revision has a role with no worker in rotation, or `front_door` says why the
    model's URL does not answer (a local splitter or router not running), it is said, not shown as
    Ready."""
    shown = dict(status)
    conditions = [cond.Condition.model_validate(c) for c in status.get("conditions") or [] if isinstance(c, Mapping)
                  and c.get("type") and c.get("status") in ("True", "False", "Unknown") and c.get("reason")]  # fmt: skip
    stored_generation = status.get("observedGeneration")
    generation = stored_generation if isinstance(stored_generation, int) else None
    change = pool_gate_degraded(pools, cond.find_condition(conditions, cond.DEGRADED))
    if change is not None:
        conditions = cond.set_condition(conditions, cond.make_condition(cond.DEGRADED, *change, now=now, generation=generation))
    missing = roles_out_of_rotation(pools, serving) if serving is not None else []
    why = "; ".join(p.message for p in pools if p.revision == serving and p.role in missing and not p.verified)
    problems = [(reason, message) for reason, message in (
        (NOT_LISTENING_REASON, front_door),
        (NO_WORKER_REASON, f"revision {serving} has no {' or '.join(missing)} worker in rotation, so it answers 503: {why}"
                           if missing else None),
    ) if message is not None]  # fmt: skip
    if problems:  # one condition per type: the first reason, every message
        message = "; ".join(message for _, message in problems)
        for type_ in (cond.DEGRADED, cond.READY):
            status_of: cond.ConditionStatus = "True" if type_ == cond.DEGRADED else "False"
            conditions = cond.set_condition(conditions, cond.make_condition(type_, status_of, problems[0][0], message, now=now, generation=generation))
        shown["phase"] = Phase.DEGRADED.value
    if change is not None or missing or front_door:
        shown["conditions"] = [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in conditions]
    shown["pools"] = [p.model_dump(mode="json", by_alias=True, exclude_none=True) for p in status_pools(pools)]
    return shown


def reconcile(body: Mapping[str, Any], observed: Observed, *, now: dt.datetime) -> Outcome:
    """The desired state for one InferenceModel `body` (a dict as the API server returns it)."""
    meta = body.get("metadata", {})
    generation = meta.get("generation")  # kmock stores none; tolerate it
    run = _Run(body, observed, now, previous_status(body.get("status")), generation if isinstance(generation, int) else None)
    try:
        spec = InferenceModelSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return _invalid(run, "InvalidSpec", field_errors(exc))
    if not meta.get("uid"):
        return _invalid(run, "MissingUID", "metadata.uid: the API server did not assign one; cannot own children")
    if (bad_name := model_name_problem(str(meta.get("name") or ""))) is not None:  # stored before the CEL rule existed
        return _invalid(run, "InvalidName", bad_name)
    spec, problem = resolve_architecture(spec, observed)
    if problem is not None:
        return _invalid(run, "ArchitectureUnavailable", problem, requeue_after=ARCHITECTURE_RECHECK_SECONDS)
    unsupported = engine_problems(spec)
    if unsupported:  # the engine would run something else than the plan says: never deploy it
        return _invalid(run, "InvalidSpec", "; ".join(unsupported))
    try:
        kv_plan = plan(spec)
    except PlanInputError as exc:
        return _invalid(run, "InvalidPlanInput", str(exc))
    if (mismatch := parity_problem(spec, kv_plan)) is not None:  # sglang#19398
        return _invalid(run, "PDParityMismatch", mismatch)
    faults, fault_problem = injected_faults(meta.get("annotations") or {}, run.observed.fault_injection_allowed)
    if fault_problem is not None:
        return _invalid(run, "InvalidFaults", fault_problem)
    if observed.refused_object is not None:
        return _invalid(run, "ObjectRefused", f"the API server refused an object of this spec: {observed.refused_object}")
    if observed.foreign_objects:  # S3: never run beside (or with the key of) an object someone else made
        message = "; ".join(observed.foreign_objects)
        return _invalid(run, "ForeignObject", message, requeue_after=FOREIGN_RECHECK_SECONDS, in_spec=False)
    _clear_spec_degraded(run)
    revision = revision_of(spec, faults)
    run.status.plan = kv_plan
    run.status.target_revision = revision
    run.status.kv_ratio = min((r.ratio for r in kv_plan.roles.values()), default=None)
    namespace = meta.get("namespace") or "default"
    owner = Owner(name=meta["name"], namespace=namespace, uid=meta["uid"])
    if kv_plan.verdict == "blocked":
        gate = policy_gate(spec, namespace, observed.policies, kv_plan, None)
        return _blocked(run, spec, kv_plan, revision, gate)
    run.set(cond.KV_POOL_SUFFICIENT, "True", "KVPoolSufficient", describe_pools(kv_plan))
    try:
        rendered = render_rollout_revision(spec, kv_plan, owner, revision, faults)  # a spec its engine cannot run never deploys
    except RenderError as exc:
        return _invalid(run, "InvalidSpec", str(exc))
    gate = policy_gate(spec, namespace, observed.policies, kv_plan, rendered)
    outcome = _roll_out(run, spec, kv_plan, revision, gate, plan_ok=True, plan_message="")
    return dataclasses.replace(outcome, faults=faults, rendered=rendered, events=_fault_events(run, faults, meta) + outcome.events)


def policy_gate(
    spec: InferenceModelSpec, namespace: str, policies: Sequence[InferencePolicy], kv_plan: KVPlan, rendered: RenderedRevision | None
) -> PolicyGate:
    """The InferencePolicy verdict (S7) on the resolved spec, its plan and the command lines that
    will run (so requiredEngineFlags / requireKVIntegrity see the flags, not only extraArgs)."""
    if not policies:
        return PolicyGate()
    commands = rendered.worker_commands() if rendered is not None else None
    return PolicyGate.from_verdict(evaluate(spec, namespace, list(policies), kv_plan=kv_plan, commands=commands))


def injected_faults(annotations: Mapping[str, Any], allowed: bool) -> tuple[str, str | None]:
    """(faults, problem) from the kvguard.io/faults annotation; ignored unless the operator allows it."""
    faults = str(annotations.get(FAULTS_ANNOTATION) or "").strip()
    if not faults or not allowed:
        return "", None
    from kvguard.workers.faults import FaultSpecError, parse_faults  # pure pydantic, no torch

    try:
        parse_faults(faults)
    except FaultSpecError as exc:
        return "", f"metadata.annotations[{FAULTS_ANNOTATION}]: {exc}"
    return faults, None


def _fault_events(run: _Run, faults: str, meta: Mapping[str, Any]) -> list[EventSpec]:
    """Say it loudly, once per revision, whether the annotation is honoured or ignored."""
    if run.previous.target_revision == run.status.target_revision:
        return []
    if faults:
        return [EventSpec("Warning", "FaultInjection", f"revision {run.status.target_revision} runs with KVGUARD_FAULTS={faults} "
                          "(test clusters only)")]  # fmt: skip
    if (meta.get("annotations") or {}).get(FAULTS_ANNOTATION):
        return [EventSpec("Warning", "FaultInjectionIgnored", f"{FAULTS_ANNOTATION} is ignored: the operator does not "
                          "run with KVGUARD_ALLOW_FAULT_INJECTION=true")]  # fmt: skip
    return []


SPEC_DEGRADED_REASONS = frozenset({"InvalidSpec", "MissingUID", "InvalidName", "ArchitectureUnavailable", "InvalidPlanInput",
                                   "PDParityMismatch", "InvalidFaults", "ObjectRefused", "ForeignObject"})  # fmt: skip
"""Degraded reasons `_invalid` sets: they describe the spec (or what stood in its way), so a pass
that gets past every one of those checks clears them at once, not only when a rollout completes."""


def _clear_spec_degraded(run: _Run) -> None:
    degraded = cond.find_condition(run.previous.conditions, cond.DEGRADED)
    if degraded is not None and degraded.status == "True" and degraded.reason in SPEC_DEGRADED_REASONS:
        run.set(cond.DEGRADED, "False", "SpecAccepted", f"resolved: {degraded.reason}")


def _invalid(run: _Run, reason: str, message: str, requeue_after: float | None = None, in_spec: bool = True) -> Outcome:
    """A spec the operator cannot act on: say why, keep everything running as it is (S8).
    Nothing is awaited (a spec change is an event), unless the cause is outside the spec
    (`in_spec` False: an object in the way; the conditions then do not send anyone to the spec)."""
    run.status.phase = Phase.DEGRADED
    run.status.message = message
    run.set(cond.DEGRADED, "True", reason, message)
    # Not left saying what an earlier, valid spec was judged: this one cannot be judged.
    if in_spec:
        planned, checked, halted = "the spec could not be planned: ", "the spec could not be checked against policies: ", "until the spec is fixed"
    else:
        planned = checked = "not judged while the rollout is halted: "
        halted = "until the object in the way is gone"
    run.set(cond.KV_POOL_SUFFICIENT, "Unknown", reason, planned + message)
    run.set(cond.POLICY_COMPLIANT, "Unknown", reason, checked + message)
    run.set(cond.PROGRESSING, "False", reason, f"rollout halted {halted}")
    _set_ready(run, run.status.revision)
    previous_degraded = cond.find_condition(run.previous.conditions, cond.DEGRADED)
    repeated = previous_degraded is not None and previous_degraded.status == "True" and previous_degraded.message == message
    events = [] if repeated else [EventSpec("Warning", reason, message)]
    return run.outcome(events=events, blocked_reason=reason, requeue_after=requeue_after)


def _blocked(run: _Run, spec: InferenceModelSpec, kv_plan: KVPlan, revision: str, gate: PolicyGate) -> Outcome:
    """S7 gate: the plan says a pool is below minKVRatio x contextLength. The stable revision is
    not touched (S8); the rollout machine removes an unfinished canary of an older spec."""
    message = describe_pools(kv_plan) + ". " + describe_fixes(kv_plan)
    run.set(cond.KV_POOL_SUFFICIENT, "False", "KVPoolTooSmall", message)
    # Before the Blocked entry, which then stays at the head: one Warning per blocked revision.
    _supersede_replaced_candidate(run, revision, _served_traffic(run.status.rollout))
    new = run.record(revision, "Blocked", message, run.status.kv_ratio)
    outcome = _roll_out(run, spec, kv_plan, revision, gate, plan_ok=False, plan_message=message)
    events = [e for e in outcome.events if e.reason != "KVPoolTooSmall"]
    if new:
        events.insert(0, EventSpec("Warning", "KVPoolTooSmall", f"revision {revision}: {message}"))
    run.status.message = f"revision {revision} blocked: KV pool too small"
    run.apply_pool_gate()  # (its event, if any, is in outcome.events already)
    return dataclasses.replace(outcome, status=status_patch(run.status), events=events, blocked_reason="KVPoolTooSmall")


_PHASES = {
    RolloutState.BLOCKED: Phase.BLOCKED,
    RolloutState.FAILED: Phase.DEGRADED,
    RolloutState.ROLLED_BACK: Phase.DEGRADED,
    RolloutState.STABLE: Phase.READY,
}
_CANARY_SUMMARY = {
    RolloutState.PLANNING: "Pending",
    RolloutState.CANARY_DEPLOYING: "Pending",
    RolloutState.CANARY_VERIFYING: "Running",
}


def _roll_out(
    run: _Run, spec: InferenceModelSpec, kv_plan: KVPlan, revision: str, gate: PolicyGate, *, plan_ok: bool, plan_message: str
) -> Outcome:
    """Feed the rollout state machine once and turn its decision into status, actions and events."""
    meta = run.body.get("metadata", {})
    stable = run.status.revision
    annotations = dict(meta.get("annotations") or {})
    pin = rollback_pin(run.previous.continuous, revision)
    if pin is not None and not annotations.get(ROLLBACK_ANNOTATION):  # a person's own rollback-to wins
        annotations[ROLLBACK_ANNOTATION] = pin  # the continuous canary's rollback, kept in status (continuous.py)
    world = World(
        target=revision, numerics=numerics_of(spec), now=run.now, plan_ok=plan_ok, plan_message=plan_message, policy=gate,
        revisions=dict(run.observed.revisions), serving=run.observed.serving,
        previous_stables=previous_stables(run.status.history, stable), annotations=annotations,
        worker_reports=run.observed.worker_reports, canary=run.observed.canary, canary_running=run.observed.canary_running,
        analysis=run.observed.analysis,
        gate_refusals=gate_refusals(run.observed.pools),
    )  # fmt: skip
    decision = step(spec, run.status.rollout, stable, world)
    previous = run.status.rollout
    run.status.rollout = decision.rollout
    _record_transition(run, decision, previous)
    for action in decision.of_type(SetCondition):
        run.set(action.type, action.status, action.reason, action.message)
    rollout = decision.rollout
    if rollout.state == RolloutState.STABLE:
        run.set(cond.DEGRADED, "False", "AsExpected", "")
    run.status.phase = _PHASES.get(rollout.state, Phase.PROGRESSING)
    if rollout.state == RolloutState.PAUSED and decision.stable:
        run.status.phase = Phase.READY
    run.status.message = rollout.message
    run.status.canary = _canary_summary(rollout, revision, decision.stable)
    _set_ready(run, decision.stable)
    workload = [a for a in decision.actions if not isinstance(a, SetCondition | RecordEvent | ScrapeMetrics | MeasureAnalysis)]
    events = [EventSpec(e.type, e.reason, e.message) for e in decision.of_type(RecordEvent)]
    scrape = next((a.revision for a in decision.of_type(ScrapeMetrics)), None)
    kept = [r for r in world.previous_stables[: spec.revision_history_limit] if r in run.observed.revisions]
    cont = continuous_step(spec.canary.continuous, run.previous.continuous, decision.stable,
                           rollout.state == RolloutState.STABLE and rollout.revision == decision.stable,
                           run.observed.continuous, run.observed.continuous_running, kept, run.now, revision)  # fmt: skip
    run.status.continuous = cont.status
    if cont.degraded is not None:
        run.set(cond.DEGRADED, "True", *cont.degraded)
    events += [EventSpec(e.type, e.reason, e.message) for e in cont.events]
    return run.outcome(
        actions=workload, spec=spec, revision=revision, scrape=scrape, events=events,
        measure=next(iter(decision.of_type(MeasureAnalysis)), None),
        requeue_after=_sooner(decision.requeue_after, cont.requeue_after), plan=kv_plan,
        deadline_in=_sooner(decision.deadline_in, cont.requeue_after),  # the next run is due then: wake by then
        continuous_start=cont.start, continuous_verdict=cont.recorded, continuous_stop=cont.stop,
    )  # fmt: skip


def gate_refusals(pools: Sequence[PodPool]) -> dict[str, tuple[str, ...]]:
    """revision -> the readiness gate's message for each of its pods kept out for too small a pool."""
    found: dict[str, list[str]] = {}
    for pool in pools:
        if pool.reason == "KVPoolTooSmall":
            found.setdefault(pool.revision, []).append(pool.message)
    return {rev: tuple(messages) for rev, messages in found.items()}


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _record_transition(run: _Run, decision: Decision, previous: RolloutStatus | None) -> None:
    """status.history: Candidate when a canary starts, Failed, Stable/Superseded on promotion."""
    rollout, old_stable = decision.rollout, run.status.revision
    previous_state = previous.state if previous is not None else None
    replaced = _supersede_replaced_candidate(run, rollout.revision or "", _served_traffic(previous))
    if decision.stable != old_stable and decision.stable is not None:
        run.status.revision = decision.stable
        if old_stable:
            run.record(old_stable, "Superseded", f"replaced by {decision.stable}")
        run.record(decision.stable, "Stable", None, None if rollout.rollback else run.status.kv_ratio)
    elif rollout.state == RolloutState.CANARY_DEPLOYING and (previous_state != RolloutState.CANARY_DEPLOYING or replaced):
        run.record(rollout.revision or "", "Candidate", None, run.status.kv_ratio)  # a canary starts
    elif rollout.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK) and previous_state not in (
        RolloutState.FAILED, RolloutState.ROLLED_BACK
    ):
        run.record(rollout.revision or "", "Failed", rollout.message)  # a no-op if recorded while paused (below)
    elif rollout.state == RolloutState.PAUSED and rollout.paused_from in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
        # Failed while paused (a watched step, rollout._watch_paused_step): history says so now, not
        # at a resume that a spec change may replace (a review: it read Superseded "before it served").
        run.record(rollout.revision or "", "Failed", rollout.paused_message)


def _served_traffic(rollout: RolloutStatus | None) -> bool:
    """A candidate that entered a traffic step (or was given a weight) served a share of it before
    it was replaced: Shifting is entered only with a step set, and a pause keeps it."""
    return rollout is not None and (rollout.step is not None or bool(rollout.weight))


def _supersede_replaced_candidate(run: _Run, revision: str, served: bool) -> bool:
    """A newer spec replaced the candidate before it was promoted -- with another candidate (the
    state may stay CanaryDeploying), a blocked one, or the stable revision again: the replaced one
    is Superseded, never left reading Candidate, and says whether it had served a share of traffic.
    True when one was. The newest entry of another revision is the one replaced: a blocked spec's
    own entry is recorded first (an outside probe: the candidate read Candidate for ever)."""
    head = next((h for h in run.status.history if h.revision != revision), None)
    if head is None or head.state != "Candidate":
        return False
    how = f"after serving a share of traffic, {NEVER_PROMOTED}" if served else NEVER_SERVED
    run.record(head.revision, "Superseded", f"replaced by {revision} {how}")
    return True


def _canary_summary(rollout: RolloutStatus, target: str, stable: str | None) -> str:
    """The printer column's word for the target revision's canary (as CanaryPassed says it)."""
    if rollout.revision not in (None, target) and not rollout.rollback:  # paused before the target's rollout
        return "Passed" if target == stable else "NotRun"  # (a review: the earlier revision's "Passed")
    if rollout.canary is not None:
        return {"pass": "Passed", "fail": "Failed"}.get(rollout.canary.verdict, "CannotRun")
    if rollout.rollback:
        return "Skipped"
    if rollout.state == RolloutState.STABLE:  # back at the stable after a superseded candidate: its canary passed
        return "Passed"
    if rollout.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
        return "NotRun"
    return _CANARY_SUMMARY.get(rollout.state, "NotRun")


def _set_ready(run: _Run, stable: str | None) -> None:
    if stable is None:
        run.set(cond.READY, "False", "NoStableRevision", "no revision has been promoted yet")
        return
    view = run.observed.revisions.get(stable)
    if view is None or not view.ready:
        waiting = ", ".join(view.waiting) if view is not None and view.waiting else "its workloads (not created)"
        run.set(cond.READY, "False", "WorkloadsNotReady", f"stable revision {stable}: waiting for {waiting}")
    else:
        run.set(cond.READY, "True", "StableRevisionServing", f"revision {stable} is serving")


# --- helpers -----------------------------------------------------------------------------------


def resolve_architecture(spec: InferenceModelSpec, observed: Observed) -> tuple[InferenceModelSpec, str | None]:
    """Fill spec.model.architecture from the ConfigMap's config.json when the spec asks for it."""
    ref = spec.model.architecture_config_map
    if spec.model.architecture is not None or ref is None:
        return spec, None
    where = f"spec.model.architectureConfigMap ({ref.name}/{ref.key})"
    if observed.architecture_config is None:
        return spec, f"{where}: {observed.architecture_config_error or 'not found'}"
    try:
        arch = architecture_from_hf_config(observed.architecture_config)
    except (HFConfigError, ValueError) as exc:
        return spec, f"{where}: {exc}"
    model = spec.model.model_copy(update={"architecture": arch})
    return spec.model_copy(update={"model": model}), None


def describe_pools(kv_plan: KVPlan) -> str:
    parts = [
        f"{name}: {r.pool_tokens:,} tokens = {ratio_text(r.pool_tokens, kv_plan.context_length)} context {kv_plan.context_length:,}"
        + ("" if r.sufficient else f" < {ratio_number(kv_plan.min_ratio)}x required")
        for name, r in kv_plan.roles.items()
    ]
    return "KV pool per instance: " + "; ".join(parts)


def describe_fixes(kv_plan: KVPlan) -> str:
    if not kv_plan.suggestions:
        return "No change found that passes; see status.plan"
    return "Suggested fixes (any one; each complete): " + "; ".join(change_summary(s) for s in kv_plan.suggestions)


def field_errors(exc: ValidationError) -> str:
    """pydantic errors as `spec.a.b[0].c: message` (wire names, as the user wrote them; a list
    index in brackets, as the API server and the CRD's rules write paths). Each message is worded
    as the command line words it: no pydantic "Value error, " prefix, no class names."""
    parts = []
    for err in exc.errors():
        path = field_path(err["loc"], root="spec")
        parts.append(f"{path}: {field_message(err)}")
    return "; ".join(parts)


def previous_status(raw: Any) -> InferenceModelStatus:
    """The status as last written; anything unreadable is dropped rather than crashing reconcile."""
    if not isinstance(raw, Mapping):
        return InferenceModelStatus()
    known = {f.alias or name for name, f in InferenceModelStatus.model_fields.items()}
    data = {k: v for k, v in raw.items() if k in known}
    try:
        return InferenceModelStatus.model_validate(data)
    except ValidationError:
        keep = {k: data[k] for k in ("revision", "targetRevision", "history") if k in data}
        try:
            return InferenceModelStatus.model_validate(keep)
        except ValidationError:
            return InferenceModelStatus()


def status_patch(status: InferenceModelStatus) -> dict[str, Any]:
    """A merge patch that sets every status field; None clears a field left from earlier. Inside
    lists a null is a value, not a deletion (RFC 7386), so unset fields of list items are left out."""
    return {k: _no_nulls_in_lists(v) for k, v in status.model_dump(mode="json", by_alias=True).items()}


def _no_nulls_in_lists(value: Any, in_list: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _no_nulls_in_lists(v, in_list) for k, v in value.items() if not (in_list and v is None)}
    if isinstance(value, list):
        return [_no_nulls_in_lists(v, True) for v in value]
    return value


def status_differs(desired: Any, live: Any) -> bool:
    """Would writing `desired` (a merge patch: None = absent) change the stored status `live`?
    False means no write is needed: an idle model costs the API server nothing."""
    if isinstance(desired, Mapping):
        live = live if isinstance(live, Mapping) else {}
        keys = set(desired) | set(live)
        return any(status_differs(desired.get(k), live.get(k)) for k in keys if k in desired)
    if isinstance(desired, list):
        return not isinstance(live, list) or len(desired) != len(live) or any(map(status_differs, desired, live))
    if desired is None:
        return live is not None
    return bool(desired != live)
