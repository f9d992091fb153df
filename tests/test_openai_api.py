"""The OpenAI API's fidelity (issue 13) through the official `openai` client against a real router +
prefill + decode trio: logprobs in both shapes, n and prompt batches, echo, penalties and bias,
max_tokens defaulting as OpenAI's (16 for completions, the rest of the context for chat), strict types, and every parameter either
implemented or refused with a 400 naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from openai.types import Completion
from openai.types.chat import ChatCompletion
from pd_harness import _engine, client, deployment, metric, served_model, wait_pools_empty

from kvguard.workers.launcher import LocalDeployment
from kvguard.workers.request import SamplingParams
from kvguard.workers.tiny import EOS_ID

CONTEXT = 1024


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def api(trio: LocalDeployment) -> openai.OpenAI:
    return client(trio)


@pytest.fixture(scope="module")
def model(trio: LocalDeployment) -> str:
    return served_model(trio)


def post(trio: LocalDeployment, path: str, body: dict) -> requests.Response:
    return requests.post(f"{trio.api_base}/{path}", json=body, timeout=60)


# ------------------------------------------------------------------------------ logprobs


def test_completion_logprobs_in_openais_shape_match_the_engine(trio: LocalDeployment, api: openai.OpenAI, model: str,
                                                               tiny_model_dir: Path) -> None:
    raw = post(trio, "completions", {"model": model, "prompt": "The quick brown fox", "max_tokens": 6,
                                     "temperature": 0, "logprobs": 3}).json()
    Completion.model_validate(raw)
    logprobs = raw["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 6
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert isinstance(logprob, float) and logprob <= 0  # the first one too: it came from prefill
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the best, always listed
        assert 3 <= len(top) <= 4
    # The same numbers as the single-process engine (a canary compares builds by exactly these).
    engine = _engine(tiny_model_dir, 4096, CONTEXT)
    [request] = engine.generate([engine.tokenizer.encode("The quick brown fox")],
                                SamplingParams(max_tokens=6, temperature=0, logprobs=3))
    assert request.output_text == raw["choices"][0]["text"]
    whole = api.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=3)
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.token_logprobs == logprobs["token_logprobs"]


def _reference_logprobs(tiny_model_dir: Path, prompt: str, n: int) -> list[float]:
    engine = _engine(tiny_model_dir, 4096, CONTEXT)
    request = engine.add_request(f"ref-{prompt}", engine.tokenizer.encode(prompt), SamplingParams(max_tokens=n, temperature=0, logprobs=0))
    values: list[float] = []
    while engine.has_work():
        values += [r.logprob for o in engine.step() if o.request_id == request.request_id for r in o.logprobs or ()]  # type: ignore[misc]
    return values


def test_first_token_logprob_crosses_from_prefill(trio: LocalDeployment, model: str, tiny_model_dir: Path) -> None:
    raw = post(trio, "completions", {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 0}).json()
    got = raw["choices"][0]["logprobs"]["token_logprobs"]
    # 1e-3: the workers and this process may run torch with different thread counts, so float32 sums
    # are reduced in a different order (1.07e-4 apart seen, 1 run in 5); a wrong token is far further off.
    assert got == pytest.approx(_reference_logprobs(tiny_model_dir, "hello", 4), abs=1e-3)


def test_chat_logprobs_refusal_and_shape(trio: LocalDeployment, api: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    raw = post(trio, "chat/completions", {"model": model, "messages": messages, "max_tokens": 5, "temperature": 0,
                                          "logprobs": True, "top_logprobs": 2}).json()
    ChatCompletion.model_validate(raw)
    choice = raw["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None}
    content = choice["logprobs"]["content"]
    assert len(content) == 5 and choice["logprobs"]["refusal"] is None
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert all(0 <= b < 256 for b in entry["bytes"])
    plain = post(trio, "chat/completions", {"model": model, "messages": messages, "max_tokens": 2}).json()
    assert "logprobs" in plain["choices"][0] and plain["choices"][0]["logprobs"] is None
    typed = api.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)  # type: ignore[arg-type]
    assert typed.choices[0].logprobs is not None and [t.logprob for t in typed.choices[0].logprobs.content or []] == [
        e["logprob"] for e in content]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_equal_whole(api: openai.OpenAI, model: str, chat: bool) -> None:
    if chat:
        args = {"messages": [{"role": "user", "content": "stream me"}], "logprobs": True, "top_logprobs": 1}
        whole = api.chat.completions.create(model=model, max_tokens=8, temperature=0, **args)  # type: ignore[call-overload]
        chunks = list(api.chat.completions.create(model=model, max_tokens=8, temperature=0, stream=True, **args))  # type: ignore[call-overload]
        streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
        assert streamed == [t.logprob for t in whole.choices[0].logprobs.content]
        return
    whole = api.completions.create(model=model, prompt="stream me", max_tokens=8, temperature=0, logprobs=1)
    chunks = list(api.completions.create(model=model, prompt="stream me", max_tokens=8, temperature=0, logprobs=1, stream=True))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs or []]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]
    assert whole.choices[0].logprobs is not None
    assert streamed == whole.choices[0].logprobs.token_logprobs and offsets == whole.choices[0].logprobs.text_offset


MID_CHARACTER = {"226": 100}  # byte 0xE2 (token 226 of the tiny byte vocabulary): a 3-byte character's first byte


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_token_that_ends_mid_character_sends_no_chunk_that_carries_nothing(trio: LocalDeployment, model: str, path: str,
                                                                            logprobs: bool) -> None:
    """Each forced token is a character's first byte, so the text holds it back: such a token sent
    `content: ""` (`text: ""`) with nothing else. Without logprobs it sends no chunk (its bytes come
    with a later one); with logprobs its chunk carries them. Text, logprobs and usage are the
    whole answer's."""
    body: dict = {"model": model, "max_tokens": 6, "temperature": 0, "logit_bias": MID_CHARACTER}
    chat = path.startswith("chat")
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1})
    whole = post(trio, path, body).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{trio.api_base}/{path}", json=stream, timeout=60, stream=True) as answer:
        frames = [line.removeprefix("data: ") for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta" if chat else "text"]]
    texts = [c["delta"].get("content") if chat else c["text"] for c in choices]
    assert all(text or c["logprobs"] or c["finish_reason"] for text, c in zip(texts, choices, strict=True)), chunks
    assert "".join(t or "" for t in texts) == (whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"])
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 6
    if logprobs:
        key = "content" if chat else "token_logprobs"
        streamed = [lp for c in choices if c["logprobs"] for lp in c["logprobs"][key]]
        assert streamed == whole["choices"][0]["logprobs"][key] and len(streamed) == 6
    else:
        assert len(choices) < 6  # held-back tokens sent no chunk


def test_an_assistant_turn_passed_back_as_the_client_dumps_it_is_accepted(trio: LocalDeployment, api: openai.OpenAI,
                                                                          model: str) -> None:
    """The multi-turn pattern: `message.model_dump()` has `annotations: None` (openai >= 1.x), which
    was refused as an unknown argument. Null or [] is accepted (`annotations`, `tool_calls`: an
    outside probe, some clients replay `tool_calls: []`); citations and tool calls are refused by name."""
    question = {"role": "user", "content": "hi"}
    first = api.chat.completions.create(model=model, messages=[question], max_tokens=3, temperature=0)  # type: ignore[list-item]
    dumped = first.choices[0].message.model_dump()
    assert "annotations" in dumped, dumped  # the client's shape this test is about
    turns = [question, dumped, {"role": "user", "content": "more"}]
    again = api.chat.completions.create(model=model, messages=turns, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and first.usage is not None and again.usage.prompt_tokens > first.usage.prompt_tokens
    empty = post(trio, "chat/completions", {"model": model, "max_tokens": 2, "messages": [question, {**dumped, "annotations": []}]})
    assert empty.status_code == 200, empty.text
    no_calls = post(trio, "chat/completions", {"model": model, "max_tokens": 2, "messages": [question, {**dumped, "tool_calls": []}]})
    assert no_calls.status_code == 200, no_calls.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = post(trio, "chat/completions", {"model": model, "max_tokens": 2, "messages": [question, {**dumped, "tool_calls": [call]}]})
    assert called.status_code == 400 and called.json()["error"]["param"] == "messages[1].tool_calls", called.text
    cited = {**dumped, "annotations": [{"type": "url_citation", "url_citation": {"url": "https://example.com"}}]}
    refused = post(trio, "chat/completions", {"model": model, "max_tokens": 2, "messages": [question, cited]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("messages[1].annotations", "unsupported_parameter"), error


# --------------------------------------------------------------------- n, batches, echo


def test_n_choices_are_seeded_each_and_the_first_is_the_n1_answer(api: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": "sample", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    one = api.completions.create(**args)  # type: ignore[call-overload]
    three = api.completions.create(n=3, **args)  # type: ignore[call-overload]
    again = api.completions.create(n=3, **args)  # type: ignore[call-overload]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text
    assert [c.text for c in three.choices] == [c.text for c in again.choices]
    assert len({c.text for c in three.choices}) > 1
    assert three.usage is not None and three.usage.completion_tokens == 36 and three.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_streamed_chat_of_n_choices_opens_with_each_role_in_index_order(trio: LocalDeployment, api: openai.OpenAI, model: str) -> None:
    """The official client's stream helper (`chat.completions.stream`) builds each choice from the
    first chunk it hears of it and finds it by position: our first chunk of a choice was its
    first token (role, text and logprobs together), so choices first heard out of order raised
    IndexError there and a first chunk's logprobs were counted twice (an outside probe, 6 runs
    in 8). A chat stream now opens as OpenAI's and vLLM's do: a role-only chunk per choice, in
    index order, before any token."""
    args = {"model": model, "messages": [{"role": "user", "content": "four ways"}], "max_tokens": 6,
            "temperature": 1.0, "seed": 11, "n": 4, "logprobs": True, "top_logprobs": 1}  # fmt: skip
    whole = api.chat.completions.create(**args)  # type: ignore[call-overload]
    for _ in range(3):  # which choice's first token comes first varies from run to run
        with api.chat.completions.stream(**args) as stream:  # type: ignore[call-overload]
            for _event in stream:
                pass
            snapshot = stream.current_completion_snapshot
        assert [c.index for c in snapshot.choices] == [0, 1, 2, 3]
        for streamed, alone in zip(snapshot.choices, whole.choices, strict=True):
            assert streamed.message.role == "assistant" and streamed.message.content == alone.message.content
            assert streamed.logprobs is not None and alone.logprobs is not None
            assert [t.token for t in streamed.logprobs.content or []] == [t.token for t in alone.logprobs.content or []]
    body = {**args, "stream": True}
    with requests.post(f"{trio.api_base}/chat/completions", json=body, stream=True, timeout=60) as raw:
        frames = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith(b"data: {")]
    assert [f["choices"][0]["index"] for f in frames[:4]] == [0, 1, 2, 3]
    assert all(f["choices"][0]["delta"] == {"role": "assistant", "content": ""} and f["choices"][0]["logprobs"] is None
               for f in frames[:4])  # fmt: skip
    assert not any("role" in f["choices"][0]["delta"] for f in frames[4:] if f["choices"])


def test_a_batch_of_prompts_gets_choices_in_prompt_order(api: openai.OpenAI, model: str) -> None:
    prompts = ["alpha", "beta gamma"]
    batch = api.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    solo = [api.completions.create(model=model, prompt=p, max_tokens=5, temperature=0).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [solo[0], solo[0], solo[1], solo[1]]
    token_batch = api.completions.create(model=model, prompt=[[104, 105], [104]], max_tokens=3, temperature=0)
    assert len(token_batch.choices) == 2 and token_batch.usage is not None and token_batch.usage.prompt_tokens == 3


def test_echo_puts_the_prompt_before_the_completion(api: openai.OpenAI, model: str) -> None:
    plain = api.completions.create(model=model, prompt="echo this", max_tokens=4, temperature=0).choices[0].text
    echoed = api.completions.create(model=model, prompt="echo this", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "echo this" + plain
    streamed = api.completions.create(model=model, prompt="echo this", max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "echo this" + plain


# ------------------------------------------------------------------ sampling parameters


def test_logit_bias_min_tokens_and_penalties_are_applied(api: openai.OpenAI, model: str) -> None:
    forced = api.completions.create(model=model, prompt="x", max_tokens=5, temperature=0, logit_bias={"65": 100})
    assert forced.choices[0].text == "AAAAA"
    eos = {str(EOS_ID): 100}
    early = api.completions.create(model=model, prompt="x", max_tokens=20, temperature=0, logit_bias=eos)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1  # type: ignore[union-attr]
    held = api.completions.create(model=model, prompt="x", max_tokens=20, temperature=0, logit_bias=eos, extra_body={"min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5  # type: ignore[union-attr]
    plain = api.completions.create(model=model, prompt="repeat", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    penalized = api.completions.create(model=model, prompt="repeat", max_tokens=40, temperature=0, frequency_penalty=2.0,
                                       presence_penalty=1.0, extra_body={"ignore_eos": True})
    assert penalized.choices[0].text != plain.choices[0].text


def test_text_offsets_count_only_what_the_text_holds(api: openai.OpenAI, model: str) -> None:
    """Outside probe: EOS sampled under ignore_eos is left out of the text but was counted into
    text_offset (the characters of its name each), so every later offset pointed past the text."""
    done = api.completions.create(model=model, prompt="x", max_tokens=3, temperature=0, logprobs=0,
                                  logit_bias={str(EOS_ID): 100}, extra_body={"ignore_eos": True})  # fmt: skip
    choice = done.choices[0]
    assert choice.text == "" and choice.logprobs is not None and choice.logprobs.text_offset == [0, 0, 0]
    assert choice.logprobs.tokens == ["<|eos|>"] * 3  # still named, as vLLM names them


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_is_counted_but_its_text_is_not_output(api: openai.OpenAI, model: str, stream: bool) -> None:
    """vLLM's meaning of stop_token_ids (outside probe: the stop token's own text ended the output).
    'A' (65), forced by logit_bias, is the stop token: one token generated and counted, no text."""
    args = {"model": model, "prompt": "x", "max_tokens": 20, "temperature": 0, "logit_bias": {"65": 100},
            "extra_body": {"stop_token_ids": [65]}}
    if not stream:
        done = api.completions.create(**args)  # type: ignore[call-overload]
        assert (done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens) == ("", "stop", 1)
        return
    chunks = list(api.completions.create(**args, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1


@pytest.mark.parametrize("max_tokens", ["absent", None])
def test_chat_max_tokens_defaults_to_the_rest_of_the_context(trio: LocalDeployment, model: str, max_tokens: object) -> None:
    body: dict = {"model": model, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": "go on"}]}
    if max_tokens != "absent":
        body["max_tokens"] = max_tokens
    raw = post(trio, "chat/completions", body).json()
    usage = raw["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert raw["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("max_tokens", ["absent", None])
def test_completions_max_tokens_defaults_to_16_as_the_legacy_api(trio: LocalDeployment, model: str, max_tokens: object) -> None:
    """OpenAI's legacy completions default (vLLM's and SGLang's too): an outside probe found a client
    that left max_tokens out getting the whole context, thousands of tokens per choice."""
    body: dict = {"model": model, "temperature": 0, "ignore_eos": True, "prompt": "go on", "n": 2}
    if max_tokens != "absent":
        body["max_tokens"] = max_tokens
    raw = post(trio, "completions", body).json()
    assert raw["usage"]["completion_tokens"] == 2 * 16
    assert [c["finish_reason"] for c in raw["choices"]] == ["length", "length"]
    near_the_end = post(trio, "completions", {"model": model, "prompt": [1] * (CONTEXT - 10)})
    assert near_the_end.status_code == 400 and near_the_end.json()["error"]["code"] == "context_length_exceeded"
    beyond = post(trio, "completions", {"model": model, "prompt": "go on", "min_tokens": 17})
    assert beyond.status_code == 400 and beyond.json()["error"]["message"] == "min_tokens (17) must be at most max_tokens (16)"


# ---------------------------------------------------------------- refusals and types

REFUSED = [
    ("completions", {"suffix": "after"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"tools": [{"type": "function"}]}, "tools"),  # not a completions parameter at all
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"parallel_tool_calls": True}, "parallel_tool_calls"),
    ("chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat/completions", {"store": True}, "store"),
    ("chat/completions", {"metadata": {"k": "v"}}, "metadata"),
    ("chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat/completions", {"messages": [{"role": "tool", "content": "r", "tool_call_id": "1"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ("completions", {"guided_json": {}}, "guided_json"),  # an engine extension this server lacks
    ("completions", {"frobnicate": 1}, "frobnicate"),
    # vLLM's extensions asking for more than vLLM's default
    ("completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("completions", {"priority": 5}, "priority"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("completions", {"bad_words": ["x"]}, "bad_words"),
    ("completions", {"add_special_tokens": None, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("completions", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ("chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("chat/completions", {"add_special_tokens": True}, "add_special_tokens"),
    ("chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {"echo": True}, "echo"),
    ("chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ("chat/completions", {"chat_template_kwargs": {"range": 1}}, "chat_template_kwargs"),  # jinja's own
    ("chat/completions", {"chat_template_kwargs": {"custom_tools": [[[[[[[[[1]]]]]]]]]}}, "chat_template_kwargs"),  # 9 deep
    ("chat/completions", {"chat_template_kwargs": {"custom_tools": "x" * 70_000}}, "chat_template_kwargs"),
    ("chat/completions", {"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
]

# vLLM's extensions at vLLM's defaults, as clients send them explicitly: served as if left out (an
# outside probe: every one of these was a 400 unknown_parameter).
VLLM_DEFAULTS = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
                 "truncate_prompt_tokens": None, "prompt_logprobs": None, "priority": 0, "return_tokens_as_token_ids": False,
                 "return_token_ids": False, "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None,
                 "bad_words": [], "structured_outputs": None, "guided_json": None, "guided_regex": None,
                 "logits_processors": None, "kv_transfer_params": None, "mm_processor_kwargs": None, "vllm_xargs": None,
                 "cache_salt": "tenant-a", "request_id": "my-own-id"}  # fmt: skip
VLLM_CHAT_DEFAULTS = {"add_generation_prompt": True, "chat_template_kwargs": {}, "continue_final_message": False,
                      "add_special_tokens": False, "chat_template": None, "documents": None, "echo": False,
                      "structural_tag": None, "include_reasoning": True}  # fmt: skip


@pytest.mark.parametrize("path, extra, param", REFUSED, ids=[f"{p}-{param}" for p, _, param in REFUSED])
def test_what_is_not_implemented_is_refused_naming_it(trio: LocalDeployment, model: str, path: str, extra: dict, param: str) -> None:
    base = {"model": model, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    answer = post(trio, path, {**base, **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split("[")[0] in error["message"]
    assert error["code"] in ("unsupported_parameter", "unknown_parameter", "invalid_value"), error  # never null


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_vllm_extensions_at_their_defaults_are_served_as_if_left_out(trio: LocalDeployment, model: str, path: str) -> None:
    base: dict = {"model": model, "max_tokens": 6, "temperature": 0}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    completions = {"add_special_tokens": True, "response_format": None, "prompt_embeds": None}
    defaults = {**VLLM_DEFAULTS, **(VLLM_CHAT_DEFAULTS if path.startswith("chat") else completions)}
    plain, explicit = post(trio, path, base), post(trio, path, {**base, **defaults})
    assert plain.status_code == explicit.status_code == 200, explicit.text
    assert plain.json()["choices"] == explicit.json()["choices"] and plain.json()["usage"] == explicit.json()["usage"]
    assert explicit.json()["id"] != "my-own-id" and "my-own-id" not in explicit.json()["id"]  # a label, never the id (S9)


def test_the_chat_templates_own_switches_are_passed_to_it(trio: LocalDeployment, model: str) -> None:
    """vLLM's add_generation_prompt and chat_template_kwargs reach the template (the tiny model's
    opens the assistant's turn only when asked; a variable it does not read changes nothing, as in
    vLLM); a name the server sets itself is refused, naming the field. Completions' add_special_tokens
    false leaves the tokenizer's BOS out, as vLLM does."""
    base = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}

    def prompt_tokens(**extra: object) -> int:
        answer = post(trio, "chat/completions", {**base, **extra})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    opened = prompt_tokens()
    with_bos = post(trio, "completions", {"model": model, "max_tokens": 2, "prompt": "hi"}).json()["usage"]["prompt_tokens"]
    without = post(trio, "completions", {"model": model, "max_tokens": 2, "prompt": "hi", "add_special_tokens": False})
    assert without.json()["usage"]["prompt_tokens"] == with_bos - 1, without.text  # the tiny tokenizer's BOS
    assert prompt_tokens(add_generation_prompt=False) < opened
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == opened
    refused = post(trio, "chat/completions", {**base, "chat_template_kwargs": {"bos_token": "x"}}).json()["error"]
    assert (refused["param"], refused["code"]) == ("chat_template_kwargs", "invalid_value") and "bos_token" in refused["message"]


def test_a_text_part_with_a_caching_hint_and_a_body_after_a_byte_order_mark_are_served(trio: LocalDeployment,
                                                                                        model: str) -> None:
    """Both were 400s (an outside probe): LiteLLM-style clients send `cache_control` in text parts,
    and Python's json, so FastAPI and vLLM, skips a UTF-8 BOM (RFC 8259 allows it)."""
    plain = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    hinted = {**plain, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                  "cache_control": {"type": "ephemeral"}}]}]}  # fmt: skip
    expected = post(trio, "chat/completions", plain).json()["choices"]
    assert post(trio, "chat/completions", hinted).json()["choices"] == expected
    with_bom = requests.post(f"{trio.api_base}/chat/completions", data=b"\xef\xbb\xbf" + json.dumps(plain).encode(),
                             headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    assert with_bom.status_code == 200 and with_bom.json()["choices"] == expected, with_bom.text


def test_parallel_tool_calls_is_a_boolean(trio: LocalDeployment, model: str) -> None:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "no"}
    error = post(trio, "chat/completions", body).json()["error"]
    assert (error["param"], error["code"]) == ("parallel_tool_calls", "invalid_type"), error


@pytest.mark.parametrize("field, value", [("tools", 0), ("tools", ""), ("tools", {}), ("tools", False),
                                          ("functions", 0), ("functions", {}), ("store", 0), ("tool_choice", 0),
                                          ("function_call", [])])  # fmt: skip
def test_refused_chat_fields_are_typed_as_openais_schema(trio: LocalDeployment, model: str, field: str, value: object) -> None:
    """A falsy value of the wrong type was taken for "asks for nothing" (`"tools": 0` was a 200)."""
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    error = post(trio, "chat/completions", body).json()["error"]
    assert (error["param"], error["code"]) == (field, "invalid_type"), error


def test_text_parts_are_one_text_a_line_apart_as_vllm_renders_them(api: openai.OpenAI, model: str) -> None:
    def answer(content: object) -> tuple[int, str]:
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],  # type: ignore[misc]
                                            max_tokens=6, temperature=0)  # fmt: skip
        return reply.usage.prompt_tokens, reply.choices[0].message.content  # type: ignore[union-attr,return-value]

    parts = answer([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])
    assert parts == answer("one\ntwo") and parts != answer("onetwo")


def test_a_clients_long_parameter_name_is_echoed_clipped(trio: LocalDeployment, model: str) -> None:
    """An unknown key of 1 MiB came back whole, twice (`message` and `param`)."""
    key = "k" * 2**20
    answer = post(trio, "completions", {"model": model, "prompt": "hi", "max_tokens": 2, key: 1})
    assert answer.status_code == 400 and len(answer.content) < 1024, len(answer.content)
    assert answer.json()["error"]["param"] == "k" * 61 + "..."


def test_the_clients_caching_hints_and_null_moderation_are_served_unchanged(api: openai.OpenAI, model: str) -> None:
    """openai's chat parameters `prompt_cache_retention` and `prompt_cache_options` (hints, like
    `prompt_cache_key`) and `moderation: null` were 400 `unknown_parameter`."""
    def answer(**hints: object) -> str | None:
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, **hints)  # type: ignore[call-overload]  # fmt: skip
        return reply.choices[0].message.content

    # As extra_body: the client's keyword for a deprecated field may go, the field still arrives.
    plain = answer()
    assert answer(extra_body={"prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"}}) == plain
    assert answer(extra_body={"moderation": None, "prompt_cache_retention": "in_memory"}) == plain
    for wrong, param in (({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
                         ({"prompt_cache_options": {"mode": "bogus"}}, "prompt_cache_options.mode"),
                         ({"prompt_cache_options": {"ttl": "forever"}}, "prompt_cache_options.ttl"),
                         ({"prompt_cache_options": {"x": 1}}, "prompt_cache_options.x")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            answer(extra_body=wrong)
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


def test_parallel_tool_calls_false_asks_for_nothing_and_is_served(api: openai.OpenAI, model: str) -> None:
    answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         parallel_tool_calls=False)  # fmt: skip
    assert answer.choices[0].message.content is not None


STRICT = [
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": "1"}, "temperature"),
    ({"n": 0}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"seed": "1"}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic 3: read as token 3 once
    ({"logit_bias": {"03": 1}}, "logit_bias"),  # would alias "3" (two biases for one token)
    ({"model": None}, "model"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
]


@pytest.mark.parametrize("override, param", STRICT, ids=[p for _, p in STRICT])
def test_types_are_as_strict_as_openais_schema(trio: LocalDeployment, model: str, override: dict, param: str) -> None:
    answer = post(trio, "completions", {"model": model, "prompt": "hi", "max_tokens": 2, **override})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


CODED = [  # the `code` OpenAI's API answers for the same mistake, which clients branch on
    ({"max_tokens": "5"}, "invalid_type"),
    ({"stream": "yes"}, "invalid_type"),
    ({"temperature": 5}, "decimal_above_max_value"),
    ({"top_p": 0}, "decimal_below_min_value"),
    ({"n": 0}, "integer_below_min_value"),
    ({"logprobs": 6}, "integer_above_max_value"),
    ({"stop": [""]}, "invalid_value"),  # the right type, a value not allowed
    ({"n": 17}, "integer_above_max_value"),  # the router's max_choices (16), not the schema's 128
    ({"n": 129}, "integer_above_max_value"),  # said as the router's 16 too (an outside probe: "<= 128")
    # a list over its length limit is array_above_max_length, whichever the list
    ({"prompt": ["p"] * 17}, "array_above_max_length"),
    ({"stop": ["a"] * 5}, "array_above_max_length"),
    ({"stop_token_ids": list(range(65))}, "array_above_max_length"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "array_above_max_length"),
    # a value of the wrong JSON type is invalid_type, whichever validator reads it
    ({"prompt": 5}, "invalid_type"),
    ({"prompt": [[1], ["a"]]}, "invalid_type"),
    ({"stop": 123}, "invalid_type"),
    ({"stop": {"a": 1}}, "invalid_type"),
    ({"logit_bias": []}, "invalid_type"),
    ({"prompt": [-1]}, "invalid_value"),  # the right type, out of range
]


@pytest.mark.parametrize("override, code", CODED, ids=[c for _, c in CODED])
def test_invalid_parameters_carry_openais_error_code(api: openai.OpenAI, model: str, override: dict, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=override)
    assert caught.value.code == code and caught.value.param == next(iter(override)), caught.value.body


CHAT_CODED = [
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ([{"role": 5, "content": "x"}], "messages[0].role", "invalid_type"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content", "invalid_type"),
    ([5], "messages[0]", "invalid_type"),
    ([{"role": "user", "content": "x"}] * 4097, "messages", "array_above_max_length"),
    ([], "messages", "empty_array"),  # an outside probe: array_below_min_length, which docs/openai-api.md does not list
]


@pytest.mark.parametrize("messages, param, code", CHAT_CODED, ids=[f"{p}-{c}" for _, p, c in CHAT_CODED])
def test_invalid_messages_carry_openais_error_code(trio: LocalDeployment, model: str, messages: list, param: str, code: str) -> None:
    answer = post(trio, "chat/completions", {"model": model, "messages": messages, "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    assert (answer.json()["error"]["param"], answer.json()["error"]["code"]) == (param, code), answer.text


def test_limits_are_said_as_the_server_holds_them(api: openai.OpenAI, trio: LocalDeployment, model: str) -> None:
    """An outside probe: n=129 said "<= 128" (the schema's) where 16 holds, and a role that is no
    role listed 'tool' and 'function', which are then refused."""
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt="hi", max_tokens=2, n=10**6)
    assert "more than 16 choices per request" in caught.value.message and "128" not in caught.value.message
    answer = post(trio, "chat/completions", {"model": model, "messages": [{"role": "robot", "content": "x"}], "max_tokens": 2})
    message = answer.json()["error"]["message"]
    assert message.startswith("messages[0].role: must be 'system', 'developer', 'user' or 'assistant'"), message
    assert "not implemented" in message and "Input should" not in message
    empty = post(trio, "chat/completions", {"model": model, "messages": [], "max_tokens": 2}).json()["error"]
    assert empty["message"] == "messages: empty array: expected at least one message", empty


@pytest.mark.parametrize(("path", "budget"), [("completions", "max_tokens"), ("chat/completions", "max_tokens"),
                                               ("chat/completions", "max_completion_tokens")])  # fmt: skip
def test_min_tokens_above_the_budget_is_refused_as_vllm_refuses_it(trio: LocalDeployment, model: str, path: str, budget: str) -> None:
    body = {"model": model, budget: 2, "min_tokens": 5}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    answer = post(trio, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "min_tokens" and error["message"] == f"min_tokens (5) must be at most {budget} (2)"


def test_a_missing_model_is_refused_as_openai_refuses_it(trio: LocalDeployment) -> None:
    answer = post(trio, "completions", {"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 400
    assert answer.json()["error"] == {"message": "you must provide a model parameter", "type": "invalid_request_error",
                                      "param": "model", "code": "missing_required_parameter"}


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_an_empty_model_is_refused_as_openai_refuses_it(trio: LocalDeployment, path: str) -> None:
    """`"model": ""` names no model: not a 404 for a model called ''."""
    body: dict = {"model": "", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    answer = post(trio, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {"message": "you must provide a model parameter", "type": "invalid_request_error",
                                      "param": "model", "code": "invalid_value"}


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", "utf-16"])
def test_a_body_in_a_charset_other_than_utf8_is_refused(trio: LocalDeployment, model: str, charset: str) -> None:
    """The body is read as UTF-8, as JSON is: a body labelled otherwise would be misread, not refused."""
    body = json.dumps({"model": model, "prompt": "caf\u00e9", "max_tokens": 2}, ensure_ascii=False).encode("latin-1")
    answer = requests.post(f"{trio.api_base}/completions", data=body, timeout=60,
                           headers={"Content-Type": f"application/json; charset={charset}"})
    assert answer.status_code == 415, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unsupported_media_type" and "UTF-8" in error["message"], error


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/json;charset=UTF-8",
                                          'application/json; charset="utf-8"', "application/json",
                                          # a review: its other names, and ASCII (UTF-8 too), were refused
                                          "application/json; charset=utf8", "application/json; charset='utf-8'",
                                          "application/json; charset=us-ascii"])
def test_a_utf8_body_is_served_whatever_the_case_of_its_charset(trio: LocalDeployment, model: str, content_type: str) -> None:
    body = json.dumps({"model": model, "prompt": "caf\u00e9", "max_tokens": 2}, ensure_ascii=False).encode()
    answer = requests.post(f"{trio.api_base}/completions", data=body, timeout=60, headers={"Content-Type": content_type})
    assert answer.status_code == 200, answer.text


def test_nullable_parameters_take_their_defaults(trio: LocalDeployment, model: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "temperature": None, "top_p": None, "n": None, "stop": None,
            "stream": None, "seed": None, "logprobs": None, "user": "tenant-7", "frequency_penalty": None}
    assert post(trio, "completions", body).status_code == 200


def test_over_length_chat_names_messages(api: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * 1100}], max_tokens=4)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as too_much:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2000)
    assert too_much.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as newer:  # the parameter the client used is the one named
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_completion_tokens=2000)
    assert newer.value.param == "max_completion_tokens"


def test_a_model_card_by_id(api: openai.OpenAI, model: str) -> None:
    card = api.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("someone-else/model")
    assert missing.value.code == "model_not_found"


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_with_include_usage_every_chunk_carries_usage_null_and_the_last_the_totals(trio: LocalDeployment, model: str, path: str) -> None:
    """OpenAI: "All other chunks will also include a usage field, but with a null value"."""
    import json

    body: dict = {"model": model, "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    with requests.post(f"{trio.api_base}/{path}", json=body, timeout=60, stream=True) as answer:
        frames = [line.removeprefix("data: ") for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert list(chunks[-1]) == list(chunks[0]) and chunks[-1]["system_fingerprint"] is None  # as every other chunk
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    with requests.post(f"{trio.api_base}/{path}", json=plain, timeout=60, stream=True) as answer:
        frames = [line.removeprefix("data: ") for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert all("usage" not in json.loads(f) for f in frames[:-1])  # without it: no usage key at all, as before


# ------------------------------------------------------------------------------ token ids (S2 at the router)

VOCAB = 320  # the tiny model's (workers/tiny.py)
OUT_OF_VOCAB = [
    ("prompt", {"prompt": [[72, 105], [VOCAB + 5]]}),  # the second prompt of a batch: the first must not run either
    ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [3, VOCAB]}),
    ("logit_bias", {"prompt": "hi", "logit_bias": {str(VOCAB * 2): 5}}),
]


@pytest.mark.parametrize(("param", "body"), OUT_OF_VOCAB, ids=[p for p, _ in OUT_OF_VOCAB])
def test_a_token_id_outside_the_vocabulary_is_refused_before_any_worker_runs(trio: LocalDeployment, model: str,
                                                                             param: str, body: dict) -> None:
    """The router knows the workers' vocabulary (WorkerInfo.vocab_size): an id outside it is the
    client's 400, counted `rejected`, not `failed` (what a rollout's error ratio reads), and no
    sibling prompt of the same request is prefilled or sent before the refusal."""
    wait_pools_empty(trio)  # every earlier request has ended, and is counted, on every process
    before = {outcome: metric(trio, "router", "kvguard_requests_total", outcome=outcome) for outcome in ("rejected", "failed")}
    prefilled = metric(trio, "prefill", "kvguard_requests_total")
    answer = post(trio, "completions", {"model": model, "max_tokens": 2, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {"message": f"{param}: token ids must be in [0, {VOCAB})", "type": "invalid_request_error",
                                      "param": param, "code": "invalid_value"}  # fmt: skip
    assert metric(trio, "router", "kvguard_requests_total", outcome="rejected") == before["rejected"] + 1
    assert metric(trio, "router", "kvguard_requests_total", outcome="failed") == before["failed"]
    assert metric(trio, "prefill", "kvguard_requests_total") == prefilled  # no worker saw any of it


def test_min_tokens_above_the_rest_of_the_context_is_refused(trio: LocalDeployment, model: str) -> None:
    """With max_tokens absent a chat's budget is the rest of the context; min_tokens beyond it could
    not be honoured (vLLM refuses it too)."""
    messages = [{"role": "user", "content": "hi"}]
    answer = post(trio, "chat/completions", {"model": model, "messages": messages, "min_tokens": CONTEXT})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "min_tokens"
    assert re.fullmatch(rf"min_tokens \({CONTEXT}\) must be at most the \d+ tokens left in the context after the prompt", error["message"])


def test_a_charset_no_codec_can_name_is_refused_not_a_500() -> None:
    """A review: a NUL or a byte no codec name holds made codecs.lookup raise ValueError: a 500."""
    from kvguard.workers.router import _reads_as_utf8

    assert not _reads_as_utf8("utf-8\x00") and not _reads_as_utf8("utf-8\udcff")
    assert _reads_as_utf8("UTF8") and _reads_as_utf8("us-ascii") and not _reads_as_utf8("latin-1")
