"""kopf glue: watches, indexes and admission; the controller (controller.py) does the rest.

Start with `kopf run -m kvguard.operator.handlers` (or `kvguard operator`). kopf runs standalone
(no kopf peering): HA is a Lease held by one replica (leader.py), while every replica watches,
keeps its indexes warm and serves the admission webhook. kopf's part:
- label-selected watches (server-side `labelSelector`; the indexes apply the same filter in code
  for API servers that ignore it, the child event handlers do not: a child that loses the label
  comes as DELETED, and a filter on that event's body must not be what decides whether the
  operator looks at it again) on the Deployments, Services and NetworkPolicies the operator owns,
  indexed by owning model (`kvguard_deployments`, ...): kopf runs no handler before every index
  has its initial listing, so the controller never decides on a half-read cluster;
- watch events of InferenceModels, of those children and of InferencePolicies, each only
  enqueues the models concerned (no API request is made in a handler);
- a label-selected watch of the engine pods, for their readiness gate (backends/pod_gate.py).
Nothing here writes: no kopf finalizers, progress or diff-base annotations (only event handlers
and indexes are registered), so kopf adds no requests per model.
Environment: KVGUARD_METRICS_PORT (default 8080; 0 disables), and controller.ControllerSettings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from kvguard.commands.operator import watched_namespaces
from kvguard.operator import (
    metrics,
    webhook,  # noqa: F401  (registers the admission webhook and the InferencePolicy index)
)
from kvguard.operator.api import API_GROUP, API_VERSION
from kvguard.operator.backends.base import CanaryRunner
from kvguard.operator.backends.kubernetes import Resolver
from kvguard.operator.controller import Controller, ControllerSettings
from kvguard.operator.kube import Kube, selector_string
from kvguard.operator.render import MANAGED_BY
from kvguard.operator.webhook import policies_from_index
from kvguard.operator.workloads import child_projection, owner_key

MODELS = (API_GROUP, API_VERSION, "inferencemodels")
POLICIES = (API_GROUP, API_VERSION, "inferencepolicies")
DEPLOYMENTS = ("apps", "v1", "deployments")
SERVICES = ("", "v1", "services")
NETWORK_POLICIES = ("networking.k8s.io", "v1", "networkpolicies")
PODS = ("", "v1", "pods")
CHILD_INDEXES = ("kvguard_deployments", "kvguard_services", "kvguard_networkpolicies")
ENDPOINT_RESOLVER: list[Resolver] = []
"""Tests only: where revisions answer when there is no cluster DNS (kmock); empty in production."""
_METRICS_SERVED: list[int] = []


class KopfChildIndex:
    """The controller's ChildIndex over kopf's indexes (key: (namespace, model))."""

    def __init__(self, *indexes: Mapping[Any, Any]) -> None:
        self._indexes = indexes

    def children(self, namespace: str, model: str) -> list[Mapping[str, Any]]:
        key = (namespace, model)
        return [obj for index in self._indexes for obj in (index.get(key) or ())]


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    settings.peering.standalone = True  # leader election is the controller's Lease, not kopf peering
    settings.posting.level = logging.WARNING  # our own Events come from kube.record_event
    # The namespaced install may not list or watch namespaces: it serves exactly the ones it is
    # given (kopf otherwise tries to scan them, is refused, and warns at every start).
    settings.scanning.disabled = bool(watched_namespaces([], os.environ))
    for resource in (DEPLOYMENTS, SERVICES, NETWORK_POLICIES, PODS):
        settings.watching.label_selectors[resource] = selector_string(MANAGED_BY)
    if not os.environ.get("KVGUARD_LOG_HANDLERS"):  # a line per watch event is noise (and CPU) at scale
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    port = int(os.environ.get("KVGUARD_METRICS_PORT", "8080"))
    if port and port not in _METRICS_SERVED:
        await metrics.serve(port)
        _METRICS_SERVED.append(port)
    controller_settings = memo.get("kvguard_settings") or ControllerSettings.from_env()
    resolver = memo.get("kvguard_resolver") or (ENDPOINT_RESOLVER[-1] if ENDPOINT_RESOLVER else None)
    suite = memo.get("kvguard_suite")
    policy_index = kwargs["inference_policies"]
    kube = memo.get("kvguard_kube") or Kube(user_agent=f"kvguard-operator/{controller_settings.identity}")
    controller = Controller(
        kube,
        KopfChildIndex(*(kwargs[name] for name in CHILD_INDEXES)),
        lambda: policies_from_index(policy_index),
        controller_settings,
        runner=CanaryRunner(suite) if suite is not None else None,
        resolver=resolver,
    )  # fmt: skip
    memo["kvguard"] = controller
    controller.start()


@kopf.on.cleanup()
async def shut_down(memo: kopf.Memo, **_: Any) -> None:
    controller = memo.get("kvguard")
    if controller is not None:
        await controller.stop()  # releases the Lease: a standby takes over at once


def _child_index(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    owner = owner_key(body)
    return {owner: child_projection(body)} if owner is not None else {}  # by its controller, whatever its labels say


kvguard_deployments = kopf.index(*DEPLOYMENTS, labels=dict(MANAGED_BY), id="kvguard_deployments")(_child_index)
kvguard_services = kopf.index(*SERVICES, labels=dict(MANAGED_BY), id="kvguard_services")(_child_index)
kvguard_networkpolicies = kopf.index(*NETWORK_POLICIES, labels=dict(MANAGED_BY), id="kvguard_networkpolicies")(_child_index)


@kopf.on.event(*MODELS)
async def inference_model_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["kvguard"].model_event(type, dict(body))


async def _child_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["kvguard"].child_event(type, child_projection(body))


# No label filter here: the watch's own selector (configure) already keeps the stream to the
# operator's children. A child that loses its labels comes as DELETED; the API server sends its
# previous state, but a body without the labels (a cache, an emulator, a relist) would be dropped
# by a filter, and the operator would never look at the child again.
for _resource in (DEPLOYMENTS, SERVICES, NETWORK_POLICIES):
    kopf.on.event(*_resource, id=f"{_resource[-1]}_event")(_child_event)


@kopf.on.event(*PODS, labels=dict(MANAGED_BY), id="pods_event")
async def engine_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every engine pod of every revision: the readiness gate kvguard.io/kv-pool-verified (S7)."""
    memo["kvguard"].pod_event(type, dict(body))


@kopf.on.event(*POLICIES)
async def inference_policy_event(memo: kopf.Memo, **_: Any) -> None:
    memo["kvguard"].policies_changed()
