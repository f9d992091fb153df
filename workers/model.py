"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes its K/V in the paged pool.

Module and parameter names mirror Hugging Face's so a checkpoint's state dict loads as is.
Attention never keeps K/V of its own: every layer writes the new tokens' K/V into the pool at
`slot_mapping` and, when decoding, reads the history back through the request's page table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    """The architecture read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    """The gated MLP's activation (ACTIVATIONS)."""
    sliding_window: int | None = None
    """Mistral's attention window: the engine attends to everything, so it serves no context
    longer than this (Engine refuses one)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Raises ValueError naming the field of config.json that is missing or of the wrong type."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json: must be a JSON object, got {type(cfg).__name__}")
        try:
            return cls._from_hf_config(cfg)
        except KeyError as exc:
            raise ValueError(f"config.json {exc.args[0]}: is required") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        heads, hidden = _number(cfg, "num_attention_heads", int), _number(cfg, "hidden_size", int)
        kv_heads = _number(cfg, "num_key_value_heads", int, heads)
        if heads % kv_heads:  # every query head reads one K/V head: a whole group each
            raise ValueError(f"config.json num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
        act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"config.json hidden_act: {str(act)[:40]!r} is not supported ({', '.join(ACTIVATIONS)})")
        # Transformers' Mistral masks to the window whenever it is set; Qwen2 only with use_sliding_window.
        window = _number(cfg, "sliding_window", int, 0) if model_type == "mistral" else 0
        # transformers >= 5 nests theta and scaling under rope_parameters; older configs use
        # rope_theta + rope_scaling at top level.
        rope_field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        if not isinstance(rope := cfg.get(rope_field) or {}, dict):
            raise ValueError(f"config.json {rope_field}: must be an object, got {rope!r}")
        rope = dict(rope)
        theta = _number({"rope_theta": rope.pop("rope_theta", cfg.get("rope_theta"))}, "rope_theta", float, 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else _checked_rope_scaling({**rope, "rope_type": rope_type}, rope_field)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=_number(cfg, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_number(cfg, "intermediate_size", int),
            num_layers=_number(cfg, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_number(cfg, "head_dim", int, hidden // heads),
            rms_norm_eps=_number(cfg, "rms_norm_eps", float, 1e-6),
            max_position_embeddings=_number(cfg, "max_position_embeddings", int, 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            hidden_act=act,
            sliding_window=window or None,
        )

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelArgs:
        """Raises OSError (no config.json) or ValueError (one that is not JSON, or a field wrong)."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_hf_config(raw)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _number(cfg: dict[str, Any], name: str, kind: type[int] | type[float], default: float | None = None) -> Any:
    """cfg[name] as `kind` (absent or null: `default`, else required), naming the field when wrong.
    Every number read this way is a size, a count or an epsilon: it must be above 0."""
    value = cfg.get(name)
    if value is None:
        if default is None:
            raise KeyError(name)
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (kind is int and value != int(value)):
        raise ValueError(f"config.json {name}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value <= 0:
        raise ValueError(f"config.json {name}: must be above 0, got {value!r}")
    return kind(value)


ACTIVATIONS: dict[str, Any] = {
    # transformers' ACT2FN names for the activations Llama-family checkpoints use
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

_ROPE_NUMBERS = {  # rope type -> (required, optional) numbers, each above 0
    "linear": (("factor",), ()),
    "llama3": (("factor",), ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "yarn": ((), ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow")),
}


def _checked_rope_scaling(scaling: dict[str, Any], where: str) -> dict[str, Any]:
    """The rope scaling, its numbers checked here (they were read only when the rope tables were
    built, after the weights had loaded: a missing factor was a KeyError traceback)."""
    kind = scaling["rope_type"]
    if kind not in _ROPE_NUMBERS:
        raise ValueError(f"config.json {where}: rope type {str(kind)[:40]!r} is not supported (default, {', '.join(_ROPE_NUMBERS)})")
    required, optional = _ROPE_NUMBERS[kind]
    for name in (*required, *optional):
        if name in required or scaling.get(name) is not None:
            try:
                _number(scaling, name, float)
            except KeyError:
                raise ValueError(f"config.json {where}.{name}: is required for rope type {kind}") from None
            except ValueError as exc:
                raise ValueError(str(exc).replace("config.json ", f"config.json {where}.", 1)) from None
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise ValueError(f"config.json {where}: llama3's low_freq_factor and high_freq_factor must differ")
    return scaling


def generation_eos_ids(model_dir: Path | str) -> tuple[int, ...]:
    """`generation_config.json`'s eos_token_id (one or a list): Hugging Face's generate() and vLLM
    stop at these too (Llama 3 Instruct ships its end-of-turn token only there)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{path}: not a JSON object") from None
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path} eos_token_id: must be a token id or a list of them, got {str(eos)[:80]}")
    return tuple(ids)


# ---------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (yarn's attention factor), as transformers does."""
    dim = args.head_dim
    base = args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, args.max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(args, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any], max_pos: int) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", max_pos))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(args: ModelArgs, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    dim, base = args.head_dim, args.rope_theta
    original = float(s.get("original_max_position_embeddings") or args.max_position_embeddings)
    factor = float(s.get("factor") or args.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(args: ModelArgs, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, head_dim]` in float32."""
    inv_freq, scale = rope_inv_freq(args)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# ----------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) of the batch, gathered and attended together over `pages` pages."""

    start: int
    end: int
    pages: int
    index: torch.Tensor  # [(end - start) * pages] page ids, row-major
    visible: torch.Tensor  # [end - start, 1, 1, pages * page_size] bool: slot position < seq_len


@dataclass(frozen=True)
class DecodePlan:
    """What every layer's decode attention shares within one step, computed once per step rather
    than once per layer: per group of rows, the flattened page table to gather K/V pages with and
    which gathered slots each request may see."""

    groups: tuple[DecodeGroup, ...]


def decode_plan(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                bounds: Sequence[tuple[int, int, int]] | None = None) -> DecodePlan:
    """`bounds`: (start, end, pages) row groups (see `length_groups`); default one group."""
    batch, width = page_table.shape
    groups = []
    for start, end, pages in bounds or [(0, batch, width)]:
        positions = torch.arange(pages * page_size, device=page_table.device)
        visible = positions[None, :] < seq_lens[start:end, None]
        index = page_table[start:end, :pages].reshape(-1)
        groups.append(DecodeGroup(start, end, pages, index, visible[:, None, None, :]))
    return DecodePlan(tuple(groups))


def length_groups(pages: Sequence[int], overhead_pages: float) -> list[tuple[int, int, int]]:
    """Split decode rows sorted by page count (longest first) into contiguous groups, so short
    requests are not padded to the longest one's length. Attention work is rows x pages per group;
    a group costs about `overhead_pages` page-rows more (its gather and attention calls), so a new
    group starts where the padding it avoids for the remaining rows exceeds that. Linear, greedy."""
    groups, start = [], 0
    for i in range(1, len(pages)):
        if (pages[start] - pages[i]) * (len(pages) - i) > overhead_pages:
            groups.append((start, i, pages[start]))
            start = i
    if pages:
        groups.append((start, len(pages), pages[start]))
    return groups


@dataclass
class AttentionBatch:
    """Where one forward pass writes and reads K/V.

    `slot_mapping[t]` is the flat pool slot (`page * page_size + offset`) that token t's K/V goes
    to. The pass holds prefill tokens first, then decode tokens; either part may be empty.
    Prefill: `cu_seqlens` delimits each request's tokens (python ints, starting at 0), and
    attention is causal within each request over its fresh K/V. Decode: the remaining tokens, one
    per request; `page_table[b]` lists the request's pages (padded), `seq_lens[b]` the tokens to
    attend to including the new one.
    """

    slot_mapping: torch.Tensor
    cu_seqlens: list[int] | None = None
    page_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    decode_groups: list[tuple[int, int, int]] | None = None  # `length_groups`; None: one group
    _plan: DecodePlan | None = field(default=None, repr=False)

    def plan(self, page_size: int) -> DecodePlan:
        """The step's decode plan, built by the first layer and reused by the others."""
        if self._plan is None:
            assert self.page_table is not None and self.seq_lens is not None
            self._plan = decode_plan(self.page_table, self.seq_lens, page_size, self.decode_groups)
        return self._plan


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query token per request against its paged K/V history.

    q: [B, heads, head_dim]; kv_layer: [2, pages, page_size, kv_heads, head_dim];
    page_table: [B, P] page ids; seq_lens: [B]. Returns [B, heads, head_dim].
    Pages are gathered with `index_select` (a row copy per page; advanced indexing costs about twice
    as much on CPU), per group of rows of similar length. Grouped-query attention is folded into
    the query axis -- the `g` query heads that share a KV head attend as `g` query rows of that
    head -- so K/V are never repeated per query head.
    """
    page_size, kv_heads, head_dim = kv_layer.shape[2:]
    plan = plan or decode_plan(page_table, seq_lens, page_size)
    outs = []
    for group in plan.groups:
        rows, length = group.end - group.start, group.pages * page_size
        k = kv_layer[0].index_select(0, group.index).view(rows, length, kv_heads, head_dim).transpose(1, 2)
        v = kv_layer[1].index_select(0, group.index).view(rows, length, kv_heads, head_dim).transpose(1, 2)
        grouped = q[group.start : group.end].view(rows, kv_heads, -1, head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=group.visible, scale=scale)
        outs.append(out.reshape(rows, -1, head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one request over its own fresh K/V. q: [T, heads, d]; k, v: [T, kv_heads, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


# -------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass
class FusedLinear:
    """Linear layers that read the same input, run as one matmul (vLLM's QKV / gate-up merge):
    fewer, larger kernels per layer. The layers' own parameters become views of the fused weight,
    so the checkpoint's names still resolve and memory is not doubled."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, *layers: nn.Linear) -> FusedLinear:
        weight = torch.cat([layer.weight for layer in layers])
        bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
        start = 0
        for layer in layers:
            rows = layer.weight.shape[0]
            layer.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
        return cls(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=args.o_bias)

        self.qkv: FusedLinear | None = None

    def fuse(self) -> None:
        self.qkv = FusedLinear.of(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        assert self.qkv is not None, "load_model() fuses the projections"
        tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv(x).view(tokens, heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, : heads + self.num_kv_heads], cos, sin)  # q and k heads rotate alike
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + self.num_kv_heads :]
        flat = kv_layer.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, batch.slot_mapping, k)
        flat[1].index_copy_(0, batch.slot_mapping, v)
        bounds = batch.cu_seqlens or [0]
        parts = [dense_causal_attention(q[a:b], k[a:b], v[a:b], self.scale) for a, b in zip(bounds[:-1], bounds[1:])]
        if batch.page_table is not None:
            assert batch.seq_lens is not None
            plan = batch.plan(kv_layer.shape[2])
            parts.append(paged_decode_attention(q[bounds[-1]:], kv_layer, batch.page_table, batch.seq_lens, self.scale, plan))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[args.hidden_act]
        self.gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        self.gate_up = FusedLinear.of(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up is not None, "load_model() fuses the projections"
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # `_weight` skips nn.Embedding's random init, which on the meta device runs a Python
        # decomposition that imports torch._dynamo: ~2.4 s of every worker's start-up. The
        # weights are always loaded from the checkpoint (load_model) anyway.
        weight = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder. `forward` runs one batch (prefill or decode) against the paged pool `kv`
    (`[layers, 2, pages, page_size, kv_heads, head_dim]`) and returns final hidden states."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        self.rope_cos, self.rope_sin = rope_cos_sin(self.args, max_positions, device)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor
    ) -> torch.Tensor:
        assert self.rope_cos is not None and self.rope_sin is not None, "call init_rope() first"
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv[i], batch)
        return self.model.norm(x).to(dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of hidden states."""
        return self.lm_head(hidden).float()


# ------------------------------------------------------------------------------------- loading


def _read_state_dict(model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(model_dir / name), device=str(device)))
        except (SafetensorError, ValueError) as exc:  # a worker's one line, not a traceback
            raise ValueError(f"{model_dir / name}: not a readable safetensors file ({exc})") from None
    return state


def load_model(model_dir: Path | str, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build the decoder for `model_dir/config.json` and load its safetensors weights (single
    file or sharded with `model.safetensors.index.json`). Fails on missing or unknown tensors."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(args)
    state = {k: v for k, v in _read_state_dict(model_dir, device).items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_word_embeddings:  # untied without lm_head.weight is a missing tensor, not a tied one
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v.to(dtype) for k, v in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # a tensor of another shape than config.json gives it
        raise ValueError(f"{model_dir}: weights do not match config.json: {str(exc).strip().splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match config.json: missing={missing} unexpected={unexpected}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.fuse()
        layer.mlp.fuse()
    return model.eval().requires_grad_(False)
