"""Observe -> reconcile -> record -> act for one InferenceModel, on top of a backend (async glue).

`reconcile_model` is what every kopf handler calls. It reads what exists (filtering by label and
owner in code), runs the pure `reconcile` (plan + rollout state machine), scrapes the candidate's
workers when the machine asks and reconciles again with the reports, writes the status (the
rollout step is recorded BEFORE it is acted on, so a restart re-issues whatever is missing), then
lets the backend carry out the workload actions and records the events. The canary suite runs as
an asyncio task per model (`CanaryRunner`), off the reconcile path; when it finishes it triggers
a reconcile that records its verdict. One lock per model serialises the handlers that can fire
together (the model's own events, the timer, its Deployments' events, a finished canary).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvguard.operator import metrics
from kvguard.operator.api import InferenceModelSpec, InferencePolicy
from kvguard.operator.backends.base import CanaryRunner, ModelRef, RevisionRequest, execute, scrape_workers
from kvguard.operator.backends.kubernetes import KubernetesBackend, is_subset
from kvguard.operator.kube import Kube, KubeError, ObjectRef
from kvguard.operator.reconcile import Observed, Outcome, deployment_state, owned_by, reconcile
from kvguard.operator.render import LABEL_REVISION
from kvguard.operator.rollout import PolicyGate

log = logging.getLogger(__name__)

ModelKey = tuple[str, str]
"""(namespace, name) of an InferenceModel."""


@dataclasses.dataclass
class _LoopState:
    """Per event loop (tests start several; a Lock or Task cannot cross loops): one lock per
    model, the models with a reconcile queued on their lock, and each model's pending requeue."""

    locks: dict[ModelKey, asyncio.Lock] = dataclasses.field(default_factory=dict)
    waiting: set[ModelKey] = dataclasses.field(default_factory=set)
    requeues: dict[ModelKey, asyncio.Task[None]] = dataclasses.field(default_factory=dict)


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()


def _loop_state() -> _LoopState:
    return _LOOPS.setdefault(asyncio.get_running_loop(), _LoopState())

__all__ = ["is_subset", "observe", "owner_of", "reconcile_model"]


def model_ref(body: Mapping[str, Any]) -> ModelRef:
    meta = body["metadata"]
    return ModelRef(namespace=meta.get("namespace") or "default", name=meta["name"], uid=meta.get("uid"))


async def observe(kube: Kube, body: Mapping[str, Any], runner: CanaryRunner | None = None) -> Observed:
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace"), meta.get("uid")
    deployments = [d for d in await kube.alist("Deployment", namespace) if owned_by(d, name, uid)]
    others = [o for kind in ("Service", "NetworkPolicy") for o in await kube.alist(kind, namespace) if owned_by(o, name, uid)]
    revisions = {(o["metadata"].get("labels") or {}).get(LABEL_REVISION) for o in deployments + others}
    model_service = next((o for o in others if o["kind"] == "Service" and o["metadata"]["name"] == name), None)
    config, config_error = await _architecture_config(kube, body)
    ref = model_ref(body)
    rollout = (body.get("status") or {}).get("rollout") or {}
    running = runner is not None and runner.running(ref.key, str(rollout.get("revision")), str(rollout.get("attempt") or ""))
    return Observed(
        deployments=[deployment_state(d) for d in deployments],
        revisions_present=frozenset(r for r in revisions if r and r != "None"),
        architecture_config=config,
        architecture_config_error=config_error,
        serving=(((model_service or {}).get("spec") or {}).get("selector") or {}).get(LABEL_REVISION),
        policy=await policy_gate(kube, body),
        canary=runner.result(ref.key) if runner is not None else None,
        canary_running=running,
        fault_injection_allowed=fault_injection_allowed(),
    )


FAULT_INJECTION_ENV = "KVGUARD_ALLOW_FAULT_INJECTION"


def fault_injection_allowed() -> bool:
    """Test clusters only (manifests/testing/fault-injection): honour the kvguard.io/faults annotation."""
    return os.environ.get(FAULT_INJECTION_ENV, "").strip().lower() in ("1", "true", "yes")


async def policy_gate(kube: Kube, body: Mapping[str, Any]) -> PolicyGate:
    """The InferencePolicy verdict on the spec (S7). No policy, or no evaluator installed: compliant."""
    try:
        from kvguard.operator.policy import evaluate
    except ImportError:
        return PolicyGate()
    try:
        raw = await kube.alist("InferencePolicy", None)
    except KubeError as exc:
        if exc.status == 404:  # the CRD is not installed: no policy applies
            return PolicyGate()
        raise
    policies = []
    for item in raw:
        try:
            policies.append(InferencePolicy.model_validate(item))
        except ValidationError as exc:
            log.warning("ignoring invalid InferencePolicy %s: %s", (item.get("metadata") or {}).get("name"), exc)
    if not policies:
        return PolicyGate()
    try:
        spec = InferenceModelSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return PolicyGate()  # reconcile reports the invalid spec itself
    return PolicyGate.from_verdict(evaluate(spec, body["metadata"].get("namespace") or "default", policies))


async def _architecture_config(kube: Kube, body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    model = (body.get("spec") or {}).get("model") or {}
    ref = model.get("architectureConfigMap")
    if not isinstance(ref, Mapping) or model.get("architecture") or not ref.get("name"):
        return None, None
    key = ref.get("key") or "config.json"
    cm = await kube.aget(ObjectRef("ConfigMap", str(ref["name"]), body["metadata"].get("namespace")))
    if cm is None:
        return None, f"ConfigMap {ref['name']} not found"
    text = (cm.get("data") or {}).get(key)
    if text is None:
        return None, f"ConfigMap {ref['name']} has no key {key}"
    try:
        config = json.loads(text)
    except ValueError as exc:
        return None, f"{key} is not JSON: {exc}"
    return (config, None) if isinstance(config, dict) else (None, f"{key} is not a JSON object")


async def record_and_act(
    kube: Kube, backend: KubernetesBackend, runner: CanaryRunner, body: Mapping[str, Any], outcome: Outcome, now: dt.datetime
) -> None:
    """Status first (the step is recorded before it is acted on), then the workloads, then events."""
    meta = body["metadata"]
    if not is_subset(outcome.status, body.get("status") or {}):
        await kube.apatch_status(ObjectRef("InferenceModel", meta["name"], meta.get("namespace")), outcome.status)
    if outcome.actions and outcome.spec is not None:
        ref = model_ref(body)
        request = None
        if outcome.plan is not None and outcome.revision is not None:
            request = RevisionRequest(ref, outcome.revision, outcome.spec, outcome.plan, outcome.faults)
        key_only = {"metadata": {"name": ref.name, "namespace": ref.namespace}}

        async def canary_done() -> None:
            try:
                await reconcile_model(kube, key_only, backend=backend, runner=runner)
            except KubeError as exc:
                log.warning("reconcile of %s/%s after its canary failed: %s (the timer retries)", *ref.key, exc)

        await execute(backend, request, outcome.actions, runner, outcome.spec.canary, on_canary_done=canary_done)
    for event in outcome.events:
        await kube.arecord_event(body, type_=event.type, reason=event.reason, message=event.message, now=now)


async def reconcile_model(
    kube: Kube, body: Mapping[str, Any], *, backend: KubernetesBackend | None = None, runner: CanaryRunner | None = None
) -> Outcome | None:
    """The one reconcile every handler calls. Raises KubeError when the API server fails.

    Bursts coalesce: when a reconcile of the same model is already queued, this call returns None
    at once, because the queued one reads the resource and its children after this change."""
    meta = body["metadata"]
    key = (meta.get("namespace") or "", meta["name"])
    state = _loop_state()
    if key in state.waiting:
        return None  # a reconcile that has not read anything yet is queued: it will see this change
    lock = state.locks.setdefault(key, asyncio.Lock())
    state.waiting.add(key)
    try:
        await lock.acquire()
    finally:
        state.waiting.discard(key)
    backend, runner = backend or KubernetesBackend(kube), runner or CanaryRunner()
    try:
        outcome = await _reconcile_locked(kube, backend, runner, body, key)
    finally:
        lock.release()
    _schedule_requeue(kube, backend, runner, key, outcome.requeue_after)
    return outcome


def _schedule_requeue(
    kube: Kube, backend: KubernetesBackend, runner: CanaryRunner, key: ModelKey, delay: float | None
) -> None:
    """Look again after `delay` (the rollout is waiting on workloads, metrics or a canary) rather
    than at the next timer tick. Each reconcile replaces the pending requeue of its model."""
    requeues = _loop_state().requeues
    pending = requeues.pop(key, None)
    if pending is not None and pending is not asyncio.current_task():
        pending.cancel()
    if delay is None:
        return
    key_only = {"metadata": {"namespace": key[0] or None, "name": key[1]}}

    async def later() -> None:
        await asyncio.sleep(delay)
        if requeues.get(key) is asyncio.current_task():
            del requeues[key]  # from here on a newer reconcile must not cancel this one
        try:
            await reconcile_model(kube, key_only, backend=backend, runner=runner)
        except KubeError as exc:
            log.warning("requeued reconcile of %s/%s failed: %s (the timer retries)", *key, exc)

    requeues[key] = asyncio.get_running_loop().create_task(later(), name=f"requeue {key[0]}/{key[1]}")


async def _reconcile_locked(
    kube: Kube, backend: KubernetesBackend, runner: CanaryRunner, body: Mapping[str, Any], key: tuple[str, str]
) -> Outcome:
    meta = body["metadata"]
    started = time.monotonic()
    fresh = await kube.aget(ObjectRef("InferenceModel", meta["name"], meta.get("namespace")))
    if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
        metrics.forget_model(key[0], key[1])
        runner.forget((key[0] or "default", key[1]))
        return Outcome(status={})
    fresh.setdefault("metadata", {}).setdefault("uid", meta.get("uid"))
    now = dt.datetime.now(dt.UTC)
    try:
        observed = await observe(kube, fresh, runner)
        outcome = reconcile(fresh, observed, now=now)
        if outcome.scrape is not None:  # S7: every candidate worker's own report, then decide again
            reports = await scrape_workers(await backend.endpoints(model_ref(fresh), outcome.scrape))
            outcome = reconcile(fresh, dataclasses.replace(observed, worker_reports=tuple(reports)), now=now)
        await record_and_act(kube, backend, runner, fresh, outcome, now)
    except Exception:
        metrics.RECONCILES.labels("error").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    result = "ok" if outcome.blocked_reason is None else ("blocked" if outcome.plan is not None else "invalid")
    metrics.RECONCILES.labels(result).inc()
    if outcome.blocked_reason and outcome.events:
        metrics.BLOCKED_PLANS.labels(outcome.blocked_reason).inc()
    metrics.record_plan(key[0], key[1], outcome.plan)
    return outcome


def owner_of(child: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the InferenceModel controlling a child object, if any."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "InferenceModel" and ref.get("controller"):
            return meta.get("namespace") or "", ref["name"]
    return None

