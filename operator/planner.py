"""KV pool planner: does every role's KV pool hold `minKVRatio` x `contextLength` tokens? (S7)

Pure Python: no torch, kopf or kubernetes. `plan(spec)` turns an `InferenceModelSpec` into a
`KVPlan` (per role: bytes per token per GPU, weights per GPU, pool tokens in whole pages, ratio,
verdict) and, when blocked, the smallest single changes that would pass.

Pool rules, per GPU of one engine instance (all GPUs of an instance are alike, so one suffices):
- SGLang and kvguard: `pool = (free_before_load - weights) - free_before_load x (1 - fraction)`
  = `fraction x (memory - overhead) - weights - reserve`. SGLang calls free-before-load "total"
  (`mem_fraction_static`); on CPU kvguard's "device memory" is the configured budget.
- vLLM: `pool = memory x gpu_memory_utilization - weights - activation peak - non-torch memory`;
  the activation peak goes into `reserve`, non-torch memory (CUDA context) into `deviceOverhead`.
The pool is rounded down to whole pages and capped by an explicit `kvPoolTokens`.

KV bytes per token per GPU: MHA/GQA stores K and V for `kv_heads / attention_tp` heads per layer,
at least one head when attention TP exceeds the KV heads (heads are replicated). MLA stores one
latent (`kv_lora_rank + qk_rope_head_dim`) per layer on every GPU whatever the TP, plus the sparse
indexer key (fp8 with one fp32 scale per 128) when the model has one. Data-parallel attention keeps
full KV per DP rank. Pipeline stages split the layers; speculative draft layers share the pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

from kvguard.operator.api import (
    DeviceKind,
    EngineKind,
    InferenceModelSpec,
    KVCacheDtype,
    KVPlan,
    ModelArchitecture,
    ModelDtype,
    PlanSuggestion,
    Quantization,
    QuantizedLayers,
    RolePlan,
    WorkerRole,
)

DEFAULT_MEMORY_FRACTION: dict[EngineKind, float] = {
    EngineKind.SGLANG: 0.88,  # SGLang's auto value on one 80 GB GPU (reference row S03)
    EngineKind.VLLM: 0.9,  # vLLM 0.10/0.11 default gpu_memory_utilization
    EngineKind.KVGUARD: 0.9,
}

_MODEL_DTYPE_BYTES: dict[ModelDtype, Fraction] = {
    ModelDtype.BF16: Fraction(2),
    ModelDtype.FP16: Fraction(2),
    ModelDtype.FP32: Fraction(4),
}

_KV_BYTES: dict[KVCacheDtype, Fraction] = {
    KVCacheDtype.BF16: Fraction(2),
    KVCacheDtype.BFLOAT16: Fraction(2),
    KVCacheDtype.FP16: Fraction(2),
    KVCacheDtype.FLOAT16: Fraction(2),
    KVCacheDtype.FP32: Fraction(4),
    KVCacheDtype.FLOAT32: Fraction(4),
    KVCacheDtype.FP8: Fraction(1),
    KVCacheDtype.FP8_E4M3: Fraction(1),
    KVCacheDtype.FP8_E5M2: Fraction(1),
    KVCacheDtype.FP4_E2M1: Fraction(1, 2) + Fraction(1, 16),  # 4-bit values + one fp8 scale per 16
}

# Indexer keys of sparse-attention MLA models (DeepSeek-V3.2, GLM-5): fp8 + one fp32 scale / 128.
_INDEXER_SCALE_BLOCK = 128


def quantized_weight_bytes(quantization: Quantization, group_size: int) -> Fraction:
    """Bytes per quantized weight, including its share of scales and zero points."""
    table: dict[Quantization, Fraction] = {
        Quantization.BF16: Fraction(2),
        Quantization.FP16: Fraction(2),
        Quantization.FP32: Fraction(4),
        Quantization.FP8: 1 + Fraction(4, 128 * 128),  # fp32 scale per 128x128 block (DeepSeek/GLM FP8)
        Quantization.INT8: 1 + Fraction(4, 4096),  # per-channel fp32 scale, ~4K inputs per channel
        Quantization.INT4: Fraction(1, 2) + Fraction(2, group_size),  # fp16 scale per group
        Quantization.AWQ: Fraction(1, 2) + Fraction(5, 2 * group_size),  # fp16 scale + 4-bit zero
        Quantization.GPTQ: Fraction(1, 2) + Fraction(5, 2 * group_size),
        Quantization.MXFP4: Fraction(1, 2) + Fraction(1, 32),  # e8m0 scale per 32 (OCP MX)
        Quantization.NVFP4: Fraction(1, 2) + Fraction(1, 16),  # fp8 scale per 16
    }
    return table[quantization]


class PlanInputError(ValueError):
    """Input the planner cannot plan: each problem names the spec field it is about."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{field}: {message}" for field, message in problems))

    @property
    def field(self) -> str:
        """The first offending field path (e.g. spec.roles.decode.tensorParallel)."""
        return self.problems[0][0]


# --- Validation ----------------------------------------------------------------------------------


def check_spec(spec: InferenceModelSpec) -> None:
    """Raise PlanInputError listing every cross-field inconsistency (field-level ones are pydantic's)."""
    problems = list(_spec_problems(spec))
    if problems:
        raise PlanInputError(problems)


def _spec_problems(spec: InferenceModelSpec) -> Iterator[tuple[str, str]]:
    arch = spec.model.architecture
    if arch is None:
        yield "spec.model.architecture", "is required to plan (write it, or pass --hf-config)"
        return
    yield from _architecture_problems(arch, needs_parameters=spec.weights.measured_bytes_per_device is None)
    hw = spec.hardware
    if hw.device_overhead >= hw.memory_per_device:
        yield "spec.hardware.deviceOverhead", "must be smaller than memoryPerDevice"
    if hw.device is DeviceKind.CPU and spec.engine.kind is not EngineKind.KVGUARD:
        yield "spec.engine.kind", f"{spec.engine.kind.value} does not run on device cpu (only kvguard does)"
    for name, role in spec.roles.worker_roles().items():
        yield from _role_problems(f"spec.roles.{name}", role, arch)


def _architecture_problems(arch: ModelArchitecture, needs_parameters: bool) -> Iterator[tuple[str, str]]:
    path = "spec.model.architecture"
    if arch.mla is None:
        if arch.num_kv_heads > arch.num_attention_heads:
            yield f"{path}.numKVHeads", "must not exceed numAttentionHeads"
        elif arch.num_attention_heads % arch.num_kv_heads:
            yield f"{path}.numKVHeads", f"{arch.num_kv_heads} does not divide numAttentionHeads={arch.num_attention_heads}"
        if arch.effective_head_dim is None:
            yield f"{path}.headDim", "is required when hiddenSize is not given"
    if needs_parameters and arch.total_parameters is None:
        yield f"{path}.totalParameters", "is required unless spec.weights.measuredBytesPerDevice is given"
    parts = arch.embedding_parameters + arch.attention_parameters + arch.expert_parameters
    if arch.total_parameters is not None and parts > arch.total_parameters:
        yield f"{path}.totalParameters", (
            f"{arch.total_parameters} is less than embedding + attention + expert parameters ({parts})"
        )


def _role_problems(path: str, role: WorkerRole, arch: ModelArchitecture) -> Iterator[tuple[str, str]]:
    tp, dp = role.tensor_parallel, role.data_parallel
    if role.data_parallel_attention and tp % dp:
        yield f"{path}.dataParallel", f"{dp} must divide tensorParallel={tp} with dataParallelAttention"
        return
    attn_tp = _attention_tp(role)
    if arch.num_attention_heads % attn_tp:
        yield f"{path}.tensorParallel", (
            f"attention TP {attn_tp} does not divide numAttentionHeads={arch.num_attention_heads}"
        )
    elif arch.mla is None and not _kv_heads_split_evenly(arch.num_kv_heads, attn_tp):
        yield f"{path}.tensorParallel", (
            f"attention TP {attn_tp} and numKVHeads={arch.num_kv_heads}: neither divides the other"
        )
    if role.pipeline_parallel > arch.num_layers:
        yield f"{path}.pipelineParallel", f"{role.pipeline_parallel} exceeds numLayers={arch.num_layers}"
    if role.expert_parallel > 1:
        moe_group = tp * (1 if role.data_parallel_attention else dp)
        if arch.expert_parameters == 0 and arch.num_experts == 0:
            yield f"{path}.expertParallel", "the model has no experts"
        elif moe_group % role.expert_parallel:
            yield f"{path}.expertParallel", f"{role.expert_parallel} does not divide the {moe_group} GPUs sharing experts"


def _kv_heads_split_evenly(kv_heads: int, attn_tp: int) -> bool:
    return kv_heads % attn_tp == 0 if attn_tp <= kv_heads else attn_tp % kv_heads == 0


def _attention_tp(role: WorkerRole) -> int:
    return role.tensor_parallel // role.data_parallel if role.data_parallel_attention else role.tensor_parallel


# --- Per-GPU quantities --------------------------------------------------------------------------


def kv_element_bytes(spec: InferenceModelSpec) -> Fraction:
    """Bytes of one KV cache element (`auto` follows the model dtype)."""
    if spec.kv_cache_dtype is KVCacheDtype.AUTO:
        arch = spec.model.architecture
        return _MODEL_DTYPE_BYTES[arch.dtype if arch else ModelDtype.BF16]
    return _KV_BYTES[spec.kv_cache_dtype]


def resolved_kv_dtype(spec: InferenceModelSpec) -> str:
    if spec.kv_cache_dtype is KVCacheDtype.AUTO and spec.model.architecture is not None:
        return spec.model.architecture.dtype.value
    return spec.kv_cache_dtype.value


def kv_bytes_per_token(spec: InferenceModelSpec, role: WorkerRole) -> int:
    """KV bytes one token occupies on one GPU of `role` (layers of its pipeline stage + draft)."""
    arch = _require_arch(spec)
    layers = math.ceil(arch.num_layers / role.pipeline_parallel) + spec.model.extra_draft_layers
    element = kv_element_bytes(spec)
    if arch.mla is not None:
        per_layer = (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * element
        if arch.mla.indexer_head_dim:
            index_dim = arch.mla.indexer_head_dim
            per_layer += index_dim + 4 * math.ceil(index_dim / _INDEXER_SCALE_BLOCK)
    else:
        heads = max(1, arch.num_kv_heads // _attention_tp(role))
        per_layer = 2 * heads * (arch.effective_head_dim or 0) * element
    return math.ceil(layers * per_layer)


def weights_bytes_per_gpu(spec: InferenceModelSpec, role: WorkerRole) -> int:
    """Weight memory on one GPU of `role`: measured, or parameters x bytes split by parallelism.

    Embeddings are vocab-parallel over TP; attention is sharded over the attention TP group
    (replicated per rank with DP attention); routed experts over max(TP, EP) GPUs; other dense
    weights over TP. Pipeline stages split all of it."""
    if spec.weights.measured_bytes_per_device is not None:
        return spec.weights.measured_bytes_per_device
    arch = _require_arch(spec)
    assert arch.total_parameters is not None  # check_spec guarantees it
    dense_bytes, quant_bytes = _weight_byte_widths(spec)
    experts_quantized = spec.weights.quantization is not None
    expert_bytes = quant_bytes if experts_quantized else dense_bytes
    linear_bytes = dense_bytes if _quantizes_experts_only(spec) else quant_bytes
    other = arch.total_parameters - arch.embedding_parameters - arch.attention_parameters - arch.expert_parameters
    tp = role.tensor_parallel
    expert_shards = max(tp, role.expert_parallel)
    per_gpu = (
        arch.embedding_parameters * dense_bytes / tp
        + arch.attention_parameters * linear_bytes / _attention_tp(role)
        + other * linear_bytes / tp
        + arch.expert_parameters * expert_bytes / expert_shards
    )
    return math.ceil(per_gpu / role.pipeline_parallel)


def _weight_byte_widths(spec: InferenceModelSpec) -> tuple[Fraction, Fraction]:
    """(bytes of an unquantized weight, bytes of a quantized one)."""
    arch = _require_arch(spec)
    quant = spec.weights.quantization
    if quant is None:
        width = _MODEL_DTYPE_BYTES[arch.dtype]
        return width, width
    if quant in (Quantization.BF16, Quantization.FP16, Quantization.FP32):
        width = quantized_weight_bytes(quant, spec.weights.group_size)
        return width, width
    return _MODEL_DTYPE_BYTES[arch.dtype], quantized_weight_bytes(quant, spec.weights.group_size)


def _quantizes_experts_only(spec: InferenceModelSpec) -> bool:
    scope = spec.weights.quantized_layers
    if scope is None:
        return spec.weights.quantization is Quantization.MXFP4
    return scope is QuantizedLayers.EXPERTS_ONLY


def _require_arch(spec: InferenceModelSpec) -> ModelArchitecture:
    if spec.model.architecture is None:
        raise PlanInputError([("spec.model.architecture", "is required to plan (write it, or pass --hf-config)")])
    return spec.model.architecture


def memory_fraction(spec: InferenceModelSpec, role: WorkerRole) -> float:
    if role.memory_fraction is not None:
        return role.memory_fraction
    if spec.memory_fraction is not None:
        return spec.memory_fraction
    return DEFAULT_MEMORY_FRACTION[spec.engine.kind]


def pool_bytes_per_gpu(spec: InferenceModelSpec, fraction: float, weights: int) -> int:
    """Memory left for the KV pool on one GPU under the engine's rule (may be negative)."""
    hw = spec.hardware
    if spec.engine.kind is EngineKind.VLLM:
        budget = hw.memory_per_device * fraction - hw.device_overhead
    else:  # SGLang and kvguard: the fraction applies to what was free before loading weights
        budget = (hw.memory_per_device - hw.device_overhead) * fraction
    return math.floor(budget - weights - spec.reserve)


def _whole_pages(tokens: int, page_size: int) -> int:
    return max(0, tokens) // page_size * page_size


# --- Planning ------------------------------------------------------------------------------------


def plan_role(spec: InferenceModelSpec, role: WorkerRole) -> RolePlan:
    """The KV pool of one engine instance of `role`."""
    bpt = kv_bytes_per_token(spec, role)
    weights = weights_bytes_per_gpu(spec, role)
    fraction = memory_fraction(spec, role)
    memory_tokens = _whole_pages(pool_bytes_per_gpu(spec, fraction, weights) // bpt, spec.page_size)
    cap = role.kv_pool_tokens if role.kv_pool_tokens is not None else spec.kv_pool_tokens
    capped = cap is not None and _whole_pages(cap, spec.page_size) < memory_tokens
    pool = _whole_pages(cap, spec.page_size) if capped and cap is not None else memory_tokens
    ratio = pool / spec.context_length
    dp_ranks = role.data_parallel
    return RolePlan(
        gpus_per_instance=role.tensor_parallel * role.pipeline_parallel // (dp_ranks if role.data_parallel_attention else 1),
        instances=role.replicas * dp_ranks,
        bytes_per_token=bpt,
        weights_bytes_per_gpu=weights,
        kv_bytes_per_gpu=pool * bpt,
        memory_fraction=fraction,
        memory_pool_tokens=memory_tokens,
        pool_tokens=pool,
        capped_by="kvPoolTokens" if capped else "memory",
        ratio=round(ratio, 4),
        sufficient=pool >= spec.min_kv_ratio * spec.context_length,
    )


def plan(spec: InferenceModelSpec) -> KVPlan:
    """Plan every role of `spec`; raises PlanInputError (naming the field) on inconsistent input."""
    check_spec(spec)
    roles = {name: plan_role(spec, role) for name, role in spec.roles.worker_roles().items()}
    passed = all(r.sufficient for r in roles.values())
    return KVPlan(
        verdict="pass" if passed else "blocked",
        engine=spec.engine.kind,
        context_length=spec.context_length,
        min_ratio=spec.min_kv_ratio,
        page_size=spec.page_size,
        kv_cache_dtype=resolved_kv_dtype(spec),
        roles=roles,
        suggestions=[] if passed else suggest(spec, roles),
        warnings=list(_warnings(spec)),
    )


def _warnings(spec: InferenceModelSpec) -> Iterator[str]:
    if spec.engine.kind is EngineKind.VLLM and spec.reserve == 0:
        yield (
            "vLLM profiles an activation peak (often 2-9 GiB) that this plan does not know: set "
            "spec.reserve to it (from the startup log), or the pool is overestimated"
        )
    arch = spec.model.architecture
    if spec.weights.measured_bytes_per_device is None and arch is not None and arch.total_parameters:
        yield "weights estimated from parameter count and quantization; measuredBytesPerDevice is exact"


# --- Suggestions ---------------------------------------------------------------------------------


def suggest(spec: InferenceModelSpec, roles: dict[str, RolePlan]) -> list[PlanSuggestion]:
    """The smallest single changes that make every role pass (each verified by re-planning)."""
    found: list[PlanSuggestion] = []
    for name, role_plan in roles.items():
        if not role_plan.sufficient:
            role = spec.roles.worker_roles()[name]
            found.extend(_role_suggestions(spec, name, role, role_plan))
    found.extend(_global_suggestions(spec, roles))
    return found


def _needed_tokens(spec: InferenceModelSpec) -> int:
    needed = math.ceil(spec.min_kv_ratio * spec.context_length)
    return math.ceil(needed / spec.page_size) * spec.page_size


def _role_suggestions(
    spec: InferenceModelSpec, name: str, role: WorkerRole, current: RolePlan
) -> Iterator[PlanSuggestion]:
    path = f"spec.roles.{name}"
    needed = _needed_tokens(spec)
    capped = current.capped_by == "kvPoolTokens"
    if capped and current.memory_pool_tokens >= needed:
        yield PlanSuggestion(
            field=f"{path}.kvPoolTokens", role=name, value=needed,
            message=f"raise the explicit KV pool cap to {needed:,} tokens; memory allows {current.memory_pool_tokens:,}",
        )  # fmt: skip
        return
    also = f" (and raise kvPoolTokens to {needed:,})" if capped else ""
    uncapped_spec, uncapped_role = _without_caps(spec, role)
    fraction = _fraction_needed(uncapped_spec, uncapped_role)
    if fraction is not None:
        yield PlanSuggestion(
            field=f"{path}.memoryFraction", role=name, value=fraction,
            message=f"memory fraction {fraction:.2f} (now {current.memory_fraction:.2f}) gives {needed:,}+ tokens{also}",
        )  # fmt: skip
    tp = _tensor_parallel_needed(uncapped_spec, uncapped_role)
    if tp is not None:
        yield PlanSuggestion(
            field=f"{path}.tensorParallel", role=name, value=tp,
            message=f"tensor parallelism {tp} (now {role.tensor_parallel}) shrinks weights and KV per GPU enough{also}",
        )  # fmt: skip


def _without_caps(spec: InferenceModelSpec, role: WorkerRole) -> tuple[InferenceModelSpec, WorkerRole]:
    return spec.model_copy(update={"kv_pool_tokens": None}), role.model_copy(update={"kv_pool_tokens": None})


def _passes(spec: InferenceModelSpec, role: WorkerRole) -> bool:
    return plan_role(spec, role).sufficient


def _fraction_needed(spec: InferenceModelSpec, role: WorkerRole) -> float | None:
    """Smallest memory fraction, in hundredths up to 0.99, that passes."""
    for hundredths in range(1, 100):
        if _passes(spec, role.model_copy(update={"memory_fraction": hundredths / 100})):
            return hundredths / 100
    return None


def _tensor_parallel_needed(spec: InferenceModelSpec, role: WorkerRole, limit: int = 64) -> int | None:
    """Smallest valid TP above the current one that passes. Measured weights are scaled by the
    TP ratio, since they were measured at the current TP."""
    arch = _require_arch(spec)
    measured = spec.weights.measured_bytes_per_device
    for tp in range(role.tensor_parallel + 1, limit + 1):
        candidate = role.model_copy(update={"tensor_parallel": tp})
        if list(_role_problems("", candidate, arch)):
            continue
        candidate_spec = spec
        if measured is not None:
            scaled = measured * role.tensor_parallel // tp
            weights = spec.weights.model_copy(update={"measured_bytes_per_device": scaled})
            candidate_spec = spec.model_copy(update={"weights": weights})
        if _passes(candidate_spec, candidate):
            return tp
    return None


def _global_suggestions(spec: InferenceModelSpec, roles: dict[str, RolePlan]) -> Iterator[PlanSuggestion]:
    if kv_element_bytes(spec) > 1:
        fp8 = spec.model_copy(update={"kv_cache_dtype": KVCacheDtype.FP8_E4M3})
        capped = [name for name, r in roles.items() if r.capped_by == "kvPoolTokens" and not r.sufficient]
        if all(_passes(*_without_caps(fp8, role)) for role in spec.roles.worker_roles().values()):
            also = f" (and raise kvPoolTokens of {', '.join(capped)})" if capped else ""
            yield PlanSuggestion(
                field="spec.kvCacheDtype", value=KVCacheDtype.FP8_E4M3.value,
                message=f"an fp8 KV cache halves bytes per token and passes on every role{also}",
            )  # fmt: skip
    smallest_pool = min(r.pool_tokens for r in roles.values())
    longest = math.floor(smallest_pool / spec.min_kv_ratio)
    if longest > 0:
        yield PlanSuggestion(
            field="spec.contextLength", value=longest,
            message=f"the longest safe context with these pools is {longest:,} tokens (now {spec.context_length:,})",
        )  # fmt: skip


__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "PlanInputError",
    "check_spec",
    "kv_bytes_per_token",
    "kv_element_bytes",
    "memory_fraction",
    "plan",
    "plan_role",
    "pool_bytes_per_gpu",
    "quantized_weight_bytes",
    "weights_bytes_per_gpu",
]
