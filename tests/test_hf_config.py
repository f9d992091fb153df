"""Hugging Face config.json -> ModelArchitecture for the families kvguard plans for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.operator import api
from kvguard.operator.hf_config import (
    HFConfigError,
    architecture_from_file,
    architecture_from_hf_config,
    quantization_from_hf_config,
)
from kvguard.operator.planner import kv_bytes_per_token

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"

# file -> (layers, attention heads, KV heads, head dim, total parameters published, experts)
PUBLISHED = {
    "llama-3.1-8b-instruct.json": (32, 32, 8, 128, 8.03e9, 0),
    "mistral-7b-instruct-v0.3.json": (32, 32, 8, 128, 7.25e9, 0),
    "mistral-small-3.2-24b-instruct.json": (40, 32, 8, 128, 23.6e9, 0),  # text part of a 24B VLM
    "qwen2-7b-instruct.json": (28, 28, 4, 128, 7.62e9, 0),
    "qwen2.5-14b-instruct-1m.json": (48, 40, 8, 128, 14.7e9, 0),
    "qwen3-8b.json": (36, 32, 8, 128, 8.19e9, 0),
    "qwen3-30b-a3b.json": (48, 32, 4, 128, 30.5e9, 128),
    "glm-4-9b-0414.json": (40, 32, 2, 128, 9.4e9, 0),
    "glm-4.5.json": (92, 96, 8, 128, 355e9, 160),  # 355B includes the MTP layer we leave out
    "gpt-oss-20b.json": (24, 64, 8, 64, 20.9e9, 32),
    "deepseek-v2-lite.json": (27, 16, 16, 192, 15.7e9, 64),
    "deepseek-v3.json": (61, 128, 128, 192, 671e9, 256),
    "glm-5.json": (78, 64, 64, 256, 744e9, 256),
    # added for bench/planner_accuracy.py (models of the reference KV-pool logs)
    "qwen3-0.6b.json": (28, 16, 8, 128, 0.6e9, 0),
    "qwen3-14b.json": (40, 40, 8, 128, 14.8e9, 0),
    "qwen3-32b.json": (64, 64, 8, 128, 32.8e9, 0),
    "qwq-32b.json": (64, 40, 8, 128, 32.8e9, 0),
    "llama-3.3-70b-instruct.json": (80, 64, 8, 128, 70.6e9, 0),
    "meta-llama-3-8b.json": (32, 32, 8, 128, 8.03e9, 0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_architecture_matches_published_shapes_and_sizes(name: str) -> None:
    layers, heads, kv_heads, head_dim, total, experts = PUBLISHED[name]
    arch = architecture_from_file(CONFIGS / name)
    assert (arch.num_layers, arch.num_attention_heads, arch.num_kv_heads) == (layers, heads, kv_heads)
    assert arch.effective_head_dim == head_dim
    assert arch.total_parameters == pytest.approx(total, rel=0.015)
    assert arch.num_experts == experts
    assert (arch.expert_parameters > 0) == (experts > 0)
    assert arch.dtype is api.ModelDtype.BF16


def test_max_position_embeddings_is_read_for_the_context_warning() -> None:
    assert architecture_from_file(CONFIGS / "qwen2.5-14b-instruct-1m.json").max_position_embeddings == 1_010_000
    assert architecture_from_hf_config({**json.loads((CONFIGS / "qwen3-8b.json").read_text()),
                                        "max_position_embeddings": None}).max_position_embeddings is None  # fmt: skip


def test_explicit_head_dim_is_used_not_hidden_over_heads() -> None:
    arch = architecture_from_file(CONFIGS / "qwen3-8b.json")
    assert arch.head_dim == 128 and arch.hidden_size // arch.num_attention_heads == 128  # type: ignore[operator]
    mistral = architecture_from_file(CONFIGS / "mistral-small-3.2-24b-instruct.json")
    assert mistral.head_dim == 128 and 5120 // 32 == 160  # hidden / heads would be wrong


@pytest.mark.parametrize(("name", "indexer"), [("deepseek-v2-lite.json", 0), ("deepseek-v3.json", 0), ("glm-5.json", 128)])
def test_mla_models_carry_latent_rank_rope_dim_and_indexer(name: str, indexer: int) -> None:
    arch = architecture_from_file(CONFIGS / name)
    assert arch.mla == api.MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64, indexer_head_dim=indexer)


def test_moe_expert_share_dominates_for_deepseek_v3() -> None:
    arch = architecture_from_file(CONFIGS / "deepseek-v3.json")
    assert arch.expert_parameters / arch.total_parameters > 0.95  # type: ignore[operator]
    assert arch.embedding_parameters == 2 * 129280 * 7168


def test_gpt_oss_bytes_per_token_matches_vllm_log() -> None:
    arch = architecture_from_file(CONFIGS / "gpt-oss-20b.json")
    spec = api.InferenceModelSpec(
        model=api.ModelSpec(name="gpt-oss-20b", architecture=arch), context_length=16000,
        hardware=api.HardwareSpec(memory_per_device="80Gi"),
    )  # fmt: skip
    assert kv_bytes_per_token(spec, api.WorkerRole()) == 49_152  # reference row V17


def test_quantization_is_read_from_quantization_config() -> None:
    assert quantization_from_hf_config(json.loads((CONFIGS / "deepseek-v3.json").read_text())) == "fp8"
    assert quantization_from_hf_config(json.loads((CONFIGS / "gpt-oss-20b.json").read_text())) == "mxfp4"
    assert quantization_from_hf_config(json.loads((CONFIGS / "qwen3-8b.json").read_text())) is None


def test_tiny_float32_model_is_counted_exactly() -> None:
    arch = architecture_from_hf_config(
        {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "torch_dtype": "float32"}
    )  # fmt: skip
    assert arch.dtype is api.ModelDtype.FP32
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 KV heads of 16), o
    mlp, norms = 3 * 64 * 128, 2 * 64
    assert arch.total_parameters == 2 * 320 * 64 + 2 * (attention + mlp + norms) + 64 == 115_008


def test_errors_name_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError) as missing:
        architecture_from_hf_config({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8})
    assert missing.value.key == "num_hidden_layers"
    with pytest.raises(HFConfigError) as bad:
        architecture_from_hf_config({**json.loads((CONFIGS / "qwen3-8b.json").read_text()), "num_hidden_layers": -2})
    assert bad.value.key == "num_hidden_layers"
    with pytest.raises(HFConfigError, match="torch_dtype"):
        architecture_from_hf_config({**json.loads((CONFIGS / "qwen3-8b.json").read_text()), "torch_dtype": "int3"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match="not valid JSON"):
        architecture_from_file(tmp_path)


@pytest.mark.parametrize("key, value", [("text_config", 5), ("text_config", "x"), ("quantization_config", "fp8"),
                                        ("quantization_config", ["fp8"])])  # fmt: skip
def test_a_nested_section_that_is_not_an_object_names_its_key(key: str, value: object) -> None:
    """Outside probe: a string or a number where config.json nests an object ended in an
    AttributeError or TypeError: a traceback from `kvguard plan --hf-config`, and an exception
    out of reconcile for an architecture in a ConfigMap."""
    config = {**json.loads((CONFIGS / "qwen3-8b.json").read_text()), key: value}
    with pytest.raises(HFConfigError, match=f"config.json {key}: must be an object") as bad:
        architecture_from_hf_config(config)
        quantization_from_hf_config(config)
    assert bad.value.key == key


@pytest.mark.parametrize("value", [5, "0,1", [0, "1"], [True]])
def test_mlp_only_layers_that_are_not_a_list_of_indices_name_their_key(value: object) -> None:
    """The review of the fix above: a number there was a TypeError, a string a set of characters."""
    config = {**json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()), "mlp_only_layers": value}
    with pytest.raises(HFConfigError, match="config.json mlp_only_layers: must be a list of layer indices"):
        architecture_from_hf_config(config)


@pytest.mark.timeout(60)  # the enumeration it replaces took ~10 hours here
@pytest.mark.parametrize(("name", "moe_layers"), [("deepseek-v3.json", 10**12 - 3), ("qwen3-30b-a3b.json", 10**12)])
def test_a_huge_layer_count_is_counted_not_enumerated(name: str, moe_layers: int) -> None:
    """A ConfigMap anyone in the namespace may write: 10**12 layers were enumerated one by one
    to find the mixture-of-experts ones (30M took 1 s), holding the operator's event loop."""
    config = {**json.loads((CONFIGS / name).read_text()), "num_hidden_layers": 10**12}
    arch = architecture_from_hf_config(config)
    assert arch.num_layers == 10**12
    per_expert = arch.expert_parameters // moe_layers
    assert per_expert * moe_layers == arch.expert_parameters  # every MoE layer counted once, none more
