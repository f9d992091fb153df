"""The rollout revision: a short hash of every spec field that changes what a worker computes.

A new hash means a new KV plan and a new set of workloads brought up beside the stable ones.
Fields that only scale or place pods (replicas, resources, node selector, tolerations, router
shape) and the canary configuration are left out: changing them updates the running revision in
place. Pure: no kopf, no kubernetes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.numerics import WEIGHTS_PART

REVISION_LENGTH = 10

# Fields of spec.roles.<prefill|decode> that change the engine's KV pool or command line.
_ROLE_FIELDS = (
    "tensorParallel",
    "pipelineParallel",
    "dataParallel",
    "dataParallelAttention",
    "expertParallel",
    "memoryFraction",
    "kvPoolTokens",
    "gpuType",
    "gpuCount",
)
# Top-level spec fields that do (weights revision and source, quantization, KV dtype, GPU memory,
# memory fraction, context length, engine image/version/args, transfer settings).
_SPEC_FIELDS = (
    "model",
    "weights",
    "kvCacheDtype",
    "pageSize",
    "contextLength",
    "kvPoolTokens",
    "memoryFraction",
    "reserve",
    "engine",
    "hardware",
    "kvTransfer",
)


def kv_relevant(spec: InferenceModelSpec) -> dict[str, Any]:
    """The subset of the spec a revision is made of, as a canonical JSON-ready dict."""
    wire = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    picked: dict[str, Any] = {key: wire[key] for key in _SPEC_FIELDS if key in wire}
    picked["model"] = _without_plan_only(picked.get("model", {}))
    roles = wire.get("roles", {})
    picked["roles"] = {
        role: {key: roles[role][key] for key in _ROLE_FIELDS if key in roles.get(role, {})}
        for role in ("prefill", "decode")
    }
    return picked


def _without_plan_only(model: dict[str, Any]) -> dict[str, Any]:
    """spec.model less what makes no revision: the ConfigMap name (the architecture it resolves to
    is in `model` already) and `architecture.moeLayers`, which only the planner reads (a review:
    read from a ConfigMap's config.json by a new operator, it changed the revision of every
    DeepSeek and GLM model, a rollout that ran nothing new)."""
    model = {k: v for k, v in model.items() if k != "architectureConfigMap"}
    if isinstance(arch := model.get("architecture"), dict) and "moeLayers" in arch:
        model["architecture"] = {k: v for k, v in arch.items() if k != "moeLayers"}
    return model


# Fields of spec.roles.<prefill|decode> that change the order of floating-point reductions.
_NUMERICS_ROLE_FIELDS = ("tensorParallel", "pipelineParallel", "expertParallel", "dataParallelAttention")


def _short(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def numerics_parts(spec: InferenceModelSpec) -> dict[str, str]:
    """What decides the greedy outputs, part by part: the model (source, revision, architecture:
    a hash), the weights' format, the model and KV dtypes, device kind, engine, and the sharding
    that reorders reductions (tensor, pipeline, expert parallelism, DP attention; data parallelism
    only replicates). The engine's version and image are left out on purpose: a new build of the
    same engine must still match (that is how the canary catches a build that corrupts KV)."""
    wire = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    model = {k: v for k, v in _without_plan_only(wire["model"]).items() if k != "name"}  # the served name is a label
    roles = wire.get("roles", {})
    sharding = {r: {k: roles.get(r, {}).get(k) for k in _NUMERICS_ROLE_FIELDS} for r in ("prefill", "decode")}
    return {
        WEIGHTS_PART: _short(model),
        "quantization": _short(wire.get("weights")),
        "kvCacheDtype": str(wire.get("kvCacheDtype")),
        "device": str(wire["hardware"].get("device")),
        "engine": str(wire["engine"].get("kind")),
        "sharding": _short(sharding),
    }


def numerics_of(spec: InferenceModelSpec) -> str:
    """The output fingerprint (`numerics_parts` as one readable string, `part=value;...`). Two
    revisions with the same fingerprint must answer a greedy prompt identically."""
    return ";".join(f"{k}={v}" for k, v in numerics_parts(spec).items())


def revision_of(spec: InferenceModelSpec, faults: str = "") -> str:
    """Hex prefix of the SHA-256 of the KV-relevant spec; stable across key order and defaults.
    Test-only injected faults (KVGUARD_FAULTS) are part of it: a faulty build is its own revision,
    so turning faults off rolls out anew instead of restarting a serving revision in place."""
    relevant = kv_relevant(spec) | ({"faults": faults} if faults else {})
    canonical = json.dumps(relevant, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
