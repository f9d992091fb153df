"""InferenceModel API models: wire names, quantities, field-level validation errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvguard.operator import api

MINIMAL = {
    "apiVersion": "kvguard.io/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "m", "uid": "server-set fields pass through"},
    "spec": {"model": {"name": "x"}, "contextLength": 4096, "hardware": {"memoryPerDevice": "80Gi"}},
}


def with_spec(**changes: object) -> dict[str, object]:
    return {**MINIMAL, "spec": {**MINIMAL["spec"], **changes}}  # type: ignore[dict-item]


def error_locations(document: dict[str, object]) -> set[str]:
    with pytest.raises(ValidationError) as caught:
        api.InferenceModel.model_validate(document)
    return {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}


def test_minimal_manifest_gets_documented_defaults() -> None:
    model = api.InferenceModel.model_validate(MINIMAL)
    spec = model.spec
    assert spec.min_kv_ratio == 2.0 and spec.page_size == 1 and spec.kv_cache_dtype is api.KVCacheDtype.AUTO
    assert spec.engine.kind is api.EngineKind.KVGUARD
    assert spec.hardware.memory_per_device == 80 * 1024**3
    assert spec.roles.prefill.tensor_parallel == 1 and spec.roles.router.replicas == 1


def test_wire_names_are_camel_case_with_kv_capitalised_inside() -> None:
    wire = api.InferenceModel.model_validate(MINIMAL).to_wire()
    assert {"contextLength", "minKVRatio", "kvCacheDtype", "pageSize"} <= set(wire["spec"])
    assert wire["apiVersion"] == "kvguard.io/v1alpha1" and wire["kind"] == "InferenceModel"
    arch = api.ModelArchitecture(num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=8)
    assert "numKVHeads" in arch.to_wire()
    assert api.InferenceModelSpec.model_validate(wire["spec"]) == api.InferenceModel.model_validate(MINIMAL).spec


def test_python_names_are_accepted_too() -> None:
    spec = api.InferenceModelSpec(model=api.ModelSpec(name="x"), context_length=8, hardware={"memory_per_device": 1024})
    assert spec.context_length == 8


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("80Gi", 80 * 1024**3), ("79.18Gi", int(79.18 * 1024**3)), ("16G", 16 * 10**9), ("1e9", 10**9), (4096, 4096)],
)
def test_byte_quantities(quantity: object, expected: int) -> None:
    assert api.parse_byte_quantity(quantity) == expected


@pytest.mark.parametrize("quantity", [float("inf"), float("nan"), "1e400Gi", "1e30", 10**400, -1, True])
def test_byte_quantities_that_are_not_finite_or_too_large_are_value_errors(quantity: object) -> None:
    with pytest.raises(ValueError):
        api.parse_byte_quantity(quantity)


def test_non_finite_ratios_and_fractions_are_field_level_errors() -> None:
    assert "spec.minKVRatio" in error_locations(with_spec(minKVRatio=float("inf")))
    assert "spec.memoryFraction" in error_locations(with_spec(memoryFraction=float("nan")))
    assert "spec.reserve" in error_locations(with_spec(reserve=float("inf")))
    assert "spec.roles.decode.memoryFraction" in error_locations(with_spec(roles={"decode": {"memoryFraction": float("nan")}}))


def test_omitted_overheads_stay_unknown_so_the_planner_can_estimate_them() -> None:
    spec = api.InferenceModel.model_validate(MINIMAL).spec
    assert spec.reserve is None and spec.hardware.device_overhead is None
    assert "reserve" not in api.InferenceModel.model_validate(MINIMAL).to_wire()["spec"]


def test_typos_and_bad_values_are_field_level_errors() -> None:
    assert "spec.contextLenght" in error_locations(with_spec(contextLenght=5))
    assert "spec.contextLength" in error_locations(with_spec(contextLength=-1))
    assert "spec.kvCacheDtype" in error_locations(with_spec(kvCacheDtype="fp7"))
    assert "spec.hardware.memoryPerDevice" in error_locations(with_spec(hardware={"memoryPerDevice": "80 GB"}))
    assert "spec.memoryFraction" in error_locations(with_spec(memoryFraction=1.5))
    assert "spec.minKVRatio" in error_locations(with_spec(minKVRatio=0.5))
    assert "spec.roles.decode.tensorParallel" in error_locations(with_spec(roles={"decode": {"tensorParallel": 0}}))
    assert "spec.engine.kind" in error_locations(with_spec(engine={"kind": "tgi"}))
    assert "kind" in error_locations({**MINIMAL, "kind": "Deployment"})


def test_json_schema_documents_fields_for_the_crd() -> None:
    schema = api.InferenceModel.model_json_schema(by_alias=True)
    spec = schema["$defs"]["InferenceModelSpec"]["properties"]
    assert "contextLength" in spec and spec["contextLength"]["description"]
    assert schema["$defs"]["HardwareSpec"]["properties"]["memoryPerDevice"]["x-kubernetes-int-or-string"] is True
    assert schema["$defs"]["EngineKind"]["enum"] == ["kvguard", "sglang", "vllm"]


def test_plan_round_trips_through_status() -> None:
    role = api.RolePlan(
        gpus_per_instance=1, instances=1, bytes_per_token=512, weights_bytes_per_gpu=1, kv_bytes_per_gpu=2048,
        memory_fraction=0.9, memory_pool_tokens=4, pool_tokens=4, capped_by="memory", ratio=2.0, sufficient=True,
    )  # fmt: skip
    plan = api.KVPlan(verdict="pass", engine="kvguard", context_length=2, min_ratio=2.0, page_size=1,
                      kv_cache_dtype="fp32", roles={"decode": role})  # fmt: skip
    status = api.InferenceModelStatus(plan=plan)
    assert api.InferenceModelStatus.model_validate(status.to_wire()) == status
    assert status.to_wire()["plan"]["roles"]["decode"]["poolTokens"] == 4
