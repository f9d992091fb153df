"""The Kubernetes backend: a revision is prefill/decode/router Deployments + Services + Secret +
NetworkPolicy (rendered by `render`), applied through `kube` (the only module talking to the API).

Reads come from memory: the controller keeps an index of every child the operator owns, fed by
label-selected watches (`ChildIndex`), so observing a model costs no API request; the traffic
objects (HTTPRoute, InferencePool: `UNWATCHED_KINDS`) are read by name when applied. Writes:
- children are server-side applied (field manager `kvguard`), so a field the renderer drops is
  removed on the cluster; an apply is skipped when the object already holds exactly this manifest
  (a hash annotation) at the replicas wanted and nobody changed its spec since (its generation);
- before a child is applied for the first time, its name is checked: an object the model does not
  own is never modified (ForeignObjectError), since apply with force would take it over;
- the transfer Secret (S3) is created once, under a name with a random suffix nobody can claim
  before the operator does, and recorded in the revision's Deployments (their pods read the key
  from it). No Secret is ever read: RBAC grants create and delete only;
- scaling is a merge patch of replicas under its own field manager.

Where a revision answers (used by the canary): the router through its per-revision Service's
in-cluster DNS name (`http://<model>-<rev>-router.<ns>.svc:8000`); every worker through its pod IP
(`http://<podIP>:8000/metrics`, pods listed by label selector, Running, Ready and not
terminating), because a Service would load-balance and S7 needs every worker's own report. The
resolver is injectable: tests against kmock (no pods, no DNS) point it at real processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kvguard.operator.api import EngineKind
from kvguard.operator.backends.base import (
    ForeignObjectError,
    ModelRef,
    Observation,
    RevisionEndpoints,
    RevisionRequest,
    WorkerEndpoint,
)
from kvguard.operator.kube import FIELD_MANAGER, SCALE_FIELD_MANAGER, Kube, KubeError, ObjectRef, ref_of
from kvguard.operator.render import (
    ENGINE_CONTAINER,
    HTTP_PORT,
    LABEL_ENGINE,
    LABEL_MODEL,
    LABEL_REVISION,
    LABEL_ROLE,
    OPERATOR_LABEL_KEYS,
    ROLES,
    Owner,
    Role,
    is_transfer_secret_name,
    labels,
    network_policy_name,
    object_name,
    render_model_service,
    render_rollout_revision,
    render_transfer_secret,
    transfer_secret_name,
    transfer_secret_of,
)
from kvguard.operator.rollout import Scale
from kvguard.operator.traffic import Share, inference_pool_name, render_traffic, route_name
from kvguard.operator.workloads import (
    deployment_state,
    model_revision_of,
    owned_by,
    owner_key,
    pod_is_serving,
    revision_views,
    secrets_missing,
)

log = logging.getLogger(__name__)

REPLICAS_ANNOTATION = "kvguard.io/replicas-before-scale-down"
"""Set on a Deployment scaled to zero, so a rollback restores its replicas."""
APPLIED_HASH_ANNOTATION = "kvguard.io/applied-hash"
"""On every applied child: a hash of the manifest applied, to skip applying it again unchanged."""

UNWATCHED_KINDS = frozenset({"HTTPRoute", "InferencePool"})
"""Children the operator reads by name only (RBAC: no list/watch; their CRDs may not be installed):
read again whenever they are applied, since no watch says one was deleted or edited."""

Resolver = Callable[[ModelRef, str], Awaitable[RevisionEndpoints]]
ObjectKey = tuple[str, str, str]
"""(kind, namespace, name)."""
REVISION_CHILD_KINDS = ("Deployment", "Service", "NetworkPolicy")
"""The kinds of a revision's children that the operator watches (by its labels)."""
SECRET_RECHECK_SECONDS = 300.0
"""How often, on a pass that applies a revision, the operator checks that the revision's transfer
Secret is still there: a dry-run create under its recorded name (409: it is). The operator may not
read Secrets, so this is how it learns of a deleted one; a model at rest has a pass every
KVGUARD_RESYNC_SECONDS (600)."""


class KnownSecret(NamedTuple):
    """A revision's transfer Secret as this process knows it."""

    name: str
    checked_at: float
    """time.monotonic() of the last check that found it there, or of its creation."""
    retired: frozenset[str] = frozenset()
    """Names the revision's Secret had before, found deleted. A watch cache still showing
    Deployments that name one is behind this replica's own apply, not newer than it."""


MetadataKey = tuple[str, str]
"""("labels" or "annotations", key)."""
RevisionKey = tuple[str, str, str, str]
"""(namespace, model, model uid, revision): a model deleted and created again under its name (a new
uid) has new children, so nothing of the old one's may be taken for them."""


class ChildIndex(Protocol):
    """Every Deployment, Service and NetworkPolicy carrying the operator's labels, by model."""

    def children(self, namespace: str, model: str) -> list[Mapping[str, Any]]: ...


class DictChildIndex:
    """A ChildIndex held in a dict (tests, and anything not fed by kopf)."""

    def __init__(self) -> None:
        self.objects: dict[ObjectKey, Mapping[str, Any]] = {}

    def put(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta.get("namespace") or "", meta["name"])] = obj

    def children(self, namespace: str, model: str) -> list[Mapping[str, Any]]:
        return [o for (_, ns, _), o in self.objects.items() if ns == namespace and owner_key(o) == (namespace, model)]


@dataclass(frozen=True)
class Applied:
    """What this process last wrote to a child: the manifest's hash, its replicas, the generation,
    and the uid of the InferenceModel it was written for."""

    digest: str
    replicas: int | None
    generation: int | None
    owner_uid: str | None
    resource_version: str | None = None
    """The object's after this write: a watch-cache view older than it lags behind the write."""
    unheld: frozenset[MetadataKey] = frozenset()
    """The labels and annotations of the operator's that the object as written came back without
    (an admission webhook rewrites them): a later mismatch of those is no edit, and is not fought."""


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def with_digest(manifest: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    digest = manifest_digest(manifest)
    meta = manifest["metadata"]
    return {**manifest, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), APPLIED_HASH_ANNOTATION: digest}}}, digest


def _recreate_to_apply(desired: Mapping[str, Any], refused: KubeError) -> bool:
    """The apply was refused for a field the API server keeps immutable that only re-creating the
    object changes: a Service's clusterIP (an earlier release's virtual IP, now headless). A
    Deployment's selector never changes for a revision (its labels are fixed), so it is not here."""
    return refused.status == 422 and desired.get("kind") == "Service" and "clusterIP" in str(refused)


def _replicas(obj: Mapping[str, Any]) -> int | None:
    value = (obj.get("spec") or {}).get("replicas")
    return int(value) if isinstance(value, int) else None


def _generation(obj: Mapping[str, Any]) -> int | None:
    value = (obj.get("metadata") or {}).get("generation")
    return int(value) if isinstance(value, int) else None


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return str(value) if value else None


def _older(live: Mapping[str, Any], resource_version: str | None) -> bool:
    """Is `live` a version before `resource_version`? Opaque to clients, but etcd's are integers:
    compared only when both are (otherwise: not known to be older)."""
    mine, theirs = _resource_version(live) or "", resource_version or ""
    return mine.isdigit() and theirs.isdigit() and int(mine) < int(theirs)


def _owner(model: ModelRef) -> Owner:
    if not model.uid:
        raise KubeError(422, f"InferenceModel {model.namespace}/{model.name} has no uid; cannot own children")
    return Owner(name=model.name, namespace=model.namespace, uid=model.uid)


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace") or "", meta["name"]


def _revisions(owned: Sequence[Mapping[str, Any]]) -> set[str]:
    """The revisions the model's children belong to."""
    return {r for o in owned if (r := ((o["metadata"].get("labels") or {}).get(LABEL_REVISION)))}


def _foreign(ref: ObjectRef, model: ModelRef) -> ForeignObjectError:
    return ForeignObjectError(f"{ref} exists and is not owned by InferenceModel {model.name}; refusing to modify it "
                              "(delete or rename it)", (ref.kind, ref.name, ref.namespace))  # fmt: skip


class KubernetesBackend:
    """`Backend` on a cluster. Every method is idempotent and runs the blocking client off the loop."""

    def __init__(self, kube: Kube, index: ChildIndex, resolver: Resolver | None = None) -> None:
        self.kube = kube
        self.index = index
        self._resolver = resolver
        self._applied: dict[ObjectKey, Applied] = {}
        self._transfer_secrets: dict[RevisionKey, KnownSecret] = {}  # the Secret each revision's pods read
        self._traffic: dict[tuple[str, str], set[ObjectKey]] = {}  # per model: the traffic objects applied
        self._traffic_swept: set[tuple[str, str]] = set()  # models whose earlier HTTPRoute and pools were looked for
        self._left: dict[tuple[str, str], dict[ObjectKey, dict[str, str]]] = {}
        """Per model: children the watch reported gone that this process did not delete, with the
        operator's labels they had (a child whose labels were taken off leaves the watch, not the
        cluster: looked for on the model's next pass, `_relabel_left`)."""
        self._deleting: set[ObjectKey] = set()  # deleted by this process: their DELETED events are expected

    # --- the Backend interface ------------------------------------------------------------------
    async def ensure_revision(self, request: RevisionRequest, scale: Scale = "full") -> None:
        owner = _owner(request.model)
        rendered = request.rendered or render_rollout_revision(request.spec, request.plan, owner, request.revision, request.faults)
        # Someone else's object under a child's name blocks the revision before anything is made
        # for it: a Secret made on every blocked pass would pile up, named by nothing.
        await self._refuse_foreign(rendered.at(scale), request.model)
        if rendered.uses_transfer_key():  # created before any pod references it
            rendered = rendered.with_transfer_secret(await self.ensure_transfer_secret(owner, request.revision))
        # The children are independent of each other: apply them concurrently (one round trip of
        # latency per revision, not seven). Every failure is raised.
        results = await asyncio.gather(*(self.apply(m, request.model, checked=True) for m in rendered.at(scale)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, ForeignObjectError)), errors[0])

    async def scale_revision(self, model: ModelRef, revision: str, replicas: int | None) -> None:
        children = await self._revision_children(model, revision, kinds=("Deployment",))
        for key, (live, hidden) in children.items():
            role = next(r for r in ROLES if key[2] == object_name(model.name, revision, r))
            patch = _scale_patch(live, replicas)
            if hidden:  # its labels back, so that the watch (and the next decision) sees it again
                patch = {**(patch or {}), "metadata": {**(patch or {}).get("metadata", {}), "labels": labels(model.name, revision, role)}}
            if patch is None:
                continue
            result = await self.kube.amerge_patch(ref_of(live), patch, field_manager=SCALE_FIELD_MANAGER)
            previous = self._known(key, model)
            digest = previous.digest if previous else ""  # not applied by this process: the next apply writes it
            unheld = previous.unheld if previous else frozenset()
            self._applied[key] = Applied(digest, _replicas(result), _generation(result), model.uid, _resource_version(result), unheld)
            log.info("scaled %s to %s%s", ref_of(live), _replicas(result), " (its labels put back)" if hidden else "")

    async def delete_revision(self, model: ModelRef, revision: str) -> None:
        children = await self._revision_children(model, revision)
        doomed = [live for live, _ in children.values()]
        in_watch = {key for key, (_, hidden) in children.items() if not hidden}  # their deletion comes back as an event
        # Named by the Deployments, so looked up before they go. One nobody recorded (the operator
        # stopped between creating it and its Deployments) stays until the model is deleted: it is
        # owned by the model, and the operator cannot list Secrets to find it.
        owner = _owner(model)
        known = self._transfer_secrets.pop(_revision_key(owner, revision), None)
        named = await self._transfer_secret_candidates(owner, revision, known, self._recorded_transfer_secrets(owner, revision, known))
        pool = ObjectRef("InferencePool", inference_pool_name(model.name, revision), model.namespace)  # 404 when none
        # The Secrets first: only the Deployments name them, so a stop (a failover) after the
        # Deployments went left the key behind for the model's life (outside probe). The running
        # pods hold it already; a stop after the Secrets leaves Deployments that still name them.
        refs = [ObjectRef("Secret", name, model.namespace) for name in named] + [ref_of(o) for o in doomed] + [pool]
        for ref in refs:
            key = (ref.kind, ref.namespace or "", ref.name)
            if key in in_watch:
                self._deleting.add(key)  # before the DELETE: its watch event may come before the answer
            deleted = False
            try:
                deleted = await self.kube.adelete(ref)
            finally:
                if not deleted:
                    self._deleting.discard(key)  # no event will come for it
            if deleted:
                log.info("deleted %s of revision %s", ref, revision)
            self.forget(key)

    async def _revision_children(
        self, model: ModelRef, revision: str, kinds: Sequence[str] = REVISION_CHILD_KINDS
    ) -> dict[ObjectKey, tuple[Mapping[str, Any], bool]]:
        """The revision's children of `kinds` that exist, each with whether the watch cache lacks
        it: one whose labels someone took off leaves the cache, not the cluster, and must still be
        scaled down and deleted with its revision. Those the cache does not show are read by name
        (none, normally) and kept only if the model controls them."""
        expected = [key for role in ROLES for key in _child_keys(model, revision, role) if key[0] in kinds]
        cached = {_key(o): o for o in self._owned(model) if _key(o) in expected}
        missing = [key for key in expected if key not in cached]
        fetched = await asyncio.gather(*(self.kube.aget(ObjectRef(key[0], key[2], key[1])) for key in missing))
        found = {key: (obj, False) for key, obj in cached.items()}
        found.update({key: (obj, True) for key, obj in zip(missing, fetched, strict=True) if obj is not None and self._is_ours(obj, model)})
        return found

    async def observe(self, model: ModelRef) -> Observation:
        await self._relabel_left(model)
        owned = self._owned(model)
        deployments = [deployment_state(o) for o in owned if o.get("kind") == "Deployment"]
        present = sorted(_revisions(owned))
        service = next((o for o in owned if o.get("kind") == "Service" and o["metadata"]["name"] == model.name), None)
        serving = (((service or {}).get("spec") or {}).get("selector") or {}).get(LABEL_REVISION)
        return Observation(revisions=revision_views(deployments, present), serving=serving)

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        if self._resolver is not None:
            return await self._resolver(model, revision)
        router = f"http://{object_name(model.name, revision, 'router')}.{model.namespace}.svc:{HTTP_PORT}"
        pods = await self.kube.alist("Pod", model.namespace, {LABEL_MODEL: model.name, LABEL_REVISION: revision})
        workers: list[WorkerEndpoint] = []
        routers: list[WorkerEndpoint] = []
        for pod in pods:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            role = labels.get(LABEL_ROLE)
            if owned_by_revision(pod, model.name, revision) and role in ("prefill", "decode", "router") and pod_is_serving(pod):
                ip, name = pod["status"]["podIP"], pod["metadata"]["name"]
                sglang = role != "router" and labels.get(LABEL_ENGINE) == EngineKind.SGLANG.value
                log = PodLog(self.kube, model.namespace, name) if sglang else None
                endpoint = WorkerEndpoint(name, role, f"http://{ip}:{metrics_port(pod)}/metrics", log)
                (routers if role == "router" else workers).append(endpoint)
        return RevisionEndpoints(router_url=router, workers=tuple(sorted(workers, key=lambda w: w.name)),
                                 routers=tuple(sorted(routers, key=lambda w: w.name)))  # fmt: skip

    async def route_traffic(self, model: ModelRef, revision: str) -> None:
        await self.apply(render_model_service(_owner(model), revision), model)

    async def split_traffic(self, request: RevisionRequest, shares: tuple[Share, ...]) -> None:
        """The InferencePools (first: the route names them) and the HTTPRoute, server-side applied;
        then those of this model the spec no longer calls for are deleted (trafficRouter switched
        to service, or from inferencePool to gatewayAPI): a route left behind would keep sending
        traffic to a revision that is scaled to zero."""
        model, wanted = request.model, render_traffic(request.spec, _owner(request.model), shares)
        made = self._traffic.setdefault(model.key, set())
        for manifest in wanted:
            await self.apply(manifest, model)
            made.add(_key(manifest))  # one at a time: a later one refused (foreign) leaves this one known
        await self._sweep_traffic(model, {_key(m) for m in wanted})

    async def _sweep_traffic(self, model: ModelRef, kept: set[ObjectKey]) -> None:
        """Delete this model's traffic objects outside `kept`: those this process applied, and once
        per process the model's HTTPRoute and the InferencePools of its revisions (an earlier
        process or leader may have made them). Never one that is not the model's own."""
        made = self._traffic.setdefault(model.key, set())
        stale = made - kept
        if model.key not in self._traffic_swept:
            earlier = {("InferencePool", model.namespace, inference_pool_name(model.name, r)) for r in _revisions(self._owned(model))}
            stale |= ({("HTTPRoute", model.namespace, route_name(model.name))} | earlier) - kept
        for key in stale:
            ref = ObjectRef(key[0], key[2], key[1])
            meta = await self.kube.aget_metadata(ref)
            if meta is not None and self._is_ours(meta, model) and await self.kube.adelete(ref):
                log.info("deleted %s: spec.rollout no longer routes through it", ref)
            self.forget(key)
            made.discard(key)
        self._traffic_swept.add(model.key)

    async def still_foreign(self, model: ModelRef, found: Sequence[ForeignObjectError]) -> list[ForeignObjectError]:
        still = []
        for error in found:
            if error.ref is None:
                continue
            kind, name, namespace = error.ref
            meta = await self.kube.aget_metadata(ObjectRef(kind, name, namespace))
            if meta is not None and not self._is_ours(meta, model):
                still.append(error)
        return still

    # --- applying -------------------------------------------------------------------------------
    async def apply(self, manifest: Mapping[str, Any], model: ModelRef, *, checked: bool = False) -> None:
        """Server-side apply of one child, unless it already holds exactly this manifest.
        `checked`: `_refuse_foreign` has looked at its name in this pass already."""
        desired, digest = with_digest(manifest)
        key, ref = _key(desired), ref_of(desired)
        live: Mapping[str, Any] | None
        if key[0] in UNWATCHED_KINDS:
            live = await self._read_unwatched(key, ref, model)
        else:
            live = self._live(key, model)
        if self._up_to_date(key, live, desired, model):
            return
        if not checked:
            await self._refuse_foreign([manifest], model)
        try:
            result = await self.kube.aapply(desired)
        except KubeError as exc:
            if not _recreate_to_apply(desired, exc):
                raise
            result = await self._recreate(key, ref, desired, exc)
        self._applied[key] = Applied(digest, _replicas(result), _generation(result), model.uid, _resource_version(result),
                                     _metadata_mismatches(result, desired))  # fmt: skip
        log.info("applied %s", ref)

    async def _recreate(self, key: ObjectKey, ref: ObjectRef, desired: Mapping[str, Any], refused: KubeError) -> dict[str, Any]:
        """Delete a child the API server will not change in place, and apply it anew (as `kubectl
        apply --force` does). A Service made by an earlier release with a virtual IP, now rendered
        headless: its clusterIP is immutable. Nothing reaches a revision's worker Services but its
        router, which resolves their names again every second."""
        log.info("%s cannot be changed in place (%s): replacing it", ref, refused)
        watched = key[0] not in UNWATCHED_KINDS
        if watched:
            self._deleting.add(key)  # its DELETED event is this process's own (before the DELETE: it may come first)
        if not await self.kube.adelete(ref) and watched:
            self._deleting.discard(key)
        self.forget(key)
        return await self.kube.aapply(desired)

    async def _refuse_foreign(self, manifests: Sequence[Mapping[str, Any]], model: ModelRef) -> None:
        """ForeignObjectError for the first child name someone else's object holds. Asked of the
        API server (metadata only, concurrently) for the watched kinds this process has not applied
        for this model and its watch cache does not show as the model's; unwatched kinds are
        checked on every apply (`_read_unwatched`)."""
        unknown = [ref_of(m) for m in manifests if (key := _key(m))[0] not in UNWATCHED_KINDS
                   and self._known(key, model) is None and self._live(key, model) is None]  # fmt: skip
        found = await asyncio.gather(*(self.kube.aget_metadata(ref) for ref in unknown))
        for ref, meta in zip(unknown, found, strict=True):
            if meta is not None and not self._is_ours(meta, model):
                raise _foreign(ref, model)

    def _known(self, key: ObjectKey, model: ModelRef) -> Applied | None:
        """What this process applied under the child's name for this model (what it applied for an
        earlier model of the same name, deleted since, proves nothing now and is dropped)."""
        known = self._applied.get(key)
        if known is not None and known.owner_uid != model.uid:
            del self._applied[key]
            return None
        return known

    def _live(self, key: ObjectKey, model: ModelRef) -> Mapping[str, Any] | None:
        return next((o for o in self._owned(model) if _key(o) == key), None)

    async def _read_unwatched(self, key: ObjectKey, ref: ObjectRef, model: ModelRef) -> dict[str, Any] | None:
        """The metadata of a child no watch reports on: gone means apply it again (someone deleted
        it), a newer generation means someone edited it; one that is not ours is never touched."""
        live = await self.kube.aget_metadata(ref)
        if live is None:
            self.forget(key)
        elif not self._is_ours(live, model):
            raise _foreign(ref, model)
        return live

    def _up_to_date(self, key: ObjectKey, live: Mapping[str, Any] | None, desired: Mapping[str, Any], model: ModelRef) -> bool:
        """Does the child hold `desired` (with its digest annotation) already, as this process
        applied it? A child this process has not applied yet is applied once (after a start or on
        taking the lead: someone may have edited it while no operator led; an unchanged object
        makes that apply a no-op). Someone else's edit shows as a newer generation (spec) or as
        labels or annotations of ours changed (metadata, which bumps no generation): either is
        applied over. No live object while this process remembers applying it is the watch cache
        lagging behind that apply: a deletion, or the loss of the labels the watch selects by,
        reaches the watch as DELETED and makes it forget first."""
        known = self._known(key, model)
        if known is None:
            return False
        digest = desired["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
        return known.digest == digest and known.replicas == _replicas(desired) and not _edited_since(live, known, desired)

    def forget_model(self, model: tuple[str, str]) -> None:
        """The model is gone (its children with it, by owner reference): what was kept of it goes."""
        for key in {model, (model[0] or "default", model[1])}:
            self._traffic.pop(key, None)
            self._traffic_swept.discard(key)
        for gone in [k for k in self._transfer_secrets if k[:2] in ((model[0], model[1]), (model[0] or "default", model[1]))]:
            del self._transfer_secrets[gone]
        self._left.pop(model, None)

    def forget(self, key: ObjectKey) -> None:
        """A child was deleted (its watch said so): apply it again when it is wanted."""
        self._applied.pop(key, None)

    def child_left(self, child: Mapping[str, Any], model_known: bool) -> None:
        """The watch reports a child gone: deleted, or its labels (the watch's selector) taken off.
        It is applied again when its revision is; unless this process deleted it, the model's
        next pass also looks whether it is still there without its labels, whatever its revision's
        state (an old revision parked at zero, the stable one after a rollback), so that the watch,
        and every decision after, sees it again. `model_known`: the owner is a live model (one
        being deleted takes its children with it)."""
        meta = child.get("metadata") or {}
        key: ObjectKey = (str(child.get("kind")), meta.get("namespace") or "", meta.get("name") or "")
        self.forget(key)
        owner = owner_key(child)
        if key in self._deleting or owner is None or not model_known:
            self._deleting.discard(key)
            return
        had = {k: v for k, v in (meta.get("labels") or {}).items() if k in OPERATOR_LABEL_KEYS}
        if had.get(LABEL_MODEL) == owner[1]:  # the previous state (a real watch sends it): the operator's labels
            self._left.setdefault(owner, {})[key] = had

    async def _relabel_left(self, model: ModelRef) -> None:
        """Children of the model that left the watch but not the cluster get the operator's labels
        back (a merge patch; read by name first: most that leave were deleted). A child's record
        goes once it is handled: a failed request leaves it for the pass that is retried."""
        left = self._left.get(model.key, {})
        keys = list(left)
        found = await asyncio.gather(*(self.kube.aget_metadata(ObjectRef(key[0], key[2], key[1])) for key in keys))
        for key, meta in zip(keys, found, strict=True):
            had = left[key]
            have = (meta or {}).get("metadata", {}).get("labels") or {}
            if meta is not None and self._is_ours(meta, model) and any(have.get(k) != v for k, v in had.items()):
                await self._put_labels_back(ObjectRef(key[0], key[2], key[1]), had)
            del left[key]
        if not left:
            self._left.pop(model.key, None)

    async def _put_labels_back(self, ref: ObjectRef, had: Mapping[str, str]) -> None:
        try:
            await self.kube.amerge_patch(ref, {"metadata": {"labels": dict(had)}}, field_manager=FIELD_MANAGER)
        except KubeError as exc:
            if exc.status != 404:  # deleted since the read: nothing to put back
                raise
            return
        log.info("put the operator's labels back on %s", ref)

    # --- the transfer Secret (S3) ----------------------------------------------------------------
    async def ensure_transfer_secret(self, owner: Owner, revision: str) -> str:
        """The name of the revision's KV-transfer Secret. A revision whose Deployments name none,
        or only Secrets that are not there (deleted), gets a new Secret under a new random name. Its
        pods then roll to the new key together (their env names the Secret), rather than old pods
        keeping the old key while restarted ones read a new key under the old name and no transfer
        between the two authenticates. Never read back: a Secret someone else created under a name
        the operator might choose is impossible to plant first (the suffix is random), and one in
        the way of a new name only makes the operator draw another."""
        key = _revision_key(owner, revision)
        known = self._transfer_secrets.get(key)
        recorded = self._recorded_transfer_secrets(owner, revision, known)
        if known is not None and recorded <= {known.name} and time.monotonic() - known.checked_at < SECRET_RECHECK_SECONDS:
            return known.name
        retired, name = known.retired if known is not None else frozenset(), None
        for candidate in await self._transfer_secret_candidates(owner, revision, known, recorded):
            if await self._transfer_secret_exists(owner, revision, candidate):
                name = candidate
                break
            # Nothing watches Secrets: this check is how the operator learns of a deleted one.
            log.warning("Secret %s/%s, named for revision %s's KV-transfer key, is not there; its pods move to one that is",
                        owner.namespace, candidate, revision)  # fmt: skip
            retired |= {candidate}
        if name is None:
            name = await self._create_transfer_secret(owner, revision)
        self._transfer_secrets[key] = KnownSecret(name, time.monotonic(), retired)
        return name

    async def _create_transfer_secret(self, owner: Owner, revision: str) -> str:
        for _ in range(3):
            name = transfer_secret_name(owner.name, revision, secrets.token_hex(4))
            if await self.kube.acreate(render_transfer_secret(owner, revision, secrets.token_bytes(32), name)) is not None:
                log.info("created the KV-transfer Secret %s/%s of revision %s", owner.namespace, name, revision)
                return name
        raise KubeError(409, f"three new names for the KV-transfer Secret of {owner.namespace}/{owner.name} revision {revision} "
                             "were taken; retrying")  # fmt: skip

    async def _transfer_secret_exists(self, owner: Owner, revision: str, name: str) -> bool:
        """A dry-run create: 409 when the Secret is there; nothing is stored either way. (The key
        is random all the same, so an API server that ignored dryRun would store nothing usable.)
        A refusal for another reason (a full Secret quota, an admission webhook) cannot tell, and
        the name is kept: a Secret really gone shows in its pods (transfer_secret_missing)."""
        probe = render_transfer_secret(owner, revision, secrets.token_bytes(32), name)
        try:
            return await self.kube.acreate(probe, dry_run=True) is None
        except KubeError as exc:
            if exc.status not in (400, 403, 422):
                raise
            log.warning("could not check Secret %s/%s (%s); keeping it", owner.namespace, name, exc)
            return True

    async def _transfer_secret_candidates(self, owner: Owner, revision: str, known: KnownSecret | None, recorded: set[str]) -> list[str]:
        """The names the revision's Secret may have, the most trusted first: the one this replica
        made or checked, then those the revision's Deployments record (`recorded`, from the watch
        cache: an edit of their annotation cannot move the revision off a Secret that is there).
        The Deployments are read by name only when neither the memory nor the cache knows any."""
        if known is None and not recorded:
            recorded = await self._fetched_transfer_secrets(owner, revision)
        first = [known.name] if known is not None else []
        return first + sorted(recorded - set(first))

    def _recorded_transfer_secrets(self, owner: Owner, revision: str, known: KnownSecret | None) -> set[str]:
        """The Secrets the revision's Deployments name, by their annotation in the watch cache (no
        request), but for names this replica found gone (a cache behind its own apply)."""
        names = {object_name(owner.name, revision, role) for role in ROLES}
        model = ModelRef(owner.namespace, owner.name, owner.uid)
        recorded = _recorded_in([o for o in self._owned(model) if o.get("kind") == "Deployment" and o["metadata"]["name"] in names],
                                owner, revision)  # fmt: skip
        return recorded - known.retired if known is not None else recorded

    async def _fetched_transfer_secrets(self, owner: Owner, revision: str) -> set[str]:
        """The same, from the Deployments read by name: just after a start the watches may not
        have listed everything yet, and Deployments made before the annotation name it only in
        their pods' env."""
        model = ModelRef(owner.namespace, owner.name, owner.uid)
        names = sorted({object_name(owner.name, revision, role) for role in ROLES})
        fetched = await asyncio.gather(*(self.kube.aget(ObjectRef("Deployment", n, owner.namespace)) for n in names))
        return _recorded_in([d for d in fetched if d is not None and self._is_ours(d, model)], owner, revision)

    def transfer_secret_missing(self, pod: Mapping[str, Any]) -> tuple[str, str] | None:
        """A pod of a revision waits for its KV-transfer Secret, which the kubelet cannot find
        (deleted): the model's next pass checks for it whatever the recheck interval said, so its
        pods roll onto a new Secret within a pass rather than within SECRET_RECHECK_SECONDS. The
        (namespace, model) to pass over, or None when the pod waits for no such Secret."""
        where = model_revision_of(pod)
        if where is None:
            return None
        namespace, model, revision = where
        missing = {n for n in secrets_missing(pod) if is_transfer_secret_name(n, model, revision)}
        if not missing:
            return None
        for key, known in list(self._transfer_secrets.items()):
            if key[0] == namespace and key[1] == model and key[3] == revision and known.name in missing:
                self._transfer_secrets[key] = known._replace(checked_at=-math.inf)
        return namespace, model

    def forget_everything(self) -> None:
        """This replica stops leading: what it applied and which Secrets it knew may be stale when
        it leads again (a later leader may re-apply, delete a revision's Secret or make a new one,
        and nobody may undo someone's edit meanwhile), so it starts over as a new process would."""
        self._applied.clear()
        self._transfer_secrets.clear()
        self._traffic.clear()
        self._traffic_swept.clear()
        self._left.clear()
        self._deleting.clear()

    # --- reads from the index -------------------------------------------------------------------
    def _owned(self, model: ModelRef) -> list[Mapping[str, Any]]:
        return [o for o in self.index.children(model.namespace, model.name) if owned_by(o, model.name, model.uid)]

    @staticmethod
    def _is_ours(meta: Mapping[str, Any], model: ModelRef) -> bool:
        return owned_by(meta, model.name, model.uid)


def _edited_since(live: Mapping[str, Any] | None, known: Applied, desired: Mapping[str, Any]) -> bool:
    """Did someone else write the child after this process did? Not known while the watch cache
    has no view of it, or only one older than this process's own write."""
    if live is None or _older(live, known.resource_version):
        return False
    generation = _generation(live)
    newer = generation is not None and known.generation is not None and generation > known.generation
    return newer or bool(_metadata_mismatches(live, desired) - known.unheld)


def _metadata_mismatches(live: Mapping[str, Any], desired: Mapping[str, Any]) -> frozenset[MetadataKey]:
    """The labels and annotations the operator sets (the digest among them) that do not have its
    value on the live object (others' additions are theirs to keep)."""
    have, want = live.get("metadata") or {}, desired["metadata"]
    return frozenset((field, k) for field in ("labels", "annotations") for k, v in (want.get(field) or {}).items()
                     if (have.get(field) or {}).get(k) != v)  # fmt: skip


def _child_keys(model: ModelRef, revision: str, role: Role) -> list[ObjectKey]:
    """The watched children a revision has for a role (the Service is named as its Deployment)."""
    name = object_name(model.name, revision, role)
    return [("Deployment", model.namespace, name), ("Service", model.namespace, name),
            ("NetworkPolicy", model.namespace, network_policy_name(model.name, revision, role))]  # fmt: skip


def _revision_key(owner: Owner, revision: str) -> RevisionKey:
    return owner.namespace, owner.name, owner.uid, revision


def _recorded_in(deployments: Sequence[Mapping[str, Any]], owner: Owner, revision: str) -> set[str]:
    names = (transfer_secret_of(d) for d in deployments)
    return {n for n in names if n is not None and is_transfer_secret_name(n, owner.name, revision)}


def _scale_patch(live: Mapping[str, Any], replicas: int | None) -> dict[str, Any] | None:
    current = _replicas(live)
    current = 1 if current is None else current
    saved = ((live.get("metadata") or {}).get("annotations") or {}).get(REPLICAS_ANNOTATION)
    if replicas == 0 and current != 0:
        return {"metadata": {"annotations": {REPLICAS_ANNOTATION: str(current)}}, "spec": {"replicas": 0}}
    if replicas is None and current == 0 and saved and saved.isdigit():
        return {"metadata": {"annotations": {REPLICAS_ANNOTATION: None}}, "spec": {"replicas": int(saved)}}
    if replicas is not None and replicas != 0 and current != replicas:
        return {"spec": {"replicas": replicas}}
    return None


class PodLog:
    """An engine pod's log through the API server (pods/log), for SGLang's KV-canary violations.
    The API answers by time, not offset: `appended` asks for the seconds since `mark`, rounded up
    plus one, so it may repeat a line from just before the run but never misses one of it."""

    LIMIT_BYTES = 8 << 20  # a suite's worth of log; a flood of lines must not exhaust the operator

    def __init__(self, kube: Kube, namespace: str, pod: str, container: str = ENGINE_CONTAINER) -> None:
        self.kube, self.namespace, self.pod, self.container = kube, namespace, pod, container
        self._marked = time.monotonic()

    @property
    def name(self) -> str:
        return f"pod/{self.pod} ({self.namespace})"

    async def mark(self) -> None:
        self._marked = time.monotonic()

    async def appended(self) -> str:
        since = math.ceil(time.monotonic() - self._marked) + 1
        return await self.kube.apod_log(self.namespace, self.pod, self.container, since_seconds=since,
                                        limit_bytes=self.LIMIT_BYTES)


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The pod's read-only metrics port: the container port named `metrics` (kvguard), else `http`
    (SGLang and vLLM serve /metrics beside their API)."""
    named = {p.get("name"): p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []}
    return int(named.get("metrics") or named.get("http") or HTTP_PORT)


def owned_by_revision(pod: Mapping[str, Any], model: str, revision: str) -> bool:
    """Pods carry the model/revision labels of their Deployment's template (no owner reference to us)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_MODEL) == model and labels.get(LABEL_REVISION) == revision
