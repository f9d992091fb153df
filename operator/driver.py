"""The one rollout driver: observe once, decide once, record, act. Both platforms run it.

    observe (backend views, policies, the scrape the last pass asked for, the canary's result)
      -> reconcile (pure: parse, plan, render, policy, rollout.step, once)
      -> write status, conditional on the version the decision was made on (409: re-read, decide again)
      -> act (the workload actions, only once the status that asked for them is stored)
      -> events

The Kubernetes controller (`controller.py`) passes an API-server `ModelStore` and its cached
backend; `kvguard apply --local` (`backends/local_rollout.py`) passes the state folder and the
local backend. Same reconcile, same status. Nothing here imports kopf or kubernetes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from kvguard.operator.api import InferenceModelSpec, InferencePolicy
from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic
from kvguard.operator.backends.base import (
    Backend,
    CanaryRunner,
    ForeignObjectError,
    ModelRef,
    RevisionRequest,
    execute,
    scrape_workers,
)
from kvguard.operator.canary.spec import CanarySpec
from kvguard.operator.kube import KubeError, TransportError
from kvguard.operator.pool_gate import PodPool
from kvguard.operator.reconcile import EventSpec, Observed, Outcome, reconcile, status_differs
from kvguard.operator.rollout import AnalysisOutcome, AnalysisResult, MeasureAnalysis, RunCanary, canary_run_key

log = logging.getLogger(__name__)

MAX_CONFLICTS = 3
"""Status writes refused as stale in one pass before it gives up (and backs off)."""

ModelKey = tuple[str, str]


class StatusConflict(Exception):
    """The model changed after it was read: the status decided on it was not written."""


class ModelStore(Protocol):
    """Where an InferenceModel's status and events live (the API server, or the state folder)."""

    async def write_status(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> Mapping[str, Any]:
        """Store `status` if the model is still the version `body` is; return the stored model.
        Raises StatusConflict when it has moved on."""
        ...

    async def reread(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The model as stored now; None when it is gone."""
        ...

    async def record_event(self, body: Mapping[str, Any], event: EventSpec, now: dt.datetime) -> None: ...


def model_ref(body: Mapping[str, Any]) -> ModelRef:
    meta = body["metadata"]
    return ModelRef(namespace=meta.get("namespace") or "default", name=meta["name"], uid=meta.get("uid"))


@dataclass
class DriverMemory:
    """What one driver process remembers between passes of a model (lost on restart, by design:
    the machine asks again)."""

    scrape: dict[ModelKey, str] = field(default_factory=dict)
    """Revision whose workers to scrape at the model's next pass (the last decision asked)."""
    foreign: dict[ModelKey, tuple[str, tuple[ForeignObjectError, ...]]] = field(default_factory=dict)
    """(digest of the spec, the objects that blocked its actions because someone else owns them):
    reported until they are gone or the spec changes (a new spec may not need them: it is tried
    afresh, and one it still needs blocks it again)."""
    refused: dict[ModelKey, tuple[str, str]] = field(default_factory=dict)
    """(digest of the spec, the API server's message) of a child object it refused (422) for
    that spec: reported until the spec changes, instead of retried forever unseen."""
    measure: dict[ModelKey, MeasureAnalysis] = field(default_factory=dict)
    """Candidate and stable whose live traffic to measure at the model's next pass."""
    analysis: AnalysisMemory = field(default_factory=AnalysisMemory)
    """The last scrape of each model's revisions (where the next measurement's window starts)."""
    outbox: dict[ModelKey, list[UnpostedEvent]] = field(default_factory=dict)
    """Events of decisions already recorded in status but not yet posted: a failed post (or a
    failed action before it) is retried at the next pass, which does not decide them again."""

    def forget(self, key: ModelKey) -> None:
        self.scrape.pop(key, None)
        self.foreign.pop(key, None)
        self.refused.pop(key, None)
        self.measure.pop(key, None)
        self.outbox.pop(key, None)
        self.analysis.forget(key)

    def clear(self) -> None:
        self.scrape.clear()
        self.foreign.clear()
        self.refused.clear()
        self.measure.clear()
        self.outbox.clear()
        self.analysis.last.clear()


@dataclass(frozen=True)
class UnpostedEvent:
    """An Event as its pass decided it: about that object (its uid) at that time."""

    body: Mapping[str, Any]
    event: EventSpec
    decided_at: dt.datetime


MAX_UNPOSTED_EVENTS = 64
"""Events a model may have waiting for the API server; past it the oldest go (an Event API
that stays down must not grow the operator without bound)."""


@dataclass(frozen=True)
class PassResult:
    outcome: Outcome
    body: Mapping[str, Any]
    """The model as stored after the pass (with the written status)."""
    wrote_status: bool


async def observe(
    body: Mapping[str, Any],
    backend: Backend,
    runner: CanaryRunner,
    memory: DriverMemory,
    *,
    policies: Sequence[InferencePolicy] = (),
    architecture_config: tuple[Mapping[str, Any] | None, str | None] = (None, None),
    fault_injection_allowed: bool = False,
    pools: Sequence[PodPool] = (),
    continuous: CanaryRunner | None = None,
) -> Observed:
    """Everything reconcile looks at, read once: the backend's revisions and route, the scrape the
    previous decision asked for, objects still in the way, the canary's state."""
    ref = model_ref(body)
    seen = await backend.observe(ref)
    reports = None
    scrape = memory.scrape.pop(ref.key, None)
    if scrape is not None:
        reports = tuple(await scrape_workers(await backend.endpoints(ref, scrape)))
    digest = spec_digest(body)
    foreign: tuple[ForeignObjectError, ...] = ()
    if (blocked := memory.foreign.pop(ref.key, None)) is not None and blocked[0] == digest:
        foreign = tuple(await backend.still_foreign(ref, blocked[1]))
        if foreign:
            memory.foreign[ref.key] = (digest, foreign)
    refused = memory.refused.get(ref.key)
    if refused is not None and refused[0] != digest:
        del memory.refused[ref.key]  # a new spec: let the API server judge it afresh
        refused = None
    rollout = (body.get("status") or {}).get("rollout") or {}
    analysis = None
    wanted = memory.measure.pop(ref.key, None)
    if wanted is not None:
        analysis = await _measure(body, ref, backend, memory, wanted, rollout)
    schedule = (body.get("status") or {}).get("continuous") or {}
    continuous_running = continuous is not None and continuous.running(ref.key, str(schedule.get("revision")), str(schedule.get("nextRunAt")))
    return Observed(
        analysis=analysis,
        revisions=seen.revisions, serving=seen.serving, policies=tuple(policies),
        architecture_config=architecture_config[0], architecture_config_error=architecture_config[1],
        worker_reports=reports, canary=runner.result(ref.key),
        canary_running=runner.running(ref.key, str(rollout.get("revision")),
                                      canary_run_key(str(rollout.get("attempt") or ""), rollout.get("canaryRun"))),
        fault_injection_allowed=fault_injection_allowed, foreign_objects=tuple(f.description for f in foreign),
        refused_object=refused[1] if refused is not None else None,
        pools=tuple(pools), continuous=continuous.result(ref.key) if continuous is not None else None,
        continuous_running=continuous_running,
    )  # fmt: skip


async def _measure(
    body: Mapping[str, Any], ref: ModelRef, backend: Backend, memory: DriverMemory, wanted: MeasureAnalysis,
    rollout: Mapping[str, Any],
) -> AnalysisOutcome | None:  # fmt: skip
    """The candidate's live traffic against the stable's since the last measurement (None: the
    spec no longer parses; the pass will say why)."""
    try:
        spec = InferenceModelSpec.model_validate(body.get("spec") or {})
        previous = [AnalysisResult.model_validate(r) for r in rollout.get("analysis") or []]
    except ValidationError:
        return None
    candidate = await backend.endpoints(ref, wanted.candidate)
    stable = await backend.endpoints(ref, wanted.stable)
    return await measure_live_traffic(
        ref.key, spec.rollout.analysis, (wanted.candidate, candidate.metrics_urls()), (wanted.stable, stable.metrics_urls()),
        previous, memory.analysis, model=ref.name, namespace=ref.namespace,
    )  # fmt: skip


async def run_pass(
    body: Mapping[str, Any],
    observed: Observed,
    store: ModelStore,
    backend: Backend,
    runner: CanaryRunner,
    memory: DriverMemory,
    *,
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    on_canary_done: Callable[[], Awaitable[None]] | None = None,
    continuous: CanaryRunner | None = None,
    on_recorded: Callable[[Outcome], None] | None = None,
) -> PassResult | None:
    """Decide once on `observed`, record, act. None: the model is gone. Raises StatusConflict
    after MAX_CONFLICTS stale writes, and whatever the backend raises (the caller backs off).
    `on_recorded` sees the decision once it is recorded, before any action can fail."""
    wrote = False
    for _ in range(MAX_CONFLICTS):
        now = clock()
        outcome = reconcile(body, observed, now=now)
        if not status_differs(outcome.status, body.get("status")):
            break
        try:
            body = await store.write_status(body, outcome.status)
            wrote = True
            break
        except StatusConflict:  # another writer (or our own stale copy): decide again on the latest
            fresh = await store.reread(body)
            if fresh is None:
                return None
            body = fresh
    else:
        raise StatusConflict(f"{model_ref(body).key}: status stale {MAX_CONFLICTS} times in one pass")
    ref = model_ref(body)
    if on_recorded is not None:
        on_recorded(outcome)  # counted once: a retried pass does not decide this again
    if outcome.scrape is not None:
        memory.scrape[ref.key] = outcome.scrape
    if outcome.measure is not None:
        memory.measure[ref.key] = outcome.measure
    # The decision is in status: its Events go out even if an action fails (a retried pass does not
    # decide them again; an outside probe: one failed post lost the first continuous-canary
    # failure's Event and count for good, and with it the alert).
    outbox = memory.outbox.setdefault(ref.key, [])
    outbox.extend(UnpostedEvent(body, event, now) for event in outcome.events)
    del outbox[:-MAX_UNPOSTED_EVENTS]
    if continuous is not None and outcome.continuous_stop:
        continuous.cancel(ref.key)  # before the actions: one that fails must not leave the run going
    try:
        await _act(ref, outcome, backend, runner, on_canary_done)
    except ForeignObjectError as exc:
        log.warning("%s/%s: %s", *ref.key, exc.description)
        digest = spec_digest(body)
        kept = memory.foreign.get(ref.key)
        earlier = kept[1] if kept is not None and kept[0] == digest else ()
        memory.foreign[ref.key] = (digest, (*earlier, exc))
        raise
    except KubeError as exc:
        if exc.status == 422:  # the spec renders an object the API server refuses: the next pass says so
            memory.refused[ref.key] = (spec_digest(body), str(exc))
        raise
    finally:
        await _post_events(store, outbox)
    if continuous is not None and outcome.continuous_start is not None and outcome.spec is not None:
        await _start_continuous(ref, outcome.continuous_start, outcome.spec.canary_to_run(), backend, continuous, on_canary_done)
    return PassResult(outcome, body, wrote)


async def _post_events(store: ModelStore, outbox: list[UnpostedEvent]) -> None:
    """Post the model's waiting Events in order, each about the object and at the time its pass
    decided. One that fails for a while (the API server unavailable, throttling, the connection)
    stays, with those after it, for the next pass; one the API server refuses (another 4xx, or
    not sent: this operator no longer leads) is dropped, so it cannot block the rest. Events are
    reports: a failure to post one fails no pass."""
    while outbox:
        waiting = outbox[0]
        try:
            await store.record_event(waiting.body, waiting.event, waiting.decided_at)
        except Exception as exc:  # noqa: BLE001 - whatever the API server or the connection did
            # Unreachable (no answer), unavailable or throttling: worth another try. Anything else
            # (a refusal, a call not sent because this operator no longer leads, a bug) would fail
            # the same way again and hold the model's later Events back.
            again = isinstance(exc, TransportError) or (isinstance(exc, KubeError) and (exc.status == 429 or exc.status >= 500))
            log.warning("%s: event %s not posted (%s)%s", model_ref(waiting.body).key, waiting.event.reason, exc,
                        "; retried at the next pass" if again else "; dropped")  # fmt: skip
            if again:
                return
        outbox.pop(0)


async def _start_continuous(
    ref: ModelRef, run: tuple[str, str], spec: CanarySpec, backend: Backend, runner: CanaryRunner,
    on_done: Callable[[], Awaitable[None]] | None,
) -> None:  # fmt: skip
    """The light probe set against the serving revision (continuous.py), off the reconcile path."""
    revision, attempt = run
    target = await backend.endpoints(ref, revision)
    if target.router_url is None:
        log.warning("continuous canary of %s/%s: revision %s has no router URL", *ref.key, revision)
        return
    runner.start(ref.key, RunCanary(revision, None, attempt), target.router_url, spec=spec.for_continuous(), baseline_url=None,
                 metrics_urls=[w.metrics_url for w in target.workers], on_done=on_done)  # fmt: skip


async def _act(
    ref: ModelRef, outcome: Outcome, backend: Backend, runner: CanaryRunner,
    on_canary_done: Callable[[], Awaitable[None]] | None,
) -> None:  # fmt: skip
    if not outcome.actions or outcome.spec is None:
        return
    request = None
    if outcome.plan is not None and outcome.revision is not None:
        request = RevisionRequest(ref, outcome.revision, outcome.spec, outcome.plan, outcome.faults, outcome.rendered)
    await execute(backend, request, outcome.actions, runner, outcome.spec.canary_to_run(), on_canary_done=on_canary_done)


def spec_digest(body: Mapping[str, Any]) -> str:
    """What identifies the spec a refusal was for (generation is not stored by every API server)."""
    return hashlib.sha256(json.dumps(body.get("spec"), sort_keys=True, default=str).encode()).hexdigest()


def requeue_delay(outcome: Outcome, waits: int, *, base: float, cap: float, jitter: Callable[[float], float]) -> float | None:
    """When to look again: never at rest; at once when asked; otherwise the machine's wait grown
    exponentially with the passes that changed nothing (waits), jittered, capped, and never past
    the awaited thing's deadline (a rollout must fail on time)."""
    if outcome.requeue_after is None:
        return None
    if outcome.requeue_after <= 0:
        return 0.0
    delay = jitter(min(cap, max(base, outcome.requeue_after) * 2 ** min(waits, 30)))
    if outcome.deadline_in is not None:
        delay = min(delay, outcome.deadline_in + 1.0)
    return max(0.0, delay)


__all__ = ["DriverMemory", "ModelStore", "PassResult", "StatusConflict", "observe", "requeue_delay", "run_pass"]
