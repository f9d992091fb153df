"""The only module that talks to the Kubernetes API server.

Verbs used: create, get, list, merge-patch, delete. No server-side apply and no PUT: both are
missing from the kmock emulator used in CI, and merge-patch of a fully rendered object is enough
for objects this operator owns alone. Requests go through the `kubernetes` client's ApiClient with
plain JSON bodies (the typed v37 APIs would round-trip every body through their own models).

The calls are blocking; async callers use the `a*` wrappers, which run them on a worker thread so
the kopf event loop never blocks (a blocking call on the loop's own thread deadlocks on kmock).
Object bodies are never logged: a Secret body holds the KV-transfer HMAC key.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


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
    "Event": Kind("v1", "events"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Pod": Kind("v1", "pods"),
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


class KubeError(RuntimeError):
    """An API call failed with a status the caller did not expect."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube:
    """Blocking API calls on plain dicts. One instance per process; thread-safe via urllib3's pool."""

    def __init__(self, api_client: k8s.ApiClient | None = None) -> None:
        self._api = api_client or k8s.ApiClient()

    # --- the five verbs -------------------------------------------------------------------------
    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        status, body = self._call("GET", ref.path)
        if status == 404:
            return None
        return self._expect(status, body, ref)

    def list(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        status, body = self._call("GET", KINDS[kind].collection_path(namespace))
        result = self._expect(status, body, ObjectRef(kind, "*", namespace))
        items: list[dict[str, Any]] = result.get("items") or []
        for item in items:  # list items carry no kind/apiVersion on a real API server
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", KINDS[kind].api_version)
        return items

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when the object already exists (409)."""
        ref = ref_of(manifest)
        status, body = self._call("POST", KINDS[ref.kind].collection_path(ref.namespace), dict(manifest))
        if status == 409:
            return None
        return self._expect(status, body, ref)

    def merge_patch(self, ref: ObjectRef, patch: Mapping[str, Any], *, subresource: str = "") -> dict[str, Any]:
        path = f"{ref.path}/{subresource}" if subresource else ref.path
        status, body = self._call("PATCH", path, dict(patch), content_type=MERGE_PATCH)
        return self._expect(status, body, ref)

    def delete(self, ref: ObjectRef) -> bool:
        """Delete with background propagation; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        status, resp = self._call("DELETE", ref.path, body)
        if status == 404:
            return False
        self._expect(status, resp, ref)
        return True

    # --- helpers built on them ----------------------------------------------------------------
    def patch_status(self, ref: ObjectRef, status: Mapping[str, Any]) -> dict[str, Any]:
        return self.merge_patch(ref, {"status": dict(status)}, subresource="status")

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
        return await asyncio.to_thread(self.get, ref)

    async def alist(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.list, kind, namespace)

    async def acreate(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.create, manifest)

    async def amerge_patch(self, ref: ObjectRef, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self.merge_patch, ref, patch)

    async def adelete(self, ref: ObjectRef) -> bool:
        return await asyncio.to_thread(self.delete, ref)

    async def apatch_status(self, ref: ObjectRef, status: Mapping[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self.patch_status, ref, status)

    async def arecord_event(self, involved: Mapping[str, Any], **kwargs: Any) -> None:
        await asyncio.to_thread(lambda: self.record_event(involved, **kwargs))

    # --- transport ------------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self._api.param_serialize(
            method=method, resource_path=path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self._api.call_api(method, url, headers, body, _request_timeout=30)
            response.read()
            raw = response.data or b""
            status = int(response.status)
        except k8s.ApiException as exc:  # the rest client raises for some statuses
            raw = (exc.body or "").encode() if isinstance(exc.body, str) else (exc.body or b"")
            status = int(exc.status or 0)
        log.debug("%s %s -> %s", method, path, status)  # never the body
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"message": raw[:200].decode(errors="replace")}

    @staticmethod
    def _expect(status: int, body: Any, ref: ObjectRef) -> dict[str, Any]:
        if 200 <= status < 300:
            return body if isinstance(body, dict) else {}
        message = body.get("message", "") if isinstance(body, dict) else str(body)[:200]
        raise KubeError(status, f"{ref}: {message}")
