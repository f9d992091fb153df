"""CustomResourceDefinitions generated from the pydantic models in `kvguard.operator.api`.

pydantic's JSON Schema is turned into a Kubernetes structural schema: $refs inlined, `null`
alternatives dropped (optional = not required), `exclusiveMinimum: N` rewritten to OpenAPI 3.0's
boolean form, `additionalProperties: false` removed (the API server prunes unknown fields), `Any`
mapped to `x-kubernetes-preserve-unknown-fields`, and CEL rules added where a rule spans fields.

Defaults: an object field whose model default is "all of its own defaults" (`default_factory`)
gets `default: {}`. The API server applies structural defaults top-down before validation, so
`spec.engine` left out becomes `{kind: kvguard, ...}` before any CEL rule runs, exactly as pydantic
fills it in. The rules guard optional fields with `has()` anyway (tests/test_crd_cel.py evaluates
every rule the way kube-apiserver does: defaults applied, then CEL).

`kvguard crds` writes the result to crds/; a test fails when the files drift from the models.
Pure: no kopf, no kubernetes client.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from kvguard.operator.api import (
    API_GROUP,
    API_VERSION,
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
    REVISION_SEGMENT,
    InferenceModelSpec,
    InferenceModelStatus,
    InferencePolicySpec,
    InferencePolicyStatus,
)

_DROP_KEYS = {"title", "$defs", "discriminator"}
_SCHEMA_KEYS = {"items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"}  # values that are schemas

# CEL rules (x-kubernetes-validations) that need more than one field; keyed by schema path.
_MODEL_RULES: list[dict[str, str]] = [
    {"rule": f"self.metadata.name.size() <= {MODEL_NAME_MAX}",
     "message": f"metadata.name: at most {MODEL_NAME_MAX} characters (child objects append -<revision>-<role>)"},
    {"rule": f"self.metadata.name.matches('{MODEL_NAME_PATTERN}')",
     "message": "metadata.name: lowercase letters, digits and '-', a letter first and a letter or digit last "
                "(child Services are named after it)"},
    {"rule": f"!self.metadata.name.matches('{REVISION_SEGMENT}')",
     "message": "metadata.name: no part of 10 hex digits (child objects name their revision so: <model>-<revision>-<role>)"},
]  # fmt: skip
# Every optional field a rule reads is guarded with has(): the defaults make them present on a real
# API server, but a rule must never fail with "no such key" on an object an older CRD stored.
_KVGUARD_ENGINE = "(!has(self.engine) || !has(self.engine.kind) || self.engine.kind == 'kvguard')"
_SPEC_RULES: list[dict[str, str]] = [
    {"rule": f"!has(self.hardware.device) || self.hardware.device == 'cuda' || {_KVGUARD_ENGINE}",
     "message": "spec.hardware.device: cpu runs only with engine kind kvguard"},
    {"rule": f"!has(self.model.source) || !has(self.model.source.huggingFace) || !{_KVGUARD_ENGINE}",
     "message": "spec.model.source: the kvguard engine loads weights from a directory; use pvc"},
    # The canary's field that only fails against the rest of the spec, as the webhook refuses it
    # (spec_checks.canary_problems), for clusters without it. (minRatio against minKVRatio is the
    # webhook's only: an older CRD defaulted minRatio to 2 into stored models, which a rule at this
    # level would lock out of every spec edit.)
    # Not where isolation is disabled: the webhook then admits any value (an outside probe: the
    # CRD refused a disabled probe's leftover longRequestMaxTokens the webhook admitted). Where
    # only the continuous canary's light set runs it, the webhook alone refuses (looser here).
    {"rule": "!has(self.canary) || !has(self.canary.isolation) || !has(self.canary.isolation.longRequestMaxTokens) || "
             "(has(self.canary.isolation.enabled) && !self.canary.isolation.enabled) || "
             "self.canary.isolation.longRequestMaxTokens < self.contextLength",
     "message": "spec.canary.isolation.longRequestMaxTokens: must be below contextLength (a long request's prompt "
                "needs room; a healthy engine refuses the request)"},
]  # fmt: skip


def _role_value(obj: str, role: str, field: str, default: str) -> str:
    path = f"{obj}.roles.{role}"
    return f"((has({obj}.roles) && has({path}) && has({path}.{field})) ? {path}.{field} : {default})"


def _same_split(role: str) -> str:
    """The role's (tensorParallel, pipelineParallel) unchanged, as spec_checks._splits compares them."""
    return " && ".join(f"{_role_value('self', role, field, '1')} == {_role_value('oldSelf', role, field, '1')}"
                       for field in ("tensorParallel", "pipelineParallel"))


def _split_of_shards(role: str, shards: str) -> str:
    """The role split as a figure measured over `shards` GPUs is taken: tensor parallelism alone."""
    return (f"{_role_value('self', role, 'tensorParallel', '1')} == {shards} && "
            f"{_role_value('self', role, 'pipelineParallel', '1')} == 1")


def _attention_ranks(obj: str, role: str) -> str:
    """As spec_checks._attention_ranks: dataParallel with dataParallelAttention, else 1."""
    return f"({_role_value(obj, role, 'dataParallelAttention', 'false')} ? {_role_value(obj, role, 'dataParallel', '1')} : 1)"


_WORKER_ROLES = ("prefill", "decode")
# An update that keeps weights.measuredBytesPerDevice (the text as stored) while the split it was
# measured at changes: spec_checks.resplit_problem, which the webhook runs, as transition rules for
# clusters without it (an outside probe stored TP4 -> TP1 there, and reconcile planned the TP4 figure).
# Evaluated on updates only (oldSelf); every field read is guarded, as above.
_MEASURED_KEPT = ("has(self.weights) && has(self.weights.measuredBytesPerDevice) && has(oldSelf.weights) && "
                  "has(oldSelf.weights.measuredBytesPerDevice) && "
                  "string(self.weights.measuredBytesPerDevice) == string(oldSelf.weights.measuredBytesPerDevice)")
_SHARDS_BEFORE = "oldSelf.weights.measuredShards"
_RESPLIT_RULES: list[dict[str, str]] = [
    {"rule": f"!({_MEASURED_KEPT}) || " + " && ".join(
        f"{_attention_ranks('self', r)} == {_attention_ranks('oldSelf', r)}" for r in _WORKER_ROLES),
     "message": "spec.weights.measuredBytesPerDevice: the attention split (dataParallel with dataParallelAttention) "
                "changed while measuredBytesPerDevice stayed: measure it again, or remove it"},
    {"rule": f"!({_MEASURED_KEPT}) || has(self.weights.measuredShards) || (has({_SHARDS_BEFORE}) ? ("
             + " && ".join(_split_of_shards(r, _SHARDS_BEFORE) for r in _WORKER_ROLES) + ") : ("
             + " && ".join(_same_split(r) for r in _WORKER_ROLES) + "))",
     "message": "spec.weights.measuredShards: the split (tensorParallel, pipelineParallel) changed while "
                "measuredBytesPerDevice stayed: set measuredShards to the split it was measured at, or measure it again"},
]  # fmt: skip


class _KubernetesDefaults(GenerateJsonSchema):
    """`default: {}` for an object field that defaults to a model of its own defaults: the API
    server then fills the nested defaults in, as pydantic does (pydantic omits such defaults)."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return {} if isinstance(factory(), BaseModel) else NoDefault  # type: ignore[call-arg]
        return super().get_default_value(schema)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_KubernetesDefaults)
    return _convert(raw, raw.get("$defs", {}))


def _convert(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_convert(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            rest.pop("default", None) if rest.get("default") is None else None
            return _convert({**options[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
            continue
        if key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
            continue
        if key == "const":
            out["enum"] = [value]
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
            continue
        out[key] = _convert(value, defs) if key in _SCHEMA_KEYS else value
    if node.get("x-kubernetes-int-or-string"):
        return _int_or_string(node, out)
    if "properties" in out or "additionalProperties" in out:
        out.setdefault("type", "object")
    if "enum" in out and "type" not in out:
        out["type"] = "string" if all(isinstance(v, str) for v in out["enum"]) else "number"
    if not out.get("type") and "anyOf" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out = {"x-kubernetes-preserve-unknown-fields": True, **out}  # Any
    return out


def _int_or_string(node: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """The one anyOf a structural schema allows here (bare `{type: integer}` and `{type: string}`
    branches), with the value validations beside it: a bound the integer branch carried
    (ByteQuantity's `minimum: 0`) moves to the node, where it checks integers only (strings keep
    their pattern). Dropped, `memoryPerDevice: -1` was stored and refused only at reconcile."""
    integer: dict[str, Any] = next((o for o in node.get("anyOf", []) if o.get("type") == "integer"), {})
    bounds: dict[str, Any] = {k: integer[k] for k in ("minimum", "exclusiveMinimum") if k in integer}
    if not isinstance(bounds.get("exclusiveMinimum", True), bool):  # JSON Schema's number; the API server's is a flag
        bounds = {"minimum": bounds["exclusiveMinimum"], "exclusiveMinimum": True}
    kept: dict[str, Any] = {k: out[k] for k in ("description", "default", "pattern", "maxLength", "minimum", "exclusiveMinimum",
                                "x-kubernetes-validations") if k in out}  # fmt: skip
    return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}], **bounds, **kept}


def _version(spec: type[BaseModel], status: type[BaseModel], columns: list[dict[str, Any]], root_rules: list[dict[str, str]], spec_rules: list[dict[str, str]], spec_required: bool) -> dict[str, Any]:
    spec_schema = structural_schema(spec)
    if spec_rules:
        spec_schema["x-kubernetes-validations"] = spec_rules
    root: dict[str, Any] = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": structural_schema(status),
        },
    }
    if spec_required:
        root["required"] = ["spec"]
    if root_rules:
        root["x-kubernetes-validations"] = root_rules
    return {
        "name": API_VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": columns,
        "schema": {"openAPIV3Schema": root},
    }


def _crd(kind: str, plural: str, scope: str, short: list[str], version: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{API_GROUP}", "labels": {"app.kubernetes.io/part-of": "kvguard"}},
        "spec": {
            "group": API_GROUP,
            "scope": scope,
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                      "shortNames": short, "categories": ["kvguard"]},  # fmt: skip
            "versions": [version],
        },
    }


def inference_model_crd() -> dict[str, Any]:
    columns: list[dict[str, Any]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Revision", "type": "string", "jsonPath": ".status.revision"},
        {"name": "KV Ratio", "type": "number", "jsonPath": ".status.kvRatio", "format": "float"},
        {"name": "Canary", "type": "string", "jsonPath": ".status.canary"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.rollout.step", "priority": 1,
         "description": "Index of the traffic step in progress, from 0 (Events and kvguard status say step 1 of N for 0)"},
        {"name": "Weight", "type": "integer", "jsonPath": ".status.rollout.weight",
         "description": "Percent of user traffic the candidate revision gets"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    version = _version(InferenceModelSpec, InferenceModelStatus, columns, _MODEL_RULES, _SPEC_RULES + _RESPLIT_RULES, True)
    return _crd("InferenceModel", "inferencemodels", "Namespaced", ["infm"], version)


def inference_policy_crd() -> dict[str, Any]:
    columns = [
        {"name": "Min KV Ratio", "type": "number", "jsonPath": ".spec.minKVRatio"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    version = _version(InferencePolicySpec, InferencePolicyStatus, columns, [], [], False)
    return _crd("InferencePolicy", "inferencepolicies", "Cluster", ["infpol"], version)


CRD_FILES: dict[str, Any] = {
    "kvguard.io_inferencemodels.yaml": inference_model_crd,
    "kvguard.io_inferencepolicies.yaml": inference_policy_crd,
}


class _NoAliasDumper(yaml.SafeDumper):
    """Shared sub-objects (one enum list used by two fields) are written out each time: anchors and
    aliases (`&id001` / `*id001`) are legal YAML but some tools and reviewers choke on them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml(crd: dict[str, Any]) -> str:
    header = "# Generated by `kvguard crds` from kvguard.operator.api. Do not edit.\n"
    return header + yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=False, width=100)


def all_files() -> dict[str, str]:
    return {name: render_yaml(build()) for name, build in CRD_FILES.items()}
