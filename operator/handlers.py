"""kopf glue: register handlers and delegate to `controller.reconcile_model`. Nothing else.

Start with `kopf run -m kvguard.operator.handlers` (or `kvguard operator`). Level-based: create,
update, resume, a timer, events of the Deployments we own and a finished canary run all run the
same reconcile.
Environment: KVGUARD_METRICS_PORT (default 8080; 0 disables), KVGUARD_RECONCILE_INTERVAL
(timer seconds, default 30).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from kvguard.operator import (
    metrics,
    webhook,  # noqa: F401  (registers the admission webhook and the InferencePolicy index)
)
from kvguard.operator.api import API_GROUP, API_VERSION
from kvguard.operator.backends.base import CanaryRunner
from kvguard.operator.backends.kubernetes import KubernetesBackend, Resolver
from kvguard.operator.controller import owner_of, reconcile_model
from kvguard.operator.kube import Kube, KubeError
from kvguard.operator.render import MANAGED_BY

MODELS = (API_GROUP, API_VERSION, "inferencemodels")
RETRY_SECONDS = 5
_KUBE: list[Kube] = []
_DRIVER: list[tuple[KubernetesBackend, CanaryRunner]] = []
ENDPOINT_RESOLVER: list[Resolver] = []
"""Tests only: where revisions answer when there is no cluster DNS (kmock); empty in production."""


def _kube() -> Kube:
    if not _KUBE:
        _KUBE.append(Kube())
    return _KUBE[0]


def _driver() -> tuple[KubernetesBackend, CanaryRunner]:
    """One backend and one canary runner per operator process (the runner owns the canary tasks)."""
    if not _DRIVER:
        _DRIVER.append((KubernetesBackend(_kube(), ENDPOINT_RESOLVER[-1] if ENDPOINT_RESOLVER else None), CanaryRunner()))
    return _DRIVER[0]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base in our own annotations: the CRD's status schema has no `kopf` field.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.peering.name = "kvguard"
    settings.posting.level = logging.WARNING  # our own Events come from kube.record_event
    port = int(os.environ.get("KVGUARD_METRICS_PORT", "8080"))
    if port:
        metrics.serve(port)


async def _reconcile(body: kopf.Body) -> None:
    backend, runner = _driver()
    try:
        await reconcile_model(_kube(), body, backend=backend, runner=runner)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_SECONDS) from exc


@kopf.on.resume(*MODELS)
@kopf.on.create(*MODELS)
@kopf.on.update(*MODELS)
async def reconcile_inference_model(body: kopf.Body, **_: Any) -> None:
    await _reconcile(body)


@kopf.timer(*MODELS, interval=float(os.environ.get("KVGUARD_RECONCILE_INTERVAL", "30")), idle=5)
async def reconcile_periodically(body: kopf.Body, **_: Any) -> None:
    await _reconcile(body)


@kopf.on.event("apps", "v1", "deployments", labels=dict(MANAGED_BY))
async def deployment_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A revision's readiness changed: reconcile its owner now rather than at the next tick."""
    owner = owner_of(body)
    if owner is None or type is None:
        return
    namespace, name = owner
    key_only = {"metadata": {"name": name, "namespace": namespace}}
    backend, runner = _driver()
    try:
        await reconcile_model(_kube(), key_only, backend=backend, runner=runner)
    except KubeError as exc:
        logging.getLogger(__name__).warning("reconcile of %s/%s after a Deployment event failed: %s", namespace, name, exc)
