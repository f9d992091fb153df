"""Conservative estimates of the memory figures an InferenceModel spec leaves out (S7).

The KV pool is what a device has left after weights and the engine's own overheads. A spec often
lacks some of those figures (they are only in a startup log nobody has yet). Assuming zero for them
over-estimates the pool, the direction that passes a configuration that will not fit. So every
missing figure gets a range from the engine's own accounting: `safe` (the end that leaves the
smallest pool, which the plan and its verdict use) and `optimistic` (the other end, reported so the
user sees how much setting the figure could gain). Pure: no torch, kopf or kubernetes.

What each engine subtracts, per device (and so what can be missing):

- vLLM (V1 engine, 0.8+; `Worker.determine_available_memory`): pool = total x
  gpu_memory_utilization - (weights + torch peak increase of the profile run + non-torch
  increase). The CUDA context exists before vLLM's baseline snapshot, so it is not subtracted.
  * activation peak -> `spec.reserve`. The profile run (`GPUModelRunner.profile_run`) is one
    forward of max_num_batched_tokens tokens, then the sampler on min(max_num_seqs,
    max_num_batched_tokens) rows of full-vocabulary logits (fp32, sorted for top-k/top-p): the
    sampler dominates. `vllm serve` defaults (`EngineArgs.get_batch_defaults`): 8192 tokens and
    1024 sequences on devices of >= 70 GiB that are not A100s, else 2048 and 256; explicit
    `--max-num-batched-tokens` / `--max-num-seqs` in engine.extraArgs win. The reference logs
    (../shared/reference/kv_pools.csv, vLLM 0.11 on H100, default limits) show 36.6-37.1 bytes
    per sampled row and vocabulary entry (V17, V20, V21, V23); V08 (A100, vLLM 0.10.1) shows under
    12.5; so the sampler is counted at 8-40 bytes, the forward at 4-16 hidden-sized bf16 tensors
    per token, plus 2 kept for the hidden states (safe end only).
  * non-torch memory -> `spec.hardware.deviceOverhead`: 0.13-0.14 GiB at TP 1 in vLLM 0.11
    (V11, V17, V20, V21), 0.35 GiB in 0.6 (V01); +0.41 GiB at TP 2 (V19, V23: NCCL communicators
    and custom all-reduce buffers, which grow with the group): 0.1-0.4 GiB, +0.3-0.75 GiB when
    more than one GPU serves an instance.
  * CUDA graphs: vLLM up to 0.11 captures them after the KV cache is allocated, so they do not
    shrink the pool (the 0.11 logs match without them). Later versions can count a CUDA-graph
    estimate in the profile (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS); the logs show 0.1-0.76 GiB
    of graphs at the default capture sizes (V08, V11, V12, V17, V19-V23), so for a version after
    0.11 or none given the safe end adds 1 GiB, unless engine.extraArgs has `--enforce-eager`.
  * Before 0.8 (the V0 engine) the profile is different and not modelled: spec.reserve is then
    required (one V0 log, V03, shows a 9.37 GiB peak that vLLM's default limits do not explain).
- SGLang (`ModelRunner.profile_max_num_token`): pool = free_after_load - free_before_load x (1 -
  mem_fraction_static). free_before_load is measured after `init_torch_distributed`, so it lacks
  the CUDA context, NCCL communicators and the custom all-reduce buffers (and whatever other
  processes hold): `spec.hardware.deviceOverhead`. The reference logs show 0.37 GiB at TP 1 (S03)
  and at TP 4 (S02): 0.3-0.6 GiB, plus up to 0.75 GiB when more than one GPU serves an instance.
  Activations and CUDA graphs live in the (1 - fraction) share: `spec.reserve` is 0 when omitted.
- kvguard: the SGLang rule; on cpu the device memory is the configured budget and nothing else is
  subtracted (no estimate), on cuda the CUDA context is estimated as for SGLang.
- Weights from a parameter count (no `measuredBytesPerDevice`), on cuda: measured figures in the
  reference logs run 0-1.9% above the count x bytes for unquantized checkpoints (allocator slack,
  rotary caches, the vision tower of a multimodal one: V01, V03, V08, V11, V20, V21, V23, S02, S03)
  and 5% for mxfp4 (V17): the safe end adds 2% (5% for quantized weights). A measured figure
  scaled to a wider split (`measuredShards`) adds 3% (replicated parts do not shrink).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from kvguard.operator.api import DeviceKind, EngineKind, EstimatedInput, InferenceModelSpec, WorkerRole
from kvguard.operator.engine_flags import canonical

GiB = 1024**3

# vLLM profile-run constants (see the module docstring for where each comes from).
_SAMPLER_BYTES = (8, 40)  # (optimistic, safe) bytes per sampled row x vocabulary entry
_FORWARD_TENSORS = (4, 16)  # hidden-sized bf16 tensors per token at the forward's peak
_KEPT_TENSORS = (0, 2)  # hidden states kept while the sampler runs
_VOCAB_UNKNOWN = (32_000, 262_144)  # the smallest and largest common vocabularies (Llama 2, Gemma 3)
_LARGE_DEVICE = 70 * GiB
_VLLM_LIMITS_LARGE = (8192, 1024)  # (max_num_batched_tokens, max_num_seqs) of `vllm serve`
_VLLM_LIMITS_SMALL = (2048, 256)
VLLM_V1_SINCE = (0, 8)
_VLLM_A100_RULE_SINCE = (0, 9)  # A100s get the small limits from here on (vLLM PR #17885)
_VLLM_GRAPHS_AFTER_KV_UNTIL = (0, 11)  # up to here CUDA graphs are captured after the KV cache
_CUDA_GRAPHS = (0.0, 1.0)

# Overheads in GiB: (optimistic, safe).
_VLLM_NON_TORCH = (0.1, 0.4)
_CUDA_CONTEXT = (0.3, 0.6)
_MULTI_GPU_VLLM = (0.3, 0.75)
_MULTI_GPU_SGLANG = (0.0, 0.75)
WEIGHTS_MARGIN = 0.02
SCALED_WEIGHTS_MARGIN = 0.03
QUANTIZED_WEIGHTS_MARGIN = 0.05


@dataclass(frozen=True)
class Figure:
    """One memory figure per device: the spec's value, or an estimate's two ends."""

    safe: int
    optimistic: int
    estimate: EstimatedInput | None = None

    @classmethod
    def given(cls, value: int) -> Figure:
        return cls(value, value)


def engine_version(spec: InferenceModelSpec) -> tuple[int, int] | None:
    """(major, minor) of spec.engine.version ('0.11.0', 'v0.9.1.dev705'); None when not given."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", spec.engine.version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def engine_flag(spec: InferenceModelSpec, name: str) -> str | None:
    """The value of `name` in engine.extraArgs (`--x=v` or `--x v`; the last one wins, as in argparse),
    read as the engine's parser reads it (`--x_y`, abbreviations: engine_flags.canonical)."""
    value: str | None = None
    args = canonical(spec.engine.extra_args, (name,))
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def has_engine_flag(spec: InferenceModelSpec, name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in canonical(spec.engine.extra_args, (name,)))


def _gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB"


def _devices(role: WorkerRole) -> int:
    return role.tensor_parallel * role.pipeline_parallel


# --- Device overhead -----------------------------------------------------------------------------


def device_overhead(spec: InferenceModelSpec, role: WorkerRole) -> Figure:
    """spec.hardware.deviceOverhead, or its estimate for the engine and the role's GPU group."""
    given = spec.hardware.device_overhead
    if given is not None:
        return Figure.given(given)
    if spec.hardware.device is DeviceKind.CPU:
        return Figure.given(0)  # the configured budget is all there is
    multi = _devices(role) > 1
    if spec.engine.kind is EngineKind.VLLM:
        base, extra = _VLLM_NON_TORCH, _MULTI_GPU_VLLM if multi else (0.0, 0.0)
        description = "vLLM non-torch memory (NCCL, custom all-reduce, cuBLAS workspaces)"
        basis = "0.1-0.4 GiB" + (", +0.3-0.75 GiB for NCCL and all-reduce buffers across the GPU group" if multi else "")
    else:
        base, extra = _CUDA_CONTEXT, _MULTI_GPU_SGLANG if multi else (0.0, 0.0)
        description = "memory in use before the engine loads weights (CUDA context" + (", NCCL, all-reduce)" if multi else ")")
        basis = "CUDA context 0.3-0.6 GiB" + (", NCCL and all-reduce buffers up to 0.75 GiB" if multi else "")
    optimistic = round((base[0] + extra[0]) * GiB)
    safe = round((base[1] + extra[1]) * GiB)
    estimate = EstimatedInput(
        field="spec.hardware.deviceOverhead", description=description, safe_bytes=safe, optimistic_bytes=optimistic,
        basis=basis + " (other processes on the device are not counted)",
    )  # fmt: skip
    return Figure(safe, optimistic, estimate)


# --- Reserve (vLLM's activation peak) ------------------------------------------------------------


def reserve(spec: InferenceModelSpec, role: WorkerRole) -> Figure:
    """spec.reserve, or for vLLM the activation peak of its profile run (0 for SGLang and kvguard)."""
    if spec.reserve is not None:
        return Figure.given(spec.reserve)
    if spec.engine.kind is not EngineKind.VLLM:
        return Figure.given(0)  # activations come out of (1 - memoryFraction)
    (tokens_opt, seqs_opt), (tokens_safe, seqs_safe) = vllm_batch_limits(spec)
    graphs = _vllm_cuda_graphs(spec)
    optimistic = _vllm_activation(spec, tokens_opt, seqs_opt, end=0) + round(graphs[0] * GiB)
    safe = _vllm_activation(spec, tokens_safe, seqs_safe, end=1) + round(graphs[1] * GiB)
    limits = f"{tokens_safe:,} batched tokens, {seqs_safe:,} sequences"
    if (tokens_opt, seqs_opt) != (tokens_safe, seqs_safe):
        limits += f" ({tokens_opt:,} and {seqs_opt:,} at the optimistic end)"
    arch = spec.model.architecture
    vocab = f"vocabulary {arch.vocab_size:,}" if arch and arch.vocab_size else "vocabulary unknown (32,000-262,144)"
    basis = f"one forward of max_num_batched_tokens, then the sampler on min(max_num_seqs, tokens) rows: {limits}, {vocab}"
    if graphs[1]:
        basis += "; plus up to 1 GiB of CUDA graphs, which vLLM after 0.11 may count (no engine.version <= 0.11 given)"
    estimate = EstimatedInput(
        field="spec.reserve", description="vLLM activation peak (profile run)", safe_bytes=safe, optimistic_bytes=optimistic,
        basis=basis,
    )  # fmt: skip
    return Figure(safe, optimistic, estimate)


def _vllm_cuda_graphs(spec: InferenceModelSpec) -> tuple[float, float]:
    """(optimistic, safe) GiB of CUDA graphs vLLM may count against the KV cache."""
    version = engine_version(spec)
    if has_engine_flag(spec, "--enforce-eager") or (version is not None and version <= _VLLM_GRAPHS_AFTER_KV_UNTIL):
        return 0.0, 0.0
    return _CUDA_GRAPHS


def vllm_batch_limits(spec: InferenceModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """((tokens, seqs) at the optimistic end, (tokens, seqs) at the safe end) of vLLM's profile run."""
    optimistic, safe = _default_vllm_limits(spec)
    tokens_flag, seqs_flag = engine_flag(spec, "--max-num-batched-tokens"), engine_flag(spec, "--max-num-seqs")
    chunked_off = has_engine_flag(spec, "--no-enable-chunked-prefill") or (
        (engine_flag(spec, "--enable-chunked-prefill") or "").lower() in ("false", "0")
    )

    def resolve(default: tuple[int, int]) -> tuple[int, int]:
        tokens = int(tokens_flag) if tokens_flag else default[0]
        if chunked_off and not tokens_flag:
            tokens = max(spec.context_length, tokens)  # vLLM: the whole prompt in one step
        return tokens, int(seqs_flag) if seqs_flag else default[1]

    return resolve(optimistic), resolve(safe)


def _default_vllm_limits(spec: InferenceModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    if spec.hardware.memory_per_device < _LARGE_DEVICE:
        return _VLLM_LIMITS_SMALL, _VLLM_LIMITS_SMALL
    product = (spec.hardware.gpu_product or "").lower()
    if not product:  # an A100 80GB gets the small limits, anything else the large ones
        return _VLLM_LIMITS_SMALL, _VLLM_LIMITS_LARGE
    if "a100" in product:
        version = engine_version(spec)
        recent = version is not None and version >= _VLLM_A100_RULE_SINCE
        return _VLLM_LIMITS_SMALL, _VLLM_LIMITS_SMALL if recent else _VLLM_LIMITS_LARGE
    return _VLLM_LIMITS_LARGE, _VLLM_LIMITS_LARGE


def _vllm_activation(spec: InferenceModelSpec, tokens: int, seqs: int, end: int) -> int:
    """Peak bytes of vLLM's profile run at one end (0 optimistic, 1 safe) of each constant."""
    arch = spec.model.architecture
    assert arch is not None  # check_spec guarantees it
    vocab = arch.vocab_size or _VOCAB_UNKNOWN[end]
    hidden = arch.hidden_size or arch.num_attention_heads * (arch.effective_head_dim or 128)
    rows = min(seqs, tokens)
    sampler = rows * vocab * _SAMPLER_BYTES[end]
    forward = tokens * hidden * 2 * _FORWARD_TENSORS[end]
    kept = tokens * hidden * 2 * _KEPT_TENSORS[end]
    return max(sampler, forward) + kept


# --- Weights -------------------------------------------------------------------------------------


def estimated_weights(spec: InferenceModelSpec, counted: int) -> Figure:
    """Weights per device counted from parameters x bytes: exact on cpu (the kvguard engine's own
    sum), a range on cuda (what loading really takes runs above the count)."""
    if spec.hardware.device is DeviceKind.CPU:
        return Figure.given(counted)
    quantized = spec.weights.quantization is not None and spec.weights.quantization.value not in ("bf16", "fp16", "fp32")
    margin = QUANTIZED_WEIGHTS_MARGIN if quantized else WEIGHTS_MARGIN
    safe = math.ceil(counted * (1 + margin))
    estimate = EstimatedInput(
        field="spec.weights.measuredBytesPerDevice", description="weight memory per GPU", safe_bytes=safe,
        optimistic_bytes=counted,
        basis=f"parameters x bytes per weight = {_gib(counted)}, +{margin:.0%} for what loading takes beyond the count",
    )  # fmt: skip
    return Figure(safe, counted, estimate)


@dataclass(frozen=True)
class PipelineStage:
    """What the heaviest pipeline stage of a role holds beyond an even 1/PP of the weights (the
    planner works it out from the architecture: `planner.heaviest_stage`)."""

    layer_share: Fraction
    """The stage's share of the layers' weights over an even 1/PP: PP x ceil(layers / PP) / layers,
    or its share of the MoE layers' where fewer layers carry experts (never below the dense one)."""
    unstaged_bytes: int
    """Weights the stages do not split layer by layer (the embeddings and the speculative draft
    layers; 0 where unknown): a figure measured with TP alone holds 1/TP of them, taken out
    before its layers are scaled."""
    stage_unstaged_bytes: int
    """What the heaviest stage holds of those, whole before TP: one vocabulary matrix (the first
    and the last stage each hold one) and the draft layers (SGLang and vLLM run them beside the
    last stage)."""


def scaled_weights(spec: InferenceModelSpec, role: WorkerRole, stage: PipelineStage | None = None) -> Figure:
    """measuredBytesPerDevice, scaled to the role's split when measuredShards says where it came from.

    A scaled figure is taken as measured with tensor parallelism alone. For a role with pipeline
    stages (`stage`) the GPU count is not enough: the heaviest stage holds ceil(layers / PP)
    layers, a whole vocabulary matrix and the draft layers (split over TP), where an even split
    gives it 1/PP of each. Llama-3.1-8B measured at TP1 and planned at PP4 read 3.89 GiB, where its
    stage holds 4.23 GiB (a review). The figure's own share of those is taken out before the
    layers are scaled, and the stage's added."""
    measured, shards = spec.weights.measured_bytes_per_device, spec.weights.measured_shards
    assert measured is not None
    devices = _devices(role)
    shapes = {(r.tensor_parallel, r.pipeline_parallel) for r in spec.roles.worker_roles().values()}
    assumed = shards is None and len(shapes) > 1
    if assumed:
        # One figure cannot be every role's when their splits differ (an outside probe planned a
        # role moved to TP1 on a TP4 figure, 7 GiB where 28 sit; a review, TP8 beside TP2 x PP4):
        # taken as measured over the widest split with TP alone, which charges every other role
        # the most.
        shards = max(tp * pp for tp, pp in shapes)
    staged = stage is not None and shards is not None
    if shards is None or (shards == devices and not staged):
        return Figure.given(measured)
    scaled = measured * shards // devices
    basis = (f"{_gib(measured)} taken as measured over {shards} GPUs, the roles' widest split (measuredShards "
             f"unset), scaled to {devices}" if assumed else f"{_gib(measured)} measured over {shards} GPUs, scaled to {devices}")
    if staged:
        assert stage is not None
        layers = max(0, scaled - stage.unstaged_bytes // devices) * stage.layer_share
        scaled = math.ceil(layers + Fraction(stage.stage_unstaged_bytes, role.tensor_parallel))
        basis += (f", on the heaviest of {role.pipeline_parallel} pipeline stages ({float(stage.layer_share):.3g}x an even "
                  f"share of the layers, a whole vocabulary matrix and any draft layers over {role.tensor_parallel} GPUs)")
    safe = math.ceil(scaled * (1 + SCALED_WEIGHTS_MARGIN)) if devices > shards else scaled
    if devices > shards:
        basis += f" (+{SCALED_WEIGHTS_MARGIN:.0%}: replicated parts do not shrink)"
    estimate = EstimatedInput(
        field="spec.weights.measuredShards" if assumed else "spec.weights.measuredBytesPerDevice",
        description="weight memory per GPU", safe_bytes=safe, optimistic_bytes=scaled, basis=basis,
    )
    return Figure(safe, scaled, estimate)


__all__ = [
    "Figure",
    "PipelineStage",
    "VLLM_V1_SINCE",
    "device_overhead",
    "engine_flag",
    "engine_version",
    "estimated_weights",
    "has_engine_flag",
    "reserve",
    "scaled_weights",
    "vllm_batch_limits",
]
