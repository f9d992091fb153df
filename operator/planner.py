"""KV pool planner: does every role's KV pool hold `minKVRatio` x `contextLength` tokens? (S7)

Pure Python: no torch, kopf or kubernetes. `plan(spec)` turns an `InferenceModelSpec` into a
`KVPlan` (per role: bytes per token per GPU, weights per GPU, pool tokens in whole pages, ratio,
verdict, the memory figures it had to estimate) and, when blocked, complete changes that pass
(`kvguard.operator.suggestions`).

Pool rules, per GPU of one engine instance (all GPUs of an instance are alike, so one suffices):
- SGLang and kvguard: `pool = (free_before_load - weights) - free_before_load x (1 - fraction)`
  = `fraction x (memory - overhead) - weights - reserve`. SGLang calls free-before-load "total"
  (`mem_fraction_static`); on CPU kvguard's "device memory" is the configured budget.
- vLLM: `pool = memory x gpu_memory_utilization - weights - activation peak - non-torch memory`;
  the activation peak is `reserve`, non-torch memory `deviceOverhead`.
The pool is rounded down to whole pages and capped by an explicit `kvPoolTokens`.

Never over-estimate silently: a memory figure the spec leaves out (weights without
`measuredBytesPerDevice`, `deviceOverhead`, vLLM's `reserve`) is not taken as zero but estimated
from the engine's own accounting (`kvguard.operator.estimates`) as a range. The pool and the verdict
use the safe end; the plan lists each estimate, its range and the optimistic pool. Weights and
overheads that do not fit leave a negative budget, which the plan reports as the reason it is
blocked (never clamped to an empty pool without a word).

KV bytes per token per GPU: MHA/GQA stores K and V for `kv_heads / attention_tp` heads per layer,
at least one head when attention TP exceeds the KV heads (heads are replicated). MLA stores one
latent (`kv_lora_rank + qk_rope_head_dim`) per layer on every GPU whatever the TP, plus the sparse
indexer key (fp8 with one fp32 scale per 128) when the model has one. Data-parallel attention keeps
full KV per DP rank. Pipeline stages split the layers; speculative draft layers share the pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from kvguard.operator import engine_flags, estimates
from kvguard.operator.api import (
    DeviceKind,
    EngineKind,
    EstimatedInput,
    InferenceModelSpec,
    KVCacheDtype,
    KVPlan,
    ModelArchitecture,
    ModelDtype,
    Quantization,
    QuantizedLayers,
    RolePlan,
    WorkerRole,
)
from kvguard.operator.estimates import Figure, GiB
from kvguard.workers.pool_ratio import pages_per_context, ratio_down, ratio_number, ratio_text, required_pool_tokens

# What the renderer writes on the command line when the spec sets no fraction (so these are facts,
# not guesses at the engines' own auto values).
DEFAULT_MEMORY_FRACTION: dict[EngineKind, float] = {
    EngineKind.SGLANG: 0.88,  # --mem-fraction-static 0.88 (SGLang's auto value on one 80 GB GPU, row S03)
    EngineKind.VLLM: 0.9,  # --gpu-memory-utilization 0.9 (vLLM 0.10/0.11's default)
    EngineKind.KVGUARD: 0.9,  # the kvguard engine is given --kv-pool-tokens from this plan instead
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
    if hw.device_overhead is not None and hw.device_overhead >= hw.memory_per_device:
        yield "spec.hardware.deviceOverhead", "must be smaller than memoryPerDevice"
    if hw.device is DeviceKind.CPU and spec.engine.kind is not EngineKind.KVGUARD:
        yield "spec.engine.kind", f"{spec.engine.kind.value} does not run on device cpu (only kvguard does)"
    if spec.engine.kind is EngineKind.KVGUARD and kv_element_bytes(spec) != _MODEL_DTYPE_BYTES[arch.dtype]:
        yield "spec.kvCacheDtype", f"the kvguard engine keeps KV in the model dtype ({arch.dtype.value}): use auto"
    yield from _engine_problems(spec)
    for name, role in spec.roles.worker_roles().items():
        yield from _role_problems(f"spec.roles.{name}", role, arch)
        measured = spec.weights.measured_bytes_per_device is not None  # (without one it is required anyway)
        if measured and role.pipeline_parallel > 1 and spec.model.extra_draft_layers and arch.total_parameters is None:
            # The last stage holds the draft layers whole, which a measured figure spreads over every
            # stage unless their size is known: planned 4.46 GiB where the stage held 4.64 (a review).
            yield "spec.model.architecture.totalParameters", (
                f"is needed to plan spec.model.extraDraftLayers over spec.roles.{name}.pipelineParallel "
                f"{role.pipeline_parallel}: a draft layer's size is counted from it"
            )


def _engine_problems(spec: InferenceModelSpec) -> Iterator[tuple[str, str]]:
    path = "spec.engine.extraArgs"
    yield from extra_args_problems(spec)
    if spec.engine.kind is not EngineKind.VLLM:
        return
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        value = estimates.engine_flag(spec, flag)
        if estimates.has_engine_flag(spec, flag) and not (value and value.isdigit() and int(value) > 0):
            yield path, f"{flag} needs a positive integer, got {value!r}"
    version = estimates.engine_version(spec)
    if spec.reserve is None and version is not None and version < estimates.VLLM_V1_SINCE:
        yield "spec.reserve", (
            f"is required for vLLM {spec.engine.version}: the V0 engine's activation profile is not modelled "
            "(set the activation peak from its startup log: peak torch memory minus weights)"
        )


def extra_args_problems(spec: InferenceModelSpec) -> Iterator[tuple[str, str]]:
    """S7: a flag the renderer writes from the spec, written again by hand, wins over it
    (engine_flags.py); so do the flags the plan reads, in a role's list; and for the kvguard
    engine, whose parser is ours, any flag but its tunables stops the worker."""
    path = "spec.engine.extraArgs"
    owned = engine_flags.OWNED[spec.engine.kind]
    sources = [(path, "*", spec.engine.extra_args)]
    sources += [(f"spec.roles.{name}.extraArgs", name, role.extra_args or []) for name, role in spec.roles.worker_roles().items()]
    read_by_plan = engine_flags.PLANNER_READ.get(spec.engine.kind, ())
    for where, role_name, args in sources:
        if spec.model.extra_draft_layers == 0 and (found := engine_flags.speculative(args, spec.engine.kind)):
            yield where, _undeclared_draft_message(found)
        overriding = list(engine_flags.overrides(args, owned))
        for token, flag, owner in overriding:
            yield where, engine_flags.override_message(token, flag, owner.replace("spec.roles.*", f"spec.roles.{role_name}"))
        if where != path:  # the plan reads these from the engine's list only
            for token, _, _ in engine_flags.overrides(args, dict.fromkeys(read_by_plan, "")):
                yield where, f"{token} sizes vLLM's activation reserve, which the plan reads from spec.engine.extraArgs: set it there"
        if spec.engine.kind is EngineKind.KVGUARD:  # our own parser: every other flag would stop the worker
            said = {token for token, _, _ in overriding}
            for token in args:  # as written: kvguard's parser reads no `_` for `-` and no abbreviation
                name = engine_flags.flag_name(token) and token.split("=", 1)[0]
                if name and token not in said and name not in engine_flags.KVGUARD_TUNABLE_FLAGS:
                    yield where, (f"{token} is not a kvguard worker flag it may set (only "
                                  f"{' and '.join(engine_flags.KVGUARD_TUNABLE_FLAGS)}): the worker would not start")


def _undeclared_draft_message(found: list[tuple[str, str]]) -> str:
    """S7: speculative decoding in extraArgs with no draft layers in the plan: the draft model's
    layers keep KV in the same pool (one slot per target token), which the plan would not count."""
    tokens = ", ".join(token if token.split("=", 1)[0] == flag else f"{token} (read as {flag})" for token, flag in found)
    return (f"{tokens} set{'s' if len(found) == 1 else ''} up speculative decoding, whose draft layers keep their KV in "
            "the same pool, but spec.model.extraDraftLayers is 0: declare the draft layers there (1 for an EAGLE or "
            "MTP head; a draft model's layer count) so the plan sizes the pool with them")


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
    if arch.moe_layers is not None and arch.moe_layers > arch.num_layers:
        yield f"{path}.moeLayers", f"{arch.moe_layers} exceeds numLayers={arch.num_layers}"
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
    elif role.pipeline_parallel > 1 and not _stage_embedding_parameters(arch, role.pipeline_parallel):
        # The first and last stage each hold a whole vocabulary matrix, which a stage's weights
        # cannot leave out (heaviest_stage, counted_weight_bytes).
        missing, other = ("hiddenSize", "vocabSize") if arch.vocab_size is not None else ("vocabSize", "hiddenSize")
        yield f"spec.model.architecture.{missing}", (
            f"is needed with {other} (or embeddingParameters) to plan {path}.pipelineParallel "
            f"{role.pipeline_parallel}: the first and last stage each hold a vocabulary matrix"
        )
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
    """Weight memory on one GPU of `role` as a point figure: measured (scaled to the role's split
    when `measuredShards` is set), or parameters x bytes split by parallelism. `weights_figure`
    adds the range the plan uses."""
    return weights_figure(spec, role).optimistic


def weights_figure(spec: InferenceModelSpec, role: WorkerRole) -> Figure:
    """Weights per GPU: the measured figure, or the parameter count's estimate with its range."""
    if spec.weights.measured_bytes_per_device is not None:
        return estimates.scaled_weights(spec, role, heaviest_stage(spec, role))
    return estimates.estimated_weights(spec, counted_weight_bytes(spec, role))


def heaviest_stage(spec: InferenceModelSpec, role: WorkerRole) -> estimates.PipelineStage | None:
    """What a measured figure scaled to `role`'s pipeline stages must add (None without PP): as
    `counted_weight_bytes` plans a stage, ceil(layers / PP) layers, as many of them MoE layers as
    there are, one vocabulary matrix and the draft layers."""
    pp = role.pipeline_parallel
    arch = spec.model.architecture
    if pp == 1 or arch is None:
        return None
    stage_layers = math.ceil(arch.num_layers / pp)
    moe_layers = arch.moe_layers or arch.num_layers
    dense_bytes, _ = _weight_byte_widths(spec)
    draft = _draft_bytes(spec, role) * role.tensor_parallel  # whole, before TP
    return estimates.PipelineStage(
        layer_share=Fraction(pp * min(stage_layers, moe_layers), moe_layers),
        unstaged_bytes=math.floor(arch.embedding_parameters * dense_bytes + draft),
        stage_unstaged_bytes=math.ceil(_stage_embedding_parameters(arch, pp) * dense_bytes + draft),
    )


def counted_weight_bytes(spec: InferenceModelSpec, role: WorkerRole) -> int:
    """Parameters x bytes per weight on one GPU of `role`.

    Embeddings are vocab-parallel over TP; attention is sharded over the attention TP group
    (replicated per rank with DP attention); routed experts over max(TP, EP) GPUs; other dense
    weights over TP. Speculative draft layers (EAGLE, MTP) are one decoder layer each, sharded over
    TP, on top.

    Pipeline stages split the layers, and the plan is the heaviest stage's:
    - ceil(layers / PP) layers: SGLang and vLLM give the remainder to some stages, not all;
    - as many of them MoE layers as there are (`moeLayers`): DeepSeek-V3's 3 dense layers of 61
      leave 21 MoE layers, not an average 20.7, on a stage of 3 (a review);
    - one vocabulary matrix: the first stage holds the input embedding, the last the LM head (a
      tied one is on both).
    An even split undercounted 80 layers over 3 stages by 0.7% of the GPU: a plan passed at 2.01x
    that the stage's own weights put at 1.98x (an outside probe)."""
    arch = _require_arch(spec)
    assert arch.total_parameters is not None  # check_spec guarantees it
    dense_bytes, quant_bytes = _weight_byte_widths(spec)
    experts_quantized = spec.weights.quantization is not None
    expert_bytes = quant_bytes if experts_quantized else dense_bytes
    linear_bytes = dense_bytes if _quantizes_experts_only(spec) else quant_bytes
    other = arch.total_parameters - arch.embedding_parameters - arch.attention_parameters - arch.expert_parameters
    tp = role.tensor_parallel
    expert_shards = max(tp, role.expert_parallel)
    stage_layers = math.ceil(arch.num_layers / role.pipeline_parallel)
    moe_layers = arch.moe_layers or arch.num_layers  # a stage of MoE layers only, where it can be
    non_expert = arch.attention_parameters * linear_bytes / _attention_tp(role) + other * linear_bytes / tp
    layers = non_expert * Fraction(stage_layers, arch.num_layers)
    experts = arch.expert_parameters * expert_bytes / expert_shards * Fraction(min(stage_layers, moe_layers), moe_layers)
    per_gpu = _stage_embedding_parameters(arch, role.pipeline_parallel) * dense_bytes / tp + layers + experts
    return math.ceil(per_gpu + _draft_bytes(spec, role))


def _draft_bytes(spec: InferenceModelSpec, role: WorkerRole) -> Fraction:
    """Speculative draft layers (EAGLE, MTP) on one GPU of `role`: one decoder layer each, sharded
    over TP, 0 without them or without a parameter count (a measured figure then holds them)."""
    arch = _require_arch(spec)
    if not spec.model.extra_draft_layers or arch.total_parameters is None:
        return Fraction(0)
    dense_bytes, quant_bytes = _weight_byte_widths(spec)
    linear_bytes = dense_bytes if _quantizes_experts_only(spec) else quant_bytes
    per_layer = Fraction(arch.total_parameters - arch.embedding_parameters, arch.num_layers)
    return spec.model.extra_draft_layers * per_layer * linear_bytes / role.tensor_parallel


def _stage_embedding_parameters(arch: ModelArchitecture, pipeline_parallel: int) -> int:
    """Embedding parameters on the heaviest pipeline stage: all of them without PP; else one
    vocabulary matrix (vocab x hidden when both are known, else all of them: a tied matrix sits
    on the first and last stage alike). Where embeddingParameters is not given (0) the matrix is
    vocab x hidden on top of the other weights, which already count it spread over the layers
    (the safe side); `_role_problems` asks for one of the two with PP."""
    if pipeline_parallel == 1:
        return arch.embedding_parameters
    if arch.vocab_size is not None and arch.hidden_size is not None:
        matrix = arch.vocab_size * arch.hidden_size
        return min(arch.embedding_parameters, matrix) if arch.embedding_parameters else matrix
    return arch.embedding_parameters


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


def pool_cap(spec: InferenceModelSpec, role: WorkerRole) -> int | None:
    """The explicit KV pool cap of `role` (its own kvPoolTokens, else the spec's)."""
    return role.kv_pool_tokens if role.kv_pool_tokens is not None else spec.kv_pool_tokens


@dataclass(frozen=True)
class RoleMemory:
    """What the pool rule subtracts on one GPU of a role, each figure given or estimated."""

    weights: Figure
    overhead: Figure
    reserve: Figure

    @property
    def estimates(self) -> list[EstimatedInput]:
        return [f.estimate for f in (self.weights, self.overhead, self.reserve) if f.estimate is not None]


def role_memory(spec: InferenceModelSpec, role: WorkerRole) -> RoleMemory:
    return RoleMemory(weights_figure(spec, role), estimates.device_overhead(spec, role), estimates.reserve(spec, role))


def kv_budget_bytes(spec: InferenceModelSpec, fraction: float, weights: int, overhead: int, reserve: int) -> int:
    """Memory left for the KV pool on one GPU under the engine's rule; negative when weights and
    overheads do not fit (the engine would refuse to start)."""
    memory = spec.hardware.memory_per_device
    if spec.engine.kind is EngineKind.VLLM:
        budget = memory * fraction - overhead
    else:  # SGLang and kvguard: the fraction applies to what was free before loading weights
        budget = (memory - overhead) * fraction
    return math.floor(budget - weights - reserve)


def _whole_pages(tokens: int, page_size: int) -> int:
    return max(0, tokens) // page_size * page_size


def _memory_tokens(spec: InferenceModelSpec, budget: int, bytes_per_token: int) -> int:
    return _whole_pages(max(0, budget) // bytes_per_token, spec.page_size)


# --- Planning ------------------------------------------------------------------------------------


def plan_role(spec: InferenceModelSpec, role: WorkerRole) -> RolePlan:
    """The KV pool of one engine instance of `role`, at the safe end of every estimate."""
    bpt = kv_bytes_per_token(spec, role)
    fraction = memory_fraction(spec, role)
    memory = role_memory(spec, role)
    safe = kv_budget_bytes(spec, fraction, memory.weights.safe, memory.overhead.safe, memory.reserve.safe)
    memory_tokens = _memory_tokens(spec, safe, bpt)
    cap = pool_cap(spec, role)
    capped = cap is not None and _whole_pages(cap, spec.page_size) < memory_tokens
    pool = _whole_pages(cap, spec.page_size) if capped and cap is not None else memory_tokens
    optimistic = None
    if memory.estimates:
        ends = (memory.weights.optimistic, memory.overhead.optimistic, memory.reserve.optimistic)
        optimistic = _memory_tokens(spec, kv_budget_bytes(spec, fraction, *ends), bpt)
        if cap is not None:
            optimistic = min(optimistic, _whole_pages(cap, spec.page_size))
    dp_ranks = role.data_parallel
    return RolePlan(
        gpus_per_instance=role.tensor_parallel * role.pipeline_parallel // (dp_ranks if role.data_parallel_attention else 1),
        instances=role.replicas * dp_ranks,
        bytes_per_token=bpt,
        weights_bytes_per_gpu=memory.weights.safe,
        kv_bytes_per_gpu=pool * bpt,
        memory_fraction=fraction,
        memory_pool_tokens=memory_tokens,
        pool_tokens=pool,
        capped_by="kvPoolTokens" if capped else "memory",
        ratio=ratio_down(pool, spec.context_length),  # down: a shortfall never reads as the minimum
        sufficient=pool >= required_pool_tokens(spec.min_kv_ratio, spec.context_length, spec.page_size),
        kv_budget_bytes=safe,
        optimistic_pool_tokens=optimistic,
        estimates=memory.estimates,
    )


def plan_roles(spec: InferenceModelSpec) -> dict[str, RolePlan]:
    """Every role's plan (input already checked)."""
    return {name: plan_role(spec, role) for name, role in spec.roles.worker_roles().items()}


def plan(spec: InferenceModelSpec) -> KVPlan:
    """Plan every role of `spec`; raises PlanInputError (naming the field) on inconsistent input."""
    from kvguard.operator.suggestions import suggest  # it re-plans candidate specs through this module

    check_spec(spec)
    roles = plan_roles(spec)
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
        warnings=list(_warnings(spec, roles)),
        reasons=list(_reasons(spec, roles)),
    )


def flag_check_plan(spec: InferenceModelSpec) -> KVPlan:
    """A passing plan whose every pool is exactly the smallest that passes: for what needs a plan
    only to render command lines -- the renderer's field checks, policies' flag rules, prefill /
    decode parity -- when the real plan cannot be made (the architecture is in a ConfigMap
    admission cannot read) or is blocked (a pool of 0 renders nothing). No flag those checks read
    depends on the pool's size. Never a verdict: reconcile renders only a real plan that passes."""
    pool = needed_tokens(spec)
    roles = {
        name: RolePlan(
            gpus_per_instance=max(1, role.tensor_parallel * role.pipeline_parallel
                                  // (role.data_parallel if role.data_parallel_attention else 1)),
            instances=role.replicas * role.data_parallel, bytes_per_token=1, weights_bytes_per_gpu=0,
            kv_bytes_per_gpu=pool, memory_fraction=memory_fraction(spec, role), memory_pool_tokens=pool,
            pool_tokens=pool, capped_by="memory", ratio=spec.min_kv_ratio, sufficient=True,
        )  # fmt: skip
        for name, role in spec.roles.worker_roles().items()
    }
    return KVPlan(verdict="pass", engine=spec.engine.kind, context_length=spec.context_length, min_ratio=spec.min_kv_ratio,
                  page_size=spec.page_size, kv_cache_dtype=resolved_kv_dtype(spec), roles=roles)  # fmt: skip


def plan_to_render(spec: InferenceModelSpec, kv_plan: KVPlan | None) -> KVPlan:
    """The plan to render the spec's command lines with for its checks: `kv_plan` when it passes,
    else (none, or blocked) the flag-check plan."""
    return kv_plan if kv_plan is not None and kv_plan.verdict == "pass" else flag_check_plan(spec)


def needed_tokens(spec: InferenceModelSpec) -> int:
    """The smallest pool that passes: minKVRatio x contextLength, in whole pages."""
    return required_pool_tokens(spec.min_kv_ratio, spec.context_length, spec.page_size)


def gib(value: int | float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (a tiny CPU model's weights
    read "0.00 GiB" in a refusal, beside the table's KiB)."""
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


_NOT_STARTING: dict[EngineKind, str] = {
    EngineKind.VLLM: "vLLM: 'No available memory for the cache blocks'",
    EngineKind.SGLANG: "SGLang: 'Not enough memory. Please try to increase --mem-fraction-static'",
    EngineKind.KVGUARD: "kvguard: 'no memory left for a KV pool'",
}


def _reasons(spec: InferenceModelSpec, roles: dict[str, RolePlan]) -> Iterator[str]:
    for name, r in roles.items():
        if r.sufficient:
            continue
        if r.kv_budget_bytes < 0:
            yield (
                f"{name}: weights ({gib(r.weights_bytes_per_gpu)} per GPU) and overheads exceed what memory fraction "
                f"{r.memory_fraction:g} allows by {gib(-r.kv_budget_bytes)}: the engine would not start "
                f"({_NOT_STARTING[spec.engine.kind]})"
            )
        elif r.memory_pool_tokens == 0:
            yield (
                f"{name}: the {gib(r.kv_budget_bytes)} left per GPU is less than one KV page "
                f"({spec.page_size} tokens x {r.bytes_per_token:,} B): the engine would not start"
            )
        else:
            capped = f" (capped by kvPoolTokens; memory allows {r.memory_pool_tokens:,})" if r.capped_by == "kvPoolTokens" else ""
            pages = pages_per_context(spec.context_length, spec.page_size)
            paged = (f" (a full-length request takes {pages:,} pages of {spec.page_size:,}: "
                     f"{ratio_number(spec.min_kv_ratio)}x is {needed_tokens(spec):,} tokens)") if spec.context_length % spec.page_size else ""  # fmt: skip
            yield (
                f"{name}: pool {r.pool_tokens:,} tokens = {ratio_text(r.pool_tokens, spec.context_length)} contextLength {spec.context_length:,}, "
                f"below minKVRatio {ratio_number(spec.min_kv_ratio)}{capped}{paged}"
            )


def _warnings(spec: InferenceModelSpec, roles: dict[str, RolePlan]) -> Iterator[str]:
    arch = _require_arch(spec)
    limit = arch.max_position_embeddings
    if limit is not None and spec.context_length > limit:
        yield (
            f"contextLength {spec.context_length:,} exceeds the model's max_position_embeddings {limit:,}: positions "
            "beyond it were never trained; SGLang and vLLM refuse it unless told to, and the operator tells them "
            "(SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
        )
    if spec.engine.kind is EngineKind.VLLM and spec.reserve == 0:
        yield (
            "spec.reserve is 0, but vLLM always profiles an activation peak (often 2-9 GiB): set it from the startup "
            "log, or omit it to have it estimated, or the pool is over-estimated"
        )
    for name, role in spec.roles.worker_roles().items():
        if role.replicas == 0:  # the pool is fine, but nothing would hold it (rollout.py's NoWorkers gate)
            yield f"spec.roles.{name}.replicas is 0: a rollout of this spec is blocked (NoWorkers) until it is scaled up"
    yield from _estimate_warnings(roles)


def _estimate_warnings(roles: dict[str, RolePlan]) -> Iterator[str]:
    by_field: dict[str, list[tuple[str, EstimatedInput]]] = {}
    for name, r in roles.items():
        for estimate in r.estimates:
            by_field.setdefault(estimate.field, []).append((name, estimate))
    for field, found in by_field.items():
        first = found[0][1]
        if all((e.safe_bytes, e.optimistic_bytes) == (first.safe_bytes, first.optimistic_bytes) for _, e in found):
            values = f"{gib(first.safe_bytes)} per GPU (optimistic {gib(first.optimistic_bytes)})"
        else:
            values = ", ".join(f"{name} {gib(e.safe_bytes)} (optimistic {gib(e.optimistic_bytes)})" for name, e in found)
        yield f"estimated {first.description}: {values} ({first.basis}); {field} replaces the estimate"
    moved = [(name, r) for name, r in roles.items() if r.optimistic_pool_tokens not in (None, r.pool_tokens)]
    if moved:
        pools = ", ".join(f"{name} {r.pool_tokens:,} tokens (optimistic {r.optimistic_pool_tokens:,})" for name, r in moved)
        yield f"the verdict uses the safe end of these estimates: {pools}; set the figures from the engines' logs to plan exactly"


__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "PlanInputError",
    "check_spec",
    "counted_weight_bytes",
    "kv_budget_bytes",
    "kv_bytes_per_token",
    "kv_element_bytes",
    "memory_fraction",
    "needed_tokens",
    "plan",
    "plan_role",
    "plan_roles",
    "pool_cap",
    "quantized_weight_bytes",
    "role_memory",
    "weights_bytes_per_gpu",
    "weights_figure",
]
