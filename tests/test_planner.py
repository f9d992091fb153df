"""KV pool planner (S7): public numbers, per-GPU rules, suggestions and field-level input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvguard.operator import api
from kvguard.operator.planner import (
    PlanInputError,
    counted_weight_bytes,
    kv_bytes_per_token,
    plan,
    plan_role,
    quantized_weight_bytes,
    weights_bytes_per_gpu,
)
from kvguard.operator.suggestions import apply_suggestion

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GiB = 1024**3


def example_spec(name: str) -> api.InferenceModelSpec:
    return api.InferenceModel.model_validate(yaml.safe_load((EXAMPLES / name).read_text())).spec


def llama_arch(**changes: object) -> api.ModelArchitecture:
    fields: dict[str, object] = dict(
        num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
        total_parameters=8_030_261_248, embedding_parameters=1_050_673_152, attention_parameters=1_342_177_280,
    )  # fmt: skip
    fields.update(changes)
    return api.ModelArchitecture(**fields)


def make_spec(role: api.WorkerRole | None = None, **changes: object) -> api.InferenceModelSpec:
    role = role or api.WorkerRole()
    fields: dict[str, object] = dict(
        model=api.ModelSpec(name="m", architecture=llama_arch()),
        context_length=131072,
        memory_fraction=0.88,
        engine=api.EngineSpec(kind="sglang"),
        hardware=api.HardwareSpec(memory_per_device="79.18Gi", device_overhead="0.37Gi"),
        roles=api.RolesSpec(prefill=role, decode=role),
    )
    fields.update(changes)
    return api.InferenceModelSpec(**fields)


def deepseek_v3_arch() -> api.ModelArchitecture:
    return api.ModelArchitecture(
        num_layers=61, num_attention_heads=128, num_kv_heads=128, hidden_size=7168,
        total_parameters=671_026_419_200, embedding_parameters=1_853_358_080,
        attention_parameters=11_413_547_008, expert_parameters=653_908_770_816, num_experts=256,
        mla=api.MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64),
    )  # fmt: skip


# --- Must-show public numbers (S7) ---------------------------------------------------------------


def test_s7_llama_8b_sglang_h100_matches_logged_444500_within_1_percent() -> None:
    result = plan(example_spec("llama-3.1-8b-sglang-h100.yaml"))
    pool = result.roles["decode"].pool_tokens
    assert abs(pool - 444_500) / 444_500 < 0.01
    assert result.roles["decode"].bytes_per_token == 131_072
    assert result.verdict == "pass"


def test_s7_incident_is_blocked_with_prefill_pool_681280() -> None:
    result = plan(example_spec("incident.yaml"))
    assert result.context_length == 1_048_576
    assert result.roles["prefill"].pool_tokens == 681_280
    assert not result.roles["prefill"].sufficient
    assert result.verdict == "blocked"


def test_s7_incident_fix_passes_with_pool_about_2_04_mi_tokens() -> None:
    result = plan(example_spec("incident-fixed.yaml"))
    prefill = result.roles["prefill"]
    assert prefill.pool_tokens == 2_139_136 and round(prefill.ratio, 2) == 2.04
    assert result.verdict == "pass"
    assert all(role.ratio >= 2.0 for role in result.roles.values())


def test_s7_sglang_issue_30233_glm_5_2_fp8_is_blocked_with_pool_284928() -> None:
    spec = example_spec("sglang-30233.yaml")
    assert spec.kv_cache_dtype is api.KVCacheDtype.FP8_E4M3 and spec.page_size == 64
    assert spec.memory_fraction == 0.75 and spec.context_length == 1_048_576
    result = plan(spec)
    assert result.roles["decode"].pool_tokens == 284_928
    assert result.roles["decode"].bytes_per_token == 78 * (576 + 132)
    assert result.verdict == "blocked"


def test_tiny_cpu_example_passes_with_its_explicit_pool() -> None:
    result = plan(example_spec("tiny-cpu.yaml"))
    assert result.verdict == "pass"
    for role in result.roles.values():
        assert role.pool_tokens == 4096 and role.capped_by == "kvPoolTokens"
        assert role.bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x K,V x heads x dim x fp32
        assert role.memory_pool_tokens > 4096  # the budget really holds the capped pool


# --- Bytes per token per GPU ---------------------------------------------------------------------


def test_gqa_kv_heads_split_over_tp_then_replicated_beyond_kv_heads() -> None:
    per_tp = {tp: kv_bytes_per_token(make_spec(), api.WorkerRole(tensor_parallel=tp)) for tp in (1, 2, 8, 16, 32)}
    assert per_tp[1] == 32 * 2 * 8 * 128 * 2
    assert per_tp[2] == per_tp[1] // 2
    assert per_tp[8] == per_tp[16] == per_tp[32] == 32 * 2 * 1 * 128 * 2  # one head each, replicated


def test_mla_keeps_full_latent_on_every_gpu() -> None:
    spec = make_spec(model=api.ModelSpec(name="dsv3", architecture=deepseek_v3_arch()))
    assert {kv_bytes_per_token(spec, api.WorkerRole(tensor_parallel=tp)) for tp in (1, 8, 16)} == {61 * 576 * 2}


def test_dp_attention_keeps_full_kv_heads_per_rank() -> None:
    spec = make_spec()
    plain = kv_bytes_per_token(spec, api.WorkerRole(tensor_parallel=8))
    dp_attention = api.WorkerRole(tensor_parallel=8, data_parallel=8, data_parallel_attention=True)
    assert kv_bytes_per_token(spec, dp_attention) == 8 * plain  # attention TP 1: all 8 KV heads
    assert plan_role(spec, dp_attention).instances == 8


def test_draft_layers_share_the_pool_and_pipeline_splits_layers() -> None:
    spec = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(), extra_draft_layers=1))
    assert kv_bytes_per_token(spec, api.WorkerRole()) == 33 * 2 * 8 * 128 * 2  # reference row V04
    assert kv_bytes_per_token(make_spec(), api.WorkerRole(pipeline_parallel=2)) == 16 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(("layers", "pp", "heaviest"), [(32, 1, 32), (32, 2, 16), (80, 3, 27), (61, 4, 16)])
def test_pipeline_weights_are_the_heaviest_stages(layers: int, pp: int, heaviest: int) -> None:
    """Outside probe: weights were split evenly over the stages, but SGLang and vLLM give the
    remainder of the layers to some stages, and the first and last stage each hold a vocabulary
    matrix: 80 layers over 3 stages passed at 2.01x what the heaviest stage leaves at 1.98x."""
    arch = llama_arch(num_layers=layers, vocab_size=128_256, embedding_parameters=2 * 128_256 * 4096)  # untied
    spec = make_spec(model=api.ModelSpec(name="m", architecture=arch))
    per_layer = (arch.total_parameters or 0) - arch.embedding_parameters
    matrices = 2 if pp == 1 else 1  # without PP one GPU holds the embedding and the LM head
    expected = (matrices * 128_256 * 4096 + per_layer * heaviest / layers) * 2  # bf16
    assert counted_weight_bytes(spec, api.WorkerRole(pipeline_parallel=pp)) == pytest.approx(expected, rel=1e-9)


def test_head_dim_defaults_to_hidden_over_heads_but_explicit_head_dim_wins() -> None:
    implicit = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(head_dim=None)))
    explicit = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(hidden_size=5120)))
    assert kv_bytes_per_token(implicit, api.WorkerRole()) == kv_bytes_per_token(explicit, api.WorkerRole())


# --- Weights -------------------------------------------------------------------------------------


def test_quantization_scale_overheads() -> None:
    assert float(quantized_weight_bytes(api.Quantization.AWQ, 128)) == pytest.approx(0.5 + 2.5 / 128)
    assert float(quantized_weight_bytes(api.Quantization.GPTQ, 64)) == pytest.approx(0.5 + 2.5 / 64)
    assert float(quantized_weight_bytes(api.Quantization.MXFP4, 128)) == pytest.approx(0.53125)
    assert float(quantized_weight_bytes(api.Quantization.FP8, 128)) == pytest.approx(1 + 4 / 16384)


def test_awq_quantizes_linear_layers_but_not_embeddings() -> None:
    spec = make_spec(weights=api.WeightsSpec(quantization="awq"))
    arch = spec.model.architecture
    assert arch is not None and arch.total_parameters is not None
    linear = arch.total_parameters - arch.embedding_parameters
    expected = arch.embedding_parameters * 2 + linear * (0.5 + 2.5 / 128)
    assert weights_bytes_per_gpu(spec, api.WorkerRole()) == pytest.approx(expected, rel=1e-9)


def test_mxfp4_quantizes_experts_only_by_default() -> None:
    arch = api.ModelArchitecture(
        num_layers=24, num_attention_heads=64, num_kv_heads=8, head_dim=64, hidden_size=2880,
        total_parameters=20_914_686_528, embedding_parameters=1_158_266_880,
        attention_parameters=637_132_800, expert_parameters=19_116_933_120,
    )  # fmt: skip
    spec = make_spec(model=api.ModelSpec(name="gpt-oss-20b", architecture=arch), weights=api.WeightsSpec(quantization="mxfp4"))
    rest = arch.total_parameters - arch.expert_parameters  # type: ignore[operator]
    expected = rest * 2 + arch.expert_parameters * 0.53125
    got = weights_bytes_per_gpu(spec, api.WorkerRole())
    assert got == pytest.approx(expected, rel=1e-9)
    assert 12 * GiB < got < 14 * GiB  # vLLM logged 13.47 GiB for gpt-oss-20b (reference row V17)


def test_experts_shard_over_expert_parallel_and_attention_replicates_with_dp_attention() -> None:
    spec = make_spec(model=api.ModelSpec(name="dsv3", architecture=deepseek_v3_arch()), weights=api.WeightsSpec(quantization="fp8"))
    tp8 = weights_bytes_per_gpu(spec, api.WorkerRole(tensor_parallel=8))
    dp_attention = weights_bytes_per_gpu(spec, api.WorkerRole(tensor_parallel=8, data_parallel=8, data_parallel_attention=True))
    assert 75 * GiB < tp8 < 82 * GiB  # ~671 GB fp8 over 8 GPUs
    assert dp_attention - tp8 == pytest.approx(11_413_547_008 * (1 - 1 / 8), rel=1e-3)  # attention unsharded


def test_measured_weights_override_the_estimate() -> None:
    spec = make_spec(weights=api.WeightsSpec(measured_bytes_per_device="15Gi"))
    assert weights_bytes_per_gpu(spec, api.WorkerRole(tensor_parallel=2)) == 15 * GiB


# --- Pool rules ----------------------------------------------------------------------------------


def test_sglang_rule_applies_fraction_to_memory_free_before_load() -> None:
    # Reference row S02: free 21.63 GiB before load, 6.09 after, fraction 0.85, TP4 -> 46,611 logged.
    spec = make_spec(
        model=api.ModelSpec(name="qwq", architecture=llama_arch(num_layers=64, num_attention_heads=40, head_dim=128)),
        weights=api.WeightsSpec(measured_bytes_per_device=int((21.63 - 6.09) * GiB)),
        memory_fraction=0.85,
        hardware=api.HardwareSpec(memory_per_device=int(21.63 * GiB), device_overhead=0),  # free before load: known
    )
    assert abs(plan_role(spec, api.WorkerRole(tensor_parallel=4)).pool_tokens - 46_611) <= 10


def test_vllm_rule_subtracts_weights_activation_and_non_torch_from_utilization() -> None:
    # Reference row V01: 23.58 GiB x 0.9 - 14.9888 - 2.0712 (activation) - 0.35 (non-torch) -> 1952 blocks.
    spec = make_spec(
        weights=api.WeightsSpec(measured_bytes_per_device=int(14.9888 * GiB)),
        memory_fraction=0.9,
        reserve=int(2.0712 * GiB),
        engine=api.EngineSpec(kind="vllm"),
        hardware=api.HardwareSpec(memory_per_device=int(23.58 * GiB), device_overhead=int(0.35 * GiB)),
        page_size=16,
    )
    assert abs(plan_role(spec, api.WorkerRole()).pool_tokens - 31_232) <= 16


def test_pool_is_whole_pages_and_explicit_cap_applies() -> None:
    for page in (1, 16, 64):
        assert plan_role(make_spec(page_size=page), api.WorkerRole()).pool_tokens % page == 0
    capped = plan_role(make_spec(kv_pool_tokens=300_001, page_size=16), api.WorkerRole())
    assert capped.pool_tokens == 300_000 and capped.capped_by == "kvPoolTokens"
    per_role = plan_role(make_spec(kv_pool_tokens=300_000), api.WorkerRole(kv_pool_tokens=270_000))
    assert per_role.pool_tokens == 270_000


def test_weights_larger_than_memory_are_an_explicit_blocked_reason_not_a_silent_empty_pool() -> None:
    spec = make_spec(weights=api.WeightsSpec(measured_bytes_per_device="200Gi"))
    result = plan(spec)
    decode = result.roles["decode"]
    assert decode.pool_tokens == 0 and result.verdict == "blocked"
    assert decode.kv_budget_bytes < -100 * GiB  # reported as the shortfall, not clamped to 0
    assert any(r.startswith("decode:") and "would not start" in r and "Not enough memory" in r for r in result.reasons)


def test_kvguard_cpu_budget_is_its_device_memory() -> None:
    spec = example_spec("tiny-cpu.yaml").model_copy(update={"kv_pool_tokens": None})
    budget_tokens = plan_role(spec, api.WorkerRole()).pool_tokens
    smaller = spec.model_copy(update={"hardware": api.HardwareSpec(device="cpu", memory_per_device="128Mi")})
    assert plan_role(smaller, api.WorkerRole()).pool_tokens < budget_tokens


# --- Unknown memory figures: estimated at the safe end, never taken as zero ---------------------


def vllm_spec(**changes: object) -> api.InferenceModelSpec:
    """Llama-3.1-8B on one H100 under vLLM 0.11 (reference row V20: 51.38 GiB of KV logged)."""
    fields: dict[str, object] = dict(
        model=api.ModelSpec(name="m", architecture=llama_arch(vocab_size=128_256)),
        weights=api.WeightsSpec(measured_bytes_per_device=int(14.99 * GiB)),
        memory_fraction=0.9, page_size=128, context_length=16_000,
        engine=api.EngineSpec(kind="vllm", version="0.11.0"),
        hardware=api.HardwareSpec(memory_per_device=int(79.18 * GiB), gpu_product="NVIDIA-H100-80GB-HBM3"),
    )  # fmt: skip
    fields.update(changes)
    return make_spec(**fields)


def test_s7_unknown_vllm_activation_and_non_torch_are_estimated_not_zero() -> None:
    logged = 51.38 * GiB
    decode = plan(vllm_spec()).roles["decode"]
    assert {e.field for e in decode.estimates} == {"spec.reserve", "spec.hardware.deviceOverhead"}
    assert decode.kv_bytes_per_gpu <= logged * 1.02  # the issue: +9.6% with both taken as zero
    assert decode.kv_bytes_per_gpu >= logged * 0.95
    assert decode.optimistic_pool_tokens is not None and decode.optimistic_pool_tokens > decode.pool_tokens
    reserve = next(e for e in decode.estimates if e.field == "spec.reserve")
    assert reserve.safe_bytes > 4.76 * GiB > reserve.optimistic_bytes  # the log's 4.76 GiB lies in the range
    known = plan(vllm_spec(reserve=int(4.76 * GiB), hardware=api.HardwareSpec(
        memory_per_device=int(79.18 * GiB), device_overhead=int(0.13 * GiB)))).roles["decode"]  # fmt: skip
    assert known.estimates == [] and known.optimistic_pool_tokens is None
    assert abs(known.kv_bytes_per_gpu - logged) / logged < 0.003


def test_the_verdict_uses_the_safe_end_of_an_estimate() -> None:
    spec = vllm_spec(context_length=215_000)  # the optimistic pool holds 2x, the safe one does not
    result = plan(spec)
    decode = result.roles["decode"]
    assert decode.optimistic_pool_tokens is not None and decode.optimistic_pool_tokens >= 430_000 > decode.pool_tokens
    assert result.verdict == "blocked"
    assert any("spec.reserve replaces the estimate" in w for w in result.warnings)
    assert any("the verdict uses the safe end" in w for w in result.warnings)


def test_vllm_activation_estimate_follows_its_profile_limits() -> None:
    """More batched tokens or sequences in engine.extraArgs make vLLM's profile run (and the
    estimate) bigger; an A100 gets vLLM's smaller defaults."""
    base = next(e for e in plan_role(vllm_spec(), api.WorkerRole()).estimates if e.field == "spec.reserve")
    wide = vllm_spec(engine=api.EngineSpec(kind="vllm", version="0.11.0", extra_args=["--max-num-seqs=2048"]))
    assert next(e for e in plan_role(wide, api.WorkerRole()).estimates if e.field == "spec.reserve").safe_bytes > 1.9 * base.safe_bytes
    a100 = vllm_spec(hardware=api.HardwareSpec(memory_per_device=int(79.15 * GiB), gpu_product="NVIDIA-A100-SXM4-80GB"))
    assert next(e for e in plan_role(a100, api.WorkerRole()).estimates if e.field == "spec.reserve").safe_bytes < base.safe_bytes / 3


def test_vllm_cuda_graphs_count_at_the_safe_end_unless_the_version_captures_them_after_the_pool() -> None:
    def reserve_of(engine: api.EngineSpec) -> api.EstimatedInput:
        return next(e for e in plan_role(vllm_spec(engine=engine), api.WorkerRole()).estimates if e.field == "spec.reserve")

    v011 = reserve_of(api.EngineSpec(kind="vllm", version="0.11.0"))  # graphs after the KV cache: not counted
    unknown = reserve_of(api.EngineSpec(kind="vllm"))
    eager = reserve_of(api.EngineSpec(kind="vllm", extra_args=["--enforce-eager"]))
    assert unknown.safe_bytes - v011.safe_bytes == GiB and "CUDA graphs" in unknown.basis
    assert eager.safe_bytes == v011.safe_bytes and unknown.optimistic_bytes == v011.optimistic_bytes


def test_vllm_v0_engine_needs_its_reserve_from_the_log() -> None:
    problems = errors_of(vllm_spec(engine=api.EngineSpec(kind="vllm", version="0.6.4")))
    assert "V0 engine" in problems["spec.reserve"]
    assert plan(vllm_spec(engine=api.EngineSpec(kind="vllm", version="0.6.4"), reserve="2Gi")).verdict == "pass"


def test_sglang_memory_used_before_load_is_estimated_and_grows_with_the_gpu_group() -> None:
    spec = make_spec(hardware=api.HardwareSpec(memory_per_device="79.18Gi"))  # deviceOverhead not given
    one = plan_role(spec, api.WorkerRole())
    four = plan_role(spec, api.WorkerRole(tensor_parallel=4))
    overhead = {r.gpus_per_instance: next(e for e in r.estimates if e.field == "spec.hardware.deviceOverhead")
                for r in (one, four)}  # fmt: skip
    assert overhead[1].optimistic_bytes <= 0.37 * GiB <= overhead[1].safe_bytes  # S03's log: 0.37 GiB
    assert overhead[4].safe_bytes > overhead[1].safe_bytes
    assert not any(e.field == "spec.reserve" for e in one.estimates)  # SGLang: activations live in 1 - fraction


def test_cpu_budget_and_counted_weights_are_exact_for_the_kvguard_engine() -> None:
    assert plan(example_spec("tiny-cpu.yaml")).roles["decode"].estimates == []


def test_weights_counted_from_parameters_carry_a_margin_on_gpus() -> None:
    spec = make_spec()
    role_plan = plan_role(spec, api.WorkerRole())
    weights = next(e for e in role_plan.estimates if e.field == "spec.weights.measuredBytesPerDevice")
    assert weights.optimistic_bytes == counted_weight_bytes(spec, api.WorkerRole()) == weights_bytes_per_gpu(spec, api.WorkerRole())
    assert weights.safe_bytes == pytest.approx(weights.optimistic_bytes * 1.02, rel=1e-6)
    assert role_plan.weights_bytes_per_gpu == weights.safe_bytes


def test_measured_weights_scale_to_another_split_only_when_measured_shards_is_set() -> None:
    measured = api.WeightsSpec(measured_bytes_per_device="40Gi")
    assert weights_bytes_per_gpu(make_spec(weights=measured), api.WorkerRole(tensor_parallel=2)) == 40 * GiB
    scaled = make_spec(weights=api.WeightsSpec(measured_bytes_per_device="40Gi", measured_shards=1))
    two = plan_role(scaled, api.WorkerRole(tensor_parallel=2))
    assert weights_bytes_per_gpu(scaled, api.WorkerRole(tensor_parallel=2)) == 20 * GiB
    assert two.weights_bytes_per_gpu == pytest.approx(20.6 * GiB, rel=1e-6)  # wider split: +3% at the safe end
    assert plan_role(scaled, api.WorkerRole()).weights_bytes_per_gpu == 40 * GiB  # its own split: exact


LLAMA_UNTIED = dict(vocab_size=128_256, embedding_parameters=2 * 128_256 * 4096)
DEEPSEEK_STAGES = dict(vocab_size=129_280, moe_layers=58)  # 3 dense layers first


@pytest.mark.parametrize(("truth", "given", "draft"), [
    (llama_arch(**LLAMA_UNTIED), llama_arch(**LLAMA_UNTIED), 0),
    (llama_arch(**LLAMA_UNTIED), llama_arch(vocab_size=128_256, embedding_parameters=0), 0),  # embeddings not given
    (llama_arch(num_layers=30, **LLAMA_UNTIED), llama_arch(num_layers=30, **LLAMA_UNTIED), 0),  # layers left over
    (llama_arch(**LLAMA_UNTIED), llama_arch(**LLAMA_UNTIED), 1),  # an EAGLE layer, beside the last stage
    (deepseek_v3_arch().model_copy(update=DEEPSEEK_STAGES), deepseek_v3_arch().model_copy(update=DEEPSEEK_STAGES), 1),
], ids=["llama", "llama-embeddings-unknown", "llama-uneven", "llama-draft", "deepseek-moe-stages-mtp"])
@pytest.mark.parametrize(("shards", "tp", "pp"), [(1, 1, 2), (1, 1, 4), (8, 2, 4), (8, 1, 8), (4, 4, 2), (8, 4, 1)])
def test_measured_weights_scaled_to_pipeline_stages_cover_the_heaviest_stage(
        truth: api.ModelArchitecture, given: api.ModelArchitecture, draft: int, shards: int, tp: int, pp: int) -> None:
    """S7: a figure measured with TP alone and scaled by GPU count gave a stage 1/PP of everything;
    the heaviest stage holds ceil(layers / PP) layers, a whole vocabulary matrix and the draft
    layers. Llama-3.1-8B measured at TP1 and planned at PP4 read 3.89 GiB where the stage holds
    4.23 GiB; TP8 -> TP2 x PP4, the same GPUs, was taken as measured (reviews). Measured = the
    planner's own count of the true model at TP=shards; planned with the spec's architecture:
    never below the truth."""
    def model(arch: api.ModelArchitecture) -> api.ModelSpec:
        return api.ModelSpec(name="m", architecture=arch, extra_draft_layers=draft)

    measured = counted_weight_bytes(make_spec(model=model(truth)), api.WorkerRole(tensor_parallel=shards))
    spec = make_spec(model=model(given), weights=api.WeightsSpec(measured_bytes_per_device=measured, measured_shards=shards))
    role = api.WorkerRole(tensor_parallel=tp, pipeline_parallel=pp)
    stage = counted_weight_bytes(make_spec(model=model(truth)), role)
    planned = weights_bytes_per_gpu(spec, role)
    assert stage <= planned <= stage * 1.35 + 2**20, (planned / stage, planned - stage)
    if pp == 1:
        assert planned == measured * shards // (tp * pp)  # without stages: the GPU count alone, as before


def test_a_measured_figure_beside_roles_of_one_gpu_count_in_two_shapes_is_charged_as_tp_alone() -> None:
    """Prefill TP8 and decode TP2 x PP4 hold 8 GPUs each, so one figure (measuredShards unset) was
    taken as measured at both, and decode planned 1.87 GiB where its stage holds 2.11 GiB (a
    review). Two shapes are two splits: the figure is taken as measured over 8 GPUs with TP alone."""
    arch = llama_arch(**LLAMA_UNTIED)
    measured = counted_weight_bytes(make_spec(model=api.ModelSpec(name="m", architecture=arch)), api.WorkerRole(tensor_parallel=8))
    staged = api.WorkerRole(tensor_parallel=2, pipeline_parallel=4)
    spec = make_spec(model=api.ModelSpec(name="m", architecture=arch),
                     weights=api.WeightsSpec(measured_bytes_per_device=measured),
                     roles=api.RolesSpec(prefill=api.WorkerRole(tensor_parallel=8), decode=staged))  # fmt: skip
    assert weights_bytes_per_gpu(spec, staged) >= counted_weight_bytes(spec, staged)
    assert weights_bytes_per_gpu(spec, api.WorkerRole(tensor_parallel=8)) == measured


def test_draft_layers_on_pipeline_stages_need_the_parameter_count_under_a_measured_figure() -> None:
    """A review: with a measured figure and no totalParameters a draft layer's size is unknown, so
    it was spread over the stages like any layer: 4.46 GiB planned where the last stage holds 4.64."""
    arch = llama_arch(**LLAMA_UNTIED).model_copy(update={"total_parameters": None})
    staged = api.RolesSpec(prefill=api.WorkerRole(pipeline_parallel=4), decode=api.WorkerRole())
    spec = make_spec(model=api.ModelSpec(name="m", architecture=arch, extra_draft_layers=1), roles=staged,
                     weights=api.WeightsSpec(measured_bytes_per_device="15Gi", measured_shards=1))  # fmt: skip
    with pytest.raises(PlanInputError) as refused:
        plan(spec)
    assert "spec.model.architecture.totalParameters: is needed to plan spec.model.extraDraftLayers over " \
           "spec.roles.prefill.pipelineParallel 4" in str(refused.value), refused.value
    plan(spec.model_copy(update={"roles": api.RolesSpec(prefill=api.WorkerRole(), decode=api.WorkerRole())}))  # without PP: plans


def test_pipeline_stages_need_the_vocabulary_matrix_to_plan() -> None:
    """Neither embeddingParameters nor vocabSize x hiddenSize: the stage's vocabulary matrix is
    unknown, so no figure bounds the heaviest stage. Refused for the field that fixes it."""
    spec = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(embedding_parameters=0)),
                     roles=api.RolesSpec(prefill=api.WorkerRole(pipeline_parallel=2), decode=api.WorkerRole()))  # fmt: skip
    with pytest.raises(PlanInputError) as refused:
        plan(spec)
    assert "spec.model.architecture.vocabSize: is needed with hiddenSize (or embeddingParameters) to plan " \
           "spec.roles.prefill.pipelineParallel 2" in str(refused.value), refused.value
    headless = llama_arch(embedding_parameters=0, vocab_size=128_256, hidden_size=None)  # headDim gives the KV width
    with pytest.raises(PlanInputError) as refused:
        plan(spec.model_copy(update={"model": api.ModelSpec(name="m", architecture=headless)}))
    assert "spec.model.architecture.hiddenSize: is needed with vocabSize" in str(refused.value), refused.value
    plan(spec.model_copy(update={"roles": api.RolesSpec(prefill=api.WorkerRole(), decode=api.WorkerRole())}))  # without PP: plans


def test_measured_weights_without_shards_are_charged_at_the_widest_split_when_the_roles_differ() -> None:
    """One figure cannot be every role's when their splits differ; used as-is, a TP1 decode beside a
    TP4 prefill planned 7 GiB of weights where 28 sit (outside probe: PASS). Taken as measured over
    the widest split, the narrower role is charged the most, and the plan says so."""
    spec = make_spec(weights=api.WeightsSpec(measured_bytes_per_device="7Gi"),
                     roles=api.RolesSpec(prefill=api.WorkerRole(tensor_parallel=4), decode=api.WorkerRole()))  # fmt: skip
    result = plan(spec)
    assert result.roles["prefill"].weights_bytes_per_gpu == 7 * GiB  # the widest split: as measured
    assert result.roles["decode"].weights_bytes_per_gpu == 28 * GiB
    assert any("taken as measured over 4 GPUs, the roles' widest split (measuredShards unset)" in w
               and "spec.weights.measuredShards replaces the estimate" in w for w in result.warnings), result.warnings  # fmt: skip
    same = make_spec(weights=api.WeightsSpec(measured_bytes_per_device="7Gi"), roles=api.RolesSpec(
        prefill=api.WorkerRole(tensor_parallel=4), decode=api.WorkerRole(tensor_parallel=4)))  # fmt: skip
    assert plan(same).roles["decode"].weights_bytes_per_gpu == 7 * GiB and not plan(same).warnings  # one split: as given


def test_draft_layers_add_their_weights() -> None:
    plain = counted_weight_bytes(make_spec(), api.WorkerRole())
    draft = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(), extra_draft_layers=1))
    arch = llama_arch()
    one_layer = (arch.total_parameters - arch.embedding_parameters) / arch.num_layers * 2  # type: ignore[operator]
    assert counted_weight_bytes(draft, api.WorkerRole()) - plain == pytest.approx(one_layer, rel=1e-6)


def test_context_beyond_max_position_embeddings_is_warned_about() -> None:
    short = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(max_position_embeddings=131_072)))
    assert not any("max_position_embeddings" in w for w in plan(short).warnings)
    long = short.model_copy(update={"context_length": 262_144})
    assert any("exceeds the model's max_position_embeddings 131,072" in w for w in plan(long).warnings)


def test_a_role_at_zero_replicas_is_noted_since_a_rollout_blocks_it() -> None:
    """Outside probe: plan said PASS for decode.replicas 0, which apply then blocks (NoWorkers)."""
    spec = make_spec()
    assert not any("replicas is 0" in w for w in plan(spec).warnings)
    idle = spec.model_copy(update={"roles": spec.roles.model_copy(update={"decode": spec.roles.decode.model_copy(update={"replicas": 0})})})
    assert "spec.roles.decode.replicas is 0: a rollout of this spec is blocked (NoWorkers) until it is scaled up" in plan(idle).warnings


def test_engine_args_that_would_change_the_pool_behind_the_plan_are_refused() -> None:
    spec = make_spec(engine=api.EngineSpec(kind="sglang", extra_args=["--mem-fraction-static", "0.95"]))
    assert "spec.memoryFraction" in errors_of(spec)["spec.engine.extraArgs"]
    bad_seqs = vllm_spec(engine=api.EngineSpec(kind="vllm", extra_args=["--max-num-seqs", "many"]))
    assert "--max-num-seqs" in errors_of(bad_seqs)["spec.engine.extraArgs"]


def test_kvguard_engine_keeps_kv_in_the_model_dtype() -> None:
    spec = example_spec("tiny-cpu.yaml").model_copy(update={"kv_cache_dtype": api.KVCacheDtype.FP8_E4M3})
    assert "model dtype" in errors_of(spec)["spec.kvCacheDtype"]


# --- Suggestions when blocked --------------------------------------------------------------------


def changes_of(suggestion: api.PlanSuggestion) -> dict[str, object]:
    return {c.field: c.value for c in suggestion.changes}


@pytest.mark.parametrize("example", ["incident.yaml", "sglang-30233.yaml"])
def test_s7_every_suggestion_is_a_complete_change_that_passes_the_whole_spec(example: str) -> None:
    spec = example_spec(example)
    result = plan(spec)
    assert result.suggestions
    for suggestion in result.suggestions:
        assert suggestion.changes and suggestion.changes[0].field == suggestion.field
        fixed = plan(apply_suggestion(spec, suggestion))
        assert fixed.verdict == "pass", suggestion  # every role, not just the one the change names


def test_kvguard_engine_suggestions_are_changes_the_engine_runs() -> None:
    """Outside probe: for the kvguard engine on CUDA a blocked plan offered tensorParallel=4 and
    pipelineParallel=3 as "changes that pass"; applied as printed, both were refused (exit 2: one
    device per instance). Every suggestion is now also checked against the engine's own rules."""
    from kvguard.operator.engine_support import engine_problems

    spec = api.InferenceModelSpec.model_validate(yaml.safe_load("""
        model:
          name: meta-llama/Llama-3.1-8B-Instruct
          architecture: {numLayers: 32, numAttentionHeads: 32, numKVHeads: 8, headDim: 128, hiddenSize: 4096, dtype: bf16,
                         totalParameters: 8030261248, embeddingParameters: 1050673152, attentionParameters: 1342177280}
        pageSize: 16
        contextLength: 131072
        engine: {kind: kvguard}
        hardware: {device: cuda, memoryPerDevice: 24Gi}
        roles: {prefill: {replicas: 1}, decode: {replicas: 1}}
    """))  # fmt: skip
    assert engine_problems(spec) == []
    result = plan(spec)
    assert result.verdict == "blocked" and result.suggestions
    for suggestion in result.suggestions:
        fixed = apply_suggestion(spec, suggestion)
        assert engine_problems(fixed) == [], suggestion
        assert plan(fixed).verdict == "pass", suggestion


def test_incident_fixes_fix_both_roles_and_raise_the_prefill_cap_in_each() -> None:
    spec = example_spec("incident.yaml")
    result = plan(spec)
    by_field = {s.field: changes_of(s) for s in result.suggestions}
    needed = 2 * 1_048_576
    # prefill TP 8 alone would leave decode at 1.30x: the TP fix changes both roles.
    tp = by_field["spec.roles.prefill.tensorParallel"]
    assert tp["spec.roles.decode.tensorParallel"] == 8 and tp["spec.roles.prefill.kvPoolTokens"] == needed
    fp8 = by_field["spec.kvCacheDtype"]
    assert fp8 == {"spec.kvCacheDtype": "fp8_e4m3", "spec.roles.prefill.kvPoolTokens": needed}
    assert all("spec.roles.prefill.kvPoolTokens" in c for f, c in by_field.items() if f != "spec.contextLength")
    assert "spec.roles.prefill.memoryFraction" not in by_field  # no fraction holds 2 Mi bf16 tokens at TP 4
    fp8_message = next(s.message for s in result.suggestions if s.field == "spec.kvCacheDtype")
    assert "halves" in fp8_message and "raise kvPoolTokens" in fp8_message


def test_suggestions_are_the_smallest_changes() -> None:
    spec = make_spec(context_length=240_000)  # ~441,900 tokens at the safe end: ratio 1.84 at fraction 0.88
    result = plan(spec)
    by_field = {s.field: s for s in result.suggestions}
    fraction = changes_of(by_field["spec.roles.prefill.memoryFraction"])
    assert fraction["spec.roles.prefill.memoryFraction"] == fraction["spec.roles.decode.memoryFraction"]
    below = spec.model_copy(update={"memory_fraction": round(fraction["spec.roles.decode.memoryFraction"] - 0.01, 2)})
    assert not plan(below).roles["decode"].sufficient
    assert changes_of(by_field["spec.roles.prefill.tensorParallel"])["spec.roles.decode.tensorParallel"] == 2
    assert by_field["spec.kvCacheDtype"].value == "fp8_e4m3"
    longest = by_field["spec.contextLength"].value
    assert plan(spec.model_copy(update={"context_length": longest})).verdict == "pass"
    assert plan(spec.model_copy(update={"context_length": longest + 1})).verdict == "blocked"


def test_the_context_suggestion_never_exceeds_what_the_model_was_built_for() -> None:
    """The pools of make_spec(240_000) hold ~220,000 tokens of context safely: a model built for
    200,000 positions is offered its own limit, not a context it was never trained on."""
    spec = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(max_position_embeddings=200_000)), context_length=240_000)
    context = next(s for s in plan(spec).suggestions if s.field == "spec.contextLength")
    assert context.value == 200_000 and context.message.startswith("the model's max_position_embeddings, 200,000 tokens (now 240,000)")
    unbounded = next(s for s in plan(make_spec(context_length=240_000)).suggestions if s.field == "spec.contextLength")
    assert 200_000 < unbounded.value < 240_000


def test_fraction_is_never_suggested_above_0_95() -> None:
    # 0.96 would pass, but leaves activations and CUDA graphs no room: not a fix.
    spec = make_spec(context_length=245_000, memory_fraction=0.5)
    assert plan(spec.model_copy(update={"memory_fraction": 0.96})).verdict == "pass"
    assert plan(spec.model_copy(update={"memory_fraction": 0.95})).verdict == "blocked"
    suggestions = plan(spec).suggestions
    assert not any(s.field.endswith("memoryFraction") for s in suggestions)  # no fraction-only fix
    fractions = [c.value for s in suggestions for c in s.changes if c.field.endswith("memoryFraction")]
    assert all(f <= 0.95 for f in fractions)  # combined with fp8, a fraction may still be part of a fix


def test_capped_role_with_room_suggests_raising_the_cap_and_no_fp8() -> None:
    result = plan(make_spec(kv_pool_tokens=100_000))
    first = result.suggestions[0]
    assert changes_of(first) == {"spec.roles.prefill.kvPoolTokens": 262_144, "spec.roles.decode.kvPoolTokens": 262_144}
    assert all(s.field != "spec.kvCacheDtype" for s in result.suggestions)  # fp8 cannot lift a token cap


def test_fp32_to_fp8_quarters_the_bytes_per_token() -> None:
    fp32 = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(dtype="fp32")), context_length=131_072,
                     memory_fraction=0.5)  # fmt: skip
    fp8 = next(s for s in plan(fp32).suggestions if s.field == "spec.kvCacheDtype")
    assert "quarters" in fp8.message and "fp32 -> fp8" in fp8.message


def test_mla_tensor_parallel_suggestion_says_only_weights_shrink() -> None:
    # DeepSeek-V3 fp8 does not even fit 8 H100s; MLA KV is the same on every GPU, so more TP
    # helps only by spreading the weights.
    arch = deepseek_v3_arch()
    spec = make_spec(
        api.WorkerRole(tensor_parallel=8), model=api.ModelSpec(name="dsv3", architecture=arch),
        weights=api.WeightsSpec(quantization="fp8"), context_length=131_072,
        hardware=api.HardwareSpec(memory_per_device="79.18Gi", device_overhead="0.5Gi"),
    )  # fmt: skip
    result = plan(spec)
    assert result.verdict == "blocked" and result.roles["decode"].kv_budget_bytes < 0
    tp = next(s for s in result.suggestions if s.field.endswith("tensorParallel"))
    assert "MLA" in tp.message and plan(apply_suggestion(spec, tp)).verdict == "pass"
    assert plan_role(spec, api.WorkerRole(tensor_parallel=16)).bytes_per_token == result.roles["decode"].bytes_per_token


def test_mla_example_is_fixed_by_pipeline_stages_not_tensor_parallel() -> None:
    """examples/sglang-30233.yaml: no TP holds 2 Mi MLA tokens at fraction 0.75 (KV per GPU does not
    shrink with TP); two pipeline stages do, with the measured weights scaled to 16 GPUs."""
    spec = example_spec("sglang-30233.yaml")
    result = plan(spec)
    assert not any(s.field.endswith("tensorParallel") for s in result.suggestions)
    pp = changes_of(next(s for s in result.suggestions if s.field.endswith("pipelineParallel")))
    assert pp["spec.weights.measuredShards"] == 8 and pp["spec.roles.decode.pipelineParallel"] == 2


# --- Bad input names the field -------------------------------------------------------------------


def errors_of(spec: api.InferenceModelSpec) -> dict[str, str]:
    with pytest.raises(PlanInputError) as caught:
        plan(spec)
    return dict(caught.value.problems)


def test_tp_that_does_not_divide_heads_names_the_role_field() -> None:
    problems = errors_of(make_spec(api.WorkerRole(tensor_parallel=3)))
    assert "spec.roles.prefill.tensorParallel" in problems and "spec.roles.decode.tensorParallel" in problems


def test_inconsistent_architecture_and_hardware_name_their_fields() -> None:
    assert "spec.model.architecture.numKVHeads" in errors_of(
        make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(num_kv_heads=12)))
    )
    assert "spec.hardware.deviceOverhead" in errors_of(
        make_spec(hardware=api.HardwareSpec(memory_per_device="1Gi", device_overhead="2Gi"))
    )
    assert "spec.engine.kind" in errors_of(make_spec(hardware=api.HardwareSpec(device="cpu", memory_per_device="8Gi")))
    assert "spec.model.architecture" in errors_of(make_spec(model=api.ModelSpec(name="m")))
    assert "spec.roles.decode.expertParallel" in errors_of(make_spec(api.WorkerRole(expert_parallel=2)))
    assert "spec.roles.decode.dataParallel" in errors_of(
        make_spec(api.WorkerRole(tensor_parallel=4, data_parallel=3, data_parallel_attention=True))
    )


def test_missing_parameter_count_without_measured_weights_is_an_error() -> None:
    spec = make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(total_parameters=None)))
    assert "spec.model.architecture.totalParameters" in errors_of(spec)


def test_status_message_lists_every_field_of_each_fix_including_the_raised_cap() -> None:
    """What `kvguard apply` and the KVPoolSufficient condition show (reconcile.describe_fixes)."""
    from kvguard.operator.reconcile import describe_fixes

    message = describe_fixes(plan(example_spec("incident.yaml")))
    assert "spec.kvCacheDtype=fp8_e4m3, spec.roles.prefill.kvPoolTokens=2097152" in message
    assert "spec.roles.prefill.tensorParallel=8, spec.roles.prefill.kvPoolTokens=2097152, spec.roles.decode.tensorParallel=8" in message


def test_when_neither_split_alone_passes_both_together_are_suggested() -> None:
    """Outside probe: a plan blocked where only tensor and pipeline parallelism together pass was
    offered no change at all (the search raised one of them at a time)."""
    from kvguard.operator.hf_config import architecture_from_file

    arch = architecture_from_file(Path(__file__).resolve().parent / "data" / "hf_configs" / "llama-3.3-70b-instruct.json")
    spec = make_spec(model=api.ModelSpec(name="m", architecture=arch), context_length=1_048_576, kv_cache_dtype="fp8_e4m3",
                     hardware=api.HardwareSpec(memory_per_device="22Gi", device_overhead="0.37Gi"),
                     roles=api.RolesSpec(prefill=api.WorkerRole(), decode=api.WorkerRole(pipeline_parallel=4)))  # fmt: skip
    result = plan(spec)
    assert result.verdict == "blocked"
    (both,) = [s for s in result.suggestions if {c.field.rsplit(".", 1)[-1] for c in s.changes} >= {"tensorParallel", "pipelineParallel"}]
    assert "neither alone" in both.message
    assert plan(apply_suggestion(spec, both)).verdict == "pass"
    splits = {(c.field.split(".")[2], c.field.rsplit(".", 1)[-1]): c.value for c in both.changes}
    assert splits[("decode", "tensorParallel")] * splits[("decode", "pipelineParallel")] <= 32  # the fewest GPUs first


def test_the_ratio_counts_whole_pages_of_whole_contexts() -> None:
    """Outside probe: a pool of 3 pages of 700 (2,100 tokens) passed at 2.10x a 1,000-token
    context, but a full-length request takes 2 pages: the pool holds one, not two. Where the page
    divides the context nothing changes."""
    spec = make_spec(context_length=1000, page_size=700, kv_pool_tokens=2100)
    result = plan(spec)
    assert result.verdict == "blocked"
    assert "takes 2 pages of 700: 2x is 2,800 tokens" in result.reasons[0]
    assert all(plan(apply_suggestion(spec, s)).verdict == "pass" for s in result.suggestions) and result.suggestions
    assert plan(make_spec(context_length=1024, page_size=16, kv_pool_tokens=2048)).verdict == "pass"
    assert plan(make_spec(context_length=1000, page_size=700, kv_pool_tokens=2800)).verdict == "pass"


def test_a_pipeline_stage_of_moe_layers_only_is_planned_for_dense_first_models() -> None:
    """A review: DeepSeek-V3's first 3 of 61 layers are dense; over 3 stages the engines put 21
    layers on one, all of them MoE, 4.5% more weight than 21 average layers."""
    from fractions import Fraction

    from kvguard.operator.hf_config import architecture_from_file
    from kvguard.operator.planner import _MODEL_DTYPE_BYTES

    arch = architecture_from_file(Path(__file__).resolve().parent / "data" / "hf_configs" / "deepseek-v3.json")
    assert (arch.num_layers, arch.moe_layers) == (61, 58)
    spec = make_spec(model=api.ModelSpec(name="m", architecture=arch))
    width = _MODEL_DTYPE_BYTES[arch.dtype]
    total = arch.total_parameters or 0
    other = total - arch.embedding_parameters - arch.attention_parameters - arch.expert_parameters
    vocab = (arch.vocab_size or 0) * (arch.hidden_size or 0)
    expected = (vocab + (arch.attention_parameters + other) * Fraction(21, 61) + arch.expert_parameters * Fraction(21, 58)) * width / 8
    assert counted_weight_bytes(spec, api.WorkerRole(tensor_parallel=8, pipeline_parallel=3)) == pytest.approx(float(expected), rel=1e-9)
    average = (vocab + (total - arch.embedding_parameters) * Fraction(21, 61)) * width / 8
    assert float(expected) > float(average) * 1.03
    with pytest.raises(PlanInputError, match="moeLayers"):
        plan(make_spec(model=api.ModelSpec(name="m", architecture=llama_arch(moe_layers=40))))


def test_moe_layers_is_the_planners_alone_and_only_where_they_can_fill_a_stage() -> None:
    """A review: read from a ConfigMap's config.json by a new operator, moeLayers changed the
    revision of every DeepSeek and GLM model (a rollout that ran nothing new); and MoE layers every
    other layer are still planned as a stage of MoE layers only (more than it holds: the safe side,
    where a stage's share of the layers was too little with dense layers first); a config with
    experts but no MoE layer sets none."""
    import json

    from kvguard.operator.hf_config import architecture_from_file, architecture_from_hf_config
    from kvguard.operator.revision import numerics_of, revision_of

    configs = Path(__file__).resolve().parent / "data" / "hf_configs"
    arch = architecture_from_file(configs / "deepseek-v3.json")
    with_field = make_spec(model=api.ModelSpec(name="m", architecture=arch))
    without = make_spec(model=api.ModelSpec(name="m", architecture=arch.model_copy(update={"moe_layers": None})))
    assert (revision_of(with_field), numerics_of(with_field)) == (revision_of(without), numerics_of(without))
    qwen = json.loads((configs / "qwen3-30b-a3b.json").read_text())
    assert architecture_from_hf_config({**qwen, "decoder_sparse_step": 2}).moe_layers == 24
    assert architecture_from_hf_config({**qwen, "mlp_only_layers": [0, 1]}).moe_layers == 46
    assert architecture_from_hf_config({**qwen, "mlp_only_layers": list(range(48))}).moe_layers is None
