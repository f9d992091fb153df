"""Specs an outside probe found mishandled: the webhook answered 500 with a pydantic dump (weights
larger than the device, minKVRatio 1e308), admitted children a real API server refuses (GPU product
labels, tolerations, resources), or reconcile crashed on a spec that is not an object.

Each is now a field-level refusal (422 from the webhook, Degraded InvalidSpec from reconcile), or
admitted and reported Blocked where reconcile would block it.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_webhook import set_path

from kvguard.cli import main as cli_main
from kvguard.operator.api import MAX_KV_RATIO, HardwareSpec, InferenceModelSpec, InferencePolicy, ResourceRequirements
from kvguard.operator.controller import Controller
from kvguard.operator.crdgen import inference_model_crd, inference_policy_crd
from kvguard.operator.reconcile import Observed, reconcile
from kvguard.operator.webhook import INVALID, AdmissionDenied, check_admission, parse_policies

ROOT = Path(__file__).resolve().parent.parent
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def tiny_model() -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": "tiny", "namespace": "models", "uid": "uid-tiny", "generation": 1}
    return body


def denial(body: dict[str, Any]) -> AdmissionDenied | None:
    try:
        check_admission(body, None, "CREATE", [])
    except AdmissionDenied as exc:
        return exc
    return None


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


# --- 1a: weights larger than the device: a blocked plan, admitted as reconcile treats it -------------


def test_weights_larger_than_the_device_are_admitted_and_reconcile_blocks_them() -> None:
    body = tiny_model()
    body["spec"]["model"]["architecture"]["totalParameters"] = 1e10  # 40 GB of fp32 on a 256Mi budget
    assert denial(body) is None
    outcome = reconcile(body, Observed(), now=NOW)
    assert outcome.blocked_reason == "KVPoolTooSmall"
    assert condition(outcome.status, "KVPoolSufficient")["status"] == "False"


def test_weights_larger_than_the_device_under_a_policy_that_reads_command_lines_are_blocked_not_a_crash() -> None:
    """A policy checking the workers' flags renders their command lines; with no room for a KV pool
    the renderer refuses by field (it built an invalid WorkerArgs before), so the policy falls back
    as for any unrenderable spec and the plan's block stands."""
    body = tiny_model()
    body["spec"]["model"]["architecture"]["totalParameters"] = 1e10
    policy = parse_policies([{"apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": "p"},
                              "spec": {"requireKVIntegrity": True}}])  # fmt: skip
    assert len(policy) == 1
    try:
        check_admission(body, None, "CREATE", policy)
    except AdmissionDenied as exc:
        assert "validation error" not in str(exc)  # a field message, never a pydantic dump
    outcome = reconcile(body, Observed(policies=policy), now=NOW)
    assert outcome.blocked_reason == "KVPoolTooSmall"


# --- 1b: minKVRatio has a maximum, in the models and the CRDs -------------------------------------------


def test_an_infinite_min_kv_ratio_is_a_field_error_not_a_traceback() -> None:
    body = tiny_model()
    body["spec"]["minKVRatio"] = 1e308
    exc = denial(body)
    assert exc is not None and exc.code == INVALID
    assert str(exc).startswith("spec.minKVRatio:") and "100" in str(exc)
    degraded = condition(reconcile(body, Observed(), now=NOW).status, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and degraded["message"].startswith("spec.minKVRatio:")


def test_kvguard_render_refuses_an_infinite_min_kv_ratio_by_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = tiny_model()
    body["spec"]["minKVRatio"] = 1e308
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(body))
    assert cli_main(["render", "-f", str(manifest)]) == 2
    assert "minKVRatio" in capsys.readouterr().err


@pytest.mark.parametrize(("path", "value"), [
    ("spec.canary.isolation.longRequestMaxTokens", 1024),  # the context length: the CRD's CEL refuses it too
    ("spec.canary.isolation.longRequestMaxTokens", 1010),
    ("spec.canary.golden.prompts", [{"prompt": "hello", "maxTokens": 1024}]),
    ("spec.canary.capacity.minRatio", 3),
])
def test_kvguard_render_refuses_what_the_webhook_and_plan_refuse(path: str, value: Any, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: `render` printed every object, exit 0, for canary settings that admission
    and `kvguard plan` refuse by field. It runs their checks now (spec_checks.py), with their words."""
    body = yaml.safe_load((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text())
    set_path(body, path, value)
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(body))
    with pytest.raises(AdmissionDenied):
        check_admission(body, None, "CREATE", [])
    assert cli_main(["plan", "-f", str(manifest)]) == 2
    said = capsys.readouterr().err.replace("kvguard plan: ", "")
    assert cli_main(["render", "-f", str(manifest)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.replace("kvguard render: ", "") == said


def test_a_policy_min_kv_ratio_above_the_maximum_is_refused() -> None:
    raw: dict[str, Any] = {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": "p"}}
    raw["spec"] = {"minKVRatio": 1e308}
    assert parse_policies([raw]) == []  # unreadable: logged and skipped, never a traceback
    raw["spec"]["minKVRatio"] = MAX_KV_RATIO
    assert InferencePolicy.model_validate(raw).spec.min_kv_ratio == MAX_KV_RATIO


@pytest.mark.parametrize("build", [inference_model_crd, inference_policy_crd])
def test_the_crd_schemas_carry_the_maximum(build: Any) -> None:
    spec = build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["minKVRatio"]["maximum"] == MAX_KV_RATIO


# --- 2: what the API server would refuse in the rendered Deployments ------------------------------------


REFUSED = [
    ("spec.hardware.gpuProduct", "NVIDIA H100", "spec.hardware.gpuProduct: 'NVIDIA H100' is not a label value"),
    ("spec.hardware.gpuProduct", "H" * 64, "spec.hardware.gpuProduct"),
    ("spec.roles.decode.gpuType", "NVIDIA H100", "use the label's form, e.g. NVIDIA-H100-80GB-HBM3"),
    ("spec.roles.decode.tolerations", [{"value": "x"}], "key is required when operator is Equal"),
    ("spec.roles.decode.tolerations", [{"operator": "Equal", "effect": "NoSchedule"}], "key is required when operator is Equal"),
    ("spec.roles.decode.tolerations", [{"key": "gpu", "value": "not a value"}], "value: 'not a value' is not a label value"),
    ("spec.roles.decode.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}], "value must be empty"),
    ("spec.roles.decode.tolerations", [{"key": "gpu", "effect": "Sometimes"}], "spec.roles.decode.tolerations[0].effect"),
    ("spec.roles.decode.resources", {"requests": {"gpu": "1"}}, "resource name 'gpu' is not a standard container resource"),
    ("spec.roles.decode.resources", {"limits": {"cpu": "-1"}}, "limits.cpu: -1 must not be negative"),
    ("spec.roles.decode.resources", {"requests": {"example.com/foo": "500m"}, "limits": {"example.com/foo": "500m"}},
     "requests.example.com/foo: 500m must be a whole number"),
    ("spec.roles.decode.resources", {"requests": {"example.com/foo": "1"}}, "requests.example.com/foo (1) needs limits.example.com/foo"),
    ("spec.roles.decode.resources", {"requests": {"example.com/foo": "1"}, "limits": {"example.com/foo": "2"}},
     "requests.example.com/foo (1) must equal limits.example.com/foo (2)"),
    ("spec.roles.decode.resources", {"requests": {"hugepages-2Mi": "1Gi"}, "limits": {"hugepages-2Mi": "2Gi"}},
     "requests.hugepages-2Mi (1Gi) must equal limits.hugepages-2Mi (2Gi)"),
    ("spec.roles.decode.resources", {"requests": {"cpu": "1e400"}, "limits": {"cpu": "1"}}, "requests.cpu (1e400) must not exceed"),
    ("spec.contextLength", 99_999_999_999, "spec.contextLength: must be at most 16,777,216 tokens"),
    # YAML's yes/true and quoted numbers: lax parsing read them as 1 and 32 (contextLength: true
    # planned the incident's blocked configuration as a passing 1-token context).
    ("spec.contextLength", True, "spec.contextLength: Input should be a valid integer"),
    ("spec.model.architecture.numLayers", "32", "spec.model.architecture.numLayers: Input should be a valid integer"),
    ("spec.minKVRatio", True, "spec.minKVRatio: Input should be a valid number"),
    ("spec.roles.decode.replicas", "2", "spec.roles.decode.replicas: Input should be a valid integer"),
    ("spec.canary.isolation.longRequestFractions", [0.5, True], "spec.canary.isolation.longRequestFractions: Input should be"),
    # Booleans likewise (an outside probe: `enabled: 1` or "false" was read as one; the schema refuses them).
    ("spec.canary.isolation.enabled", 1, "spec.canary.isolation.enabled: Input should be a valid boolean"),
    ("spec.canary.isolation.enabled", "false", "spec.canary.isolation.enabled: Input should be a valid boolean"),
    ("spec.roles.decode.dataParallelAttention", "yes", "spec.roles.decode.dataParallelAttention: Input should be a valid boolean"),
    # No PVC can have this name: pods referencing it wait for a claim forever.
    ("spec.model.source.pvc.claimName", "Bad_Name", "spec.model.source.pvc.claimName: String should match pattern"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "says"), REFUSED, ids=[f"{p}={v!r}"[:60] for p, v, _ in REFUSED])
def test_children_the_api_server_would_refuse_are_denied_by_field(path: str, value: Any, says: str) -> None:
    exc = denial(set_path(tiny_model(), path, value))
    assert exc is not None and exc.code == INVALID and says in str(exc), exc


ADMITTED = [
    ("spec.roles.decode.tolerations", [{"operator": "Exists"}]),  # an empty key with Exists tolerates every taint
    ("spec.roles.decode.tolerations", [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoExecute", "tolerationSeconds": 30}]),
    ("spec.roles.decode.resources", {"requests": {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "1Gi"}, "limits": {"memory": "2Gi"}}),
    ("spec.roles.decode.resources", {"requests": {"example.com/foo": "2"}, "limits": {"example.com/foo": "2"}}),
    ("spec.roles.decode.resources", {"limits": {"example.com/foo": "1"}}),  # a limit alone: the request defaults to it
    ("spec.roles.decode.replicas", 2.0),  # a whole JSON number is an integer to the API server too
    ("spec.minKVRatio", 3),
    ("spec.canary.isolation.enabled", False),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value"), ADMITTED, ids=[f"{p}={v!r}"[:60] for p, v in ADMITTED])
def test_what_the_api_server_accepts_is_still_admitted(path: str, value: Any) -> None:
    assert denial(set_path(tiny_model(), path, value)) is None


def test_a_gpu_product_in_the_label_form_is_accepted() -> None:
    hardware = HardwareSpec.model_validate({"memoryPerDevice": "80Gi", "gpuProduct": "NVIDIA-H100-80GB-HBM3"})
    assert hardware.gpu_product == "NVIDIA-H100-80GB-HBM3"
    assert ResourceRequirements.model_validate({"limits": {"nvidia.com/gpu": "8"}}).limits == {"nvidia.com/gpu": "8"}


# --- 3: a spec that is not an object --------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["hello", [1, 2], 5])
def test_a_non_object_spec_becomes_a_degraded_condition(spec: Any) -> None:
    body = copy.deepcopy(tiny_model()) | {"spec": spec}
    outcome = reconcile(body, Observed(), now=NOW)
    degraded = condition(outcome.status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert degraded["message"].startswith("spec: ")


@pytest.mark.parametrize("spec", ["hello", [1, 2], {"model": "x"}])
def test_the_controller_reaches_reconcile_with_a_non_object_spec(spec: Any) -> None:
    # Before reconcile, the controller looks for spec.model.architectureConfigMap to read it.
    body = {"metadata": {"name": "tiny", "namespace": "models"}, "spec": spec}
    assert asyncio.run(Controller._architecture_config(None, body)) == (None, None)  # type: ignore[arg-type]


# --- 4: the stored spec validates again ------------------------------------------------------------------


@pytest.mark.parametrize("context", [8, 4096, 16 * 1024 * 1024])
def test_a_spec_validates_again_as_it_was_dumped(context: int) -> None:
    # `kvguard apply --local` stores the validated spec and re-reads it (local_gate); the canary's
    # context, filled in from contextLength, must not make that second read fail (an outside probe's
    # contextLength of 99,999,999,999 was accepted once and then a traceback).
    body = tiny_model()["spec"] | {"contextLength": context}
    spec = InferenceModelSpec.model_validate(body)
    again = InferenceModelSpec.model_validate(spec.to_wire())
    assert again == spec
    assert again.canary.context_length == (context if context >= 16 else None)


def test_kvguard_apply_refuses_an_over_long_context_before_creating_a_state_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    body = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())
    body["spec"]["contextLength"] = 99_999_999_999
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(body))
    state = tmp_path / "state"
    assert cli_main(["apply", "--local", "-f", str(manifest), "--state-dir", str(state)]) == 2
    assert "kvguard apply: spec.contextLength: must be at most 16,777,216 tokens\n" == capsys.readouterr().err
    assert not state.exists()


def test_an_invalid_spec_does_not_leave_the_last_policy_verdict_standing() -> None:
    body = tiny_model()
    first = reconcile(body, Observed(), now=NOW)
    assert condition(first.status, "PolicyCompliant")["status"] == "True"
    body["status"] = first.status
    body["spec"]["pageSize"] = 0
    body["metadata"]["generation"] = 2
    outcome = reconcile(body, Observed(), now=NOW)
    assert condition(outcome.status, "Degraded")["reason"] == "InvalidSpec"
    policy = condition(outcome.status, "PolicyCompliant")
    assert (policy["status"], policy["reason"]) == ("Unknown", "InvalidSpec")
    assert policy["message"].startswith("the spec could not be checked against policies: spec.pageSize")
