"""json_shape.py: the structure a request body may carry, counted on its bytes before parsing
(the router refuses more before pydantic builds it; tests/test_api_bounds.py runs it end to end)."""

from __future__ import annotations

import json

import pytest

from kvguard.workers.json_shape import MAX_JSON_ITEMS, MAX_JSON_STRINGS, MAX_NUMBER_DIGITS
from kvguard.workers.json_shape import json_shape_problem as shape_problem

MILLION_CONTEXT_VALUES = MAX_JSON_ITEMS + 16 * 1_048_576  # the router's bound: 16 choices at a 1M context
SMALL_CONTEXT_VALUES = MAX_JSON_ITEMS + 16 * 1024


def json_shape_problem(raw: bytes, max_values: int = MILLION_CONTEXT_VALUES) -> str | None:
    return shape_problem(raw, max_values=max_values)


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize("body", [
    _body(prompt=[7] * 1_000_000),  # a million-token prompt, at a context of a million
    _body(prompt=[[1, 2]] * 128),
    _body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}] * 9}] * 4096),
    _body(prompt="[{:" * 2_000_000),  # brackets and colons inside a string are text
    _body(prompt=['{"a": [1]}'] * 20_000 + ['\\"[', '\\\\']),  # escaped quotes and backslashes
    _body(prompt="x", logit_bias={str(i): 1 for i in range(1024)}),
], ids=["million-ids", "128-prompts", "4096-messages-of-9-parts", "brackets-in-a-string", "quoted-json", "full-logit-bias"])
def test_every_request_the_api_accepts_is_within_the_bounds(body: bytes) -> None:
    assert json_shape_problem(body) is None


def test_arrays_objects_and_members_over_the_bound_are_counted_and_refused() -> None:
    # The body's object and its 2 members ("model", "z"), the outer list, then one item each.
    assert json_shape_problem(_body(z=[[]] * (MAX_JSON_ITEMS - 4))) is None
    assert json_shape_problem(_body(z=[[]] * (MAX_JSON_ITEMS - 3))) is not None
    problem = json_shape_problem(b'{"prompt": [' + b",".join([b"[[[[[]]]]]"] * 100_000) + b"]}")
    assert problem == f"the request body has 500003 JSON arrays, objects and object members, more than the {MAX_JSON_ITEMS} the router parses"
    # An object of many members is one container: its members are what pydantic-core builds.
    assert json_shape_problem(_body(logit_bias={str(i): 1 for i in range(MAX_JSON_ITEMS)})) is not None
    assert json_shape_problem(_body(**{f"k{i}": 0 for i in range(MAX_JSON_ITEMS)})) is not None


def test_many_strings_are_counted_only_beside_many_items() -> None:
    """Strings cost pydantic little (a million names their parameter's own limit, tested end to
    end); they bound only the regex that tells a bracket in a string from one outside."""
    assert json_shape_problem(_body(stop=["a"] * 1_000_000)) is None
    problem = json_shape_problem(_body(stop=["["] * MAX_JSON_STRINGS))  # and "model", "m", "stop"
    assert problem == f"the request body has {MAX_JSON_STRINGS + 3} JSON strings, more than the {MAX_JSON_STRINGS} the router parses"
    assert json_shape_problem(_body(stop=["["] * (MAX_JSON_STRINGS - 3))) is None


def test_an_escaped_backslash_before_a_quote_closes_the_string() -> None:
    """`"\\\\"` is a string holding one backslash: the quote after it closes the string, so the
    brackets after it are structure and are counted."""
    body = b'{"a": "\\\\", "z": [' + b",".join([b"[]"] * MAX_JSON_ITEMS) + b"]}"
    assert json.loads(body)["a"] == "\\"
    assert json_shape_problem(body) is not None
    inside = b'{"a": "\\" ' + b"[]" * MAX_JSON_ITEMS + b'"}'  # an escaped quote: all still one string
    assert json.loads(inside)["a"].startswith('" [][]')
    assert json_shape_problem(inside) is None


def test_a_body_that_is_not_json_is_left_to_the_parser() -> None:
    assert json_shape_problem(b"not json [") is None
    assert json_shape_problem(b"") is None


def test_numbers_are_bounded_by_what_the_routers_context_allows() -> None:
    """An outside probe: 8 MB of one-digit token ids (4 million values) passed the bracket count and
    held the GIL 0.4 s per body; 2-6 connections sending them made another tenant 15-60x slower.
    A router at context 1024 allows 16 choices of 1024 ids beside the items' bound, no more."""
    ids = b'{"model": "m", "prompt": [' + b",".join([b"1"] * 4_000_000) + b"]}"
    assert json_shape_problem(ids, SMALL_CONTEXT_VALUES) == (
        f"the request body has 4000001 JSON values, more than the {SMALL_CONTEXT_VALUES} any request to this router "
        "holds (its token-id prompts at the context length, for every choice)")  # fmt: skip
    assert json_shape_problem(_body(prompt=[[5] * 1024] * 16), SMALL_CONTEXT_VALUES) is None  # the most it takes
    floats = b'{"model": "m", "stop_token_ids": [' + b",".join([b"0.125"] * 1_300_000) + b"]}"
    assert "JSON values" in (json_shape_problem(floats, SMALL_CONTEXT_VALUES) or "")
    # Commas and digits inside strings are text: a CSV pasted as the prompt is not counted.
    assert json_shape_problem(_body(prompt="12345678901234567890," * 300_000), SMALL_CONTEXT_VALUES) is None


def test_numbers_longer_than_any_parameter_takes_are_refused() -> None:
    """2,000 integers of 4,000 digits: few values, 8 MB of digits (0.45 s to build as a prompt)."""
    big = b'{"model": "m", "prompt": [' + b",".join([b"1" * 4000] * 2000) + b"]}"
    assert json_shape_problem(big) == (
        f"the request body's numbers have 8000000 digits, more than {MAX_NUMBER_DIGITS} per value; no parameter takes "
        "a number that long")  # fmt: skip
    assert json_shape_problem(_body(prompt="x", seed=2**64 - 1, stop_token_ids=[2**31 - 1] * 64)) is None


def test_commas_inside_strings_do_not_excuse_long_numbers() -> None:
    """The rough count takes a string's commas for values, so 400,000 of them in `user` let 1,850
    integers of 4,000 digits (400 digits per value counted outside strings) pass the digits' bound
    unstripped. Digits are judged against the values outside strings."""
    big = b'{"model": "m", "prompt": [' + b",".join([b"1" * 4000] * 1850) + b'], "user": "' + b"," * 400_000 + b'"}'
    assert json_shape_problem(big) == (
        f"the request body's numbers have 7400000 digits, more than {MAX_NUMBER_DIGITS} per value; no parameter takes "
        "a number that long")  # fmt: skip
    assert json_shape_problem(_body(prompt="1, 2, 3, " * 100_000, max_tokens=16, seed=12345)) is None
