"""Hugging Face `config.json` -> `ModelArchitecture` (what the KV pool planner needs).

Pure: reads a dict (or a file) and counts parameters from the shapes; no transformers, no torch.
Covers the families kvguard plans for: Llama, Mistral, Qwen2, Qwen3 (dense and MoE), DeepSeek-V2/V3
(MLA), GLM-4 / GLM-4.5 MoE / GLM-5 (MLA with a sparse-attention indexer) and gpt-oss. Multimodal
configs are read through their `text_config`.

Parameter counts cover the served model: embeddings, every decoder layer, norms and the LM head.
Multi-token-prediction layers (`num_nextn_predict_layers`) are not counted: they are loaded only
when speculative decoding is enabled, which the spec says through `model.extraDraftLayers`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.operator.api import MLAConfig, ModelArchitecture, ModelDtype


class HFConfigError(ValueError):
    """A config.json that cannot describe a model; `key` names the offending config key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config.json {key}: {message}")
        self.key = key
        self.message = message


_DTYPES: dict[str, ModelDtype] = {
    "bfloat16": ModelDtype.BF16,
    "float16": ModelDtype.FP16,
    "half": ModelDtype.FP16,
    "float32": ModelDtype.FP32,
    "float": ModelDtype.FP32,
}


MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config.json is kilobytes


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json, given the file or the model directory holding it."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        with file.open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)  # `--hf-config /dev/zero` read 5 GB before this (outside probe)
    except FileNotFoundError as exc:
        raise HFConfigError("(file)", f"{file} does not exist") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFConfigError("(file)", f"{file} is larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a config.json")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise HFConfigError("(file)", f"{file} is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # a config.json is a few levels deep; thousands are an attack or an accident
        raise HFConfigError("(file)", f"{file} nests JSON too deeply") from exc
    except ValueError as exc:  # an integer of more digits than Python converts (int_max_str_digits)
        raise HFConfigError("(file)", f"{file}: {str(exc).split(';')[0]}") from exc
    if not isinstance(data, dict):
        raise HFConfigError("(file)", f"{file} does not hold a JSON object")
    return data


def architecture_from_file(path: str | Path) -> ModelArchitecture:
    """`architecture_from_hf_config` of a config.json file or model directory."""
    return architecture_from_hf_config(load_hf_config(path))


def architecture_from_hf_config(config: Mapping[str, Any]) -> ModelArchitecture:
    """The planner's view of a Hugging Face config.json."""
    cfg = _Config(_section(config, "text_config") or config, outer=config)
    attention = _attention_shape(cfg)
    mlp = _mlp_shape(cfg)
    vocab, hidden, layers = cfg.int("vocab_size"), cfg.int("hidden_size"), cfg.int("num_hidden_layers")
    tied = bool(cfg.get("tie_word_embeddings", False))
    embedding = vocab * hidden * (1 if tied else 2)
    norms = layers * 2 * hidden + hidden
    total = embedding + attention.parameters * layers + mlp.total + norms
    return ModelArchitecture(
        num_layers=layers,
        num_attention_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype=_dtype(cfg),
        total_parameters=total,
        embedding_parameters=embedding,
        attention_parameters=attention.parameters * layers,
        expert_parameters=mlp.routed_experts,
        num_experts=mlp.num_experts,
        moe_layers=mlp.moe_layers if mlp.num_experts and 0 < mlp.moe_layers < layers else None,
        max_position_embeddings=cfg.int("max_position_embeddings", 0) or None,
        mla=attention.mla,
    )


class _Config:
    """config.json access that names the missing or malformed key in its error."""

    def __init__(self, data: Mapping[str, Any], outer: Mapping[str, Any]) -> None:
        self._data = data
        self._outer = outer

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._data and self._data[key] is not None:
            return self._data[key]
        return self._outer.get(key, default) if self._outer is not self._data else default

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise HFConfigError(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HFConfigError(key, f"must be a non-negative integer, got {value!r}")
        return value


@dataclass(frozen=True)
class _Attention:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    parameters: int  # per layer
    mla: MLAConfig | None


def _attention_shape(cfg: _Config) -> _Attention:
    hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
    if heads == 0:
        raise HFConfigError("num_attention_heads", "must be positive")
    if cfg.has("kv_lora_rank"):
        return _mla_attention(cfg, hidden, heads)
    kv_heads = cfg.int("num_key_value_heads", heads)
    head_dim = cfg.int("head_dim", hidden // heads)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    params = hidden * (q_out + 2 * kv_out) + q_out * hidden
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        params += q_out + 2 * kv_out  # q/k/v biases (Qwen2, GLM-4.5, gpt-oss)
    if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
        params += 2 * head_dim  # per-head q/k RMSNorm
    return _Attention(heads, kv_heads, head_dim, params, mla=None)


def _mla_attention(cfg: _Config, hidden: int, heads: int) -> _Attention:
    """DeepSeek-V2/V3 and GLM-5 multi-head latent attention (+ the DSA indexer when present)."""
    kv_rank, rope = cfg.int("kv_lora_rank"), cfg.int("qk_rope_head_dim")
    nope, v_dim = cfg.int("qk_nope_head_dim"), cfg.int("v_head_dim")
    q_rank = cfg.get("q_lora_rank")
    q_head = nope + rope
    if q_rank:
        q_params = hidden * q_rank + q_rank + q_rank * heads * q_head
    else:
        q_params = hidden * heads * q_head
    kv_params = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    params = q_params + kv_params + heads * v_dim * hidden
    index_dim = cfg.int("index_head_dim", 0)
    if index_dim:
        index_heads = cfg.int("index_n_heads")
        q_source = q_rank or hidden
        params += q_source * index_heads * index_dim + hidden * index_dim + hidden * index_heads
    mla = MLAConfig(kv_lora_rank=kv_rank, qk_rope_head_dim=rope, indexer_head_dim=index_dim)
    # KV heads are meaningless for MLA (one shared latent); report the query heads so TP checks hold.
    return _Attention(heads, heads, q_head, params, mla=mla)


@dataclass(frozen=True)
class _MLP:
    total: int  # all layers, including routed experts
    routed_experts: int  # all layers
    num_experts: int
    moe_layers: int = 0  # layers with routed experts


def _mlp_shape(cfg: _Config) -> _MLP:
    hidden, layers = cfg.int("hidden_size"), cfg.int("num_hidden_layers")
    num_experts = _num_routed_experts(cfg)
    if num_experts == 0:
        return _MLP(total=layers * 3 * hidden * cfg.int("intermediate_size"), routed_experts=0, num_experts=0)
    moe_layers = _moe_layer_count(cfg, layers)
    dense_layers = layers - moe_layers
    expert_width = cfg.int("moe_intermediate_size", cfg.int("intermediate_size"))
    per_expert = 3 * hidden * expert_width
    if cfg.get("model_type") == "gpt_oss":
        per_expert += 2 * expert_width + hidden  # gate_up and down biases
    routed = moe_layers * num_experts * per_expert
    shared_width = cfg.int("n_shared_experts", 0) * expert_width + cfg.int("shared_expert_intermediate_size", 0)
    router = hidden * num_experts + num_experts  # gate weight (+ bias / correction bias)
    shared = moe_layers * (3 * hidden * shared_width + router)
    dense = dense_layers * 3 * hidden * cfg.int("intermediate_size")
    # moe_layers counts them, not where they are: with MoE every other layer (`moe_layer_freq`,
    # `decoder_sparse_step` > 1) the plan still takes a stage of MoE layers only, more than such a
    # stage holds (Qwen3 with a sparse step of 2 over 2 stages: 31 GB for 17). The safe side: a
    # stage's share of the layers was too little with dense layers first (61 layers, 10 dense, MoE
    # every other one, over 2 stages: 13.2 MoE layers for 15, two reviews).
    return _MLP(total=routed + shared + dense, routed_experts=routed, num_experts=num_experts, moe_layers=moe_layers)


def _num_routed_experts(cfg: _Config) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.has(key):
            return cfg.int(key)
    return 0


def _moe_layer_count(cfg: _Config, layers: int) -> int:
    """Layers whose MLP is a mixture of experts. Counted, not enumerated: the layer count is the
    config's to choose, and a loop over 10**12 of them (a ConfigMap anyone in the namespace may
    write) held the operator's event loop for hours (outside probe)."""
    if cfg.has("first_k_dense_replace"):  # DeepSeek, GLM-4.5/5: layers i >= first_dense with i % freq == 0
        first_dense = min(cfg.int("first_k_dense_replace"), layers)
        freq = max(1, cfg.int("moe_layer_freq", 1))
        return _multiples_below(layers, freq) - _multiples_below(first_dense, freq)
    if cfg.has("decoder_sparse_step") or cfg.has("mlp_only_layers"):  # Qwen2/3-MoE: (i + 1) % step == 0, less the dense-only
        step = max(1, cfg.int("decoder_sparse_step", 1))
        dense_only = {i for i in _layer_indices(cfg, "mlp_only_layers") if 0 <= i < layers and (i + 1) % step == 0}
        return layers // step - len(dense_only)
    return layers  # gpt-oss, Mixtral: every layer


def _multiples_below(n: int, k: int) -> int:
    """How many of 0 .. n-1 are multiples of k."""
    return (n + k - 1) // k


def _layer_indices(cfg: _Config, key: str) -> list[int]:
    """A list of layer indices (`mlp_only_layers`); a number there ended in a TypeError, and a
    string was read as a set of its characters."""
    value = cfg.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise HFConfigError(key, f"must be a list of layer indices, got {value!r:.80}")
    return value


def _dtype(cfg: _Config) -> ModelDtype:
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    try:
        return _DTYPES[str(raw)]
    except KeyError:
        raise HFConfigError("torch_dtype", f"unsupported dtype {raw!r} (bfloat16, float16, float32)") from None


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """config[key], a nested object such as text_config, or None when absent; anything else is
    the config's error (a string or a number there ended in an AttributeError or TypeError)."""
    value = config.get(key)
    if value is None or isinstance(value, Mapping):
        return value
    raise HFConfigError(key, f"must be an object, got {type(value).__name__}")


def quantization_from_hf_config(config: Mapping[str, Any]) -> str | None:
    """The `spec.weights.quantization` value a checkpoint's `quantization_config` implies, if any."""
    quant = _section(config, "quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "mxfp4", "awq", "gptq"):
        return method
    if method in ("modelopt_fp4", "nvfp4"):
        return "nvfp4"
    if method == "compressed-tensors":
        return "fp8"  # the common FP8-dynamic checkpoints; int4 variants need an explicit spec
    return None
