"""What an engine's rendered workers actually run: a spec that asks for more is refused by field.

The planner plans whatever the spec says (tensor parallelism, quantization...), and the plan is
recorded in status as what serves. So a spec the engine would silently run differently must never
deploy: the webhook refuses it (422) and reconcile reports `InvalidSpec` naming each field.

kvguard (the CPU/GPU engine in `workers/`): one device per engine instance, weights loaded in
fp32, bf16 or fp16, the KV cache in the weights' dtype. Data parallelism is supported the way it is
rendered: each DP rank is a worker (a pod on Kubernetes, a process locally) with its own pool.
SGLang and vLLM take every field as a flag (render.py); the one refused is vLLM's
dataParallelAttention, SGLang's mode that vLLM has no flag for. On every engine, GPU fields on a CPU spec are refused: the pods would hold GPUs
they never use.

Pure: pydantic models in, strings out.
"""

from __future__ import annotations

from kvguard.operator.api import DeviceKind, EngineKind, InferenceModelSpec, KVCacheDtype, Quantization

KVGUARD_WEIGHT_DTYPES = {Quantization.FP32: "fp32", Quantization.BF16: "bf16", Quantization.FP16: "fp16"}
"""Weight formats the kvguard engine loads (as a dtype: `--dtype`)."""
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def kvguard_role_options(spec: InferenceModelSpec, role: str) -> dict[str, float]:
    """`WorkerArgs` fields that belong to one role (the others keep the worker's defaults):
    decode streams (`--stream-interval`); prefill waits for tickets and decode for prefill to
    open a transfer, each at most `--bootstrap-timeout`."""
    if role == "decode":
        return {"stream_interval": spec.engine.stream_interval or 1,
                "bootstrap_timeout": spec.kv_transfer.bootstrap_timeout_seconds}  # fmt: skip
    if role == "prefill":
        return {"bootstrap_timeout": spec.kv_transfer.bootstrap_timeout_seconds}
    return {}


def kvguard_dtype_flag(spec: InferenceModelSpec) -> str:
    """`kvguard worker --dtype` for the spec's weights: the format it names, else the checkpoint's (auto)."""
    quant = spec.weights.quantization
    return _TORCH_NAMES[KVGUARD_WEIGHT_DTYPES[quant]] if quant in KVGUARD_WEIGHT_DTYPES else "auto"
_KV_ALIASES = {
    "fp32": {KVCacheDtype.FP32, KVCacheDtype.FLOAT32},
    "bf16": {KVCacheDtype.BF16, KVCacheDtype.BFLOAT16},
    "fp16": {KVCacheDtype.FP16, KVCacheDtype.FLOAT16},
}
_ONE_DEVICE_FIELDS = ("tensor_parallel", "pipeline_parallel", "expert_parallel")
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label a GPU product is placed by (gpuType, hardware.gpuProduct: render.py)."""


def engine_problems(spec: InferenceModelSpec) -> list[str]:
    """`field: why` for every field the spec's engine would not run as written (empty: it runs)."""
    problems = _device_problems(spec)
    if spec.engine.kind == EngineKind.KVGUARD:
        problems += _kvguard_problems(spec)
    if spec.engine.kind == EngineKind.VLLM:
        problems += _vllm_problems(spec)
    return problems


def _vllm_problems(spec: InferenceModelSpec) -> list[str]:
    # The planner sizes DP attention as SGLang runs it (attention TP = TP / DP, full KV heads per
    # rank); vLLM has no such flag, renders none, and runs every DP rank with its own TP group.
    return [f"spec.roles.{name}.dataParallelAttention: SGLang's mode; vLLM's data-parallel ranks each run "
            "tensorParallel GPUs (leave it false)"
            for name, role in spec.roles.worker_roles().items() if role.data_parallel_attention]


def gpus_per_worker_pod(spec: InferenceModelSpec, role: str) -> int:
    """GPUs one prefill or decode pod's engine uses on a GPU spec (the default of its gpuCount):
    tensorParallel x pipelineParallel, times dataParallel where one pod runs every DP rank (SGLang
    without DP attention, whose ranks split the TP group, and vLLM; the kvguard engine renders a
    pod per rank)."""
    worker = spec.roles.worker_roles()[role]
    one_rank_per_pod = spec.engine.kind == EngineKind.KVGUARD
    ranks_share_tp = worker.data_parallel_attention and spec.engine.kind == EngineKind.SGLANG
    dp = 1 if ranks_share_tp or one_rank_per_pod else worker.data_parallel
    return worker.tensor_parallel * worker.pipeline_parallel * dp


def _device_problems(spec: InferenceModelSpec) -> list[str]:
    if spec.hardware.device != DeviceKind.CPU:
        return _gpu_count_problems(spec)
    problems = []
    for name, role in {**spec.roles.worker_roles(), "router": spec.roles.router}.items():
        if role.gpu_count:
            problems.append(f"spec.roles.{name}.gpuCount: hardware.device is cpu: the pods would hold {role.gpu_count} "
                            "GPU(s) they never use")  # fmt: skip
        if role.gpu_type:
            problems.append(f"spec.roles.{name}.gpuType: hardware.device is cpu: no GPU product to land on")
    if spec.hardware.gpu_product is not None:
        problems.append("spec.hardware.gpuProduct: hardware.device is cpu: no GPU product to land on")
    return problems


def _gpu_count_problems(spec: InferenceModelSpec) -> list[str]:
    """A worker pod given fewer GPUs than its engine runs on (0 among them: no GPU at all) would
    crash-loop at start, or see every GPU of its node where the runtime exposes them all."""
    problems = []
    for name, role in spec.roles.worker_roles().items():
        needed = gpus_per_worker_pod(spec, name)
        if role.gpu_count is not None and role.gpu_count < needed:
            dp = "" if needed == role.tensor_parallel * role.pipeline_parallel else " x dataParallel"
            problems.append(f"spec.roles.{name}.gpuCount: {role.gpu_count} GPU(s) per pod, but one {name} pod's engine "
                            f"runs on tensorParallel x pipelineParallel{dp} = {needed}")  # fmt: skip
    return problems


def placement_problems(spec: InferenceModelSpec) -> list[str]:
    """Where a GPU spec's pods would land, checked at admission only (spec_checks): a model
    already running with such a spec is not made Degraded by an operator upgrade."""
    if spec.hardware.device == DeviceKind.CPU:
        return []
    return _router_gpu_problems(spec) + _gpu_product_selector_problems(spec)


def _router_gpu_problems(spec: InferenceModelSpec) -> list[str]:
    """The router runs no engine (every engine's router is a CPU process: kvguard's, sglang_router,
    vllm-router), yet its gpuCount was rendered as GPUs each router pod holds, and with it the GPU
    product's nodeSelector: GPUs taken from the workers and never used."""
    count = spec.roles.router.gpu_count
    if not count:
        return []
    return [f"spec.roles.router.gpuCount: the router runs no engine and uses no GPU: each router pod would hold "
            f"{count} GPU(s) it never uses (leave it unset or 0)"]  # fmt: skip


def _gpu_product_selector_problems(spec: InferenceModelSpec) -> list[str]:
    """A worker role's nodeSelector on nvidia.com/gpu.product that names another GPU than the one
    the role is planned for (its gpuType, else hardware.gpuProduct): rendered, the selector's value
    won, so the pods landed on that GPU while the plan used the other's memory (outside probe: an
    A100-40GB selector under an H100-80GB plan)."""
    problems = []
    for name, role in spec.roles.worker_roles().items():
        selected = role.node_selector.get(GPU_PRODUCT_LABEL)
        planned, field = spec.hardware.gpu_product, "spec.hardware.gpuProduct"
        if role.gpu_type is not None:
            planned, field = role.gpu_type, f"spec.roles.{name}.gpuType"
        if selected is not None and planned is not None and selected != planned:
            problems.append(f"spec.roles.{name}.nodeSelector[{GPU_PRODUCT_LABEL}]: {selected} disagrees with {field} "
                            f"{planned}: rendered, the selector wins, so the pods would land on {selected} while the spec, "
                            f"and the plan's hardware.memoryPerDevice, are for {planned}; set {field} instead, or remove "
                            "the selector")  # fmt: skip
    return problems


def _kvguard_problems(spec: InferenceModelSpec) -> list[str]:
    problems = []
    for name, role in spec.roles.worker_roles().items():
        for field in _ONE_DEVICE_FIELDS:
            if getattr(role, field) != 1:
                wire = type(role).model_fields[field].alias or field
                problems.append(f"spec.roles.{name}.{wire}: the kvguard engine runs one device per instance (must be 1); "
                                "use dataParallel for more instances, or engine kind sglang/vllm")  # fmt: skip
        if role.data_parallel_attention:
            problems.append(f"spec.roles.{name}.dataParallelAttention: not supported by the kvguard engine")
    quant = spec.weights.quantization
    if quant is not None and quant not in KVGUARD_WEIGHT_DTYPES:
        problems.append(f"spec.weights.quantization: the kvguard engine loads fp32, bf16 or fp16 weights, not {quant.value}")
    dtype = KVGUARD_WEIGHT_DTYPES.get(quant) if quant is not None else None
    if dtype is None and spec.model.architecture is not None:
        dtype = spec.model.architecture.dtype.value
    kv = spec.kv_cache_dtype
    if kv != KVCacheDtype.AUTO and dtype is not None and kv not in _KV_ALIASES.get(dtype, set()):
        problems.append(f"spec.kvCacheDtype: the kvguard engine keeps KV in the weights' dtype ({dtype}); use auto or {dtype}")
    limit = spec.model.architecture.max_position_embeddings if spec.model.architecture is not None else None
    if limit is not None and spec.context_length > limit:  # SGLang and vLLM can be told to; the kvguard engine refuses
        problems.append(f"spec.contextLength: {spec.context_length:,} exceeds the model's maxPositionEmbeddings {limit:,}; "
                        "the kvguard engine refuses positions the model was not built for")  # fmt: skip
    # The default (mooncake) is accepted when written out: a spec dumped whole and read back has it.
    if "backend" in spec.kv_transfer.model_fields_set and spec.kv_transfer.backend != "mooncake":
        problems.append(f"spec.kvTransfer.backend: {spec.kv_transfer.backend} is SGLang's transfer backend; the kvguard "
                        "engine has its own (leave it unset)")  # fmt: skip
    return problems
