"""Observe -> reconcile -> apply for one InferenceModel, on top of `kube` (async I/O glue).

`reconcile_model` is what every kopf handler calls. It reads what exists (filtering by label and
owner in code), runs the pure `reconcile`, then applies its outcome in an order that keeps S8:
desired objects first, then the status that records a promotion, and only then deletions of
superseded revisions. One lock per model serialises the handlers that can fire together (the
model's own events, the timer and its Deployments' events).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

from kvguard.operator import metrics
from kvguard.operator.kube import Kube, KubeError, ObjectRef, ref_of
from kvguard.operator.reconcile import Observed, Outcome, deployment_state, owned_by, reconcile
from kvguard.operator.render import LABEL_REVISION

log = logging.getLogger(__name__)

_LOCKS: dict[tuple[int, str, str], asyncio.Lock] = {}  # per event loop (tests run several)
_WAITING: set[tuple[int, str, str]] = set()


def is_subset(desired: Any, live: Any) -> bool:
    """True when every value in `desired` is already in `live` (lists element by element), so
    server-side defaults do not count as drift and a no-op patch is never sent."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return bool(desired == live)


async def observe(kube: Kube, body: Mapping[str, Any]) -> Observed:
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace"), meta.get("uid")
    deployments = [d for d in await kube.alist("Deployment", namespace) if owned_by(d, name, uid)]
    others = [o for kind in ("Service", "NetworkPolicy") for o in await kube.alist(kind, namespace) if owned_by(o, name, uid)]
    revisions = {(o["metadata"].get("labels") or {}).get(LABEL_REVISION) for o in deployments + others}
    config, config_error = await _architecture_config(kube, body)
    return Observed(
        deployments=[deployment_state(d) for d in deployments],
        revisions_present=frozenset(r for r in revisions if r),
        architecture_config=config,
        architecture_config_error=config_error,
    )


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


async def apply_outcome(kube: Kube, body: Mapping[str, Any], outcome: Outcome, now: dt.datetime) -> None:
    meta = body["metadata"]
    namespace, uid = meta.get("namespace"), meta.get("uid")
    for manifest in outcome.apply:
        await _create_or_patch(kube, manifest, meta["name"], uid)
    for manifest in outcome.create_only:
        await kube.acreate(manifest)  # None on 409: the key was generated once, it stays (S3)
    if not is_subset(outcome.status, body.get("status") or {}):
        await kube.apatch_status(ObjectRef("InferenceModel", meta["name"], namespace), outcome.status)
    for kind, name in outcome.delete:
        if await kube.adelete(ObjectRef(kind, name, namespace)):
            log.info("deleted superseded %s %s/%s", kind, namespace, name)
    for event in outcome.events:
        await kube.arecord_event(body, type_=event.type, reason=event.reason, message=event.message, now=now)


async def _create_or_patch(kube: Kube, manifest: Mapping[str, Any], model: str, uid: str | None) -> None:
    ref = ref_of(manifest)
    live = await kube.aget(ref)
    if live is None:
        if await kube.acreate(manifest) is not None:
            log.info("created %s", ref)
            return
        live = await kube.aget(ref)  # lost a race with another writer
        if live is None:
            raise KubeError(409, f"{ref}: conflict on create")
    if not owned_by(live, model, uid):
        raise KubeError(409, f"{ref} exists and is not owned by InferenceModel {model}; refusing to modify it")
    if not is_subset(manifest, live):
        await kube.amerge_patch(ref, manifest)
        log.info("patched %s", ref)


async def reconcile_model(kube: Kube, body: Mapping[str, Any]) -> Outcome | None:
    """The one reconcile every handler calls. Raises KubeError when the API server fails.

    Bursts coalesce: when a reconcile of the same model is already queued, this call returns None
    at once, because the queued one reads the resource and its children after this change."""
    meta = body["metadata"]
    key = (meta.get("namespace") or "", meta["name"])
    lock_key = (id(asyncio.get_running_loop()), *key)
    if lock_key in _WAITING:
        return None  # a reconcile that has not read anything yet is queued: it will see this change
    lock = _LOCKS.setdefault(lock_key, asyncio.Lock())
    _WAITING.add(lock_key)
    try:
        await lock.acquire()
    finally:
        _WAITING.discard(lock_key)
    try:
        return await _reconcile_locked(kube, body, key)
    finally:
        lock.release()


async def _reconcile_locked(kube: Kube, body: Mapping[str, Any], key: tuple[str, str]) -> Outcome:
    meta = body["metadata"]
    started = time.monotonic()
    fresh = await kube.aget(ObjectRef("InferenceModel", meta["name"], meta.get("namespace")))
    if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
        metrics.forget_model(key[0], key[1])
        return Outcome(status={})
    fresh.setdefault("metadata", {}).setdefault("uid", meta.get("uid"))
    now = dt.datetime.now(dt.timezone.utc)
    try:
        outcome = reconcile(fresh, await observe(kube, fresh), now=now, transfer_key=secrets.token_bytes(32))
        await apply_outcome(kube, fresh, outcome, now)
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

