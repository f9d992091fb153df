"""json_shape.py: the structure a request body may carry, counted on its bytes before parsing
(the router refuses more before pydantic builds it; tests/test_api_bounds.py runs it end to end)."""

from __future__ import annotations

import json

import pytest

from kvguard.workers.json_shape import MAX_JSON_CONTAINERS, MAX_JSON_STRINGS, json_shape_problem


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize("body", [
    _body(prompt=[7] * 1_000_000),  # a million-token prompt: numbers are cheap and not counted
    _body(prompt=[[1, 2]] * 128),
    _body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}] * 4}] * 4096),
    _body(prompt="[{" * 2_000_000),  # brackets inside a string are text
    _body(prompt=['{"a": [1]}'] * 20_000 + ['\\"[', '\\\\']),  # escaped quotes and backslashes
], ids=["million-ids", "128-prompts", "4096-messages-with-parts", "brackets-in-a-string", "quoted-json"])
def test_every_request_the_api_accepts_is_within_the_bounds(body: bytes) -> None:
    assert json_shape_problem(body) is None


def test_arrays_and_objects_over_the_bound_are_counted_and_refused() -> None:
    assert json_shape_problem(_body(z=[[]] * MAX_JSON_CONTAINERS)) is not None  # 65,536 + the outer list + the body
    assert json_shape_problem(_body(z=[[]] * (MAX_JSON_CONTAINERS - 2))) is None
    problem = json_shape_problem(b'{"prompt": [' + b",".join([b"[[[[[]]]]]"] * 100_000) + b"]}")
    assert problem == ("the request body has 500002 JSON arrays and objects, more than the 65536 any request needs")
    assert json_shape_problem(_body(z=[{}] * 70_000, s="[" * 10)) is not None


def test_many_strings_are_counted_only_beside_many_brackets() -> None:
    """Strings cost pydantic little (a million names their parameter's own limit, tested end to
    end); they bound only the regex that tells a bracket in a string from one outside."""
    assert json_shape_problem(_body(stop=["a"] * 1_000_000)) is None
    problem = json_shape_problem(_body(stop=["["] * MAX_JSON_STRINGS))  # and "model", "m", "stop"
    assert problem == (f"the request body has over {MAX_JSON_CONTAINERS} brackets and {MAX_JSON_STRINGS + 3} JSON strings, "
                       f"more than the {MAX_JSON_STRINGS} any request with that many needs")  # fmt: skip
    assert json_shape_problem(_body(stop=["["] * (MAX_JSON_STRINGS - 3))) is None


def test_an_escaped_backslash_before_a_quote_closes_the_string() -> None:
    """`"\\\\"` is a string holding one backslash: the quote after it closes the string, so the
    brackets after it are structure and are counted."""
    body = b'{"a": "\\\\", "z": [' + b",".join([b"[]"] * MAX_JSON_CONTAINERS) + b"]}"
    assert json.loads(body)["a"] == "\\"
    assert json_shape_problem(body) is not None
    inside = b'{"a": "\\" ' + b"[]" * MAX_JSON_CONTAINERS + b'"}'  # an escaped quote: all still one string
    assert json.loads(inside)["a"].startswith('" [][]')
    assert json_shape_problem(inside) is None


def test_a_body_that_is_not_json_is_left_to_the_parser() -> None:
    assert json_shape_problem(b"not json [") is None
    assert json_shape_problem(b"") is None
