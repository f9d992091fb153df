"""What the operator reads from the Kubernetes objects it owns, as plain values (pure).

Readiness follows `kubectl rollout status`: a Deployment is ready when the Deployment controller
has seen its latest spec (`status.observedGeneration >= metadata.generation`), every replica runs
that spec (`updatedReplicas`), no old replica is left (`status.replicas`), and every replica is
Ready (`readyReplicas`). A scaled-down revision is at zero only once no pod of it is left.
Worker pods count for S7 scrapes only while Running, Ready and not terminating.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.operator.render import LABEL_MODEL, LABEL_REVISION, LABEL_ROLE, ROLES, SCALE_ANNOTATION
from kvguard.operator.rollout import RevisionView, Scale


@dataclass(frozen=True)
class DeploymentState:
    """What reconcile needs to know about one owned Deployment."""

    name: str
    revision: str
    role: str
    desired: int
    ready: int
    scale: Scale = "full"
    updated: int | None = None
    """status.updatedReplicas; None: not reported (kmock without a Deployment controller)."""
    current: int | None = None
    """status.replicas: every pod of the Deployment, old ones included."""
    generation: int | None = None
    observed_generation: int | None = None

    @property
    def spec_observed(self) -> bool:
        """The Deployment controller has acted on the latest spec (unknown generation: assume so)."""
        return self.generation is None or (self.observed_generation or 0) >= self.generation

    @property
    def is_ready(self) -> bool:
        if not self.spec_observed:
            return False
        updated = self.ready if self.updated is None else self.updated
        current = updated if self.current is None else self.current
        return updated >= self.desired and current <= self.desired and self.ready >= self.desired

    @property
    def at_zero(self) -> bool:
        return self.desired == 0 and self.spec_observed and not (self.current or self.ready)

    def waiting(self) -> str | None:
        """`role ...` when not ready, for status messages."""
        if self.is_ready:
            return None
        if not self.spec_observed:
            return f"{self.role} (spec not yet observed by the Deployment controller)"
        if self.updated is not None and self.updated < self.desired:
            return f"{self.role} {self.updated}/{self.desired} updated"
        if self.current is not None and self.current > self.desired:
            return f"{self.role} {self.current - self.desired} old replica(s) terminating"
        return f"{self.role} {self.ready}/{self.desired} ready"


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) or (isinstance(value, str) and value.isdigit()) else None


def deployment_state(obj: Mapping[str, Any]) -> DeploymentState:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    labels = meta.get("labels") or {}
    replicas = spec.get("replicas")
    return DeploymentState(
        name=meta.get("name", ""),
        revision=labels.get(LABEL_REVISION, ""),
        role=labels.get(LABEL_ROLE, ""),
        desired=1 if replicas is None else int(replicas),
        ready=int(status.get("readyReplicas") or 0),
        scale="canary" if (meta.get("annotations") or {}).get(SCALE_ANNOTATION) == "canary" else "full",
        updated=_int(status.get("updatedReplicas")),
        current=_int(status.get("replicas")),
        generation=_int(meta.get("generation")),
        observed_generation=_int(status.get("observedGeneration")),
    )


def revision_views(deployments: Sequence[DeploymentState], present: Sequence[str] = ()) -> dict[str, RevisionView]:
    """Per revision: ready (every role at its non-zero replicas), at zero, workers to measure.
    `present`: revisions that own other children but no Deployment (a view that is not ready)."""
    by_revision: dict[str, list[DeploymentState]] = {}
    for d in deployments:
        by_revision.setdefault(d.revision, []).append(d)
    views = {r: RevisionView() for r in present if r and r not in by_revision}
    for revision, states in by_revision.items():
        roles = {d.role: d for d in states}
        waiting = tuple(
            f"{r} (not created)" if r not in roles else (roles[r].waiting() or f"{r} scaled to zero")
            for r in ROLES
            if r not in roles or not roles[r].is_ready or roles[r].desired == 0
        )
        views[revision] = RevisionView(
            ready=not waiting, scaled_to_zero=all(d.at_zero for d in states),
            worker_replicas=sum(d.desired for d in states if d.role in ("prefill", "decode")), waiting=waiting,
            scale="canary" if any(d.scale == "canary" for d in states) else "full",
        )  # fmt: skip
    return views


def owned_by(obj: Mapping[str, Any], model: str, uid: str | None) -> bool:
    """A controller owner reference to this very InferenceModel (its uid, when known). Labels are
    no proof of ownership, and their absence no disproof: someone may edit an owned child's
    labels, and the next apply puts them back."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("kind") == "InferenceModel" and r.get("controller") and r.get("name") == model and (uid is None or r.get("uid") == uid)
               for r in refs)  # fmt: skip


def owner_key(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the InferenceModel controlling a child object, if any."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "InferenceModel" and ref.get("controller"):
            return meta.get("namespace") or "", ref["name"]
    return None


def pod_is_serving(pod: Mapping[str, Any]) -> bool:
    """S7 scrapes only pods that serve: Running, Ready, not terminating, with an IP."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


_MISSING_SECRET = re.compile(r'\bsecrets? "([^"]+)" not found')
"""The kubelet's message when a container's env or volume names a Secret that is not there (the
secret manager's NotFound; waiting reason CreateContainerConfigError)."""


def secrets_missing(pod: Mapping[str, Any]) -> set[str]:
    """The Secrets the pod's containers wait for, by the kubelet's report in their waiting state."""
    status = pod.get("status") or {}
    waiting = [((c or {}).get("state") or {}).get("waiting") or {}
               for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])]  # fmt: skip
    found = (_MISSING_SECRET.search(str(w.get("message") or "")) for w in waiting if w.get("reason") == "CreateContainerConfigError")
    return {m.group(1) for m in found if m is not None}


def model_revision_of(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, model, revision) by the pod's labels, or None for a pod without them."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    model, revision = labels.get(LABEL_MODEL), labels.get(LABEL_REVISION)
    return (str(meta.get("namespace") or ""), str(model), str(revision)) if model and revision else None


_KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "labels", "annotations",
                  "ownerReferences", "deletionTimestamp")  # fmt: skip


def child_projection(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps in memory of a child (kind, identity, labels, replicas, selector,
    rollout status): enough to decide, far smaller than the object (no pod template, no
    managedFields), so a thousand models' children fit in a few tens of MB."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    kept_spec = {k: spec[k] for k in ("replicas", "selector") if k in spec}
    kept_status = {k: status[k] for k in ("replicas", "updatedReplicas", "readyReplicas", "availableReplicas",
                                          "observedGeneration") if k in status}  # fmt: skip
    return {
        "kind": obj.get("kind"),
        "apiVersion": obj.get("apiVersion"),
        "metadata": {k: _plain(meta[k]) for k in _KEPT_METADATA if k in meta},
        "spec": _plain(kept_spec),
        "status": _plain(kept_status),
    }


def _plain(value: Any) -> Any:
    """A deep copy into builtins (kopf hands out live views of its bodies)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
