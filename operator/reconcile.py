"""One idempotent, level-based reconcile of an InferenceModel: (spec, observed) -> desired.

Create, update, resume, the timer and child events all call `reconcile`; it looks only at the
resource and what exists, never at what triggered it, so running it twice changes nothing.

    parse spec -> resolve architecture -> revision -> plan (S7 gate) -> render check
      -> `rollout.step` (canary-gated state machine) -> status + workload actions for a backend
      blocked plan:  KVPoolSufficient=False (numbers + fixes), Warning event, nothing of the stable
      revision changes (S8); an unfinished canary of an older spec is removed

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
    KVPlan,
    Phase,
    RevisionRecord,
)
from kvguard.operator.engine_support import engine_problems
from kvguard.operator.hf_config import HFConfigError, architecture_from_hf_config
from kvguard.operator.planner import PlanInputError, plan
from kvguard.operator.render import (
    LABEL_MODEL,
    LABEL_REVISION,
    LABEL_ROLE,
    ROLES,
    SCALE_ANNOTATION,
    Owner,
    RenderError,
    object_name,
    render_revision,
)
from kvguard.operator.revision import numerics_of, revision_of
from kvguard.operator.rollout import (
    Action,
    CanaryResult,
    Decision,
    PolicyGate,
    RecordEvent,
    RevisionView,
    RolloutState,
    RolloutStatus,
    Scale,
    ScrapeMetrics,
    SetCondition,
    WorkerReport,
    World,
    previous_stables,
    step,
)

HISTORY_LIMIT = 10
FAULTS_ANNOTATION = "kvguard.io/faults"
"""Test clusters only: KVGUARD_FAULTS for the spec's revision, honoured when the operator runs with
KVGUARD_ALLOW_FAULT_INJECTION=true (manifests/testing/fault-injection); ignored otherwise."""


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploymentState:
    """What reconcile needs to know about one owned Deployment."""

    name: str
    revision: str
    role: str
    desired: int
    ready: int
    scale: Scale = "full"

    @property
    def is_ready(self) -> bool:
        return self.ready >= self.desired


@dataclass(frozen=True)
class Observed:
    """The world as read by the I/O layer just before reconcile."""

    deployments: Sequence[DeploymentState] = ()
    revisions_present: frozenset[str] = frozenset()
    """Revisions that own at least one child object (Deployment, Service, NetworkPolicy)."""
    architecture_config: Mapping[str, Any] | None = None
    """The config.json from spec.model.architectureConfigMap, when the spec names one."""
    architecture_config_error: str | None = None
    """Why that config.json could not be read (missing ConfigMap or key, bad JSON)."""
    serving: str | None = None
    """The revision the model's Service selects (None: no Service yet)."""
    policy: PolicyGate = PolicyGate()
    """The InferencePolicy verdict on the spec (no policy: compliant)."""
    worker_reports: tuple[WorkerReport, ...] | None = None
    """A fresh scrape of the candidate's workers, when the previous pass asked for one."""
    canary: CanaryResult | None = None
    """The last finished canary run of this model held in memory by the operator."""
    canary_running: bool = False
    """A canary run for the candidate's current attempt is in progress."""
    fault_injection_allowed: bool = False
    """The operator runs with KVGUARD_ALLOW_FAULT_INJECTION=true (test clusters only)."""


def owned_by(obj: Mapping[str, Any], model: str, uid: str | None) -> bool:
    """Filter in code: kmock ignores label selectors, and we must never touch foreign objects."""
    meta = obj.get("metadata", {})
    if (meta.get("labels") or {}).get(LABEL_MODEL) != model:
        return False
    refs = meta.get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


def revision_views(deployments: Sequence[DeploymentState]) -> dict[str, RevisionView]:
    """Per revision: ready (all three roles at their non-zero replicas), parked at zero, workers."""
    by_revision: dict[str, list[DeploymentState]] = {}
    for d in deployments:
        by_revision.setdefault(d.revision, []).append(d)
    views = {}
    for revision, states in by_revision.items():
        roles = {d.role: d for d in states}
        waiting = tuple(f"{r} {roles[r].ready}/{roles[r].desired} ready" if r in roles else f"{r} (not created)"
                        for r in ROLES if r not in roles or not roles[r].is_ready or roles[r].desired == 0)  # fmt: skip
        views[revision] = RevisionView(
            ready=not waiting, scaled_to_zero=all(d.desired == 0 for d in states),
            worker_replicas=sum(d.desired for d in states if d.role in ("prefill", "decode")), waiting=waiting,
            scale="canary" if any(d.scale == "canary" for d in states) else "full",
        )  # fmt: skip
    return views


def deployment_state(obj: Mapping[str, Any]) -> DeploymentState:
    meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status") or {}
    labels = meta.get("labels") or {}
    return DeploymentState(
        name=meta.get("name", ""),
        revision=labels.get(LABEL_REVISION, ""),
        role=labels.get(LABEL_ROLE, ""),
        desired=int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1),
        ready=int(status.get("readyReplicas") or 0),
        scale="canary" if (meta.get("annotations") or {}).get(SCALE_ANNOTATION) == "canary" else "full",
    )


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
    scrape: str | None = None
    """Revision whose workers must be scraped, then reconcile run again with the reports."""
    faults: str = ""
    """Test-only KVGUARD_FAULTS for the spec's revision (only with fault injection allowed)."""
    events: list[EventSpec] = field(default_factory=list)
    requeue_after: float | None = None
    plan: KVPlan | None = None
    blocked_reason: str | None = None


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
            revision=revision, state=state, since=cond.rfc3339(self.now),  # type: ignore[arg-type]
            generation=self.generation, kv_ratio=kv_ratio, message=message,
        )  # fmt: skip
        rest = [h for h in self.status.history if not (h.revision == revision and h.state in ("Candidate", "Blocked"))]
        self.status.history = [entry, *rest][:HISTORY_LIMIT]
        return True

    def outcome(self, **kwargs: Any) -> Outcome:
        return Outcome(status=status_patch(self.status), **kwargs)


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
    spec, problem = resolve_architecture(spec, observed)
    if problem is not None:
        return _invalid(run, "ArchitectureUnavailable", problem)
    unsupported = engine_problems(spec)
    if unsupported:  # the engine would run something else than the plan says: never deploy it
        return _invalid(run, "InvalidSpec", "; ".join(unsupported))
    try:
        kv_plan = plan(spec)
    except PlanInputError as exc:
        return _invalid(run, "InvalidPlanInput", str(exc))
    faults, fault_problem = injected_faults(meta.get("annotations") or {}, run.observed.fault_injection_allowed)
    if fault_problem is not None:
        return _invalid(run, "InvalidFaults", fault_problem)
    revision = revision_of(spec, faults)
    run.status.plan = kv_plan
    run.status.target_revision = revision
    run.status.kv_ratio = min((r.ratio for r in kv_plan.roles.values()), default=None)
    owner = Owner(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta["uid"])
    if kv_plan.verdict == "blocked":
        return _blocked(run, spec, kv_plan, revision)
    run.set(cond.KV_POOL_SUFFICIENT, "True", "KVPoolSufficient", describe_pools(kv_plan))
    try:
        render_revision(spec, kv_plan, owner, revision)  # a spec its engine cannot run never deploys
    except RenderError as exc:
        return _invalid(run, "InvalidSpec", str(exc))
    outcome = _roll_out(run, spec, kv_plan, revision, plan_ok=True, plan_message="")
    return dataclasses.replace(outcome, faults=faults, events=_fault_events(run, faults, meta) + outcome.events)


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


def _invalid(run: _Run, reason: str, message: str) -> Outcome:
    """A spec the operator cannot act on: say why, keep everything running as it is (S8)."""
    run.status.phase = Phase.DEGRADED
    run.status.message = message
    run.set(cond.DEGRADED, "True", reason, message)
    run.set(cond.KV_POOL_SUFFICIENT, "Unknown", reason, "the spec could not be planned: " + message)
    run.set(cond.PROGRESSING, "False", reason, "rollout halted until the spec is fixed")
    _set_ready(run, run.status.revision)
    previous_degraded = cond.find_condition(run.previous.conditions, cond.DEGRADED)
    repeated = previous_degraded is not None and previous_degraded.status == "True" and previous_degraded.message == message
    events = [] if repeated else [EventSpec("Warning", reason, message)]
    return run.outcome(events=events, blocked_reason=reason, requeue_after=None)


def _blocked(run: _Run, spec: InferenceModelSpec, kv_plan: KVPlan, revision: str) -> Outcome:
    """S7 gate: the plan says a pool is below minKVRatio x contextLength. The stable revision is
    not touched (S8); the rollout machine removes an unfinished canary of an older spec."""
    message = describe_pools(kv_plan) + ". " + describe_fixes(kv_plan)
    run.set(cond.KV_POOL_SUFFICIENT, "False", "KVPoolTooSmall", message)
    new = run.record(revision, "Blocked", message, run.status.kv_ratio)
    outcome = _roll_out(run, spec, kv_plan, revision, plan_ok=False, plan_message=message)
    events = [e for e in outcome.events if e.reason != "KVPoolTooSmall"]
    if new:
        events.insert(0, EventSpec("Warning", "KVPoolTooSmall", f"revision {revision}: {message}"))
    run.status.message = f"revision {revision} blocked: KV pool too small"
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


def _roll_out(run: _Run, spec: InferenceModelSpec, kv_plan: KVPlan, revision: str, *, plan_ok: bool, plan_message: str) -> Outcome:
    """Feed the rollout state machine and turn its decision into status, actions and events."""
    meta = run.body.get("metadata", {})
    stable = run.status.revision
    world = World(
        target=revision, numerics=numerics_of(spec), now=run.now, plan_ok=plan_ok, plan_message=plan_message, policy=run.observed.policy,
        revisions=revision_views(run.observed.deployments) | {r: RevisionView() for r in run.observed.revisions_present
                                                              if r not in {d.revision for d in run.observed.deployments}},
        serving=run.observed.serving, previous_stables=previous_stables(run.status.history, stable),
        annotations=meta.get("annotations") or {}, worker_reports=run.observed.worker_reports,
        canary=run.observed.canary, canary_running=run.observed.canary_running,
    )  # fmt: skip
    decision = step(spec, run.status.rollout, stable, world)
    previous_state = run.status.rollout.state if run.status.rollout else None
    run.status.rollout = decision.rollout
    _record_transition(run, decision, previous_state)
    for action in decision.of_type(SetCondition):
        run.set(action.type, action.status, action.reason, action.message)
    rollout = decision.rollout
    if rollout.state == RolloutState.STABLE:
        run.set(cond.DEGRADED, "False", "AsExpected", "")
    run.status.phase = _PHASES.get(rollout.state, Phase.PROGRESSING)
    if rollout.state == RolloutState.PAUSED and decision.stable:
        run.status.phase = Phase.READY
    run.status.message = rollout.message
    run.status.canary = _canary_summary(rollout)
    _set_ready(run, decision.stable)
    workload = [a for a in decision.actions if not isinstance(a, SetCondition | RecordEvent | ScrapeMetrics)]
    events = [EventSpec(e.type, e.reason, e.message) for e in decision.of_type(RecordEvent)]
    scrape = next((a.revision for a in decision.of_type(ScrapeMetrics)), None)
    return run.outcome(
        actions=workload, spec=spec, revision=revision, scrape=scrape, events=events,
        requeue_after=decision.requeue_after, plan=kv_plan,
    )  # fmt: skip


def _record_transition(run: _Run, decision: Decision, previous_state: RolloutState | None) -> None:
    """status.history: Candidate when a canary starts, Failed, Stable/Superseded on promotion."""
    rollout, old_stable = decision.rollout, run.status.revision
    if decision.stable != old_stable and decision.stable is not None:
        run.status.revision = decision.stable
        if old_stable:
            run.record(old_stable, "Superseded", f"replaced by {decision.stable}")
        run.record(decision.stable, "Stable", None, None if rollout.rollback else run.status.kv_ratio)
    elif rollout.state == RolloutState.CANARY_DEPLOYING and previous_state != RolloutState.CANARY_DEPLOYING:
        run.record(rollout.revision or "", "Candidate", None, run.status.kv_ratio)
    elif rollout.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK) and previous_state not in (
        RolloutState.FAILED, RolloutState.ROLLED_BACK
    ):
        run.record(rollout.revision or "", "Failed", rollout.message)


def _canary_summary(rollout: RolloutStatus) -> str:
    if rollout.canary is not None:
        return {"pass": "Passed", "fail": "Failed"}.get(rollout.canary.verdict, "CannotRun")
    if rollout.rollback:
        return "Skipped"
    if rollout.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
        return "NotRun"
    return _CANARY_SUMMARY.get(rollout.state, "NotRun")


def _set_ready(run: _Run, stable: str | None) -> None:
    if stable is None:
        run.set(cond.READY, "False", "NoStableRevision", "no revision has been promoted yet")
        return
    waiting = not_ready_roles(run.observed, run.body["metadata"]["name"], stable)
    if waiting:
        run.set(cond.READY, "False", "WorkloadsNotReady", f"stable revision {stable}: waiting for " + ", ".join(waiting))
    else:
        run.set(cond.READY, "True", "StableRevisionServing", f"revision {stable} is serving")


def not_ready_roles(observed: Observed, model: str, revision: str) -> list[str]:
    """`role ready/desired` for every role of `revision` whose Deployment is missing or short."""
    by_name = {d.name: d for d in observed.deployments}
    waiting = []
    for role in ROLES:
        state = by_name.get(object_name(model, revision, role))
        if state is None:
            waiting.append(f"{role} (not created)")
        elif not state.is_ready:
            waiting.append(f"{role} {state.ready}/{state.desired} ready")
    return waiting


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
        f"{name}: {r.pool_tokens:,} tokens = {r.ratio:.2f}x context {kv_plan.context_length:,}"
        + ("" if r.sufficient else f" < {kv_plan.min_ratio:g}x required")
        for name, r in kv_plan.roles.items()
    ]
    return "KV pool per instance: " + "; ".join(parts)


def describe_fixes(kv_plan: KVPlan) -> str:
    if not kv_plan.suggestions:
        return "No single change found; see status.plan"
    fixes = [f"{s.field}={s.value}" + (f" ({s.role})" if s.role else "") for s in kv_plan.suggestions]
    return "Suggested fixes (any one): " + "; ".join(fixes)


def field_errors(exc: ValidationError) -> str:
    """pydantic errors as `spec.a.b: message` (wire names, as the user wrote them)."""
    parts = []
    for err in exc.errors():
        path = ".".join(str(p) for p in ("spec", *err["loc"]))
        parts.append(f"{path}: {err['msg']}")
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
    """A merge patch that sets every status field; None clears a field left from earlier."""
    return status.model_dump(mode="json", by_alias=True)
