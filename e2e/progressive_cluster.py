"""`progressive.Story` on a real cluster: the operator drives, clients go through a Gateway.

Cluster-only code: nothing here talks to a cluster without KUBECONFIG (the pure helpers at the end
are unit-tested in e2e/test_progressive_units.py). What it needs, besides what
`harness_cluster.ClusterHarness` needs (KUBECONFIG, `kubectl apply -k e2e/install`,
KVGUARD_E2E_WORKER_IMAGE, a default StorageClass, kubectl):

- a Gateway API implementation and the Gateway the scenarios' InferenceModels attach to
  (spec.rollout.gateway.parentRefs): e2e/install/gateway, after Envoy Gateway's own install
  manifest (docs/rollouts.md, "End-to-end scenarios on a cluster");
- the clients' way in: KVGUARD_E2E_GATEWAY_URL (e.g. http://<the Gateway's address>, without
  /v1) when the Gateway has an address this machine reaches; otherwise a `kubectl port-forward` to
  the Envoy Service Envoy Gateway creates for the Gateway (found by its owning-gateway labels in
  KVGUARD_E2E_ENVOY_NAMESPACE, default envoy-gateway-system).
Optional: KVGUARD_E2E_GATEWAY (default kvguard-e2e) and KVGUARD_E2E_GATEWAY_NAMESPACE (default
kvguard-e2e-gateway) name the Gateway.

How the scenarios read a cluster: rollouts from the InferenceModel's status, its Events (those
recorded since the apply began), the HTTPRoute's weights (revision by backendRef name), pods by uid
and restart count (a rollback within the scale-down window starts none), and who answered from the
`x-kvguard-revision` header every router sets (`--revision-id`, rendered by the operator).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Mapping
from typing import Any

from harness import NAME
from harness_cluster import ACTED_TIMEOUT, ClusterHarness, _get, eventually, port_forward
from harness_cluster import unavailable as cluster_unavailable
from kubernetes import client
from progressive import Event, Rolled, base_body

from kvguard.operator.render import object_name
from kvguard.operator.traffic import route_name

ENVOY_OWNER_LABELS = ("gateway.envoyproxy.io/owning-gateway-name", "gateway.envoyproxy.io/owning-gateway-namespace")
"""Labels Envoy Gateway puts on the Service of a Gateway's Envoy proxies."""
GATEWAY_PORT = 80
"""The listener e2e/install/gateway/gateway.yaml declares."""
CLOSING_REASONS = ("RevisionPromoted", "RolledBack", "PreviousRevisionScaledDown", "RolloutSuperseded")
"""Events recorded by the pass that brings a rollout to rest: their arrival ends an apply's events."""
DEFAULT_GATEWAY = ("kvguard-e2e", "kvguard-e2e-gateway")
"""(name, namespace) of the Gateway in e2e/install/gateway."""
POOL_FLAG = "--kv-pool-tokens"
SMALL_POD_SUFFIX = "smaller-pool"


def unavailable() -> str | None:
    """Why the cluster variant cannot run here (the skip reason), or None."""
    return cluster_unavailable()


class ClusterStory:
    kind = "cluster"

    def __init__(self, harness: ClusterHarness, gateway: str, gateway_namespace: str, envoy_namespace: str, url: str | None) -> None:
        self.harness = harness
        self.log = harness.log
        self.gateway, self.gateway_namespace, self.envoy_namespace = gateway, gateway_namespace, envoy_namespace
        self.core, self.apps, self.custom = harness.core, harness.apps, harness.custom
        self.namespace = harness.namespace
        self._stack = contextlib.ExitStack()
        self._url = url.rstrip("/") + "/v1" if url else None

    @classmethod
    def from_env(cls) -> ClusterStory:
        gateway = os.environ.get("KVGUARD_E2E_GATEWAY", DEFAULT_GATEWAY[0])
        namespace = os.environ.get("KVGUARD_E2E_GATEWAY_NAMESPACE", DEFAULT_GATEWAY[1])
        story = cls(ClusterHarness.from_env(), gateway, namespace, os.environ.get("KVGUARD_E2E_ENVOY_NAMESPACE", "envoy-gateway-system"),
                    os.environ.get("KVGUARD_E2E_GATEWAY_URL"))  # fmt: skip
        story._check_gateway()
        return story

    def _check_gateway(self) -> None:
        found = _get(self.custom.get_namespaced_custom_object, "gateway.networking.k8s.io", "v1", self.gateway_namespace,
                     "gateways", self.gateway)  # fmt: skip
        assert found is not None, (f"no Gateway {self.gateway_namespace}/{self.gateway}: install a Gateway API implementation and "
                                   "e2e/install/gateway (docs/rollouts.md, End-to-end scenarios on a cluster)")  # fmt: skip

    # --- Story ------------------------------------------------------------------------------------

    def body(self, version: str, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        parent = {"name": self.gateway, "namespace": self.gateway_namespace}
        return base_body(self.harness.model_source(0), version, steps, [parent], image=self.harness.engine_image)

    def apply(self, body: dict[str, Any], faults: str = "") -> Rolled:
        before = self._event_counts()
        applied = self.harness.apply(copy.deepcopy(body), faults=faults)
        result = applied.result
        # Events are recorded after the status that asked for them: wait for the resting pass's own.
        eventually(lambda: any(e.reason in CLOSING_REASONS for e in self._events_since(before)), ACTED_TIMEOUT)
        return Rolled(result.revision, result.state, result.stable, result.status, tuple(self._events_since(before)), self.url())

    def url(self) -> str:
        if self._url is None:  # one port-forward for the story: the clients' URL must never move
            port = self._stack.enter_context(port_forward(self.envoy_namespace, f"svc/{self._envoy_service()}", GATEWAY_PORT))
            self._url = f"http://127.0.0.1:{port}/v1"
        return self._url

    def stable(self) -> str:
        revision = self.harness._status().revision
        assert revision is not None, "nothing is stable yet"
        return revision

    def weights(self) -> dict[str, int]:
        route = _get(self.custom.get_namespaced_custom_object, "gateway.networking.k8s.io", "v1", self.namespace, "httproutes",
                     route_name(NAME))  # fmt: skip
        return revision_weights(route or {}, NAME)

    def workload_ids(self, revision: str) -> dict[str, str]:
        """The revision's pods (uid and restarts): a rollback within the window starts none."""
        return {k: v for k, v in self.harness._workloads(revision, detailed=True).items() if k.startswith("pod/")}

    def revision_stopped(self, revision: str) -> bool:
        return self.harness.revision_stopped(revision)

    def close(self) -> None:
        self._stack.close()
        self.harness.close()

    # --- events -----------------------------------------------------------------------------------

    def _model_events(self) -> list[Any]:
        selector = f"involvedObject.name={NAME},involvedObject.kind=InferenceModel"
        return self.core.list_namespaced_event(self.namespace, field_selector=selector).items

    def _event_counts(self) -> dict[str, int]:
        return {e.metadata.name: int(e.count or 1) for e in self._model_events()}

    def _events_since(self, before: Mapping[str, int]) -> list[Event]:
        """Events new since `before`, or recorded again (the operator aggregates a repeat into one
        Event by name and bumps its count)."""
        fresh = [e for e in self._model_events() if int(e.count or 1) > before.get(e.metadata.name, 0)]
        fresh.sort(key=lambda e: str(e.last_timestamp or e.first_timestamp or ""))
        return [Event(str(e.reason), str(e.message)) for e in fresh]

    def _envoy_service(self) -> str:
        selector = f"{ENVOY_OWNER_LABELS[0]}={self.gateway},{ENVOY_OWNER_LABELS[1]}={self.gateway_namespace}"
        services = self.core.list_namespaced_service(self.envoy_namespace, label_selector=selector).items
        assert services, (f"no Envoy Service for Gateway {self.gateway_namespace}/{self.gateway} in {self.envoy_namespace} "
                          "(is Envoy Gateway installed and the Gateway Programmed?); or set KVGUARD_E2E_GATEWAY_URL")  # fmt: skip
        return str(services[0].metadata.name)

    # --- the stable pod with a smaller pool (S7 while it serves) -----------------------------------

    def decode_deployment(self, revision: str) -> dict[str, Any]:
        deployment = self.apps.read_namespaced_deployment(object_name(NAME, revision, "decode"), self.namespace)
        return client.ApiClient().sanitize_for_serialization(deployment)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def smaller_pool_pod(self, revision: str, pool_tokens: int) -> Iterator[dict[str, Any]]:
        """A bare Pod from the stable decode Deployment's template with a smaller pool, for as long
        as the block runs (deleted after)."""
        pod = smaller_pool_pod(self.decode_deployment(revision), pool_tokens)
        self.core.create_namespaced_pod(self.namespace, pod)
        self.log.append(f"created pod {pod['metadata']['name']} with {POOL_FLAG} {pool_tokens}")
        try:
            yield pod
        finally:
            with contextlib.suppress(client.ApiException):
                self.core.delete_namespaced_pod(pod["metadata"]["name"], self.namespace, grace_period_seconds=0)

    def pod(self, name: str) -> dict[str, Any] | None:
        found = _get(self.core.read_namespaced_pod, name, self.namespace)
        return client.ApiClient().sanitize_for_serialization(found) if found is not None else None  # type: ignore[no-any-return]

    def endpoint_slices(self, revision: str, role: str) -> list[dict[str, Any]]:
        selector = f"kubernetes.io/service-name={object_name(NAME, revision, role)}"
        slices = client.DiscoveryV1Api().list_namespaced_endpoint_slice(self.namespace, label_selector=selector).items
        return [client.ApiClient().sanitize_for_serialization(s) for s in slices]

    def model_status(self) -> dict[str, Any]:
        body = self.custom.get_namespaced_custom_object("kvguard.io", "v1alpha1", self.namespace, "inferencemodels", NAME)
        return dict(body.get("status") or {})


# --- pure ---------------------------------------------------------------------------------------------


def revision_weights(route: Mapping[str, Any], model: str) -> dict[str, int]:
    """revision -> weight of an HTTPRoute the operator rendered (backendRefs name each revision's
    router Service `<model>-<revision>-router`, or InferencePool `<model>-<revision>`)."""
    found: dict[str, int] = {}
    for rule in (route.get("spec") or {}).get("rules") or []:
        for ref in rule.get("backendRefs") or []:
            name = str(ref.get("name") or "")
            revision = name.removeprefix(f"{model}-").removesuffix("-router") if name.startswith(f"{model}-") else name
            found[revision] = found.get(revision, 0) + int(ref.get("weight", 1))
    return found


def smaller_pool_pod(deployment: Mapping[str, Any], pool_tokens: int, suffix: str = SMALL_POD_SUFFIX) -> dict[str, Any]:
    """A Pod as the Deployment would start it (same labels, so the revision's Service selects it
    once Ready; same annotations, so the readiness gate judges it by its revision's ratio; the same
    readiness gate), but its engine sized to `pool_tokens` KV tokens, as a node with less GPU memory
    would size it. It carries no pod-template-hash label, so the Deployment's ReplicaSet neither
    adopts nor replaces it, and no owner: the test deletes it."""
    template = copy.deepcopy(deployment["spec"]["template"])
    meta, spec = template.get("metadata") or {}, template["spec"]
    shrunk = 0
    for container in spec.get("containers") or []:
        for key in ("command", "args"):
            argv = container.get(key)
            if argv and POOL_FLAG in argv:
                at = argv.index(POOL_FLAG)
                container[key] = [*argv[: at + 1], str(pool_tokens), *argv[at + 2 :]]
                shrunk += 1
    if not shrunk:
        raise ValueError(f"no container of {deployment['metadata']['name']} sizes its pool with {POOL_FLAG}")
    name = f"{deployment['metadata']['name']}-{suffix}"[:63].rstrip("-")
    metadata = {"name": name, "labels": dict(meta.get("labels") or {}), "annotations": dict(meta.get("annotations") or {})}
    if deployment["metadata"].get("namespace"):
        metadata["namespace"] = deployment["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def ready_endpoint_of(slices: list[Mapping[str, Any]], pod: str) -> bool:
    """Whether any EndpointSlice lists `pod` as a ready endpoint (one traffic could go to; a pod
    whose readiness gate is False is listed, if at all, with ready=false)."""
    for slice_ in slices:
        for endpoint in slice_.get("endpoints") or []:
            target = endpoint.get("targetRef") or {}
            if target.get("kind", "Pod") == "Pod" and target.get("name") == pod and (endpoint.get("conditions") or {}).get("ready"):
                return True
    return False


def pod_condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


__all__ = ["ClusterStory", "pod_condition", "ready_endpoint_of", "revision_weights", "smaller_pool_pod", "unavailable"]
