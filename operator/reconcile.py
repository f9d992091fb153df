"""One idempotent, level-based reconcile of an InferenceModel: (spec, observed) -> desired.

Create, update, resume, the timer and child events all call `reconcile`; it looks only at the
resource and what exists, never at what triggered it, so running it twice changes nothing.

    parse spec -> resolve architecture -> revision -> plan (S7 gate) -> render -> readiness
      blocked plan:  KVPoolSufficient=False (numbers + fixes), Warning event, NOTHING applied (S8)
      candidate ready -> `on_revision_ready` -> Promote (this issue) | the canary gate (next issue)
      promoted: the model Service routes to it, older revisions are deleted

Pure: no kopf, no kubernetes client, no clock, no randomness (time and key are arguments).
"""

from __future__ import annotations

import datetime as dt
import enum
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
from kvguard.operator.hf_config import HFConfigError, architecture_from_hf_config
from kvguard.operator.planner import PlanInputError, plan
from kvguard.operator.render import (
    LABEL_MODEL,
    LABEL_REVISION,
    LABEL_ROLE,
    ROLES,
    Manifest,
    Owner,
    RenderError,
    object_name,
    render_model_service,
    render_revision,
    render_transfer_secret,
    revision_object_refs,
)
from kvguard.operator.revision import revision_of

HISTORY_LIMIT = 10
PROGRESS_REQUEUE_SECONDS = 10.0


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploymentState:
    """What reconcile needs to know about one owned Deployment."""

    name: str
    revision: str
    role: str
    desired: int
    ready: int

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


def owned_by(obj: Mapping[str, Any], model: str, uid: str | None) -> bool:
    """Filter in code: kmock ignores label selectors, and we must never touch foreign objects."""
    meta = obj.get("metadata", {})
    if (meta.get("labels") or {}).get(LABEL_MODEL) != model:
        return False
    refs = meta.get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


def deployment_state(obj: Mapping[str, Any]) -> DeploymentState:
    meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status") or {}
    labels = meta.get("labels") or {}
    return DeploymentState(
        name=meta.get("name", ""),
        revision=labels.get(LABEL_REVISION, ""),
        role=labels.get(LABEL_ROLE, ""),
        desired=int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1),
        ready=int(status.get("readyReplicas") or 0),
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
    apply: list[Manifest] = field(default_factory=list)
    """Create, or merge-patch when the live object differs."""
    create_only: list[Manifest] = field(default_factory=list)
    """Create when missing, never patch (the KV-transfer Secret)."""
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) in the model's namespace."""
    events: list[EventSpec] = field(default_factory=list)
    requeue_after: float | None = None
    plan: KVPlan | None = None
    blocked_reason: str | None = None


class RolloutDecision(enum.Enum):
    """What to do with a candidate revision whose workloads are all ready."""

    PROMOTE = "Promote"
    HOLD = "Hold"


def on_revision_ready(spec: InferenceModelSpec, status: InferenceModelStatus, revision: str) -> RolloutDecision:
    """The seam for the rollout gate. This issue promotes a ready revision at once; the next one
    runs the canary suite here (CanaryPassed) and checks InferencePolicy (PolicyCompliant) before
    answering PROMOTE, and returns HOLD while the canary runs (S7)."""
    return RolloutDecision.PROMOTE


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


def reconcile(body: Mapping[str, Any], observed: Observed, *, now: dt.datetime, transfer_key: bytes) -> Outcome:
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
    try:
        kv_plan = plan(spec)
    except PlanInputError as exc:
        return _invalid(run, "InvalidPlanInput", str(exc))
    revision = revision_of(spec)
    run.status.plan = kv_plan
    run.status.target_revision = revision
    run.status.kv_ratio = min((r.ratio for r in kv_plan.roles.values()), default=None)
    owner = Owner(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta["uid"])
    if kv_plan.verdict == "blocked":
        return _blocked(run, kv_plan, revision)
    run.set(cond.KV_POOL_SUFFICIENT, "True", "KVPoolSufficient", describe_pools(kv_plan))
    try:
        desired = render_revision(spec, kv_plan, owner, revision)
    except RenderError as exc:
        return _invalid(run, "InvalidSpec", str(exc))
    return _roll_out(run, spec, kv_plan, owner, revision, desired, transfer_key)


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
    return run.outcome(events=events, blocked_reason=reason)


def _blocked(run: _Run, kv_plan: KVPlan, revision: str) -> Outcome:
    """S7 gate: the plan says a pool is below minKVRatio x contextLength. Nothing running changes."""
    message = describe_pools(kv_plan) + ". " + describe_fixes(kv_plan)
    run.status.phase = Phase.BLOCKED
    run.status.message = f"revision {revision} blocked: KV pool too small"
    run.set(cond.KV_POOL_SUFFICIENT, "False", "KVPoolTooSmall", message)
    run.set(cond.PROGRESSING, "False", "KVPoolTooSmall", f"revision {revision} is not rolled out")
    run.set(cond.DEGRADED, "False", "AsExpected", "the operator is working; the spec is blocked by the planner")
    _set_ready(run, run.status.revision)
    new = run.record(revision, "Blocked", message, run.status.kv_ratio)
    events = [EventSpec("Warning", "KVPoolTooSmall", f"revision {revision}: {message}")] if new else []
    return run.outcome(events=events, plan=kv_plan, blocked_reason="KVPoolTooSmall")


def _roll_out(
    run: _Run,
    spec: InferenceModelSpec,
    kv_plan: KVPlan,
    owner: Owner,
    revision: str,
    desired: list[Manifest],
    transfer_key: bytes,
) -> Outcome:
    run.set(cond.DEGRADED, "False", "AsExpected", "")
    apply, events = list(desired), []
    stable = run.status.revision
    waiting = not_ready_roles(run.observed, owner.name, revision)
    if revision != stable:
        if run.record(revision, "Candidate", None, run.status.kv_ratio):
            events.append(EventSpec("Normal", "RevisionCreated", f"rolling out revision {revision}"))
        if not waiting and on_revision_ready(spec, run.status, revision) is RolloutDecision.PROMOTE:
            _promote(run, revision, stable)
            events.append(EventSpec("Normal", "RevisionPromoted", f"revision {revision} is serving"))
            stable = revision
    if stable is not None:
        apply.append(render_model_service(owner, stable))
    keep = {revision} | ({stable} if stable else set())
    delete = [ref for old in sorted(run.observed.revisions_present - keep) for ref in revision_object_refs(owner.name, old)]
    run.status.canary = "NotRun"  # the canary gate lands with the rollout state machine
    if revision == stable and not waiting:
        run.status.phase, run.status.message = Phase.READY, f"revision {revision} is serving"
        run.set(cond.PROGRESSING, "False", "RolloutComplete", f"revision {revision} is serving")
    else:
        run.status.phase = Phase.PROGRESSING
        run.status.message = f"revision {revision}: waiting for " + ", ".join(waiting) if waiting else f"revision {revision}: gating"
        run.set(cond.PROGRESSING, "True", "RevisionRollingOut", run.status.message)
    _set_ready(run, stable)
    requeue = None if run.status.phase is Phase.READY else PROGRESS_REQUEUE_SECONDS
    secret = render_transfer_secret(owner, revision, transfer_key)
    return run.outcome(apply=apply, create_only=[secret], delete=delete, events=events, requeue_after=requeue, plan=kv_plan)


def _promote(run: _Run, revision: str, previous_stable: str | None) -> None:
    run.status.revision = revision
    if previous_stable:
        run.record(previous_stable, "Superseded", f"replaced by {revision}")
    run.record(revision, "Stable", None, run.status.kv_ratio)


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
