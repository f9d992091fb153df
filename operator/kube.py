"""The only module that talks to the Kubernetes API server.

Verbs used: get, list (always with a label selector where the objects are ours), create,
server-side apply (field manager `kvguard`, so a field the operator stops rendering is removed by
the API server), merge-patch (scaling; status with a resourceVersion precondition: a writer that
read a stale object gets 409 and must re-read and decide again), strategic-merge patch of pod
status (the readiness gate's condition, merged by type), delete. Requests go through the
`kubernetes` client's ApiClient with plain JSON bodies (the typed v37 APIs would round-trip every
body through their own models).

Every failure is a `KubeError`: HTTP errors keep their status; transport failures (timeouts,
resets, refused connections, TLS) become `TransportError` (status 0), so callers have one error
path, and `retriable` says whether backing off and trying again can help.

The calls are blocking; async callers use the `a*` wrappers, which run them on a worker thread so
the kopf event loop never blocks (a blocking call on the loop's own thread deadlocks on kmock).
Object bodies are never logged: a Secret body holds the KV-transfer HMAC key. The operator never
reads a Secret (its RBAC allows create and delete only); other children's ownership checks read
metadata only (`get_metadata`).
"""

from __future__ import annotations

import asyncio
import builtins  # `list` inside Kube is its method: annotations there name the type as builtins.list
import concurrent.futures
import datetime as dt
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from prometheus_client import Counter, Histogram

from kvguard.operator.metrics import REGISTRY

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
"""Pod status: its conditions merge by `type`, so setting one leaves the kubelet's alone."""
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "kvguard"
"""Server-side apply owner of every field the operator renders into its children."""
SCALE_FIELD_MANAGER = "kvguard-scale"
"""Owner of the replicas (and the saved-replicas annotation) a scale-down sets, apart from the
rendered fields, so the next apply of a rendered manifest takes replicas back on purpose (force)."""
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
REQUEST_TIMEOUT_SECONDS = 30
DEFAULT_CONCURRENCY = 16
"""API requests in flight at once per client (threads and pooled connections)."""
T = TypeVar("T")

API_REQUESTS = Counter(
    "kvguard_operator_api_requests",
    "Requests the operator sent to the Kubernetes API server (watches excluded), by verb and status (0: transport error).",
    ["verb", "code"],
    registry=REGISTRY,
)
API_REQUEST_SECONDS = Histogram(
    "kvguard_operator_api_request_seconds",
    "Latency of the operator's requests to the Kubernetes API server, as its client sees it.",
    registry=REGISTRY,
)


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    api_version: str
    plural: str
    namespaced: bool = True

    def collection_path(self, namespace: str | None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"


KINDS: dict[str, Kind] = {
    "Deployment": Kind("apps/v1", "deployments"),
    "Service": Kind("v1", "services"),
    "Secret": Kind("v1", "secrets"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "HTTPRoute": Kind("gateway.networking.k8s.io/v1", "httproutes"),
    "InferencePool": Kind("inference.networking.k8s.io/v1", "inferencepools"),
    "Event": Kind("v1", "events"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Pod": Kind("v1", "pods"),
    "Lease": Kind("coordination.k8s.io/v1", "leases"),
    "InferenceModel": Kind("kvguard.io/v1alpha1", "inferencemodels"),
    "InferencePolicy": Kind("kvguard.io/v1alpha1", "inferencepolicies", namespaced=False),
}


@dataclass(frozen=True)
class ObjectRef:
    kind: str
    name: str
    namespace: str | None = None

    @property
    def path(self) -> str:
        return f"{KINDS[self.kind].collection_path(self.namespace)}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"


def ref_of(manifest: Mapping[str, Any]) -> ObjectRef:
    meta = manifest["metadata"]
    return ObjectRef(manifest["kind"], meta["name"], meta.get("namespace"))


@dataclass(frozen=True)
class Answer:
    """The API server's answer to one call: its status, decoded body, and the seconds of its
    Retry-After header (429/503 only)."""

    status: int
    body: Any
    retry_after: float | None = None


class KubeError(RuntimeError):
    """An API call failed with a status the caller did not expect."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.retry_after = retry_after
        """Seconds the API server asked the client to wait (429/503: Retry-After), if it did."""

    @property
    def retriable(self) -> bool:
        """Trying again later can succeed: transport errors, conflicts, throttling, server errors."""
        return self.status in (0, 409, 429) or self.status >= 500


class TransportError(KubeError):
    """No HTTP answer: timeout, connection reset or refused, TLS failure."""

    def __init__(self, message: str) -> None:
        super().__init__(0, f"transport error: {message}")


def selector_string(labels: Mapping[str, str] | str | None) -> str:
    """`k=v,k2=v2` (equality-based label selector) from a dict; a string passes through."""
    if labels is None or isinstance(labels, str):
        return labels or ""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def default_api_client() -> k8s.ApiClient:
    """In a pod: the service account; else KUBECONFIG / ~/.kube/config; else the process default
    (tests point it at kmock)."""
    configuration = k8s.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    elif os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config")):
        k8s_config.load_kube_config(client_configuration=configuration)
    else:
        default = k8s.ApiClient()
        if not default.configuration.host:  # no kubeconfig and no process default: every call would fail obscurely
            raise NoCluster("no Kubernetes cluster configured: not in a pod, KUBECONFIG is unset and ~/.kube/config does not exist")
        return default
    return k8s.ApiClient(configuration)


class NoCluster(Exception):
    """Nothing says where the API server is (no service account, no kubeconfig)."""


class Kube:
    """Blocking API calls on plain dicts. One instance per process; thread-safe via urllib3's pool."""

    def __init__(self, api_client: k8s.ApiClient | None = None, *, user_agent: str | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY) -> None:  # fmt: skip
        self._api = api_client or default_api_client()
        if user_agent:
            self._api.user_agent = user_agent
        # urllib3's pool must hold as many connections as there are threads, or they queue on it.
        pool_kw = self._api.rest_client.pool_manager.connection_pool_kw
        pool_kw["maxsize"] = concurrency
        # urllib3 would answer a GET's or DELETE's 429/503 with Retry-After itself: sleep what it
        # asks, uncapped, three times, in a request thread, before the caller's own wait (the
        # controller's backoff, the elector's deadline) even began. The answer goes to the caller.
        retries = pool_kw.get("retries")
        retries = retries if isinstance(retries, urllib3.util.Retry) else urllib3.util.Retry.from_int(retries)
        pool_kw["retries"] = retries.new(respect_retry_after_header=False)
        self._executor = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="kube")
        self.write_guard: Callable[[str, str], str | None] | None = None
        """Asked before every write with (method, path): a reason to refuse it, or None. The
        operator sets it to its leadership check (Controller._write_guard): a replica paused past
        its renew deadline (SIGSTOP, a stalled node) may have a successor by the time it runs on,
        and must not write what it had in hand."""

    # --- the verbs ------------------------------------------------------------------------------
    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        answer = self._call("GET", ref.path)
        if answer.status == 404:
            return None
        return self._expect(answer, ref)

    def get_metadata(self, ref: ObjectRef) -> dict[str, Any] | None:
        """Only `metadata` of the object (a Secret's data never reaches this process on a real
        API server, which answers PartialObjectMetadata; anything else is dropped here too)."""
        answer = self._call("GET", ref.path, accept=METADATA_ONLY)
        if answer.status == 404:
            return None
        found = self._expect(answer, ref)
        return {"apiVersion": found.get("apiVersion"), "kind": ref.kind, "metadata": found.get("metadata") or {}}

    def list(self, kind: str, namespace: str | None, labels: Mapping[str, str] | str | None = None) -> list[dict[str, Any]]:
        """Objects of a kind, filtered by the API server with a label selector when one is given.
        (kmock ignores selectors: callers that must not touch foreign objects filter again.)"""
        selector = selector_string(labels)
        query = [("labelSelector", selector)] if selector else None
        answer = self._call("GET", KINDS[kind].collection_path(namespace), query=query)
        result = self._expect(answer, ObjectRef(kind, "*", namespace))
        items: list[dict[str, Any]] = result.get("items") or []
        for item in items:  # list items carry no kind/apiVersion on a real API server
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", KINDS[kind].api_version)
        return items

    def pod_log(self, namespace: str, name: str, container: str, *, since_seconds: int, limit_bytes: int) -> str:
        """The container's log of the last `since_seconds` (pods/log; capped at `limit_bytes`).
        A pod that is gone or not started yet has no log: ''."""
        query = [("container", container), ("sinceSeconds", str(since_seconds)), ("limitBytes", str(limit_bytes))]
        path = f"{KINDS['Pod'].collection_path(namespace)}/{name}/log"
        status, raw, _ = self._transport("GET", path, None, content_type="application/json", accept="text/plain", query=query)
        if status in (400, 404):  # 400: the container is waiting to start
            return ""
        if not 200 <= status < 300:
            raise KubeError(status, f"GET {path}: {raw[:200].decode(errors='replace')}")
        return raw.decode("utf-8", errors="replace")

    def create(self, manifest: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any] | None:
        """Create; None when the object already exists (409). `dry_run`: the API server checks
        the create (409 included) and stores nothing -- how the operator, which may create
        Secrets but not read them, learns whether one is there."""
        ref = ref_of(manifest)
        query = [("dryRun", "All")] if dry_run else None
        answer = self._call("POST", KINDS[ref.kind].collection_path(ref.namespace), dict(manifest), query=query)
        if answer.status == 409:
            return None
        return self._expect(answer, ref)

    def apply(self, manifest: Mapping[str, Any], *, field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply: create or update so that the fields this manager owns are exactly
        the manifest's (a field left out is removed). `force`: the operator is the only writer
        of what it renders, so a conflict with another manager is resolved in its favour."""
        ref = ref_of(manifest)
        query = [("fieldManager", field_manager), ("force", "true")]
        answer = self._call("PATCH", ref.path, json.dumps(dict(manifest)), content_type=APPLY_PATCH, query=query)
        return self._expect(answer, ref)

    def merge_patch(
        self, ref: ObjectRef, patch: Mapping[str, Any], *, subresource: str = "", field_manager: str | None = None
    ) -> dict[str, Any]:
        path = f"{ref.path}/{subresource}" if subresource else ref.path
        query = [("fieldManager", field_manager)] if field_manager else None
        answer = self._call("PATCH", path, dict(patch), content_type=MERGE_PATCH, query=query)
        return self._expect(answer, ref)

    def patch_pod_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Strategic-merge patch of a pod's status (the readiness gate, pool_gate.py): the list of
        conditions merges by type, unlike a JSON merge patch, which would replace the kubelet's."""
        ref = ObjectRef("Pod", name, namespace)
        answer = self._call("PATCH", f"{ref.path}/status", dict(patch), content_type=STRATEGIC_MERGE_PATCH,
                            query=[("fieldManager", FIELD_MANAGER)])  # fmt: skip
        return self._expect(answer, ref)

    def delete(self, ref: ObjectRef) -> bool:
        """Delete with background propagation; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        answer = self._call("DELETE", ref.path, body)
        if answer.status == 404:
            return False
        self._expect(answer, ref)
        return True

    # --- helpers built on them ----------------------------------------------------------------
    def patch_status(self, ref: ObjectRef, status: Mapping[str, Any], resource_version: str | None) -> dict[str, Any]:
        """Write status only if the object is still at `resource_version` (the version the
        decision was made on): otherwise 409, and the caller re-reads and decides again."""
        patch: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            patch["metadata"] = {"resourceVersion": resource_version}
        return self.merge_patch(ref, patch, subresource="status", field_manager=FIELD_MANAGER)

    def record_event(
        self,
        involved: Mapping[str, Any],
        *,
        type_: str,
        reason: str,
        message: str,
        now: dt.datetime,
        component: str = "kvguard-operator",
    ) -> None:
        """Create a core/v1 Event, or bump its count when the same one was already recorded.

        The name is derived from the object, reason and message instead of `generateName`, so a
        repeated reconcile aggregates into one Event (and kmock, which lacks generateName, works).
        """
        meta = involved["metadata"]
        digest = hashlib.sha256(f"{meta.get('uid')}|{type_}|{reason}|{message}".encode()).hexdigest()[:16]
        ref = ObjectRef("Event", f"{meta['name']}.{digest}", meta.get("namespace"))
        stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": ref.name, "namespace": ref.namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": component},
            "reportingComponent": component,
        }
        if self.create(event) is not None:
            return
        existing = self.get(ref) or {}
        self.merge_patch(ref, {"count": int(existing.get("count") or 1) + 1, "lastTimestamp": stamp})

    # --- async wrappers: run the blocking call off the event loop thread ------------------------
    async def aget(self, ref: ObjectRef) -> dict[str, Any] | None:
        return await self._off_loop(lambda: self.get(ref))

    async def aget_metadata(self, ref: ObjectRef) -> dict[str, Any] | None:
        return await self._off_loop(lambda: self.get_metadata(ref))

    async def alist(self, kind: str, namespace: str | None, labels: Mapping[str, str] | str | None = None) -> builtins.list[dict[str, Any]]:
        return await self._off_loop(lambda: self.list(kind, namespace, labels))

    async def apod_log(self, namespace: str, name: str, container: str, *, since_seconds: int, limit_bytes: int) -> str:
        return await self._off_loop(lambda: self.pod_log(namespace, name, container, since_seconds=since_seconds,
                                                         limit_bytes=limit_bytes))

    async def acreate(self, manifest: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any] | None:
        return await self._off_loop(lambda: self.create(manifest, dry_run=dry_run))

    async def aapply(self, manifest: Mapping[str, Any], *, field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        return await self._off_loop(lambda: self.apply(manifest, field_manager=field_manager))

    async def amerge_patch(self, ref: ObjectRef, patch: Mapping[str, Any], *, field_manager: str | None = None) -> dict[str, Any]:
        return await self._off_loop(lambda: self.merge_patch(ref, patch, field_manager=field_manager))

    async def apatch_pod_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self._off_loop(lambda: self.patch_pod_status(namespace, name, patch))

    async def adelete(self, ref: ObjectRef) -> bool:
        return await self._off_loop(lambda: self.delete(ref))

    async def apatch_status(self, ref: ObjectRef, status: Mapping[str, Any], resource_version: str | None) -> dict[str, Any]:
        return await self._off_loop(lambda: self.patch_status(ref, status, resource_version))

    async def arecord_event(self, involved: Mapping[str, Any], **kwargs: Any) -> None:
        await self._off_loop(lambda: self.record_event(involved, **kwargs))

    async def _off_loop(self, call: Callable[[], T]) -> T:
        """Run a blocking call on this client's own threads (as many as its connection pool), so
        that API latency, not the default executor's few threads, bounds how many are in flight."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    # --- transport ------------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | str | None = None,
        *,
        content_type: str = "application/json",
        accept: str = "application/json",
        query: builtins.list[tuple[str, str]] | None = None,
    ) -> Answer:
        if method != "GET" and self.write_guard is not None and (why := self.write_guard(method, path)) is not None:
            raise KubeError(0, f"{method} {path} not sent: {why}")
        status, raw, retry_after = self._transport(method, path, body, content_type=content_type, accept=accept,
                                                   query=query)  # fmt: skip
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            decoded = {"message": raw[:200].decode(errors="replace")}
        return Answer(status, decoded, retry_after)

    def _transport(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | str | None,
        *,
        content_type: str,
        accept: str,
        query: builtins.list[tuple[str, str]] | None,
    ) -> tuple[int, bytes, float | None]:
        """One request: its status, raw body, and the seconds of its Retry-After header when a 429 or
        503 has one (TransportError when no answer came)."""
        headers = {"Accept": accept, "Content-Type": content_type}
        method, url, headers, body, _ = self._api.param_serialize(
            method=method, resource_path=path, query_params=query, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )  # fmt: skip
        started = time.monotonic()
        try:
            response = self._api.call_api(method, url, headers, body, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            response.read()
            raw = response.data or b""
            status = int(response.status)
            answer_headers = response.headers
        except k8s.ApiException as exc:  # the rest client raises for some statuses (TLS: status 0)
            raw = (exc.body or "").encode() if isinstance(exc.body, str) else (exc.body or b"")
            status = int(exc.status or 0)
            answer_headers = exc.headers
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # timeouts, resets, refused connections
            API_REQUESTS.labels(method, "0").inc()
            raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        API_REQUESTS.labels(method, str(status)).inc()
        API_REQUEST_SECONDS.observe(time.monotonic() - started)
        log.debug("%s %s -> %s", method, path, status)  # never the body
        if status == 0:
            raise TransportError(f"{method} {path}: {raw[:200].decode(errors='replace')}")
        return status, raw, _seconds((answer_headers or {}).get("Retry-After")) if status in (429, 503) else None

    @staticmethod
    def _expect(answer: Answer, ref: ObjectRef) -> dict[str, Any]:
        body = answer.body
        if 200 <= answer.status < 300:
            return body if isinstance(body, dict) else {}
        message = body.get("message", "") if isinstance(body, dict) else str(body)[:200]
        retry_after = answer.retry_after
        if retry_after is None and isinstance(body, dict) and answer.status in (429, 503):
            # the header, else the Status's details (kube-apiserver sends both)
            details = body.get("details")
            if isinstance(details, dict):
                retry_after = _seconds(details.get("retryAfterSeconds"))
        raise KubeError(answer.status, f"{ref}: {message}", retry_after=retry_after)


def _seconds(value: Any) -> float | None:
    """A Retry-After in seconds (kube-apiserver sends integers; the HTTP-date form is not used)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 <= seconds < float("inf") else None
