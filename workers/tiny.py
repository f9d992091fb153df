"""`kvguard model tiny`: a small random LlamaForCausalLM in Hugging Face folder format.

Deterministic for a seed. Fixed shape (the planner example `examples/tiny-cpu.yaml` uses these
numbers): hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 320,
max_position_embeddings 4096, float32. Tokenizer: byte-level, 256 byte tokens + specials.
Weights are drawn larger than a trained model's init so that greedy outputs depend on the prompt
and on the K/V attention reads (the canary suite compares outputs to detect KV leaks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS_ID, EOS_ID, END_ID = 256, 257, 262
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def build_tokenizer() -> HFTokenizer:
    """Byte-level tokenizer: ids 0-255 are the bytes, 256+ the special tokens; prepends <|bos|>."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return tok


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights. std 0.3-ish projections and unit embeddings give peaked,
    prompt-dependent logits instead of the near-uniform ones of a 0.02 init."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(v, h, std=1.0), "model.norm.weight": torch.ones(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(heads * d, h, std=h**-0.5 * 2.0),
            p + "self_attn.k_proj.weight": normal(kv_heads * d, h, std=h**-0.5 * 2.0),
            p + "self_attn.v_proj.weight": normal(kv_heads * d, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, heads * d, std=(heads * d) ** -0.5),
            p + "mlp.gate_proj.weight": normal(i, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(i, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, i, std=i**-0.5),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    # Printable ASCII gets the large output rows so greedy text is readable; other bytes, the
    # specials and unused ids rarely win (generation mostly ends by max_tokens).
    row_scale = torch.full((v, 1), 0.3)
    row_scale[32:min(127, v)] = 3.0
    weights["lm_head.weight"] = normal(v, h, std=h**-0.5) * row_scale
    return weights


def write_random_model(model_dir: Path | str, overrides: dict, seed: int = 0) -> Path:
    """A random Llama of any shape (benchmarks): TINY_CONFIG with `overrides`, weights only
    (no tokenizer)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID], **overrides}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: t.contiguous() for k, t in random_weights(config, seed).items()}
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def tiny_model_files(seed: int = 0) -> dict[str, bytes]:
    """The tiny model's folder, file name -> content: config.json, generation_config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json. Same seed, same bytes."""
    config = {**TINY_CONFIG, "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID]}
    weights = {k: t.contiguous() for k, t in random_weights(config, seed).items()}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }

    def as_json(value: object) -> bytes:
        return (json.dumps(value, indent=2) + "\n").encode()

    return {
        "config.json": as_json(config),
        "generation_config.json": as_json({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID]}),
        "model.safetensors": save_bytes(weights, metadata={"format": "pt"}),
        "tokenizer.json": build_tokenizer().to_str(pretty=True).encode(),
        "tokenizer_config.json": as_json(tok_config),
    }


def write_tiny_model(model_dir: Path | str, seed: int = 0) -> Path:
    """Write the tiny model's files (`tiny_model_files`) into `model_dir` (created if missing)."""
    return write_files(model_dir, tiny_model_files(seed))


def write_files(folder: Path | str, files: dict[str, bytes]) -> Path:
    """Each file name -> content into `folder` (created if missing)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder
