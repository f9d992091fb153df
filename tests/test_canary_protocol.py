"""The canary's reading of any OpenAI-compatible server: SSE endings, finish reasons, where the
context length comes from, SGLang KV-canary log lines, and the logprob comparison."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai.types
import openai.types.chat
import pytest
from aiohttp import web

from kvguard.operator.canary import CanarySpec, ProbeName, ProbeStatus, Verdict, run_suite
from kvguard.operator.canary.client import Completion, EngineClient, premature_length_finish
from kvguard.operator.canary.discovery import ContextReading, choose_context_length, context_notes, readings_from_sglang_info
from kvguard.operator.canary.engine_logs import appended_text, log_offsets, parse_violations
from kvguard.operator.canary.logprob_compare import compare, judge, text_contradiction
from kvguard.operator.canary.responses import TokenLogprob, parse_body, token_logprobs

# --- SSE, as the OpenAI clients read it ---------------------------------------------------------

TEXT = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
FINISH = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
USAGE_ONLY = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
STREAMS: dict[str, list[str]] = {
    "finish_then_done": [json.dumps(TEXT), json.dumps(FINISH), "[DONE]"],  # vLLM, SGLang, ours
    "finish_no_done": [json.dumps(TEXT), json.dumps(FINISH)],  # transformers serve
    "finish_usage_done": [json.dumps(TEXT), json.dumps({**FINISH, "usage": None}), json.dumps(USAGE_ONLY), "[DONE]"],
    "done_no_finish": [json.dumps(TEXT), "[DONE]"],
    "eof_no_finish": [json.dumps(TEXT)],
}


@pytest.fixture
async def sse_server() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in STREAMS[request.match_info["name"]]:
            await resp.write(f"data: {frame}\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/{name}/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    await runner.cleanup()


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("finish_then_done", None),
        ("finish_no_done", None),
        ("finish_usage_done", None),
        ("done_no_finish", "stream cut short: 1 data frame(s), 1 text chunk(s), no choice carried a finish_reason, then data: [DONE]"),
        ("eof_no_finish", "stream cut short: 1 data frame(s), 1 text chunk(s), no choice carried a finish_reason, then the connection closed"),
    ],
)
async def test_a_stream_is_complete_once_a_choice_has_a_finish_reason(sse_server: str, name: str, error: str | None) -> None:
    async with aiohttp.ClientSession() as session:
        out = await EngineClient(session, f"{sse_server}/{name}", model="m").complete("p", max_tokens=2, stream=True)
    assert out.error == error
    if error is None:
        assert (out.text, out.finish_reason, out.completion_tokens) == ("ab", "length", 2)


def test_finish_reason_length_before_max_tokens_is_sglang_33507() -> None:
    def result(completion: int, prompt: int | None = 10) -> Completion:
        return Completion(label="x", status=200, finish_reason="length", completion_tokens=completion, prompt_tokens=prompt, max_tokens=8)

    assert premature_length_finish(result(8), 1024) is None
    problem = premature_length_finish(result(3), 1024)
    assert problem and "after 3 of max_tokens=8" in problem and "sglang#33507" in problem
    assert premature_length_finish(result(3, prompt=1021), 1024) is None  # it stopped at the context length
    assert premature_length_finish(Completion(label="x", finish_reason="stop", completion_tokens=1, max_tokens=8), None) is None
    assert premature_length_finish(Completion(label="x", finish_reason="length", max_tokens=8), None) is None  # no usage: unknowable


# --- context length ---------------------------------------------------------------------------


def test_context_length_precedence_and_disagreement_notes() -> None:
    advertised = [ContextReading("/v1/models max_model_len", 4096), ContextReading("/server_info context_length", 4096)]
    assert choose_context_length(None, advertised) == advertised[0]
    configured = ContextReading("--context-length", 2048)
    assert choose_context_length(configured, advertised) == configured
    assert context_notes(configured, advertised)[0] == "/v1/models max_model_len says 4096 tokens; the suite uses 2048 from --context-length"
    assert choose_context_length(None, []) is None
    # Outside probe: /v1/models said 8192 over engines of 4096, answering the requests in between
    # with 200; sized from 8192 the suite never sent one. The smallest value binds.
    lying = [ContextReading("/v1/models max_model_len", 8192), ContextReading("kvguard_context_length_tokens", 4096)]
    assert choose_context_length(None, lying) == lying[1]
    assert choose_context_length(ContextReading("--context-length", 8192), lying) == lying[1]
    readings, version = readings_from_sglang_info("/server_info", {"context_length": 131072, "version": "0.5.23"})
    assert readings == [ContextReading("/server_info context_length", 131072)] and version == "0.5.23"
    assert readings_from_sglang_info("/server_info", {"context_length": None})[0] == []  # unresolved: say nothing


async def test_spec_context_length_sizes_the_probes_of_a_server_that_advertises_none() -> None:
    from test_canary_fakes import Behaviour, RunningServer

    with RunningServer(Behaviour(context_length=512, metrics_style="none", advertise_context=False)) as server:
        report = await run_suite(server.url, CanarySpec(context_length=512).only([ProbeName.OVER_LENGTH]))
    assert (report.target.context_length, report.target.context_length_source) == (512, "spec.canary.contextLength")
    assert report.probe(ProbeName.OVER_LENGTH).status == ProbeStatus.PASS  # type: ignore[union-attr]


# --- SGLang's KV canary log -------------------------------------------------------------------

# The structured line as sglang 0.5.23's violation_reporter formats it, behind a logging prefix.
SGLANG_LINE = (
    "[2026-11-30 10:00:00 TP0] WARNING violation_reporter.py:63: kv_canary violation: launch_tag=TAIL_K_FULL "
    "fail_reason=verify_chain slot_idx=12 position=7 stored_token=5 expected_token=9 "
    "stored_chain_hash=0x0000000000000001 expected_aux=0x0000000000000002"
)


def test_sglang_violation_lines_are_parsed_from_a_log(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text("old noise\n" + SGLANG_LINE + "\n")
    offsets = log_offsets([log, tmp_path / "missing.log"])
    assert parse_violations(appended_text(log, offsets[log])) == []  # written before the run
    with log.open("a") as handle:
        handle.write("INFO something else\n" + SGLANG_LINE.replace("slot_idx=12", "slot_idx=40") + "\n")
    found = parse_violations(appended_text(log, offsets[log]))
    assert [(v.launch_tag, v.fail_reason, v.slot_idx, v.position) for v in found] == [("TAIL_K_FULL", "verify_chain", "40", "7")]
    assert found[0].describe() == "TAIL_K_FULL verify_chain at slot 40, position 7"


async def test_a_violation_logged_during_the_run_fails_the_suite(tmp_path: Path) -> None:
    from test_canary_fakes import Behaviour, RunningServer

    log = tmp_path / "sglang.log"
    log.write_text("")
    spec = CanarySpec().only([ProbeName.DETERMINISM, ProbeName.SAFETY_COUNTERS])

    class Writer:
        def __call__(self, event: object) -> None:
            if getattr(event, "kind", "") == "finished" and getattr(event, "probe", None) == ProbeName.DETERMINISM:
                with log.open("a") as handle:
                    handle.write(SGLANG_LINE + "\n")

    with RunningServer(Behaviour(metrics_style="none")) as server:
        clean = await run_suite(server.url, spec, engine_logs=[log])
        dirty = await run_suite(server.url, spec, engine_logs=[log], progress=Writer())
    assert clean.verdict == Verdict.PASS and "no SGLang kv_canary violation" in clean.probe(ProbeName.SAFETY_COUNTERS).reason  # type: ignore[union-attr]
    result = dirty.probe(ProbeName.SAFETY_COUNTERS)
    assert result is not None and result.status == ProbeStatus.FAIL
    assert "SGLang's KV canary logged 1 violation(s)" in result.reason and "slot 12" in result.reason


# --- logprobs: the OpenAI shapes and the comparison ------------------------------------------


@functools.cache
def _model(model_dir: Path, bf16_weights: bool) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if bf16_weights:  # a numerics change: the same weights rounded through bfloat16
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return AutoTokenizer.from_pretrained(model_dir), model


def _real_logprobs(model_dir: Path, prompt: str, steps: int, *, bf16_weights: bool = False) -> list[tuple[str, float, dict[str, float]]]:
    """Greedy tokens of the tiny model with their logprob and top-5 alternatives (transformers)."""
    import torch

    tok, model = _model(model_dir, bf16_weights)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logprobs = torch.log_softmax(model(ids).logits[0, -1], dim=-1)
            top = torch.topk(logprobs, 5)
            chosen = int(top.indices[0])
            out.append((tok.decode([chosen]), float(top.values[0]), {tok.decode([int(i)]): float(v) for i, v in zip(top.indices, top.values)}))
            ids = torch.cat([ids, torch.tensor([[chosen]])], dim=1)
    return out


def completions_body(tokens: list[tuple[str, float, dict[str, float]]]) -> dict[str, object]:
    return {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "text": "".join(t for t, _, _ in tokens), "finish_reason": "length",
        "logprobs": {"tokens": [t for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                     "top_logprobs": [top for _, _, top in tokens], "text_offset": list(range(len(tokens)))}}]}  # fmt: skip


def chat_body(tokens: list[tuple[str, float, dict[str, float]]]) -> dict[str, object]:
    content = [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in top.items()]}
               for t, lp, top in tokens]  # fmt: skip
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "".join(t for t, _, _ in tokens)},
        "logprobs": {"content": content}}]}  # fmt: skip


@pytest.mark.slow
def test_both_openai_logprob_shapes_parse_to_the_same_tokens(tiny_model_dir: Path) -> None:
    tokens = _real_logprobs(tiny_model_dir, "The capital of France is", 8)
    completion, chat = completions_body(tokens), chat_body(tokens)
    openai.types.Completion.model_validate(completion)  # the official client accepts both shapes
    openai.types.chat.ChatCompletion.model_validate(chat)
    a, b = parse_body(completion).logprobs, parse_body(chat).logprobs
    assert a == b and a is not None and [t.token for t in a] == [t for t, _, _ in tokens]
    assert token_logprobs({"content": None}) is None and token_logprobs("nope") is None


@pytest.mark.slow
def test_a_numerics_change_is_within_tolerance_and_another_requests_output_is_not(tiny_model_dir: Path) -> None:
    spec = CanarySpec().golden.logprob_tolerance
    prompt = "Once upon a time, in a small village by the sea,"
    baseline = parse_body(completions_body(_real_logprobs(tiny_model_dir, prompt, 16))).logprobs
    rounded = parse_body(chat_body(_real_logprobs(tiny_model_dir, prompt, 16, bf16_weights=True))).logprobs
    stale = parse_body(completions_body(_real_logprobs(tiny_model_dir, "Tell me about the weather today.", 16))).logprobs
    assert baseline and rounded and stale
    near = compare(rounded, baseline, spec.max_logprob_divergence)
    assert judge(near, spec.min_token_agreement, spec.max_logprob_divergence) is None, near.describe()
    assert near.mean_logprob_divergence is not None and near.mean_logprob_divergence < 0.1
    far = compare(stale, baseline, spec.max_logprob_divergence)
    problem = judge(far, spec.min_token_agreement, spec.max_logprob_divergence)
    assert problem is not None and "token agreement" in problem, far.describe()
    same = compare(baseline, baseline, spec.max_logprob_divergence)
    assert (same.token_agreement, same.mean_logprob_divergence, same.divergence) == (1.0, 0.0, None)


def test_tolerant_matching_checks_the_text_where_the_tokens_agree() -> None:
    """Logprobs that agree do not excuse a text that differs: it was changed after sampling."""
    tokens = [TokenLogprob(token=t, logprob=-0.5, top={t: -0.5, "x": -0.6}) for t in ("The", " cat", " sat", " down")]
    text = "The cat sat down"
    same = compare(tokens, tokens, 0.5)
    assert text_contradiction(text, text, tokens, tokens, same) is None
    problem = text_contradiction("The cat sat dowN", text, tokens, tokens, same)
    assert problem == "all 4 tokens agree with the baseline's but the text differs"
    # A near-tie divergence at token 2: the first two tokens agree, so the texts must agree there.
    other = [*tokens[:2], TokenLogprob(token="x", logprob=-0.6, top={"x": -0.6, " sat": -0.7}), tokens[3]]
    tie = compare(other, tokens, 0.5)
    assert tie.divergence is not None and tie.divergence.near_tie
    assert text_contradiction("The catx down", text, other, tokens, tie) is None
    assert "within the first 2 tokens" in (text_contradiction("The dogx down", text, other, tokens, tie) or "")


def test_an_inference_model_gives_its_canary_the_declared_context_length() -> None:
    import yaml

    from kvguard.operator.api import InferenceModelSpec

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples/tiny-cpu.yaml").read_text())["spec"]
    assert InferenceModelSpec.model_validate(data).canary.context_length == data["contextLength"]
    data["canary"] = {"contextLength": 512}
    assert InferenceModelSpec.model_validate(data).canary.context_length == 512


async def test_tolerant_golden_without_logprobs_says_it_could_not_compare() -> None:
    from test_canary_fakes import Behaviour, RunningServer

    tolerant = {"baselineMatch": "tolerant"}
    with RunningServer(Behaviour()) as target, RunningServer(Behaviour(weights_seed="w2")) as baseline:
        bare = await run_suite(target.url, CanarySpec.model_validate({"golden": tolerant}).only([ProbeName.GOLDEN]), baseline_url=baseline.url)
        prompts = [{"prompt": "alpha beta", "expectSubstring": "alpha"}]
        expected = CanarySpec.model_validate({"golden": {**tolerant, "prompts": prompts}}).only([ProbeName.GOLDEN])
        checked = await run_suite(target.url, expected, baseline_url=baseline.url)
    assert bare.verdict == Verdict.CANNOT_RUN
    assert "the baseline and the candidate returned no logprobs" in bare.probe(ProbeName.GOLDEN).reason  # type: ignore[union-attr]
    result = checked.probe(ProbeName.GOLDEN)
    assert result is not None and result.status == ProbeStatus.PASS
    assert result.reason == "1 prompt(s): 1 expectation(s) met; 1 not compared with the baseline (no logprobs returned)"


def test_tolerant_matching_fails_an_answer_that_ends_where_the_baseline_goes_on() -> None:
    """A candidate whose tokens all agree but stop after 2 of the baseline's 8 (an end-of-sequence
    after a corrupted read, or an abort reported as a stop) did not give the baseline's answer;
    compared only up to the shorter, it agreed 1.00 and passed (outside probe)."""
    spec = CanarySpec().golden.logprob_tolerance
    tokens = [TokenLogprob(token=f" t{i}", logprob=-0.1, top={f" t{i}": -0.1, " zz": -3.0}) for i in range(8)]
    short = compare(tokens[:2], tokens, spec.max_logprob_divergence)
    problem = judge(short, spec.min_token_agreement, spec.max_logprob_divergence)
    assert problem is not None and "token agreement 0.25" in problem, short.describe()
    assert "the candidate's answer ends after 2 tokens, the other's after 8" in problem
    longer = compare(tokens, tokens[:2], spec.max_logprob_divergence)  # the candidate ran past the baseline's end
    assert judge(longer, spec.min_token_agreement, spec.max_logprob_divergence) is not None
    one_short = compare(tokens[:7], tokens, spec.max_logprob_divergence)  # a near end, as a numerics change may give
    assert judge(one_short, spec.min_token_agreement, spec.max_logprob_divergence) is None, one_short.describe()


def test_a_divergence_that_is_not_a_near_tie_counts_to_the_longer_answer() -> None:
    """A review of the length rule: a candidate that stopped after 3 of the baseline's 8 agreeing
    tokens fails (3/8), but one that added a wrong 4th token (not a near-tie) and stopped was
    compared up to its own 4 only: 3/4 = 0.75, which passed the default. One wrong token more must
    not pass where its absence fails."""
    spec = CanarySpec().golden.logprob_tolerance
    tokens = [TokenLogprob(token=f" t{i}", logprob=-0.1, top={f" t{i}": -0.1, " zz": -3.0}) for i in range(8)]
    wrong = TokenLogprob(token=" X", logprob=-0.1, top={" X": -0.1})
    diverged = compare([*tokens[:3], wrong], tokens, spec.max_logprob_divergence)
    assert diverged.token_agreement == 3 / 8 and diverged.compared == 8, diverged.describe()
    assert judge(diverged, spec.min_token_agreement, spec.max_logprob_divergence) is not None
    longer = compare([*tokens[:3], wrong, *tokens[4:]], tokens[:4], spec.max_logprob_divergence)
    assert longer.token_agreement == 3 / 8, longer.describe()  # the candidate ran on past a wrong token too
