"""The kvguard engine runs what the spec says, or the spec is refused naming the field: in the
admission webhook (422), in reconcile (Degraded, InvalidSpec, nothing deployed) and locally."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.engine_support import engine_problems, placement_problems
from kvguard.operator.reconcile import Observed, reconcile
from kvguard.operator.webhook import INVALID, AdmissionDenied, check_admission

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def body(**changes: Any) -> dict[str, Any]:
    b = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    b["metadata"].update(namespace="ns", uid="u1", generation=1)
    b["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    for path, value in changes.items():
        node = b["spec"]
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return b


UNSUPPORTED = {
    "roles.decode.tensorParallel": (2, "spec.roles.decode.tensorParallel"),
    "roles.prefill.pipelineParallel": (2, "spec.roles.prefill.pipelineParallel"),
    "roles.decode.expertParallel": (2, "spec.roles.decode.expertParallel"),
    "roles.decode.dataParallelAttention": (True, "spec.roles.decode.dataParallelAttention"),
    "weights.quantization": ("awq", "spec.weights.quantization"),
    "kvCacheDtype": ("fp8", "spec.kvCacheDtype"),
    "model.architecture.maxPositionEmbeddings": (512, "spec.contextLength"),  # tiny-cpu.yaml asks for 1024
}


@pytest.mark.parametrize("path", list(UNSUPPORTED))
def test_what_the_kvguard_engine_does_not_run_is_refused_by_field(path: str) -> None:
    value, field = UNSUPPORTED[path]
    b = body(**{path: value})
    (problem,) = engine_problems(InferenceModelSpec.model_validate(b["spec"]))
    assert problem.startswith(field + ":")
    with pytest.raises(AdmissionDenied) as denied:
        check_admission(b, None, "CREATE", [])
    assert denied.value.code == INVALID and field in str(denied.value)
    outcome = reconcile(b, Observed(), now=NOW)
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert outcome.status["phase"] == "Degraded" and degraded["reason"] == "InvalidSpec" and field in degraded["message"]
    assert outcome.actions == []  # nothing deployed


def test_what_it_does_run_passes() -> None:
    for changes in ({}, {"roles.decode.dataParallel": 2}, {"weights.quantization": "fp32"}, {"kvCacheDtype": "float32"}):
        assert engine_problems(InferenceModelSpec.model_validate(body(**changes)["spec"])) == [], changes
    sglang = body(**{"engine.kind": "sglang", "engine.image": "i", "roles.decode.tensorParallel": 2, "hardware.device": "cuda"})
    assert engine_problems(InferenceModelSpec.model_validate(copy.deepcopy(sglang)["spec"])) == []


GPU_SHORT = {
    # engine kind, role changes -> the refusal: 0 GPUs is none at all, and SGLang/vLLM run every DP rank in one pod.
    "sglang-no-gpu": ("sglang", {"roles.decode.gpuCount": 0}, "0 GPU(s) per pod, but one decode pod's engine runs on "
                      "tensorParallel x pipelineParallel = 1"),
    "kvguard-no-gpu": ("kvguard", {"roles.prefill.gpuCount": 0}, "= 1"),
    "sglang-dp": ("sglang", {"roles.decode.dataParallel": 2, "roles.decode.gpuCount": 1}, "x dataParallel = 2"),
    "vllm-dp": ("vllm", {"roles.decode.dataParallel": 2, "roles.decode.tensorParallel": 2, "roles.decode.gpuCount": 2},
                "tensorParallel x pipelineParallel x dataParallel = 4"),
}


def test_vllm_has_no_dp_attention_and_its_ranks_each_run_tensor_parallel_gpus() -> None:
    """dataParallelAttention rendered nothing for vLLM, while the planner and the GPU count took
    SGLang's meaning (ranks splitting one TP group): TP 2 x DP 2 got 2 GPUs and a plan vLLM never ran."""
    b = body(**{"engine.kind": "vllm", "engine.image": "i", "engine.routerImage": "r", "hardware.device": "cuda",
                "roles.decode.dataParallel": 2, "roles.decode.tensorParallel": 2, "roles.decode.dataParallelAttention": True})
    (problem,) = engine_problems(InferenceModelSpec.model_validate(b["spec"]))
    assert problem.startswith("spec.roles.decode.dataParallelAttention: SGLang's mode"), problem
    with pytest.raises(AdmissionDenied) as denied:
        check_admission(b, None, "CREATE", [])
    assert "spec.roles.decode.dataParallelAttention" in str(denied.value)


@pytest.mark.parametrize("case", list(GPU_SHORT))
def test_a_worker_pod_given_fewer_gpus_than_its_engine_runs_on_is_refused_by_field(case: str) -> None:
    kind, changes, why = GPU_SHORT[case]
    b = body(**{"engine.kind": kind, "engine.image": "i", "engine.routerImage": "r", "hardware.device": "cuda", **changes})
    (problem,) = engine_problems(InferenceModelSpec.model_validate(b["spec"]))
    role = next(path.split(".")[1] for path in changes if path.endswith("gpuCount"))
    assert problem.startswith(f"spec.roles.{role}.gpuCount: ") and why in problem, problem
    with pytest.raises(AdmissionDenied) as denied:
        check_admission(b, None, "CREATE", [])
    assert denied.value.code == INVALID and f"spec.roles.{role}.gpuCount" in str(denied.value)


def test_enough_gpus_and_a_rank_per_pod_pass() -> None:
    for kind, changes in (("sglang", {"roles.decode.dataParallel": 2, "roles.decode.gpuCount": 2}),
                          ("sglang", {"roles.decode.dataParallel": 2, "roles.decode.dataParallelAttention": True, "roles.decode.gpuCount": 1}),
                          ("kvguard", {"roles.decode.dataParallel": 2, "roles.decode.gpuCount": 1})):  # fmt: skip
        b = body(**{"engine.kind": kind, "engine.image": "i", "hardware.device": "cuda", **changes})
        assert engine_problems(InferenceModelSpec.model_validate(b["spec"])) == [], (kind, changes)


GPU_PLACEMENT = {
    # Outside probe: the selector's A100 won in the rendered Deployment while the plan used the H100's memory.
    "selector against gpuProduct": ({"hardware.gpuProduct": "NVIDIA-H100-80GB-HBM3",
                                     "roles.decode.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}},
                                    "spec.roles.decode.nodeSelector[nvidia.com/gpu.product]: NVIDIA-A100-SXM4-40GB disagrees "
                                    "with spec.hardware.gpuProduct NVIDIA-H100-80GB-HBM3"),
    "selector against gpuType": ({"roles.prefill.gpuType": "NVIDIA-H100-80GB-HBM3",
                                  "roles.prefill.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
                                 "spec.roles.prefill.nodeSelector[nvidia.com/gpu.product]: NVIDIA-H200 disagrees with "
                                 "spec.roles.prefill.gpuType NVIDIA-H100-80GB-HBM3"),
    # Outside probe: admitted, each router pod held 2 GPUs on the GPU product's nodes and used none.
    "router gpus": ({"roles.router.gpuCount": 2}, "spec.roles.router.gpuCount: the router runs no engine and uses no GPU"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GPU_PLACEMENT))
@pytest.mark.parametrize("kind", ["sglang", "kvguard"])
def test_gpu_placement_that_contradicts_the_spec_is_refused_by_field(case: str, kind: str) -> None:
    changes, says = GPU_PLACEMENT[case]
    b = body(**{"engine.kind": kind, "engine.image": "i", "hardware.device": "cuda", **changes})
    spec = InferenceModelSpec.model_validate(b["spec"])
    # Admission's only (an outside review: in reconcile, a running model went Degraded on an upgrade)
    assert engine_problems(spec) == []
    (problem,) = placement_problems(spec)
    assert problem.startswith(says), problem
    with pytest.raises(AdmissionDenied) as denied:
        check_admission(b, None, "CREATE", [])
    assert denied.value.code == INVALID and says in str(denied.value)


def test_gpu_placement_that_agrees_with_the_spec_passes() -> None:
    for changes in ({"hardware.gpuProduct": "NVIDIA-H100-80GB-HBM3", "roles.decode.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                    {"hardware.gpuProduct": "NVIDIA-H100-80GB-HBM3", "roles.decode.gpuType": "NVIDIA-H200",
                     "roles.decode.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
                    {"roles.decode.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}},  # nothing to disagree with
                    {"hardware.gpuProduct": "NVIDIA-H100-80GB-HBM3", "roles.router.nodeSelector": {"nvidia.com/gpu.product": "x"}},
                    {"roles.router.gpuCount": 0}):  # fmt: skip
        b = body(**{"engine.kind": "sglang", "engine.image": "i", "hardware.device": "cuda", **changes})
        assert engine_problems(InferenceModelSpec.model_validate(b["spec"])) == [], changes
