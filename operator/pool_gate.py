"""S7 for as long as a pod serves: the readiness gate `kvguard.io/kv-pool-verified` (pure).

Every prefill/decode pod the operator renders carries the readiness gate (render.py,
`spec.readinessGates`), so the kubelet reports it Ready -- and its Service lists it as an
endpoint -- only once the operator has set the pod condition of that type to True. The operator
watches every such pod of every revision it serves, the stable one included; when a pod's
containers become ready it scrapes the pool the pod *reports* (its `metrics` port: kvguard, SGLang
or vLLM metric names, `canary/metrics.py`) and sets the condition True only when the pool holds
`requiredRatio` x context length. A pod that restarts on a node with less GPU memory gets a
smaller pool and stays out of rotation, with a Warning Event and a `Degraded` condition on its
InferenceModel naming the pod and the node.

This module holds the rule: what a pod is (`PodFacts`), when to check it (`next_move`), how a
scrape is judged (`judge`), the condition patch, and the per-pod record shown in `status.pools`
(`PodPool`). The controller (Kubernetes) and the local backend (worker processes) carry it out.

Why a container restart is checked again: the kubelet keeps pod conditions across container
restarts, so a condition set True once would admit the restarted container without a look. When a
pod's containers are not ready and its restart count moved since the verdict (or the operator has
no verdict for it: a restarted operator), the condition is set False first; it becomes True again
only after a fresh scrape.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from kvguard.workers.pool_ratio import ratio_text, required_pool_tokens

GATE_CONDITION = "kvguard.io/kv-pool-verified"
"""The pod condition (and readiness gate) type."""
RATIO_ANNOTATION = "kvguard.io/min-kv-ratio"
CONTEXT_ANNOTATION = "kvguard.io/context-length"
PAGE_ANNOTATION = "kvguard.io/page-size"
"""Pod annotations (render.py) with the requirement of the pod's own revision: a stable pod is
judged by its revision's contextLength and minKVRatio, not by a newer spec still rolling out. The
page size is written only where it does not divide the context (S7 counts whole pages of whole
contexts, `pool_ratio.required_pool_tokens`; elsewhere it changes nothing, and a pod template left
as it was restarts no pod on an operator upgrade)."""
GATED_ROLES = ("prefill", "decode")
"""Roles that own a KV pool; the router has none to verify and carries no gate."""
MAX_UNREADABLE_ATTEMPTS = 5
"""Scrapes of a ready pod that did not report a pool before its model is marked Degraded."""
MAX_STATUS_POOLS = 100
"""Entries kept in status.pools (unverified ones first): the status of a huge model stays small."""

PoolReason = Literal["KVPoolVerified", "KVPoolTooSmall", "KVPoolUnreadable", "Verifying"]


class _StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", use_attribute_docstrings=True)


class PodPool(_StatusModel):
    """One serving pod's reported KV pool against the ratio (an entry of status.pools, S7)."""

    pod: str
    """Pod name (local backend: `<model>-<revision>-<worker>`)."""
    node: str | None = None
    """Node the pod runs on (local backend: `local`)."""
    revision: str
    """Revision the pod belongs to."""
    role: str
    """prefill or decode."""
    pool_tokens: float | None = None
    """Smallest KV pool the pod reports (over its DP ranks / engines), in tokens; None: not read."""
    context_length: int | None = None
    """Context length the pool was judged against."""
    required_ratio: float
    """Pool / context ratio the pod must meet: spec.minKVRatio, raised by any InferencePolicy."""
    required: int | None = None
    """Tokens the pool must hold: ceil(requiredRatio x contextLength)."""
    verified: bool = False
    """True: the readiness gate is True and the pod may receive traffic."""
    reason: PoolReason = "Verifying"
    """KVPoolVerified, KVPoolTooSmall, KVPoolUnreadable or Verifying."""
    message: str = ""
    """The verdict in words (numbers included)."""
    checked_at: str | None = None
    """RFC 3339 time of the scrape the verdict is based on."""
    unreadable_scrapes: int = 0
    """Consecutive scrapes of the ready pod that read no pool (Degraded at MAX_UNREADABLE_ATTEMPTS)."""


@dataclass(frozen=True)
class PoolRequirement:
    """What a model's pods must report: `ratio` x the context length (the larger of the spec's and
    the pod's own, since a worker that admits longer requests needs the pool for them)."""

    ratio: float
    context_length: int
    page_size: int = 1


@dataclass(frozen=True)
class PodFacts:
    """What the gate needs to know of one pod (from the pod object; see `pod_facts`)."""

    name: str
    namespace: str
    uid: str
    model: str
    revision: str
    role: str
    node: str | None
    ip: str | None
    metrics_port: int
    gated: bool
    """The pod spec lists the readiness gate (pods rendered before the gate existed do not)."""
    containers_ready: bool
    """Running, not terminating, with an IP and ContainersReady=True."""
    terminating: bool
    restarts: int
    """Container restarts so far (the pod's incarnation)."""
    gate: Mapping[str, Any] | None
    """The pod's current condition of type GATE_CONDITION, if any."""
    declared: PoolRequirement | None = None
    """The requirement of the pod's revision (its annotations); None: not rendered with them."""

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.ip}:{self.metrics_port}/metrics" if self.ip else None

    @property
    def gate_status(self) -> str | None:
        return str(self.gate.get("status")) if self.gate else None


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def pod_facts(pod: Mapping[str, Any], labels: tuple[str, str, str], metrics_port: int) -> PodFacts:
    """`labels`: the label keys of model, revision and role (render.LABEL_*); `metrics_port`: the
    port the pod's engine reports on (backends.kubernetes.metrics_port)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    pod_labels = meta.get("labels") or {}
    gates = [g.get("conditionType") for g in spec.get("readinessGates") or []]
    terminating = bool(meta.get("deletionTimestamp"))
    ready = _condition(status, "ContainersReady")
    containers_ready = (not terminating and status.get("phase") == "Running" and bool(status.get("podIP"))
                        and ready is not None and ready.get("status") == "True")  # fmt: skip
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    declared = declared_requirement(meta.get("annotations") or {})
    return PodFacts(
        name=str(meta.get("name") or ""), namespace=str(meta.get("namespace") or ""), uid=str(meta.get("uid") or ""),
        model=str(pod_labels.get(labels[0]) or ""), revision=str(pod_labels.get(labels[1]) or ""),
        role=str(pod_labels.get(labels[2]) or ""), node=spec.get("nodeName"), ip=status.get("podIP"),
        metrics_port=metrics_port, gated=GATE_CONDITION in gates, containers_ready=containers_ready,
        terminating=terminating, restarts=restarts, gate=_condition(status, GATE_CONDITION), declared=declared,
    )  # fmt: skip


def declared_requirement(annotations: Mapping[str, Any]) -> PoolRequirement | None:
    try:
        ratio, context = float(annotations[RATIO_ANNOTATION]), int(annotations[CONTEXT_ANNOTATION])
        page = int(annotations.get(PAGE_ANNOTATION, 1))
    except (KeyError, TypeError, ValueError):
        return None
    valid = math.isfinite(ratio) and ratio >= 1.0 and context > 0 and page > 0
    return PoolRequirement(ratio, context, page) if valid else None


def requirement_for(facts: PodFacts, policy_ratio: float | None) -> PoolRequirement | None:
    """The pod's revision's requirement, its ratio raised by the InferencePolicies covering its
    namespace. A policy tightened after the rollout applies to every pod judged from then on,
    serving ones included: a verdict under another requirement no longer covers the pod
    (`Verdict.covers`), so it is judged again and, below the new ratio, kept out of rotation.
    (The local gate does not raise it: its router keeps the ratio it started with.)"""
    if facts.declared is None:
        return None
    declared = facts.declared
    return PoolRequirement(max(declared.ratio, policy_ratio or 0.0), declared.context_length, declared.page_size)


@dataclass(frozen=True)
class Verdict:
    """The operator's last judgement of one pod incarnation (kept in memory, lost on restart)."""

    uid: str
    restarts: int
    requirement: PoolRequirement
    pool: PodPool

    def covers(self, facts: PodFacts, requirement: PoolRequirement) -> bool:
        """Still valid for this pod as it is now, under this requirement."""
        return self.uid == facts.uid and self.restarts == facts.restarts and self.requirement == requirement


class Move(enum.Enum):
    NOTHING = "nothing"
    VERIFY = "verify"
    """Scrape the pod and set the condition from the verdict."""
    UNVERIFY = "unverify"
    """Set the condition False now: a restarted container must be verified again before it serves."""
    PATCH = "patch"
    """The remembered verdict holds, but the pod's condition does not say it (write it again)."""


def next_move(facts: PodFacts, verdict: Verdict | None, requirement: PoolRequirement | None) -> Move:
    """What to do about one pod now (pure; see the module doc)."""
    if not facts.gated or facts.terminating or facts.role not in GATED_ROLES or requirement is None:
        return Move.NOTHING
    if not facts.containers_ready:
        restarted = verdict is None or verdict.uid != facts.uid or verdict.restarts != facts.restarts
        return Move.UNVERIFY if facts.gate_status == "True" and restarted else Move.NOTHING
    if verdict is None or not verdict.covers(facts, requirement) or verdict.pool.reason == "Verifying":
        return Move.VERIFY
    if verdict.pool.reason == "KVPoolUnreadable":
        return Move.VERIFY  # keep trying (the driver backs off); Degraded after MAX_UNREADABLE_ATTEMPTS
    return Move.PATCH if facts.gate_status != ("True" if verdict.pool.verified else "False") else Move.NOTHING


def rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def judge(
    facts: PodFacts, requirement: PoolRequirement, pool_tokens: float | None, context_length: int | None,
    error: str | None, now: dt.datetime, unreadable: int = 0,
) -> PodPool:  # fmt: skip
    """The verdict on one scrape: the smallest pool the pod reports against ratio x context."""
    context = max(requirement.context_length, context_length or 0)
    required = required_pool_tokens(requirement.ratio, context, requirement.page_size)
    base = {"pod": facts.name, "node": facts.node, "revision": facts.revision, "role": facts.role, "context_length": context,
            "required_ratio": requirement.ratio, "required": required, "checked_at": rfc3339(now)}  # fmt: skip
    where = f"pod {facts.name} ({facts.role}, revision {facts.revision}) on node {facts.node or 'unknown'}"
    if error is not None or pool_tokens is None:
        why = error or "exposes no KV pool size"
        tries = f" ({unreadable} of {MAX_UNREADABLE_ATTEMPTS} scrapes)" if unreadable else ""
        return PodPool(**base, reason="KVPoolUnreadable", unreadable_scrapes=unreadable,
                       message=f"{where}: no KV pool reported: {why}{tries}")  # fmt: skip
    verdict = f"{where} reports a KV pool of {pool_tokens:g} tokens = {ratio_text(pool_tokens, context)} context {context}"
    if pool_tokens >= required:
        return PodPool(**base, pool_tokens=pool_tokens, verified=True, reason="KVPoolVerified",
                       message=f"{verdict} >= {requirement.ratio:g}x required")  # fmt: skip
    return PodPool(**base, pool_tokens=pool_tokens, reason="KVPoolTooSmall",
                   message=f"{verdict} < {requirement.ratio:g}x required ({required} tokens); kept out of rotation")  # fmt: skip


def unverified(facts: PodFacts, requirement: PoolRequirement, now: dt.datetime, why: str = "container restarted") -> PodPool:
    """The record of a pod not ready to be judged (its containers restarted; locally, a process
    starting or not running): out of rotation until scraped again."""
    return PodPool(pod=facts.name, node=facts.node, revision=facts.revision, role=facts.role,
                   required_ratio=requirement.ratio, reason="Verifying", checked_at=rfc3339(now),
                   message=f"pod {facts.name}: {why}; its KV pool is verified again once it is ready")  # fmt: skip


def condition_patch(pool: PodPool, previous: Mapping[str, Any] | None, now: dt.datetime) -> dict[str, Any]:
    """A strategic-merge patch of the pod's status setting the gate condition (conditions merge by
    `type`, so the kubelet's own conditions are left alone). lastTransitionTime moves only when the
    status does."""
    status = "True" if pool.verified else "False"
    moved = previous is None or previous.get("status") != status
    stamp = rfc3339(now) if moved or not previous or not previous.get("lastTransitionTime") else previous["lastTransitionTime"]
    condition = {"type": GATE_CONDITION, "status": status, "reason": pool.reason, "message": pool.message[:4096],
                 "lastProbeTime": rfc3339(now), "lastTransitionTime": stamp}  # fmt: skip
    return {"status": {"conditions": [condition]}}


def condition_matches(pool: PodPool, current: Mapping[str, Any] | None) -> bool:
    """The pod already says exactly this (no write needed)."""
    if current is None:
        return False
    wanted = ("True" if pool.verified else "False", pool.reason, pool.message[:4096])
    return (current.get("status"), current.get("reason"), current.get("message")) == wanted


def status_pools(pools: Sequence[PodPool]) -> list[PodPool]:
    """What status.pools shows: every gated pod, unverified first, then by revision, role, pod."""
    ordered = sorted(pools, key=lambda p: (p.verified, p.revision, p.role, p.pod))
    return ordered[:MAX_STATUS_POOLS]


def kept_out(pools: Sequence[PodPool]) -> list[PodPool]:
    """Pods kept out of rotation for S7 (too small, or unreadable after every attempt)."""
    return [p for p in pools if p.reason == "KVPoolTooSmall"
            or (p.reason == "KVPoolUnreadable" and p.unreadable_scrapes >= MAX_UNREADABLE_ATTEMPTS)]  # fmt: skip


def describe_kept_out(pools: Sequence[PodPool]) -> str:
    """One line naming every pod kept out and its node (the Degraded condition's message)."""
    return "; ".join(p.message for p in pools)


__all__ = [
    "CONTEXT_ANNOTATION", "GATED_ROLES", "PAGE_ANNOTATION", "GATE_CONDITION", "RATIO_ANNOTATION", "Move", "PodFacts", "PodPool", "PoolRequirement",
    "Verdict", "condition_matches", "condition_patch", "declared_requirement", "describe_kept_out", "judge", "kept_out",
    "next_move", "pod_facts", "requirement_for", "status_pools", "unverified",
]  # fmt: skip
