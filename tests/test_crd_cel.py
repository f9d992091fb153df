"""Every CEL rule of the generated CRDs, evaluated the way kube-apiserver does (defaults applied,
schema validated, then CEL; see crd_admission.py): minimal and full valid specs are stored, invalid
ones are refused with the rule's own message. kmock enforces none of this; a real API server does.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_admission import (
    Rejection,
    admit,
    all_rules,
    apply_defaults,
    evaluate_rule,
    openapi_schema,
    prune_unknown,
    rule_paths_exist,
)
from pydantic import ValidationError

from kvguard.operator.api import InferenceModel, parse_byte_quantity
from kvguard.operator.crdgen import _SPEC_RULES, all_files, inference_model_crd, inference_policy_crd
from kvguard.operator.planner import check_spec
from kvguard.operator.spec_checks import resplit_problem

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CRDS = {"InferenceModel": inference_model_crd(), "InferencePolicy": inference_policy_crd()}


def minimal(**spec: Any) -> dict[str, Any]:
    """The smallest InferenceModel pydantic accepts: everything else defaults."""
    body = {"model": {"name": "m"}, "contextLength": 1024, "hardware": {"memoryPerDevice": "80Gi"}}
    body.update(spec)
    return {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "m"}, "spec": body}


def full() -> dict[str, Any]:
    """Every optional section set (the sglang H100 example plus the rest)."""
    body = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-sglang-h100.yaml").read_text())
    spec = body["spec"]
    spec["weights"] = {"quantization": "fp8", "measuredBytesPerDevice": "15.1Gi", "groupSize": 128}
    spec["reserve"] = "1Gi"
    spec["kvPoolTokens"] = 400_000
    spec["roles"]["decode"].update({"resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
                                    "nodeSelector": {"pool": "gpu"},
                                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})  # fmt: skip
    spec["kvTransfer"] = {"maxBatch": "128Mi", "timeoutSeconds": 60, "port": 9100}
    spec["rollout"] = {"canaryReplicas": 1, "progressDeadlineSeconds": 900}
    spec["revisionHistoryLimit"] = 3
    return body


def admitted(body: dict[str, Any]) -> dict[str, Any]:
    stored, rejections = admit(body, CRDS[body["kind"]])
    assert rejections == [], rejections
    InferenceModel.model_validate(stored)  # what the API server stores, the operator can read
    return stored


VALID = {
    "minimal cuda": minimal(),
    "minimal cpu, engine left out": minimal(hardware={"device": "cpu", "memoryPerDevice": "256Mi"}),
    "engine without kind": minimal(engine={"version": "0.1"}, hardware={"device": "cpu", "memoryPerDevice": 1 << 28}),
    "hugging face with sglang": minimal(engine={"kind": "sglang", "image": "i"}, model={"name": "m", "source": {"huggingFace": "org/m"}}),
    "pvc with kvguard, engine left out": minimal(model={"name": "m", "source": {"pvc": {"claimName": "c"}}}),
    "full": full(),
    "twenty rising steps": minimal(rollout={"trafficRouter": "gatewayAPI", "gateway": {"parentRefs": [{"name": "gw"}]},
                                            "steps": [{"weight": w} for w in range(5, 100, 5)] + [{"weight": 100}]}),
    **{f"example {p.name}": yaml.safe_load(p.read_text()) for p in EXAMPLES},
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_specs_are_stored(name: str) -> None:
    body = copy.deepcopy(VALID[name])
    assert admitted(body)["kind"] == body["kind"]  # stored without a rejection, and readable (admitted asserts both)


def test_the_first_rule_failed_on_a_minimal_spec_before_defaults_and_guards() -> None:
    """The bug a real API server showed: `self.engine.kind` with spec.engine left out."""
    old_rule = "self.hardware.device == 'cuda' || self.engine.kind == 'kvguard'"
    spec = minimal(hardware={"device": "cpu", "memoryPerDevice": "1Gi"})["spec"]
    assert "no such member" in str(evaluate_rule(old_rule, spec))
    assert evaluate_rule(old_rule, apply_defaults(copy.deepcopy(spec), openapi_schema(inference_model_crd())["properties"]["spec"])) is True
    for rule in _SPEC_RULES:  # the guards hold without the defaults too (objects stored before them)
        assert evaluate_rule(rule["rule"], spec) is True


def test_defaults_fill_nested_objects_as_pydantic_does() -> None:
    stored = admitted(minimal())
    assert stored["spec"]["engine"]["kind"] == "kvguard"
    assert stored["spec"]["roles"]["decode"]["replicas"] == 1 and stored["spec"]["roles"]["router"]["replicas"] == 1
    assert stored["spec"]["rollout"]["progressDeadlineSeconds"] == InferenceModel.model_validate(minimal()).spec.rollout.progress_deadline_seconds


def rejected(body: dict[str, Any]) -> list[Rejection]:
    _, rejections = admit(body, CRDS[body["kind"]])
    return rejections


NARROW_HEADS = ("hiddenSize must be at least numAttentionHeads when headDim is not set: the head width "
                "hiddenSize / numAttentionHeads would be 0")
NAME_RULE = "metadata.name: lowercase letters, digits and '-', a letter first and a letter or digit last (child Services are named after it)"
INVALID = {
    "cpu with sglang": (minimal(engine={"kind": "sglang", "image": "i"}, hardware={"device": "cpu", "memoryPerDevice": "1Gi"}),
                        "spec", "spec.hardware.device: cpu runs only with engine kind kvguard"),
    "hugging face with kvguard named": (minimal(engine={"kind": "kvguard"}, model={"name": "m", "source": {"huggingFace": "org/m"}}),
                                        "spec", "spec.model.source: the kvguard engine loads weights from a directory; use pvc"),
    "hugging face with the default engine": (minimal(model={"name": "m", "source": {"huggingFace": "org/m"}}),
                                             "spec", "spec.model.source: the kvguard engine loads weights from a directory; use pvc"),
    "both sources": (minimal(engine={"kind": "vllm", "image": "i"}, model={"name": "m", "source": {"huggingFace": "a", "pvc": {"claimName": "c"}}}),
                     "spec.model.source", "set exactly one of huggingFace or pvc"),
    "no source kind": (minimal(model={"name": "m", "source": {"revision": "r1"}}), "spec.model.source", "set exactly one of huggingFace or pvc"),
    "long name": ({**minimal(), "metadata": {"name": "m" * 41}}, "",
                  "metadata.name: at most 40 characters (child objects append -<revision>-<role>)"),
    "digit first": ({**minimal(), "metadata": {"name": "1model"}}, "", NAME_RULE),
    "dotted name": ({**minimal(), "metadata": {"name": "my.model"}}, "", NAME_RULE),
    "another model's object": ({**minimal(), "metadata": {"name": "tiny-89c0e86f3e-decode"}}, "",
                               "metadata.name: no part of 10 hex digits (child objects name their revision so: <model>-<revision>-<role>)"),
    # Outside probe: admitted, it failed every rollout's analysis.
    "a query no value passes": (minimal(rollout={"analysis": {"prometheusURL": "http://p:9090",
                                                              "queries": [{"name": "q", "query": "up", "min": 5, "max": 1}]}}),
                                "spec.rollout.analysis.queries[0]", "min must not exceed max: no value could pass"),
    # Outside probe: a head width of 0 divided the pool size by zero in the webhook and reconcile.
    "heads without width": (minimal(model={"name": "m", "architecture": {"numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 4,
                                                                          "hiddenSize": 3}}),
                            "spec.model.architecture", NARROW_HEADS),
    # Outside probe: stored by the CRD, refused by the webhook (check_steps) alone.
    "weights that fall": (minimal(rollout={"trafficRouter": "gatewayAPI", "gateway": {"parentRefs": [{"name": "gw"}]},
                                           "steps": [{"weight": 50}, {"weight": 10}, {"weight": 100}]}),
                          "spec.rollout", "spec.rollout.steps: weights must increase from step to step"),
    "a weight twice": (minimal(rollout={"trafficRouter": "gatewayAPI", "gateway": {"parentRefs": [{"name": "gw"}]},
                                        "steps": [{"weight": 10}] * 19 + [{"weight": 100}] * 1}),
                       "spec.rollout", "spec.rollout.steps: weights must increase from step to step"),
    # Outside probe: the planner's checks were the webhook's and reconcile's alone.
    "more kv heads than heads": (minimal(model={"name": "m", "architecture": {"numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 8,
                                                                               "headDim": 64}}),
                                 "spec.model.architecture", "numKVHeads: must not exceed numAttentionHeads"),
    "kv heads that do not divide": (minimal(model={"name": "m", "architecture": {"numLayers": 2, "numAttentionHeads": 6, "numKVHeads": 4,
                                                                                  "headDim": 64}}),
                                    "spec.model.architecture", "numKVHeads: must divide numAttentionHeads"),
    "parts above the total": (minimal(model={"name": "m", "architecture": {"numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 4,
                                                                            "headDim": 64, "totalParameters": 100,
                                                                            "embeddingParameters": 60, "attentionParameters": 50}}),
                              "spec.model.architecture", "totalParameters: must be at least embedding + attention + expert parameters"),
    # A review: checked by the planner alone.
    "more moe layers than layers": (minimal(model={"name": "m", "architecture": {"numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 4,
                                                                                  "headDim": 64, "moeLayers": 3}}),
                                    "spec.model.architecture", "moeLayers: must not exceed numLayers"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_specs_are_refused_with_the_rules_message(name: str) -> None:
    body, path, message = INVALID[name]
    assert rejected(copy.deepcopy(body)) == [Rejection(path, message)]


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("hardware", "memoryPerDevice"), "lots"),
        (("hardware", "deviceOverhead"), "1 Gigabyte"),
        (("reserve",), "-1Gi"),
        (("kvTransfer", "maxBatch"), "64MB"),
        (("roles", "decode", "resources", "requests", "memory"), "lots"),
        (("roles", "prefill", "resources", "limits", "cpu"), "two"),
    ],
)
def test_quantities_that_are_not_quantities_fail_the_schema(where: tuple[str, ...], value: Any) -> None:
    body = minimal(roles={"decode": {"resources": {"requests": {}}}, "prefill": {"resources": {"limits": {}}}})
    node = body["spec"]
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    (rejection,) = rejected(body)
    assert rejection.path == "spec." + ".".join(where) and "does not match" in rejection.message


@pytest.mark.parametrize(("where", "value", "bound"), [
    (("hardware", "memoryPerDevice"), -1, 1), (("hardware", "memoryPerDevice"), 0, 1), (("hardware", "deviceOverhead"), -5, 0),
    (("reserve",), -1, 0), (("kvTransfer", "maxBatch"), 0, 1),
])  # fmt: skip
def test_byte_quantities_given_as_integers_keep_their_bounds_in_the_schema(where: tuple[str, ...], value: int, bound: int) -> None:
    """Outside probe: the int-or-string schema dropped `minimum`, so the API server stored
    `memoryPerDevice: -1` that only the webhook or reconcile refused. The models refuse it too."""
    body = minimal()
    node = body["spec"]
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    (rejection,) = rejected(copy.deepcopy(body))
    assert rejection == Rejection("spec." + ".".join(where), f"{value} is less than the minimum of {bound}")
    with pytest.raises(ValidationError, match=re.escape(".".join(where))):
        InferenceModel.model_validate(body)


@pytest.mark.parametrize("where", [("hardware", "memoryPerDevice"), ("kvTransfer", "maxBatch")])
@pytest.mark.parametrize("text", ["0", "0Gi", "00.000Ki", "0e9", " 0 "])
def test_a_zero_quantity_written_as_a_string_fails_the_schema_too(where: tuple[str, ...], text: str) -> None:
    """Outside probe: `memoryPerDevice: "0Gi"` was stored by the API server (only the integer 0
    failed its minimum) and refused by the webhook alone."""
    body = minimal()
    body["spec"].setdefault(where[0], {})[where[1]] = text
    (rejection,) = rejected(copy.deepcopy(body))
    assert rejection.path == "spec." + ".".join(where) and "does not match" in rejection.message
    with pytest.raises(ValidationError, match="greater than 0"):
        InferenceModel.model_validate(body)


@pytest.mark.parametrize("text", ["1", "0.5Ki", "80Gi", "10.0", "0001G", "0.25e3k"])
def test_a_positive_quantity_passes_both_ways(text: str) -> None:
    body = minimal(hardware={"memoryPerDevice": text}, kvTransfer={"maxBatch": text})
    stored = admitted(copy.deepcopy(body))
    assert stored["spec"]["hardware"]["memoryPerDevice"] == text  # the API server keeps the string as given
    spec = InferenceModel.model_validate(body).spec
    assert spec.hardware.memory_per_device == spec.kv_transfer.max_batch == parse_byte_quantity(text) > 0


def test_a_number_of_bytes_with_a_fraction_is_refused_both_ways() -> None:
    body = minimal(hardware={"memoryPerDevice": 1.5})
    (rejection,) = rejected(copy.deepcopy(body))
    assert rejection.path == "spec.hardware.memoryPerDevice"
    with pytest.raises(ValidationError, match="1.5 is not a whole number of bytes"):
        InferenceModel.model_validate(body)


@pytest.mark.parametrize("text", ["80Gi", "79.18Gi", "16G", "1e9", "1048576", "512k"])
def test_the_crd_quantity_pattern_accepts_what_the_operator_parses(text: str) -> None:
    assert parse_byte_quantity(text) > 0
    admitted(minimal(hardware={"memoryPerDevice": text}))


def test_every_rule_compiles_and_reads_only_declared_fields() -> None:
    for crd in CRDS.values():
        for path, rule, node in all_rules(openapi_schema(crd)):
            assert rule_paths_exist(rule["rule"], node) == [], f"{path}: {rule['rule']}"
            assert rule.get("message"), f"{path}: a rule without a message gives users the CEL text"


def test_conditions_merge_by_type() -> None:
    for crd in CRDS.values():
        conditions = openapi_schema(crd)["properties"]["status"]["properties"]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
        assert "type" in conditions["items"]["required"], "a list-map key must be required"


def test_generated_files_have_no_yaml_anchors() -> None:
    for name, text in all_files().items():
        assert "&id" not in text and "*id" not in text, name
        yaml.safe_load(text)


def test_unknown_fields_are_pruned_as_the_api_server_prunes_them() -> None:
    """A typo'd field is not stored (kubectl's strict field validation refuses it outright): the
    operator never sees `spec.bogusField` or `roles.prefill.replica`, so it cannot act on them."""
    body = minimal()
    body["spec"]["bogusField"] = 1
    body["spec"].setdefault("roles", {}).setdefault("prefill", {})["replica"] = 3
    body["metadata"]["labels"] = {"kept": "yes"}
    dropped = prune_unknown(copy.deepcopy(body), openapi_schema(CRDS["InferenceModel"]))
    assert dropped == ["spec.bogusField", "spec.roles.prefill.replica"]
    stored, rejections = admit(body, CRDS["InferenceModel"])
    assert rejections == [] and "bogusField" not in stored["spec"] and "replica" not in stored["spec"]["roles"]["prefill"]
    assert stored["metadata"]["labels"] == {"kept": "yes"}  # ObjectMeta is not the CRD schema's to prune


@pytest.mark.parametrize("name", ["another model's object", "both sources", "no source kind", "heads without width",
                                  "weights that fall", "a weight twice"])
def test_the_models_refuse_what_these_rules_refuse_where_no_api_server_runs_them(name: str) -> None:
    """kvguard plan/render/apply --local and the webhook read the pydantic models, not the CEL."""
    body, _, message = INVALID[name]
    with pytest.raises(ValueError, match=re.escape(message.removeprefix("metadata.name: ")[:20])):
        InferenceModel.model_validate(body)


ARGV_FIELDS = [
    (("model", "name"), "ti\x00ny"), (("model", "source", "pvc", "path"), "ti\x00ny"), (("model", "source", "revision"), "v\x001"),
    (("engine", "version"), "1\n2"), (("engine", "image"), "img\x00:1"), (("engine", "routerImage"), "r\x01:1"),
    (("engine", "extraArgs"), ["--header-timeout=a\x00b"]), (("roles", "decode", "extraArgs"), ["a\x00"]),
    (("roles", "decode", "image"), "img:\x7f"),
]  # fmt: skip


@pytest.mark.parametrize(("where", "value"), ARGV_FIELDS, ids=lambda v: ".".join(v) if isinstance(v, tuple) else repr(v))
def test_control_characters_bound_for_a_command_line_are_refused_by_field_both_ways(where: tuple[str, ...], value: Any) -> None:
    """Outside probe: a NUL in model.name, a pvc path, the revision, an image or an extra argument
    was admitted and rendered into the pod's command, which exec cannot start: the rollout would
    wait out its deadline. The webhook (the model) and the CRD (its patterns) both refuse it now."""
    body = full()
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}, "revision": "main"}
    admitted(copy.deepcopy(body))
    node = body["spec"]
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    with pytest.raises(ValidationError) as refused:
        InferenceModel.model_validate(body)
    assert ".".join(str(p) for p in refused.value.errors()[0]["loc"]).startswith("spec." + ".".join(where))
    _, rejections = admit(copy.deepcopy(body), CRDS["InferenceModel"])
    assert any(r.path.startswith("spec." + ".".join(where)) for r in rejections), rejections


def _split_spec(prefill: dict[str, Any], decode: dict[str, Any], **weights: Any) -> dict[str, Any]:
    return minimal(engine={"kind": "sglang", "image": "i"}, weights=weights, roles={"prefill": prefill, "decode": decode})


TP2, TP1, TP4, TP8 = {"tensorParallel": 2}, {"tensorParallel": 1}, {"tensorParallel": 4}, {"tensorParallel": 8}
TP2_PP4 = {"tensorParallel": 2, "pipelineParallel": 4}
DPA2 = {"tensorParallel": 4, "dataParallel": 2, "dataParallelAttention": True}
DPA4 = {"tensorParallel": 4, "dataParallel": 4, "dataParallelAttention": True}
RESPLITS = {  # name: (stored, update)
    "tp2 -> tp1, figure kept": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi"), _split_spec(TP1, TP1, measuredBytesPerDevice="1Mi")),
    "decode only, figure kept": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi"), _split_spec(TP2, TP4, measuredBytesPerDevice="1Mi")),
    "pp instead of tp": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi"),
                         _split_spec(TP2, {"pipelineParallel": 2}, measuredBytesPerDevice="1Mi")),  # same GPUs
    # The same GPUs in another shape: each end stage of TP2 x PP4 holds a whole vocabulary matrix
    # over 2 GPUs, where TP8 spreads two over 8 (a review: admitted while only counts compared).
    "tp8 -> tp2 x pp4, figure kept": (_split_spec(TP8, TP8, measuredBytesPerDevice="1Mi"),
                                      _split_spec(TP8, TP2_PP4, measuredBytesPerDevice="1Mi")),
    "tp8 -> tp2 x pp4, measuredShards set": (_split_spec(TP8, TP8, measuredBytesPerDevice="1Mi"),
                                             _split_spec(TP8, TP2_PP4, measuredBytesPerDevice="1Mi", measuredShards=8)),
    "measuredShards dropped, its GPUs in stages": (_split_spec(TP8, TP8, measuredBytesPerDevice="1Mi", measuredShards=8),
                                                   _split_spec(TP2_PP4, TP8, measuredBytesPerDevice="1Mi")),
    "measuredShards set": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi"),
                           _split_spec(TP1, TP1, measuredBytesPerDevice="1Mi", measuredShards=2)),
    "measured again": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi"), _split_spec(TP1, TP1, measuredBytesPerDevice="2Mi")),
    "measuredShards dropped": (_split_spec(TP1, TP1, measuredBytesPerDevice="1Mi", measuredShards=2),
                               _split_spec(TP1, TP1, measuredBytesPerDevice="1Mi")),
    "measuredShards dropped, at its split": (_split_spec(TP2, TP2, measuredBytesPerDevice="1Mi", measuredShards=2),
                                             _split_spec(TP2, TP2, measuredBytesPerDevice="1Mi")),
    "no figure": (_split_spec(TP2, TP2), _split_spec(TP1, TP1)),
    "figure added with the change": (_split_spec(TP2, TP2), _split_spec(TP1, TP1, measuredBytesPerDevice="1Mi")),
    "dp attention 2 -> 4": (_split_spec(TP4, DPA2, measuredBytesPerDevice="6Gi"), _split_spec(TP4, DPA4, measuredBytesPerDevice="6Gi")),
    "dp attention 2 -> 4, shards set": (_split_spec(TP4, DPA2, measuredBytesPerDevice="6Gi", measuredShards=4),
                                        _split_spec(TP4, DPA4, measuredBytesPerDevice="6Gi", measuredShards=4)),
    "dp attention turned off": (_split_spec(TP4, DPA2, measuredBytesPerDevice="6Gi"),
                                _split_spec(TP4, {**DPA2, "dataParallelAttention": False}, measuredBytesPerDevice="6Gi")),
    "dp without attention 2 -> 4": (_split_spec(TP4, {**DPA2, "dataParallelAttention": False}, measuredBytesPerDevice="6Gi"),
                                    _split_spec(TP4, {**DPA4, "dataParallelAttention": False}, measuredBytesPerDevice="6Gi")),
}


@pytest.mark.parametrize("name", list(RESPLITS))
def test_the_crd_refuses_a_resplit_under_a_measured_figure_as_the_webhook_does(name: str) -> None:
    """An outside probe: TP4 -> TP1 with measuredBytesPerDevice kept was refused by the webhook alone
    (spec_checks.resplit_problem); without it the API server stored it and reconcile planned the
    TP4 figure at TP1. The CRD's transition rules refuse what the webhook refuses, by the same field."""
    stored, update = (copy.deepcopy(body) for body in RESPLITS[name])
    webhook = resplit_problem(InferenceModel.model_validate(stored).spec, InferenceModel.model_validate(update).spec)
    _, created = admit(copy.deepcopy(update), CRDS["InferenceModel"])
    assert created == [], "a transition rule holds on updates only"
    _, rejections = admit(update, CRDS["InferenceModel"], old=stored)
    assert [r.message.split(":")[0] for r in rejections] == ([webhook.split(":")[0]] if webhook else []), (webhook, rejections)
    assert all(r.path == "spec" for r in rejections)


@pytest.mark.parametrize("name", ["more kv heads than heads", "kv heads that do not divide", "parts above the total",
                                  "more moe layers than layers"])
def test_the_planner_refuses_what_the_architecture_rules_refuse(name: str) -> None:
    """The architecture rules mirror planner._architecture_problems (the webhook's and reconcile's
    check): the same spec, the same field."""
    body, _, message = INVALID[name]
    field = message.split(":")[0]
    with pytest.raises(ValueError, match=re.escape(f"spec.model.architecture.{field}")):
        check_spec(InferenceModel.model_validate(body).spec)


_STRING_SIZED = ("matches", "contains", "find", "findAll", "split", "replace", "lowerAscii", "upperAscii", "trim", "indexOf")


def _rules_and_int_or_strings(node: object, name: str = "") -> tuple[list[tuple[str, str]], set[str]]:
    """Every (field name, CEL rule) in a schema, and the names of its int-or-string fields."""
    rules: list[tuple[str, str]] = []
    int_or_string: set[str] = set()
    if isinstance(node, list):
        for item in node:
            more, names = _rules_and_int_or_strings(item, name)
            rules += more
            int_or_string |= names
    elif isinstance(node, dict):
        if node.get("x-kubernetes-int-or-string"):
            int_or_string.add(name)
        rules += [(name, rule["rule"]) for rule in node.get("x-kubernetes-validations", [])]
        for key, child in node.items():
            children = child.items() if key == "properties" else [(name, child)] if key in ("items", "additionalProperties") else []
            for child_name, grandchild in children:
                more, names = _rules_and_int_or_strings(grandchild, child_name)
                rules += more
                int_or_string |= names
    return rules, int_or_string


def test_no_rule_runs_a_string_sized_function_on_an_int_or_string_field() -> None:
    """Before 1.34 an API server costs an int-or-string field at the request's size whatever its
    maxLength (kubernetes#132837): a matches() on each of 20 rollout steps' pause came to ~19M,
    over the 10M one rule may cost, so the CRD would not have installed there (an outside probe).
    No rule calls a function whose cost grows with such a field's length, on it or through it."""
    rules, int_or_string = _rules_and_int_or_strings([crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
                                                      for crd in CRDS.values()])
    assert {"pause", "memoryPerDevice"} <= int_or_string, int_or_string  # the walk finds them
    for field, rule in rules:
        receivers = {f"self.{name}" for name in int_or_string} | {f".{name}" for name in int_or_string}
        if field in int_or_string:
            receivers.add("self")
        for receiver in receivers:
            for function in _STRING_SIZED:
                assert f"{receiver}.{function}(" not in rule, (field, rule)
