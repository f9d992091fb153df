"""The Kubernetes backend: a revision is prefill/decode/router Deployments + Services + Secret +
NetworkPolicy (rendered by `render`), applied through `kube` (the only module talking to the API).

Where a revision answers (used by the canary): the router through its per-revision Service's
in-cluster DNS name (`http://<model>-<rev>-router.<ns>.svc:8000`); every worker through its pod IP
(`http://<podIP>:8000/metrics`, pods listed from the API and filtered by label in code), because a
Service would load-balance and S7 needs every worker's own report. The resolver is injectable:
tests against kmock (no pods, no DNS) point it at real processes on loopback.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvguard.operator.backends.base import (
    ModelRef,
    Observation,
    RevisionEndpoints,
    RevisionRequest,
    WorkerEndpoint,
)
from kvguard.operator.kube import Kube, KubeError, ObjectRef, ref_of
from kvguard.operator.reconcile import deployment_state, owned_by, revision_views
from kvguard.operator.render import (
    HTTP_PORT,
    LABEL_REVISION,
    LABEL_ROLE,
    ROLES,
    Owner,
    object_name,
    render_model_service,
    render_revision,
    render_transfer_secret,
    revision_object_refs,
)
from kvguard.operator.rollout import Scale

log = logging.getLogger(__name__)

REPLICAS_ANNOTATION = "kvguard.io/replicas-before-scale-down"
"""Set on a Deployment scaled to zero, so a rollback restores its replicas."""

Resolver = Callable[[ModelRef, str], Awaitable[RevisionEndpoints]]


def is_subset(desired: Any, live: Any) -> bool:
    """True when every value in `desired` is already in `live` (lists element by element), so
    server-side defaults do not count as drift and a no-op patch is never sent."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return bool(desired == live)


def _owner(model: ModelRef) -> Owner:
    if not model.uid:
        raise KubeError(422, f"InferenceModel {model.namespace}/{model.name} has no uid; cannot own children")
    return Owner(name=model.name, namespace=model.namespace, uid=model.uid)


class KubernetesBackend:
    """`Backend` on a cluster. Every method is idempotent and runs the blocking client off the loop."""

    def __init__(self, kube: Kube, resolver: Resolver | None = None) -> None:
        self.kube = kube
        self._resolver = resolver

    async def ensure_revision(self, request: RevisionRequest, scale: Scale = "full") -> None:
        owner = _owner(request.model)
        for manifest in render_revision(request.spec, request.plan, owner, request.revision, scale, request.faults):
            await self.create_or_patch(manifest, request.model)
        # Generated once, never patched, never logged (S3); None on 409 keeps the existing key.
        await self.kube.acreate(render_transfer_secret(owner, request.revision, secrets.token_bytes(32)))

    async def scale_revision(self, model: ModelRef, revision: str, replicas: int | None) -> None:
        for role in ROLES:
            ref = ObjectRef("Deployment", object_name(model.name, revision, role), model.namespace)
            live = await self.kube.aget(ref)
            if live is None or not owned_by(live, model.name, model.uid):
                continue
            current = int((live.get("spec") or {}).get("replicas", 1))
            saved = ((live.get("metadata") or {}).get("annotations") or {}).get(REPLICAS_ANNOTATION)
            if replicas == 0 and current != 0:
                patch = {"metadata": {"annotations": {REPLICAS_ANNOTATION: str(current)}}, "spec": {"replicas": 0}}
            elif replicas is None and current == 0 and saved and saved.isdigit():
                patch = {"metadata": {"annotations": {REPLICAS_ANNOTATION: None}}, "spec": {"replicas": int(saved)}}
            elif replicas is not None and replicas != 0 and current != replicas:
                patch = {"spec": {"replicas": replicas}}
            else:
                continue
            await self.kube.amerge_patch(ref, patch)
            log.info("scaled %s to %s", ref, patch["spec"]["replicas"])

    async def delete_revision(self, model: ModelRef, revision: str) -> None:
        for kind, name in revision_object_refs(model.name, revision):
            if await self.kube.adelete(ObjectRef(kind, name, model.namespace)):
                log.info("deleted %s %s/%s of revision %s", kind, model.namespace, name, revision)

    async def observe(self, model: ModelRef) -> Observation:
        deployments = [d for d in await self.kube.alist("Deployment", model.namespace) if owned_by(d, model.name, model.uid)]
        return Observation(revisions=revision_views([deployment_state(d) for d in deployments]),
                           serving=await self.serving(model))  # fmt: skip

    async def serving(self, model: ModelRef) -> str | None:
        service = await self.kube.aget(ObjectRef("Service", model.name, model.namespace))
        if service is None or not owned_by(service, model.name, model.uid):
            return None
        return ((service.get("spec") or {}).get("selector") or {}).get(LABEL_REVISION)

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        if self._resolver is not None:
            return await self._resolver(model, revision)
        router = f"http://{object_name(model.name, revision, 'router')}.{model.namespace}.svc:{HTTP_PORT}"
        workers = []
        for pod in await self.kube.alist("Pod", model.namespace):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            ip = (pod.get("status") or {}).get("podIP")
            role = labels.get(LABEL_ROLE)
            if owned_by_revision(pod, model.name, revision) and role in ("prefill", "decode") and ip:
                workers.append(WorkerEndpoint(pod["metadata"]["name"], role, f"http://{ip}:{metrics_port(pod)}/metrics"))
        return RevisionEndpoints(router_url=router, workers=tuple(sorted(workers, key=lambda w: w.name)))

    async def route_traffic(self, model: ModelRef, revision: str) -> None:
        await self.create_or_patch(render_model_service(_owner(model), revision), model)

    async def create_or_patch(self, manifest: Mapping[str, Any], model: ModelRef) -> None:
        ref = ref_of(manifest)
        live = await self.kube.aget(ref)
        if live is None:
            if await self.kube.acreate(manifest) is not None:
                log.info("created %s", ref)
                return
            live = await self.kube.aget(ref)  # lost a race with another writer
            if live is None:
                raise KubeError(409, f"{ref}: conflict on create")
        if not owned_by(live, model.name, model.uid):
            raise KubeError(409, f"{ref} exists and is not owned by InferenceModel {model.name}; refusing to modify it")
        if not is_subset(manifest, live):
            await self.kube.amerge_patch(ref, manifest)
            log.info("patched %s", ref)


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The pod's read-only metrics port: the container port named `metrics` (kvguard), else `http`
    (SGLang and vLLM serve /metrics beside their API)."""
    named = {p.get("name"): p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []}
    return int(named.get("metrics") or named.get("http") or HTTP_PORT)


def owned_by_revision(pod: Mapping[str, Any], model: str, revision: str) -> bool:
    """Pods carry the model/revision labels of their Deployment's template (no owner reference to us)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    running = (pod.get("status") or {}).get("phase") in (None, "Running")
    return labels.get("kvguard.io/model") == model and labels.get(LABEL_REVISION) == revision and running
