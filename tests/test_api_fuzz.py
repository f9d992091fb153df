"""Fuzzing the public API (issue 11): bodies generated from the request models' own fields -- each
field given plausible values, values of every other JSON type, or left out, plus unknown fields,
raw bytes and broken JSON -- against a real router + prefill + decode trio. Whatever arrives, the
answer is a completion or an OpenAI-shaped 4xx, never a 5xx, a hang or a broken stream, and the
server keeps serving afterwards with nothing left in its KV pools. Bounded for CI: ~150 requests,
at most 4 tokens each (well under a minute on a quiet machine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_harness import deployment, served_model, wait_pools_empty

from kvguard.workers.launcher import LocalDeployment
from kvguard.workers.openai_requests import ChatCompletionRequest, CompletionRequest

LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12))  # fmt: skip
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
TEXT = st.text(max_size=40)
TOKENS = st.lists(st.integers(0, 400), min_size=0, max_size=8)
ROLE = st.sampled_from(["user", "user", "assistant", "system", "developer", "tool", "robot"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": st.one_of(TEXT, TEXT, TEXT, JSON)})
# Plausible values for the fields that matter most; every field also gets arbitrary JSON.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": TEXT | TOKENS | st.lists(TEXT, max_size=3) | st.lists(TOKENS, max_size=3),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 400),
    "min_p": st.floats(0, 1),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "seed": st.integers(-(2**64), 2**65),
    "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 400).map(str) | TEXT, st.floats(-120, 120), max_size=4),
    "logprobs": st.integers(-1, 6) | st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "echo": st.booleans(),
    "min_tokens": st.integers(-1, 10),
    "ignore_eos": st.booleans(),
    "stop_token_ids": TOKENS,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
# Every request stays small: max_tokens is always sent (null would mean "the rest of the context").
MAX_TOKENS = st.integers(1, 4) | JSON.filter(lambda v: v is not None)


def bodies(kind: type[CompletionRequest] | type[ChatCompletionRequest], model: str) -> st.SearchStrategy[dict[str, Any]]:
    """Three kinds, so that both the success paths and each field's checks are reached: plausible
    bodies (a few plausible fields), plausible bodies with one field set to any JSON value (or
    an unknown field), and bodies where every field may be anything."""
    fields = [name for name in kind.model_fields if name not in ("model", "max_tokens")]
    core = "prompt" if kind is CompletionRequest else "messages"
    extras = [name for name in fields if name in PLAUSIBLE and name != core]
    base = st.fixed_dictionaries({"model": st.just(model), "max_tokens": st.integers(1, 4), core: PLAUSIBLE[core]})
    some = st.lists(st.sampled_from(extras), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: PLAUSIBLE[name] for name in names}))
    plausible = st.tuples(base, some).map(lambda parts: {**parts[0], **parts[1]})
    one_broken = st.tuples(plausible, st.sampled_from([*fields, "model", "max_tokens", "unknown_field"]), JSON).map(
        lambda t: t[0] if t[1] == "max_tokens" and t[2] is None else {**t[0], t[1]: t[2]})
    anything = st.fixed_dictionaries(
        {"model": st.just(model) | JSON, "max_tokens": MAX_TOKENS},
        optional={name: PLAUSIBLE.get(name, JSON) | JSON for name in fields},  # type: ignore[arg-type]
    )
    return st.one_of(plausible, plausible, plausible, one_broken, anything)


def payloads(model: str) -> st.SearchStrategy[tuple[str, str, bytes]]:
    completion = bodies(CompletionRequest, model).map(lambda b: ("POST", "completions", json.dumps(b).encode()))
    chat = bodies(ChatCompletionRequest, model).map(lambda b: ("POST", "chat/completions", json.dumps(b).encode()))
    broken = st.tuples(st.sampled_from(["completions", "chat/completions"]), st.binary(max_size=64)).map(
        lambda p: ("POST", p[0], p[1]))
    elsewhere = st.tuples(st.sampled_from(["GET", "PUT", "DELETE", "POST"]), st.sampled_from(
        ["models", f"models/{model}", "models/x", "completions", "nothing", "chat/completions/x"]), st.just(b"{}"))
    return st.one_of(completion, completion, chat, chat, broken, elsewhere)


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as running:
        yield running


def check(response: requests.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    kind = response.headers.get("Content-Type", "")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error" or \
            response.status_code in (404, 409), error
        return
    if kind.startswith("text/event-stream"):
        frames = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert frames and frames[-1] == "data: [DONE]", frames[-3:]
        for frame in frames[:-1]:
            assert "error" not in json.loads(frame.removeprefix("data: ")), frame
        return
    body = response.json()
    assert "choices" in body or "data" in body or body.get("object") == "model"


def test_public_api_fuzz_never_5xx_and_keeps_serving(trio: LocalDeployment) -> None:
    model = served_model(trio)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(payload=payloads(model))
    def one(payload: tuple[str, str, bytes]) -> None:
        method, path, data = payload
        check(requests.request(method, f"{trio.api_base}/{path}", data=data, timeout=60,
                               headers={"Content-Type": "application/json"}))

    one()
    wait_pools_empty(trio)
    answer = requests.post(f"{trio.api_base}/completions", json={"model": model, "prompt": "after", "max_tokens": 3}, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
