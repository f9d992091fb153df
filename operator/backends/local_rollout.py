"""Drive one rollout on the local backend to a resting state, with the operator's own driver.

`kvguard apply --local` is the operator on one machine: the same `driver.observe` and
`driver.run_pass` (so the same `reconcile`, the same status, conditions and history) with the
state folder as the API server (`LocalModelStore`: the InferenceModel's status lives in
state.json, written under a version counter exactly as the operator writes conditionally on
resourceVersion) and local processes as the workloads. Every decision is saved before it is acted
on, so a driver killed anywhere is resumed by the next `roll_out` on the same folder from the
recorded `status.rollout` (S8). The loop looks again until the rollout rests (Stable, RolledBack,
Blocked or Paused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvguard.operator.api import GROUP_VERSION, InferenceModelSpec, InferenceModelStatus, InferencePolicy, KVPlan, TrafficRouter
from kvguard.operator.backends.base import CanaryRunner
from kvguard.operator.backends.local import (
    LocalBackend,
    LocalBackendError,
    LocalWorker,
    healthy,
    instances,
    model_dir_for,
    runnable_problems,
)
from kvguard.operator.backends.local_gate import LocalPoolGate
from kvguard.operator.backends.local_progress import WaitReporter
from kvguard.operator.canary.report import CanaryReport
from kvguard.operator.canary.suite import ProgressEvent, run_suite
from kvguard.operator.conditions import Condition, ConditionStatus, find_condition, make_condition, set_condition
from kvguard.operator.driver import DriverMemory, StatusConflict, observe, run_pass
from kvguard.operator.hf_config import HFConfigError, architecture_from_file
from kvguard.operator.planner import plan
from kvguard.operator.pool_gate import MAX_UNREADABLE_ATTEMPTS, kept_out
from kvguard.operator.reconcile import FAULTS_ANNOTATION, SPEC_DEGRADED_REASONS, EventSpec, Observed, roles_out_of_rotation
from kvguard.operator.revision import revision_of
from kvguard.operator.rollout import RecordEvent, RolloutState, canary_run_key

POLL_SECONDS = 0.3
ENGINE_ROLES = ("prefill", "decode")
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
    resized: dict[str, tuple[int, int]] = field(default_factory=dict)
    """role -> (processes before, after) when this run resized the serving revision in place."""
    front_door_problem: str | None = None
    """Why the serving URL does not answer (the splitter is down or its port taken), else None."""

    @property
    def promoted(self) -> bool:
        return self.state == RolloutState.STABLE and self.stable == self.revision

    @property
    def roles_out_of_rotation(self) -> list[str]:
        """Roles of the spec's revision with no worker in rotation: it is promoted but answers 503
        (S7 keeps its only worker of a role out, say). Not "serves", for `kvguard apply`'s exit."""
        return roles_out_of_rotation(self.status.pools, self.revision) if self.promoted else []


def _drop_nones(value: Any) -> Any:
    """What a JSON merge patch leaves stored: a None removes the key (as on the API server)."""
    if isinstance(value, Mapping):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


class LocalModelStore:
    """The InferenceModel of a state folder, as the driver's ModelStore (`driver.ModelStore`)."""

    def __init__(self, backend: LocalBackend, name: str, namespace: str, spec: InferenceModelSpec,
                 annotations: Mapping[str, str], generation: int | None, say: Say) -> None:  # fmt: skip
        self.backend, self.say = backend, say
        self._spec = spec.to_wire()
        state = backend.state
        if state.spec != self._spec or not state.generation:  # what the API server does on a spec change
            state.spec, state.generation = self._spec, state.generation + 1
            backend.save()
        self._meta = {"name": name, "namespace": namespace, "uid": backend.model_uid(), "annotations": dict(annotations),
                      "generation": generation if generation is not None else state.generation}  # fmt: skip
        self.events: list[RecordEvent] = []

    def body(self) -> dict[str, Any]:
        meta = {**self._meta, "resourceVersion": str(self.backend.state.status_version)}
        return {"apiVersion": GROUP_VERSION, "kind": "InferenceModel", "metadata": meta, "spec": self._spec,
                "status": self.backend.state.status}  # fmt: skip

    async def write_status(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> Mapping[str, Any]:
        if body["metadata"].get("resourceVersion") != str(self.backend.state.status_version):
            raise StatusConflict("the state folder's status moved on")
        self.backend.state.status = _drop_nones(status)
        self.backend.state.status_version += 1
        self.backend.save()
        return self.body()

    async def reread(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return self.body()

    async def record_event(self, body: Mapping[str, Any], event: EventSpec, now: dt.datetime) -> None:
        self.events.append(RecordEvent(event.type, event.reason, event.message))  # type: ignore[arg-type]
        self.say(f"[{event.type}] {event.reason}: {event.message}")


def _check_runnable(backend: LocalBackend, spec: InferenceModelSpec, kv_plan: KVPlan) -> None:
    """Refuse what cannot run here before anything is recorded or started."""
    if kv_plan.verdict != "pass":
        return  # blocked: recorded as such, nothing starts
    problems = runnable_problems(spec)
    if problems:
        raise LocalBackendError("; ".join(problems))
    model_dir = model_dir_for(spec, backend.models_root)
    if not (model_dir / "config.json").is_file():
        raise LocalBackendError(f"spec.model.source.pvc.path: {model_dir} has no config.json")
    try:  # the model's own limit (the spec need not state it): else every worker dies at start, for ever
        limit = architecture_from_file(model_dir).max_position_embeddings
    except HFConfigError as exc:
        raise LocalBackendError(f"spec.model.source.pvc.path: {model_dir}: {exc}") from None
    if limit is not None and spec.context_length > limit:
        raise LocalBackendError(f"spec.contextLength: {spec.context_length:,} exceeds the model's maximum {limit:,} "
                                f"(max_position_embeddings in {model_dir / 'config.json'})")  # fmt: skip


def replica_change(backend: LocalBackend, revision: str, spec: InferenceModelSpec) -> dict[str, tuple[int, int]]:
    """role -> (running, wanted) engine processes when `spec` changes the replicas of `revision`
    while it serves; empty otherwise. Replicas are not part of the revision hash: the running
    revision is resized in place, as a Deployment is scaled."""
    record = backend.state.revisions.get(revision)
    if record is None or record.scaled_to_zero or backend.state.serving != revision:
        return {}
    running = {role: sum(1 for w in record.workers if w.role == role) for role in ENGINE_ROLES}
    wanted = {role: instances(spec, role, record.scale) for role in ENGINE_ROLES}
    return {role: (running[role], wanted[role]) for role in ENGINE_ROLES if running[role] != wanted[role]}


def describe_change(change: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{role} {before} -> {after}" for role, (before, after) in change.items())


def unsettled(observed: Observed, status: InferenceModelStatus, spec: InferenceModelSpec) -> str | None:
    """What the serving revision of the spec still waits for after an in-place change (a resize,
    a worker restarted): None once it runs every process the spec asks for, all ready."""
    revision = status.revision
    if revision is None or revision != status.target_revision:
        return None  # pinned to another revision (rollback-to), or nothing serves
    view = observed.revisions.get(revision)
    wanted = sum(instances(spec, role) for role in ENGINE_ROLES)
    if view is not None and view.worker_replicas == wanted and (view.ready or _kept_out(observed, revision)):
        # Every process runs. One that S7 keeps out (its pool too small) stays out until its pool
        # changes: waiting for the router to be ready would never end; Degraded names it.
        return None
    waiting = ", ".join(view.waiting) if view is not None and view.waiting else f"{wanted} worker process(es) to start"
    return f"revision {revision}: waiting for {waiting}"


def _kept_out(observed: Observed, revision: str) -> bool:
    return any(p.revision == revision for p in kept_out(observed.pools))


def unjudged(observed: Observed, status: InferenceModelStatus) -> str | None:
    """Which of the spec's serving revision's workers still wait for the gate's verdict on their
    pool (S7): a rollout rests only once each is verified or kept out, so the status it leaves names
    every worker kept out (Degraded), as the operator's does once its gate has judged the pods."""
    revision = status.revision
    if revision is None or revision != status.target_revision:
        return None  # pinned to another revision (rollback-to), or nothing serves: as `unsettled`
    pending = [p.pod for p in observed.pools if p.revision == revision and (p.reason == "Verifying"
               or (p.reason == "KVPoolUnreadable" and p.unreadable_scrapes < MAX_UNREADABLE_ATTEMPTS))]  # fmt: skip
    return f"revision {revision}: waiting for the KV pool of {', '.join(pending)} to be verified" if pending else None


def progressing(status: InferenceModelStatus) -> tuple[str, str] | None:
    """(reason, message) of the Progressing condition while it is True: what the rollout waits for."""
    condition = next((c for c in status.conditions if c.type == "Progressing"), None)
    if condition is None or condition.status != "True":
        return None
    return condition.reason, condition.message or condition.reason


def _say_what_is_for_a_cluster(spec: InferenceModelSpec, say: Say) -> None:
    """Spec fields that mean something only on a cluster: said once, then ignored."""
    if spec.roles.router.replicas > 1:
        say(f"spec.roles.router.replicas: {spec.roles.router.replicas} is for a cluster; locally each revision runs one "
            "router process (it holds no state a second one would share)")  # fmt: skip
    if spec.canary.continuous.interval_seconds is not None:
        say(f"spec.canary.continuous: every {spec.canary.continuous.interval_seconds} s is for a cluster, where the operator "
            "runs it; `kvguard apply --local` exits once the rollout rests, so nothing runs it here (not recorded in the "
            "status either; run `kvguard canary --url` against the serving URL instead)")  # fmt: skip
    if spec.rollout.traffic_router is not TrafficRouter.SERVICE:
        say(f"trafficRouter {spec.rollout.traffic_router.value}: locally the splitter in front of the revisions' routers "
            "carries the steps' weights (spec.rollout.gateway is for a cluster's Gateway and is not used here)")  # fmt: skip


def _without_continuous_canary(spec: InferenceModelSpec) -> InferenceModelSpec:
    """The spec as the local driver runs it: no continuous canary (its schedule in the status would
    say a guard is active that nothing runs: an outside probe). Not part of the revision."""
    if spec.canary.continuous.interval_seconds is None:
        return spec
    canary = spec.canary.model_copy(update={"continuous": spec.canary.continuous.model_copy(update={"interval_seconds": None})})
    return spec.model_copy(update={"canary": canary})


def _in_place_resize(backend: LocalBackend, spec: InferenceModelSpec, faults: str, say: Say) -> dict[str, tuple[int, int]]:
    """The serving revision's replica changes this spec asks for (role -> (before, after)), said;
    raises LocalBackendError if one would leave it without a role's workers."""
    resize = replica_change(backend, revision_of(spec, faults), spec)
    if emptied := [role for role, (_, after) in resize.items() if after == 0]:
        # What a new revision without them is refused for (NoWorkers), refused in place too: the
        # serving revision's router cannot run without a prefill and a decode worker.
        fields = ", ".join(f"spec.roles.{role}.replicas" for role in emptied)
        raise LocalBackendError(f"{fields}: 0 would leave the serving revision {backend.state.serving} without "
                                f"{' and '.join(emptied)} workers; it keeps serving as it is (scale it up, or `kvguard apply --delete`)")  # fmt: skip
    if resize:
        say(f"revision {backend.state.serving} serves; spec replicas changed ({describe_change(resize)}): resizing it in "
            "place, as a Deployment scales (running workers keep their processes; a router with the new worker list "
            "takes the traffic once it is ready, and the old one finishes what it holds)")  # fmt: skip
    return resize


def _with_faults(annotations: Mapping[str, str] | None, faults: str) -> dict[str, str]:
    """The model's annotations, the fault annotation replaced by `faults` when given."""
    wanted = {k: v for k, v in (annotations or {}).items() if k != FAULTS_ANNOTATION or not faults}
    if faults:
        wanted[FAULTS_ANNOTATION] = faults
    return wanted


def mark_interrupted(backend: LocalBackend, why: str = "was interrupted") -> None:
    """What the status says once `kvguard apply` was interrupted mid-rollout: nothing drives it
    any more, so a Progressing (or CanaryPassed) condition left True / Unknown by the last pass
    says so. It said "CanaryRunning: canary suite running" with Progressing True after Ctrl-C,
    with no canary running (an outside probe). The next apply resumes and writes its own."""
    status = dict(backend.state.status or {})
    conditions = [Condition.model_validate(c) for c in status.get("conditions") or ()]
    now = dt.datetime.now(dt.UTC)
    changed = False
    stops: tuple[tuple[str, ConditionStatus, ConditionStatus], ...] = (
        ("Progressing", "True", "False"), ("CanaryPassed", "Unknown", "Unknown"))  # type, unfinished, now
    for type_, unfinished, status_now in stops:
        current = find_condition(conditions, type_)
        if current is None or current.status != unfinished or current.reason == "Interrupted":
            continue
        message = f"kvguard apply {why} ({current.reason}: {current.message}); run it again to resume"
        conditions = set_condition(conditions, make_condition(type_, status_now, "Interrupted", message, now=now,
                                                              generation=current.observed_generation))  # fmt: skip
        changed = True
    if changed:
        status["conditions"] = [c.model_dump(by_alias=True, exclude_none=True) for c in conditions]
        # The phase stays: it is where the rollout stopped. The message, which `kvguard status`
        # prints under it, says that nothing drives it (a review: it still said the suite ran).
        stopped_at = f" ({status['message']})" if status.get("message") else ""
        status["message"] = f"kvguard apply {why}{stopped_at}; run it again to resume"
        backend.state.status = status
        backend.state.status_version += 1
        backend.save()


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
    LocalBackendError, or TimeoutError after `max_seconds`. `faults` (test/demo only) is the
    operator's fault annotation on a cluster that allows fault injection."""
    reporter = WaitReporter(say or (lambda _line: None))
    say = reporter.tell  # every line counts as a sign of life for the wait lines
    kv_plan = plan(spec)
    _check_runnable(backend, spec, kv_plan)
    backend.claim(name, namespace)
    _say_what_is_for_a_cluster(spec, say)
    spec = _without_continuous_canary(spec)
    resize = _in_place_resize(backend, spec, faults, say)
    store = LocalModelStore(backend, name, namespace, spec, _with_faults(annotations, faults), generation, say)
    reports: dict[str, CanaryReport] = {}

    def on_probe(event: ProgressEvent) -> None:
        reporter.heard()
        if on_canary_progress is not None:
            on_canary_progress(event)

    async def suite(url: str, canary: object, **kwargs: object) -> CanaryReport:
        report = await run_suite(url, canary, progress=on_probe, **kwargs)  # type: ignore[arg-type]
        revision = next((r for r, rec in backend.state.revisions.items() if rec.front.url == url.rstrip("/")), url)
        reports[revision] = report
        (backend.store.revision_dir(revision) / "canary.json").write_text(report.to_json())
        return report

    runner, memory = CanaryRunner(suite=suite), DriverMemory()

    def ready(worker: LocalWorker) -> bool:
        return backend.processes.alive(worker) and healthy(worker)

    # S7 while a worker serves: the router keeps a small worker out of rotation; the gate's
    # verdicts on every running worker go into the status as the operator's pod gate's do.
    gate = LocalPoolGate(ready=ready, alive=backend.processes.alive)
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if max_seconds is None else started + max_seconds
    previous_state: RolloutState | None = None
    while True:
        body = store.body()
        observed = await observe(body, backend, runner, memory, policies=policies, fault_injection_allowed=bool(faults))
        # Judged after observe: its look at the revisions restarted any dead worker and checked health.
        observed = dataclasses.replace(observed, pools=tuple(await gate.pools(backend.state)))
        result = await run_pass(body, observed, store, backend, runner, memory)
        assert result is not None  # a state folder's model never disappears mid-run
        status = InferenceModelStatus.model_validate(result.body["status"] or {})
        if result.outcome.blocked_reason in SPEC_DEGRADED_REASONS:
            # Refused by field before any rollout (the reconcile's own spec checks): nothing will
            # change until the spec does, so waiting for the rollout to rest would wait forever.
            raise LocalBackendError(status.message or str(result.outcome.blocked_reason))
        rollout = status.rollout
        state = rollout.state if rollout is not None else RolloutState.PLANNING
        if state != previous_state:
            say(f"rollout: {previous_state.value if previous_state else '-'} -> {state.value}")
            previous_state = state
        busy = rollout is not None and runner.running((namespace, name), rollout.revision or "",
                                                     canary_run_key(rollout.attempt, rollout.canary_run))
        settling = (unsettled(observed, status, spec) or unjudged(observed, status)) if state == RolloutState.STABLE else None
        if state in RESTING and not busy and result.outcome.scrape is None and settling is None:
            reporter.waiting(None)
            if resize:
                say(f"revision {status.revision} resized in place ({describe_change(resize)} processes), every worker ready")
            return RolloutResult(
                revision=status.target_revision or revision_of(spec, faults), state=state, stable=status.revision,
                serving_url=backend.serving_url(), plan=kv_plan, status=status, canary_reports=reports, events=store.events,
                resized=resize, front_door_problem=backend.front_door_problem(),
            )  # fmt: skip
        waits = ("Resizing" if resize else "Restarting", settling) if settling is not None else progressing(status)
        reporter.waiting(*(waits or (None,)))
        if deadline is not None and loop.time() > deadline:
            # Checked between passes: a pass that is starting workers runs to its end (seconds).
            raise TimeoutError(f"rollout of {name} still {state.value} after {loop.time() - started:.0f} s (--timeout {max_seconds:g})")
        wait = result.outcome.requeue_after
        await asyncio.sleep(POLL_SECONDS if wait is None or wait > 0 else 0)
