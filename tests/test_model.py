"""The decoder against dense attention and against Hugging Face transformers (same weights)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvguard.workers.kv_pool import KVPool
from kvguard.workers.model import (
    AttentionBatch,
    CausalLM,
    ModelArgs,
    decode_plan,
    length_groups,
    load_model,
    paged_decode_attention,
)

transformers = pytest.importorskip("transformers")


def test_paged_attention_equals_dense_attention() -> None:
    torch.manual_seed(0)
    pages, page_size, kv_heads, heads, dim = 12, 4, 2, 4, 8
    kv_layer = torch.randn(2, pages, page_size, kv_heads, dim)
    seq_lens = torch.tensor([9, 3, 16])
    # Scattered, non-contiguous pages per request, padded with page 0 beyond each length.
    page_table = torch.tensor([[7, 2, 11, 0], [5, 0, 0, 0], [1, 9, 3, 6]])
    q = torch.randn(3, heads, dim)
    out = paged_decode_attention(q, kv_layer, page_table, seq_lens, scale=dim**-0.5)
    for b in range(3):
        n = int(seq_lens[b])
        k = kv_layer[0][page_table[b]].reshape(-1, kv_heads, dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
        v = kv_layer[1][page_table[b]].reshape(-1, kv_heads, dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b], k) * dim**-0.5
        dense = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b], dense, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ parity


def _pool_for(model: CausalLM, pages: int = 16, page_size: int = 4) -> KVPool:
    a = model.args
    return KVPool(num_layers=a.num_layers, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, page_size=page_size,
                  num_pages=pages, dtype=torch.float32, device=torch.device("cpu"))


def _prefill_logits(model: CausalLM, pool: KVPool, tokens: list[int], lease) -> torch.Tensor:
    n = len(tokens)
    batch = AttentionBatch(pool.slots(lease, 0, n), cu_seqlens=[0, n])
    hidden = model(torch.tensor(tokens), torch.arange(n), batch, pool.kv)
    return model.logits(hidden)


def _decode_logits(model: CausalLM, pool: KVPool, token: int, position: int, lease) -> torch.Tensor:
    pages = position // pool.page_size + 1
    batch = AttentionBatch(pool.slots(lease, position, position + 1),
                           page_table=lease.page_ids_t[None, :pages], seq_lens=torch.tensor([position + 1]))
    hidden = model(torch.tensor([token]), torch.tensor([position]), batch, pool.kv)
    return model.logits(hidden)[0]


def _save_hf(model_cls, config, path: Path, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(1)
    hf = model_cls(config).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02); bigger weights make the comparison meaningful
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(path, **save_kwargs)
    return hf


def _assert_parity(hf: torch.nn.Module, model_dir: Path, prompt_len: int = 13, decode_steps: int = 27) -> None:
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    model.init_rope(256, torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, model.args.vocab_size, (prompt_len + decode_steps,), generator=generator).tolist()
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].float()
    pool = _pool_for(model)
    lease = pool.allocate("parity", len(tokens))
    ours = _prefill_logits(model, pool, tokens[:prompt_len], lease)
    torch.testing.assert_close(ours, reference[:prompt_len], atol=1e-4, rtol=1e-4)
    for position in range(prompt_len, len(tokens)):  # step-by-step decode reads K/V from the pages
        step = _decode_logits(model, pool, tokens[position], position, lease)
        torch.testing.assert_close(step, reference[position], atol=1e-4, rtol=1e-4)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=256)


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
])
def test_llama_logits_match_transformers(tmp_path: Path, rope: dict | None) -> None:
    rope_parameters = {"rope_type": "default", "rope_theta": 500.0} if rope is None else {**rope, "rope_theta": 500.0}
    config = transformers.LlamaConfig(**SMALL, rope_parameters=rope_parameters, attn_implementation="eager")
    hf = _save_hf(transformers.LlamaForCausalLM, config, tmp_path)
    _assert_parity(hf, tmp_path)


def test_qwen2_bias_and_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, attn_implementation="eager")
    hf = _save_hf(transformers.Qwen2ForCausalLM, config, tmp_path)
    args = ModelArgs.from_dir(tmp_path)
    assert args.qkv_bias and not args.o_bias and args.tie_word_embeddings
    _assert_parity(hf, tmp_path)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_the_configs_activation_is_the_one_used(tmp_path: Path, act: str) -> None:
    """hidden_act was read by nobody: every checkpoint ran SiLU (a gelu Llama diverged at token 0)."""
    config = transformers.LlamaConfig(**SMALL, hidden_act=act, attn_implementation="eager")
    hf = _save_hf(transformers.LlamaForCausalLM, config, tmp_path)
    _assert_parity(hf, tmp_path, prompt_len=7, decode_steps=5)


def test_mistral_within_its_window_matches_and_beyond_it_is_refused(tmp_path: Path) -> None:
    """Transformers' Mistral masks attention to `sliding_window`; this engine attends to every
    token, so it serves no longer context (the difference showed from the window's first token)."""
    from kvguard.workers.config import EngineConfig
    from kvguard.workers.engine import Engine
    from kvguard.workers.tiny import write_tiny_model

    config = transformers.MistralConfig(**SMALL, sliding_window=64, attn_implementation="eager")
    hf = _save_hf(transformers.MistralForCausalLM, config, tmp_path)
    assert ModelArgs.from_dir(tmp_path).sliding_window == 64
    _assert_parity(hf, tmp_path, prompt_len=40, decode_steps=24)  # 64 tokens: the window is the whole history
    for name in ("tokenizer.json", "tokenizer_config.json"):  # Engine needs a tokenizer: the tiny model's
        (tmp_path / name).write_bytes((write_tiny_model(tmp_path / "tiny", seed=0) / name).read_bytes())
    with pytest.raises(ValueError, match="sliding_window 64: sliding-window attention is not implemented"):
        Engine(EngineConfig(tmp_path, device="cpu", kv_pool_tokens=512, context_length=65))


CONFIG_REFUSALS = [  # each named before the weights load, not a traceback once the rope tables are built
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor: is required for rope type linear"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": None}}, "rope_scaling.factor: is required"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "four"}}, "rope_scaling.factor: must be a number, got 'four'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ({"hidden_act": "gelu_fast2"}, "hidden_act: 'gelu_fast2' is not supported"),
]


@pytest.mark.parametrize("change, message", CONFIG_REFUSALS)
def test_a_config_the_engine_would_compute_wrongly_or_crash_on_is_refused_by_field(change: dict, message: str) -> None:
    config = {"model_type": "llama", **SMALL, **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelArgs.from_hf_config(config)


def test_untied_weights_without_lm_head_are_missing_not_tied(tmp_path: Path) -> None:
    """An untied checkpoint missing lm_head.weight loaded with the embeddings as its output layer."""
    from safetensors.torch import load_file, save_file

    _save_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, tie_word_embeddings=False), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing=\\['lm_head.weight'\\]"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_generation_configs_end_tokens_end_a_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    """generate() and vLLM stop at generation_config.json's eos ids too (Llama 3 Instruct's
    end-of-turn token is only there); this engine generated past them."""
    import shutil

    from kvguard.workers.config import EngineConfig
    from kvguard.workers.engine import Engine
    from kvguard.workers.request import SamplingParams

    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=False)
    plain = Engine(EngineConfig(model_dir, device="cpu", kv_pool_tokens=512, context_length=128))
    tokens = plain.generate([[5, 6, 7]], params)[0].output_ids
    assert len(tokens) >= 2
    stop_at = tokens[len(tokens) // 2]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, stop_at]}))
    engine = Engine(EngineConfig(model_dir, device="cpu", kv_pool_tokens=512, context_length=128))
    assert stop_at in engine.eos_token_ids
    assert engine.generate([[5, 6, 7]], params)[0].output_ids == tokens[:tokens.index(stop_at) + 1]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match="generation_config.json eos_token_id"):
        Engine(EngineConfig(model_dir, device="cpu", kv_pool_tokens=512, context_length=128))


def test_sharded_safetensors_load_like_single_file(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**SMALL, attn_implementation="eager")
    _save_hf(transformers.LlamaForCausalLM, config, tmp_path / "single")
    hf = _save_hf(transformers.LlamaForCausalLM, config, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = load_model(tmp_path / "single", torch.device("cpu"), torch.float32).state_dict()
    sharded = load_model(tmp_path / "sharded", torch.device("cpu"), torch.float32).state_dict()
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(sharded[name], tensor)
    _assert_parity(hf, tmp_path / "sharded", prompt_len=5, decode_steps=3)


def test_missing_weight_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(**SMALL)
    _save_hf(transformers.LlamaForCausalLM, config, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


# -------------------------------------------------------------------------------- tiny model


def test_tiny_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    from kvguard.cli import main

    assert main(["model", "tiny", str(tmp_path / "a"), "--seed", "7"]) == 0
    assert main(["model", "tiny", str(tmp_path / "b"), "--seed", "7"]) == 0
    assert main(["model", "tiny", str(tmp_path / "c"), "--seed", "8"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"], config["max_position_embeddings"]) == (64, 2, 4, 2, 16, 128, 320, 4096)


def test_tiny_model_keeps_what_a_folder_already_holds_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvguard.cli import main

    folder = tmp_path / "real-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 4096}')
    (folder / "notes.txt").write_text("mine")
    assert main(["model", "tiny", str(folder)]) == 2
    assert "already holds config.json with other content; nothing was written (--force replaces them)" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "notes.txt"]  # not one file written
    assert main(["model", "tiny", str(folder), "--force"]) == 0
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 64 and (folder / "notes.txt").read_text() == "mine"
    assert main(["model", "tiny", str(folder)]) == 0  # the same files again: nothing to protect
    assert main(["model", "tiny", str(folder), "--seed", "3"]) == 2  # other weights
    assert "model.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize(("folder", "why"), [("/etc/passwd/x", "Not a directory"), ("/proc/x", "No such file or directory")])
def test_a_folder_that_cannot_be_created_is_bad_input_in_one_line(capsys: pytest.CaptureFixture[str], folder: str, why: str) -> None:
    """Outside probe: `model tiny /proc/x` was exit 1 with "No such file or directory: /proc/x"
    (bad input, exit 2, as a DIR that is a file is)."""
    from kvguard.cli import main

    assert main(["model", "tiny", folder]) == 2
    assert capsys.readouterr().err == f"kvguard model: cannot create the folder {folder}: {why}; nothing was written\n"


def test_tiny_model_loads_in_transformers_with_same_logits(tiny_model_dir: Path) -> None:
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    _assert_parity(hf, tiny_model_dir, prompt_len=9, decode_steps=4)


def test_tiny_tokenizer_round_trips_and_renders_chat(tiny_model_dir: Path) -> None:
    from kvguard.workers.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok is not None
    ids = tok.encode("héllo, wörld")
    assert ids[0] == 256 and tok.decode(ids) == "héllo, wörld"
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat == "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:2] == [256, 260]


def test_the_last_token_releases_bytes_that_never_completed_a_character(tiny_model_dir: Path) -> None:
    """A completion that ends inside a UTF-8 character still returns those bytes (as U+FFFD, as
    the tokenizer decodes them): its text is the decode of its tokens, never silently shorter."""
    from kvguard.workers.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok is not None
    ids = tok.encode("a€")[1:]  # skip BOS: 'a', then the euro sign's three bytes
    held = IncrementalDetokenizer(tok)
    assert [held.push(i) for i in ids[:3]] == ["a", "", ""]  # an incomplete character is held back
    ends = IncrementalDetokenizer(tok)
    text = "".join(ends.push(i, final=n == 2) for n, i in enumerate(ids[:3]))
    assert text == tok.decode(ids[:3]) and text.startswith("a\ufffd")
    whole = IncrementalDetokenizer(tok)
    assert "".join(whole.push(i, final=n == 3) for n, i in enumerate(ids)) == "a€"


def _straddling_tokenizer(tiny_model_dir: Path, into: Path):  # type: ignore[no-untyped-def]
    """The tiny tokenizer with one more merged token, bytes 82 AC E2: the end of one euro sign and
    the start of the next, as byte-level vocabularies (cl100k, Llama-3, Qwen2) cut CJK runs."""
    import shutil

    from kvguard.workers.tokenizer import Tokenizer, _bytes_to_unicode

    shutil.copytree(tiny_model_dir, into)
    as_text = _bytes_to_unicode()
    spelled = lambda raw: "".join(as_text[b] for b in raw)  # noqa: E731
    data = json.loads((into / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab.update({added["content"]: added["id"] for added in data["added_tokens"]})  # ids below the new ones
    vocab[spelled(b"\x82\xac")], vocab[spelled(b"\x82\xac\xe2")] = 263, 264
    data["model"]["merges"] = [[spelled(b"\x82"), spelled(b"\xac")], [spelled(b"\x82\xac"), spelled(b"\xe2")]]
    (into / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_dir(into)
    assert tok is not None and tok.decode([0xE2, 264, 0x82, 0xAC]) == "\u20ac" * 2
    return tok


@pytest.mark.parametrize("run", [3, 11, 40, 300])
def test_text_straddling_every_token_boundary_streams_as_it_decodes(tiny_model_dir: Path, tmp_path: Path, run: int) -> None:
    """Every token ends inside a character: nothing decodes cleanly until the last. Past 8 held
    tokens the tail went out as U+FFFD and a valid character was lost for good (outside probe:
    twelve euro signs streamed as eight, two U+FFFD and two more, and a stop string across them was missed).
    Now the complete characters go out, one per token once past 8, and the text is the decode of
    the tokens; past MAX_WINDOW_TOKENS (256) in a row the bounded window gives up exactness."""
    from kvguard.workers.tokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer

    tok = _straddling_tokenizer(tiny_model_dir, tmp_path / "straddle")
    ids = [0xE2, *[264] * run, 0x82, 0xAC]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i, final=n == len(ids) - 1) for n, i in enumerate(ids)]
    if run + 3 <= MAX_WINDOW_TOKENS:
        assert "".join(deltas) == tok.decode(ids) == "\u20ac" * (run + 1)
        assert all("\ufffd" not in d for d in deltas)
        if run > 8:
            assert all(d == "\u20ac" for d in deltas[10:run]), deltas  # a character a token, not all at the end
        mid = IncrementalDetokenizer(tok)  # ended mid-character: the held bytes go out as the tokenizer decodes them
        assert "".join(mid.push(i, final=n == run) for n, i in enumerate(ids[: run + 1])) == tok.decode(ids[: run + 1])
    else:  # past the window: bounded work, and U+FFFD where the window was cut (as before for any run past 8)
        assert len("".join(deltas)) >= run + 1


def _sentencepiece_like(decoder: str):  # type: ignore[no-untyped-def]
    """A Llama-2/Mistral/Gemma-shaped vocabulary (pieces with a leading '▁', byte fallback), with
    one of their three decoders: Strip removes the text's first space, as Metaspace(first) does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from kvguard.workers.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({"▁Hello": 259, "▁hello": 260, "▁world": 261})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    fallback = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = {"strip": decoders.Sequence([*fallback, decoders.Strip(" ", 1, 0)]),
                  "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),  # no fallback
                  "plain": decoders.Sequence(fallback)}[decoder]  # fmt: skip
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("decoder", ["strip", "metaspace", "plain"])
def test_the_first_token_keeps_its_space_as_the_whole_decode_has_it(decoder: str) -> None:
    """A completion is the decode of prompt and output together, less the prompt's (as vLLM and HF
    pipelines cut it). Decoded alone, '▁hello' under a decoder that strips the text's first space
    lost it: 'hello world' after 'Hello', so echo read 'Hellohello', text_offset disagreed with the
    text and stop=[' hello'] never fired (outside probe). The prompt's last tokens are context now."""
    from kvguard.workers.tokenizer import IncrementalDetokenizer

    tok = _sentencepiece_like(decoder)
    euro = [] if decoder == "metaspace" else [3 + 0xE2, 3 + 0x82, 3 + 0xAC]  # three byte-fallback tokens
    prompt, out = [1, 259], [260, 261, *euro]  # <s> Hello | hello world
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.push(i, final=n == len(out) - 1) for n, i in enumerate(out))
    assert text == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " hello world" + ("€" if euro else "")
    assert "".join(IncrementalDetokenizer(tok).push(i) for i in out[:1]) in ("hello", " hello")  # alone: the decoder's call


def test_joined_deltas_are_the_decode_of_the_tokens_for_any_bytes(tiny_model_dir: Path) -> None:
    """Random byte-level runs (whole and cut characters, stray continuation and lead bytes, literal
    U+FFFD, special tokens), under MAX_WINDOW_TOKENS: the joined deltas are decode(ids). The review's
    fuzz found a U+FFFD sent twice when the window's held tail reached back into text already sent."""
    import random

    from kvguard.workers.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok is not None
    rng = random.Random(0)
    pieces = [list("é中😀�".encode()), [0x61], [0x82], [0xE2], [0xF0, 0x9F], [256]]
    for _ in range(400):
        ids = [b for _ in range(rng.randrange(1, 60)) for b in rng.choice(pieces)]
        detok = IncrementalDetokenizer(tok, [97, 98])
        ends_with_finish = rng.random() < 0.3
        text = "".join(detok.push(i, final=n == len(ids) - 1 and not ends_with_finish) for n, i in enumerate(ids))
        text += detok.finish() if ends_with_finish else ""
        assert text == tok.decode([97, 98] + ids)[len(tok.decode([97, 98])):], ids


def _with_template(tiny_model_dir: Path, into: Path, template: str):  # type: ignore[no-untyped-def]
    """The tiny model's tokenizer with `template`, as kvguard and as transformers read it, and its config."""
    import shutil

    from transformers import AutoTokenizer

    from kvguard.workers.tokenizer import Tokenizer

    shutil.copytree(tiny_model_dir, into)
    config = json.loads((into / "tokenizer_config.json").read_text())
    (into / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    ours = Tokenizer.from_dir(into)
    assert ours is not None
    return ours, AutoTokenizer.from_pretrained(into), config


ALTERNATING = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
               "{{ m['content'] }}{{ pad_token }}{% endfor %}")  # fmt: skip


def test_a_chat_template_renders_as_transformers_renders_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A template that refuses a conversation with raise_exception (Mistral's, when roles do not
    alternate) failed with "'raise_exception' is undefined", and one writing pad_token got an empty
    string: transformers passes every special token and that function (outside probe)."""
    from jinja2 import TemplateError

    ours, theirs, config = _with_template(tiny_model_dir, tmp_path / "alternating", ALTERNATING)
    fine = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ours.render_chat(fine) == theirs.apply_chat_template(fine, tokenize=False, add_generation_prompt=True)
    assert config.get("pad_token") and str(config["pad_token"]) in ours.render_chat(fine)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        ours.render_chat(twice)
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        theirs.apply_chat_template(twice, tokenize=False)


EXTRAS = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
          "{% else %}{{ m | tojson }}{% endif %}{% endfor %}")  # fmt: skip


def test_a_chat_template_gets_transformers_jinja_extras(tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers renders with loop controls, its {% generation %} block and a tojson that keeps
    '<', '&' and non-ASCII as they are and keys in order: a template with `continue` or
    `generation` was a 400 for every chat, and jinja's own tojson gave the model another prompt
    ('<b>' as '\\u003cb\\u003e': 81 prompt tokens where HF has 52; outside probe)."""
    ours, theirs, _ = _with_template(tiny_model_dir, tmp_path / "extras", EXTRAS)
    messages = [{"role": "system", "content": "skipped"}, {"role": "user", "content": "Say <b> & '\u00e9'"},
                {"role": "assistant", "content": "ok {\"k\": 1}"}]  # fmt: skip
    rendered = ours.render_chat(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<b> & '\u00e9'" in rendered and "skipped" not in rendered


THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")  # fmt: skip


def test_a_chat_template_gets_the_requests_variables_as_transformers_passes_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) and add_generation_prompt: rendered as
    transformers' apply_chat_template renders them with the same keyword arguments."""
    from kvguard.workers.tokenizer import ChatTemplateOptions

    ours, theirs, _ = _with_template(tiny_model_dir, tmp_path / "thinking", THINKING)
    messages = [{"role": "user", "content": "a"}]
    for generation_prompt in (True, False):
        for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            options = ChatTemplateOptions(add_generation_prompt=generation_prompt, variables=variables)
            assert ours.render_chat(messages, options) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **variables)
    assert ours.render_chat(messages, ChatTemplateOptions(variables={"enable_thinking": False})).endswith("<think></think>")


def test_length_groups_split_only_where_padding_costs_more_than_a_group() -> None:
    assert length_groups([10, 10, 9, 9], overhead_pages=8) == [(0, 4, 10)]  # padding saved is small
    assert length_groups([40, 38, 5, 4, 3], overhead_pages=8) == [(0, 2, 40), (2, 5, 5)]
    assert length_groups([7], overhead_pages=0) == [(0, 1, 7)]


def test_grouped_paged_attention_equals_one_group() -> None:
    torch.manual_seed(3)
    kv_layer = torch.randn(2, 20, 4, 2, 8)
    page_table = torch.tensor([[3, 7, 1, 9, 12], [4, 2, 11, 0, 0], [5, 0, 0, 0, 0], [6, 0, 0, 0, 0]])
    seq_lens = torch.tensor([19, 10, 3, 4])
    q = torch.randn(4, 4, 8)
    whole = paged_decode_attention(q, kv_layer, page_table, seq_lens, scale=0.3)
    plan = decode_plan(page_table, seq_lens, 4, length_groups([5, 3, 1, 1], overhead_pages=1))
    assert len(plan.groups) == 3
    torch.testing.assert_close(paged_decode_attention(q, kv_layer, page_table, seq_lens, 0.3, plan), whole)


def test_tiny_model_refuses_an_empty_dir_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Outside probe: `model tiny ''` wrote into the working folder; a file as DIR was exit 1."""
    from kvguard.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["model", "tiny", ""]) == 2 and not list(tmp_path.iterdir())
    (tmp_path / "a-file").write_text("x")
    assert main(["model", "tiny", "a-file"]) == 2 and (tmp_path / "a-file").read_text() == "x"
    err = capsys.readouterr().err
    assert "DIR is empty" in err and "a-file is not a folder" in err


# Llama 3.1's template writes a variable of the request's with tojson(indent=4), so at many times
# the size it was sent at (nested lists: indentation grows with depth).
WRITES_TOOLS = ("{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
                "{% for t in tools or [] %}{{ t | tojson(indent=4) }}{% endfor %}"
                "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}")  # fmt: skip


def test_a_bounded_chat_render_stops_once_past_its_bound_and_is_render_below_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A review: 0.3 MB of chat_template_kwargs rendered to 52 MB of prompt text under such a
    template. With `max_chars`, rendering stops once past it; below it, the text is render()'s."""
    from kvguard.workers.tokenizer import ChatTemplateOptions, PromptTooLong

    ours, _, _ = _with_template(tiny_model_dir, tmp_path / "tools", WRITES_TOOLS)
    messages = [{"role": "user", "content": "a"}]
    tools = [json.loads("[" * 60 + "]" * 60)] * 50
    pieces: list[int] = []
    template = ours._chat_template
    generate = template.generate
    template.generate = lambda *a, **kw: (pieces.append(len(p)) or p for p in generate(*a, **kw))  # type: ignore[method-assign]
    with pytest.raises(PromptTooLong) as refused:
        ours.render_chat(messages, ChatTemplateOptions(variables={"custom_tools": tools}, max_chars=4096))
    unbounded = ours.render_chat(messages, ChatTemplateOptions(variables={"custom_tools": tools}))
    assert refused.value.at_least > 4096 and len(unbounded) > 100 * 4096 and len(pieces) < 5, pieces
    small = ChatTemplateOptions(variables={"custom_tools": [[1]]})
    assert ours.render_chat(messages, replace(small, max_chars=10_000)) == ours.render_chat(messages, small)
