"""kmock dressed as the kvguard API server for the tests that run kopf against it (see
../shared/reference/kmock-notes.md): our custom resources declared, a client pointed at it, and
`ApiServer`, an emulator that adds the API-server rules the operator's correctness depends on and
plain kmock lacks:

- every stored object gets `uid`, `creationTimestamp`, `generation` (bumped when `spec` changes)
  and a `resourceVersion` bumped on every write;
- a PATCH whose body carries `metadata.resourceVersion` is a precondition: 409 Conflict when the
  object has moved on (how Kubernetes does optimistic concurrency);
- label selectors on LIST and WATCH (equality, inequality and existence terms) filter the objects;
  on a WATCH, an object that stops matching is sent as DELETED (its previous state) and one
  that starts as ADDED;
- server-side apply (`application/apply-patch+yaml`) creates a missing object, and on an existing
  one removes the fields the same field manager applied before and leaves out now. Lists are
  replaced whole: right for a single manager that owns every list it sets, which is the operator's
  case (real SSA merges map-lists by key, which only matters with several managers).

- a write that changes a field the API server keeps immutable (a Deployment's selector, an
  immutable Secret's data, a Service's clusterIP) is refused with 422 Invalid;
- strategic-merge patches (`application/strategic-merge-patch+json`) merge the lists the
  operator patches by their merge key, as Kubernetes' patchMergeKey does: a pod's
  `status.conditions` by `type` and `containerStatuses` by `name` (the readiness gate's condition
  is set beside the kubelet's, not instead of them); other lists are replaced;
- pods' `status` is a subresource as on a real API server: a patch of `pods/NAME` leaves the
  status as it was, a patch of `pods/NAME/status` leaves the spec (so a readiness-gate condition
  written to the wrong endpoint is lost here too); other kinds take both anywhere;
- a create with `dryRun=All` answers as the create would (409 when the object is there, 201
  otherwise) and stores nothing;
- `secret_quota` plays a ResourceQuota on count/secrets: creates past it, dry runs included, are
  refused with 403. What it does not
  enforce: the kubelet's own rules (it never recomputes `Ready` from readiness gates: tests that
  need `Ready` play the kubelet), admission of who may write `pods/status` (RBAC), and the fields a
  status update may not touch besides `spec` (labels, annotations).

It stays an emulator: no defaulting, no schema or CEL validation (tests/crd_admission.py), no
garbage collection, no scheduler, no kubelet (tests set pod conditions). Tests that depend on
those say so.
"""

from __future__ import annotations

import collections
import copy
import datetime as dt
import itertools
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import kmock as km
import kubernetes
from kmock._internal import apps as kmock_apps
from kmock._internal import k8s as kmock_k8s
from kmock._internal import rendering as kmock_rendering

VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
APPLY_PATCH = "application/apply-patch+yaml"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
MERGE_KEYS = {"conditions": "type", "containerStatuses": "name"}
"""patchMergeKey of the lists a strategic-merge patch merges (core/v1 PodStatus)."""


def immutable_change(plural: str, live: Mapping[str, Any], target: Mapping[str, Any]) -> str | None:
    """The API server's message for a write that changes a field it keeps immutable (422
    Invalid), or None. The ones the operator's children have: a Deployment's selector (apps/v1),
    an immutable Secret's data and a Service's clusterIP."""
    def get(obj: Mapping[str, Any], *path: str) -> Any:
        for step in path:
            obj = (obj or {}).get(step) if isinstance(obj, Mapping) else None
        return obj

    if plural == "deployments" and get(live, "spec", "selector") != get(target, "spec", "selector"):
        return "spec.selector: Invalid value: field is immutable"
    if plural == "secrets" and get(live, "immutable") and (live.get("data"), live.get("immutable")) != (target.get("data"), target.get("immutable")):
        return "data: Forbidden: field is immutable when `immutable` is set"
    if plural == "services" and get(live, "spec", "clusterIP") and get(live, "spec", "clusterIP") != get(target, "spec", "clusterIP"):
        return "spec.clusterIP: Invalid value: field is immutable"
    return None


def declare_kvguard_resources(kmock: Any, *, policies: bool = False) -> str:
    """Built-in kinds plus InferenceModel (and InferencePolicy); returns the emulator's URL."""
    kmock.resources.load_bundled()
    kmock.resources["kvguard.io/v1alpha1/inferencemodels"] = km.ResourceInfo(
        kind="InferenceModel", namespaced=True, subresources={"status"}, verbs=VERBS
    )
    # The kinds a progressive rollout applies (trafficRouter gatewayAPI / inferencePool).
    kmock.resources["gateway.networking.k8s.io/v1/httproutes"] = km.ResourceInfo(kind="HTTPRoute", namespaced=True, verbs=VERBS)
    kmock.resources["inference.networking.k8s.io/v1/inferencepools"] = km.ResourceInfo(kind="InferencePool", namespaced=True, verbs=VERBS)
    if policies:
        kmock.resources["kvguard.io/v1alpha1/inferencepolicies"] = km.ResourceInfo(
            kind="InferencePolicy", namespaced=False, subresources={"status"}, verbs=VERBS
        )
    return str(kmock.url).rstrip("/")


def client_configuration(url: str, *, make_default: bool = False) -> kubernetes.client.Configuration:
    """A `kubernetes` client configuration for the emulator; optionally the process-wide default."""
    cfg = kubernetes.client.Configuration()
    cfg.host = url
    if make_default:
        kubernetes.client.Configuration.set_default(cfg)
        kubernetes.client.ApiClient.set_default(kubernetes.client.ApiClient(cfg))
    return cfg


# --- label selectors -----------------------------------------------------------------------------


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality-based selectors (`a=b`, `a==b`, `a!=b`, `a`, `!a`), comma-joined (all must hold)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


# --- server-side apply, single manager ----------------------------------------------------------


def field_paths(config: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every key path a config sets (maps recursed into; lists and scalars are leaves)."""
    paths: set[tuple[str, ...]] = set()
    if isinstance(config, Mapping):
        for key, value in config.items():
            paths.add((*prefix, key))
            paths |= field_paths(value, (*prefix, key))
    return paths


def _delete_path(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = obj
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _merge(base: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in config.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def server_side_apply(live: Mapping[str, Any], previous: Mapping[str, Any] | None, config: Mapping[str, Any]) -> dict[str, Any]:
    """The object after `config` is applied by the manager whose last applied config was `previous`."""
    result = copy.deepcopy(dict(live))
    dropped = field_paths(previous or {}) - field_paths(config)
    for path in sorted(dropped, key=len):
        if path[:1] != ("metadata",) or path[:2] in (("metadata", "labels"), ("metadata", "annotations")):
            _delete_path(result, path)
    return _merge(result, config)


def strategic_merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A strategic-merge patch applied to `base` for the lists in MERGE_KEYS (entries merged by
    their key, new keys appended); every other value as a JSON merge patch would."""
    for key, value in patch.items():
        merge_key = MERGE_KEYS.get(key)
        if merge_key and isinstance(value, list) and isinstance(base.get(key), list):
            merged = [copy.deepcopy(item) for item in base[key]]
            for item in value:
                at = next((i for i, old in enumerate(merged) if old.get(merge_key) == item.get(merge_key)), None)
                if at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = strategic_merge(merged[at], item)
            base[key] = merged
        elif isinstance(value, Mapping) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def merge_patch_that_makes(live: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning `live` into `target` (None removes a key)."""
    patch: dict[str, Any] = {key: None for key in live if key not in target}
    for key, value in target.items():
        if isinstance(value, Mapping) and isinstance(live.get(key), Mapping):
            patch[key] = merge_patch_that_makes(live[key], value)
        else:
            patch[key] = copy.deepcopy(value)
    return patch


_POD_LOG = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log")

# --- the emulator --------------------------------------------------------------------------------


class _DirectDispatch(kmock_apps.RawHandler):
    """Serves Kubernetes verbs straight from the emulator's handlers. kmock matches every request
    against its reaction DSL by scanning its request log (tens of ms per request after a few
    thousand), which would make the emulator, not the operator, what a scale test measures. The
    ApiServer registers no reactions of its own beyond the emulator's fallbacks, so this is the
    same answer, found directly; anything else (discovery) goes through kmock's matching."""

    async def _handle(self, request: Any) -> Any:
        direct = getattr(self, "_direct", None)
        if direct is not None and request.resource is not None and request.resource.plural and request.action in direct:
            return await direct[request.action](request)
        return await super()._handle(request)


class ApiServer(km.KubernetesEmulator, _DirectDispatch):
    """kmock plus resourceVersion, generation, preconditions, selectors and server-side apply."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._direct = {
            km.action.LIST: kmock_rendering.Response.guess(self._serve_list),
            km.action.WATCH: kmock_rendering.Response.guess(self._serve_watch),
            km.action.FETCH: kmock_rendering.Response.guess(self._serve_fetch),
            km.action.CREATE: kmock_rendering.Response.guess(self._serve_create),
            km.action.UPDATE: kmock_rendering.Response.guess(self._serve_update),
            km.action.DELETE: kmock_rendering.Response.guess(self._serve_delete),
        }
        # The kubernetes client's VersionApi asks for "/version/" (a real API server answers both);
        # `kvguard operator` checks its credentials with it before it starts.
        self.fallback["get /version/"] << self._serve_server_version
        self._versions = itertools.count(1)
        self._applied: dict[tuple[Any, str], dict[str, Any]] = {}
        self.conflicts = 0
        """409s answered to stale resourceVersion preconditions."""
        self.status_writes: list[dict[str, Any]] = []
        """Every status PATCH: object, precondition, outcome (what `no lost write` is checked on)."""
        self.keep_requests: int | None = None
        """Keep only this many requests in kmock's log (None: all). kmock matches each request
        against its whole log, so a long run (the scale benchmark) must trim it."""
        self.secret_quota: int | None = None
        """A ResourceQuota's count/secrets in every namespace (None: no quota)."""
        self.requests_total = 0
        self.requests_by: collections.Counter[tuple[str, str]] = collections.Counter()
        """Requests by (method, resource plural or path), whatever the log keeps."""
        self.pod_logs: dict[tuple[str, str, str], list[tuple[float, str]]] = collections.defaultdict(list)
        """(namespace, pod, container) -> (time written, line): what the kubelet would serve."""

    def write_pod_log(self, namespace: str, pod: str, line: str, container: str = "engine") -> None:
        """A line the container writes now (a test plays the engine)."""
        self.pod_logs[namespace, pod, container].append((time.time(), line))

    async def _serve_pod_log(self, request: Any, namespace: str, pod: str) -> Any:
        """GET pods/{name}/log with sinceSeconds and limitBytes, as the kubelet answers it
        (plain text, lines newer than the cut-off; 400 when a pod has several containers and
        none is named)."""
        container = request.params.get("container")
        if container is None:
            return aiohttp.web.Response(status=400, text="a container name must be given")
        since = request.params.get("sinceSeconds")
        cutoff = time.time() - int(since) if since is not None else float("-inf")
        text = "".join(f"{line}\n" for at, line in self.pod_logs.get((namespace, pod, container), []) if at >= cutoff)
        limit = request.params.get("limitBytes")
        data = text.encode()[: int(limit)] if limit is not None else text.encode()
        return aiohttp.web.Response(body=data, content_type="text/plain", charset="utf-8")

    async def _handle(self, request: Any) -> Any:
        self.requests_total += 1
        self.requests_by[(str(request.method), request.resource.plural if request.resource is not None else request.url.path)] += 1
        pod_log = _POD_LOG.fullmatch(request.url.path)
        if pod_log is not None and request.method == km.method.GET:
            return await self._serve_pod_log(request, *pod_log.groups())
        try:
            if (refused := self._over_secret_quota(request)) is not None:
                return await self._render_error(refused)
            if request.resource is not None and request.action == km.action.CREATE and request.params.get("dryRun") == "All":
                return await self._dry_run_create(request)
            if request.resource is not None:
                try:
                    await self._bookkeep(request)
                except kmock_k8s.KubernetesError as exc:
                    return await self._render_error(exc)
            return await super()._handle(request)
        finally:
            if self.keep_requests is not None and len(self._requests) > self.keep_requests:
                del self._requests[: len(self._requests) - self.keep_requests]

    def _over_secret_quota(self, request: Any) -> Exception | None:
        """A ResourceQuota on count/secrets, as its admission answers a create (dry runs too)."""
        if self.secret_quota is None or request.resource is None or request.resource.plural != "secrets" or request.action != km.action.CREATE:
            return None
        held = sum(1 for (resource, namespace, _), obj in self.objects.items()
                   if resource.plural == "secrets" and namespace == request.namespace and not obj.deleted)  # fmt: skip
        if held < self.secret_quota:
            return None
        return kmock_k8s.KubernetesError(403, "Forbidden", f"exceeded quota: secrets, requested: count/secrets=1, used: count/secrets={held}, "
                                         f"limited: count/secrets={self.secret_quota}")  # fmt: skip

    async def _dry_run_create(self, request: Any) -> Any:
        meta = request.data.get("metadata", {}) if isinstance(request.data, dict) else {}
        key = (request.resource, request.namespace or meta.get("namespace"), meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            return await self._render_error(kmock_k8s.KubernetesObjectConflictError())
        return aiohttp.web.json_response(request.data, status=201)

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def _bookkeep(self, request: Any) -> None:
        action = request.action
        if action == km.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))  # tests seed uids they assert on
            meta["resourceVersion"] = self._next_version()
            meta["generation"] = 1
            meta.setdefault("creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif action == km.action.UPDATE and request.name is not None and isinstance(request.data, dict):
            await self._patch(request)

    async def _patch(self, request: Any) -> None:
        key = (request.resource, request.namespace, request.name)
        stored = self.objects[key] if key in self.objects else None
        live = None if stored is None or stored.deleted else copy.deepcopy(stored.raw)
        headers = {k.lower(): v for k, v in request.headers.items()}
        is_apply = headers.get("content-type", "").startswith(APPLY_PATCH)
        is_strategic = headers.get("content-type", "").startswith(STRATEGIC_MERGE_PATCH)
        if is_apply:
            manager = request.params.get("fieldManager", "")
            if live is None:
                await self._create_by_apply(request, key, manager)
                return
            target = server_side_apply(live, self._applied.get((key, manager)), request.data)
            self._applied[(key, manager)] = copy.deepcopy(request.data)
        else:
            if live is None:
                return  # kmock answers 404
            wanted = ((request.data.get("metadata") or {}).get("resourceVersion"))
            current = (live.get("metadata") or {}).get("resourceVersion")
            if request.subresource == "status":
                self.status_writes.append({"resource": request.resource.plural, "object": key[1:], "precondition": wanted, "current": current,
                                           "accepted": wanted is None or wanted == current,
                                           "agent": headers.get("user-agent", "")})  # fmt: skip
            if wanted is not None and wanted != current:
                self.conflicts += 1
                raise kmock_k8s.KubernetesError(409, "Conflict", f"the object has been modified (resourceVersion {current}, "
                                                f"precondition {wanted}); please apply your changes to the latest version")  # fmt: skip
            if is_strategic:
                target = strategic_merge(copy.deepcopy(live), request.data)
            else:
                target = _merge(copy.deepcopy(live), {k: v for k, v in request.data.items()})
            target = _drop_nones(target)
        if request.resource.plural == "pods":  # the status subresource, as a real API server keeps it
            keep = "spec" if request.subresource == "status" else "status"
            target[keep] = copy.deepcopy(live.get(keep))
            if target[keep] is None:
                del target[keep]
        refused = immutable_change(request.resource.plural, live, target)
        if refused is not None:
            raise kmock_k8s.KubernetesError(422, "Invalid", refused)
        meta = target.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_version()
        if request.subresource is None and live.get("spec") != target.get("spec"):
            meta["generation"] = int((live.get("metadata") or {}).get("generation") or 1) + 1
        request.data.clear()
        request.data.update(merge_patch_that_makes(live, target))

    async def _create_by_apply(self, request: Any, key: Any, manager: str) -> None:
        body = copy.deepcopy(request.data)
        meta = body.setdefault("metadata", {})
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_version(), generation=1,
                    creationTimestamp=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))  # fmt: skip
        async with self._lock:
            if key in self.objects and not self.objects[key].deleted:
                raise kmock_k8s.KubernetesError(409, "Conflict", "created concurrently")
            if key in self.objects:
                self.objects[key].create(body)
            else:
                self.objects[key] = body
            await self._buses[request.resource].put({"type": "ADDED", "object": self.objects[key].raw})
        self._applied[(key, manager)] = copy.deepcopy(request.data)
        request.data.clear()  # the object exists now: the UPDATE kmock goes on with changes nothing

    # Single-object reads by key (kmock scans every stored object to find one).
    def _stored(self, request: Any, namespace: str | None = None, name: str | None = None) -> Any:
        key = (request.resource, namespace if namespace is not None else request.namespace, name or request.name)
        obj = self.objects[key] if key in self.objects else None
        if obj is None or obj.empty:
            raise kmock_k8s.KubernetesObjectNotFoundError()
        return obj

    async def _serve_fetch(self, request: Any) -> Any:
        obj = self._stored(request)
        if obj.deleted:
            raise kmock_k8s.KubernetesObjectNotFoundError()
        return obj.raw

    async def _serve_create(self, request: Any) -> Any:
        meta = request.data.get("metadata", {})
        return self._stored(request, request.namespace or meta.get("namespace"), meta.get("name")).raw

    async def _serve_update(self, request: Any) -> Any:
        return self._stored(request).last.raw

    async def _serve_delete(self, request: Any) -> Any:
        return self._stored(request).last.raw

    async def _serve_list(self, request: Any) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [o for o in result["items"] if selector_matches(selector, _labels(o))]
        return result

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        """A label-selected watch as the API server's watch cache filters it: an object that
        stops matching the selector is sent as DELETED, carrying its previous state (the last one
        the stream showed, as the watch cache's convertToWatchEvent does); one that starts matching
        as ADDED; the stream never shows an object in a state that does not match."""
        selector = request.params.get("labelSelector")
        shown: dict[tuple[str, str], Any] = {}
        async for item in super()._serve_watch(request):
            if not selector or not isinstance(item, dict):
                yield item
                continue
            obj = item.get("object") or {}
            meta = obj.get("metadata") or {}
            key, matches = (meta.get("namespace") or "", meta.get("name") or ""), selector_matches(selector, _labels(obj))
            if item.get("type") == "DELETED" or not matches:
                if key in shown:
                    previous = shown.pop(key)
                    yield {**item, "type": "DELETED", "object": obj if item.get("type") == "DELETED" else previous}
                continue
            yield item if key in shown or item.get("type") == "ADDED" else {**item, "type": "ADDED"}
            shown[key] = obj


def _drop_nones(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_nones(v) for k, v in obj.items() if v is not None}
    return obj
