"""The per-step streaming encoders (issue 14): what decode writes per engine step and what the
router writes per decode event must say exactly what the per-token encoders said."""

from __future__ import annotations

import json

import pytest

from kvguard.workers.openai_api import sse
from kvguard.workers.openai_responses import ResponseBuilder
from kvguard.workers.protocol import DECODE_EVENT, ErrorEvent, FinishEvent, TokenEvent, TokenLogprob
from kvguard.workers.request import RequestAborted, RequestOutput, RequestState
from kvguard.workers.stream_events import step_events

TEXTS = ["", "a", "hello world", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00nul", "héllo ☃ 𝄞", "end"]


class _Bytes:
    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])

    def text_bytes(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)


@pytest.mark.parametrize("chat", [False, True])
def test_text_chunk_is_byte_for_byte_the_model_built_chunk(chat: bool) -> None:
    builder = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=False, echo=["echoed ", "other"])
    for index in (0, 1):
        for first in (True, False):
            for text in TEXTS:
                got = builder.text_chunk_sse(index, text, first=first)
                if not text and not (first and not chat):  # carries nothing: not sent (the test below)
                    assert got == b""
                else:
                    assert got == sse(builder.chunk(index, text, first=first))


@pytest.mark.parametrize("chat", [False, True])
def test_text_chunk_with_logprobs_keeps_its_records(chat: bool) -> None:
    records = (TokenLogprob(token_id=97, logprob=-0.5, top=((97, -0.5), (98, -1.0))),)
    fast = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True)
    slow = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True)
    for _ in range(2):  # the shaper's text offset advances the same way on both
        assert fast.text_chunk_sse(0, "a", records) == sse(slow.chunk(0, "a", records))
    assert fast.text_chunk_sse(0, "b") == sse(slow.chunk(0, "b"))


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunk_that_would_carry_nothing_is_not_sent(chat: bool) -> None:
    """No text (a token that ended mid-character), no logprobs, no echo: nothing to send. Logprobs
    or a completions stream's echoed prompt are something; so is text."""
    records = (TokenLogprob(token_id=0xE2, logprob=-0.5),)
    plain = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=False, echo=["echoed "])
    assert plain.text_chunk_sse(0, "") == b"" and plain.text_chunk_sse(0, "", records) == b""
    assert plain.text_chunk_sse(1, "", first=True) == b""  # choice 1 has no echo
    assert plain.text_chunk_sse(0, "a") == sse(plain.chunk(0, "a"))
    echoed = plain.text_chunk_sse(0, "", first=True)
    assert (echoed == b"") == chat  # chat has no echo; completions' first chunk shows the prompt
    with_logprobs = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True)
    assert with_logprobs.text_chunk_sse(0, "") == b""
    assert with_logprobs.text_chunk_sse(0, "", records) == sse(ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True)
                                                               .chunk(0, "", records))  # fmt: skip


@pytest.mark.parametrize("chat", [False, True])
def test_the_usage_chunk_has_the_keys_every_other_chunk_has(chat: bool) -> None:
    builder = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=False, include_usage=True)
    usage = builder.usage_chunk(3, 4)
    assert list(usage) == list(builder.chunk(0, "a")) and usage["system_fingerprint"] is None
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def _lines(data: bytes) -> list[object]:
    return [DECODE_EVENT.validate_json(line) for line in data.splitlines()]


def test_a_steps_outputs_go_out_as_one_token_event() -> None:
    batch = [RequestOutput("r", RequestState.DECODING, [5], "a"), RequestOutput("r", RequestState.DECODING, [6, 7], "bc")]
    data, sent, ended = step_events(batch, prompt_tokens=3, sent=2)
    assert (sent, ended) == (5, False)
    assert _lines(data) == [TokenEvent(token_ids=(5, 6, 7), text="abc")]


def test_the_finishing_step_carries_its_tokens_then_the_finish() -> None:
    batch = [RequestOutput("r", RequestState.DECODING, [5], "a"),
             RequestOutput("r", RequestState.FINISHED, [6], "b", finish_reason="length")]
    data, sent, ended = step_events(batch, prompt_tokens=3, sent=1)
    assert (sent, ended) == (3, True)
    assert _lines(data) == [TokenEvent(token_ids=(5, 6), text="ab"),
                            FinishEvent(finish_reason="length", prompt_tokens=3, completion_tokens=3)]


def test_logprobs_of_every_token_in_the_step_are_kept() -> None:
    one = TokenLogprob(token_id=5, logprob=-1.0)
    two = TokenLogprob(token_id=6, logprob=-2.0, top=((6, -2.0),))
    batch = [RequestOutput("r", RequestState.DECODING, [5], "a", logprobs=[one]),
             RequestOutput("r", RequestState.DECODING, [6], "b", logprobs=[two])]
    data, _, _ = step_events(batch, prompt_tokens=1, sent=0)
    (event,) = _lines(data)
    assert isinstance(event, TokenEvent) and event.logprobs == (one, two)


def test_an_abort_ends_the_stream_with_its_error() -> None:
    error = RequestAborted("client")
    batch = [RequestOutput("r", RequestState.DECODING, [5], "a"), RequestOutput("r", RequestState.ABORTED, error=error)]
    data, sent, ended = step_events(batch, prompt_tokens=1, sent=0)
    assert (sent, ended) == (1, True)
    token, end = _lines(data)
    assert isinstance(token, TokenEvent) and isinstance(end, ErrorEvent)
    assert (end.status, end.code) == (error.status, error.code)
    assert json.loads(data.splitlines()[1])["message"] == error.message


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_is_encoded_a_slice_at_a_time_and_reads_as_json_dumps_writes_it(
    chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside probe: a 16 MB answer of logprobs encoded by one json.dumps call held the GIL,
    so the event loop every tenant shares, for 1.07 s at a stretch. Each call now encodes at most
    a slice of a long list, and the bytes are json.dumps's."""
    from kvguard.workers import router
    from kvguard.workers.openai_responses import ChoiceResult

    builder = ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True)
    top = tuple((t, -float(t)) for t in range(5))
    results = [
        ChoiceResult(index=i, text="x" * tokens, finish_reason="length", completion_tokens=tokens,
                     logprobs=[TokenLogprob(token_id=t % 250, logprob=-0.5, top=top) for t in range(tokens)])
        for i, tokens in enumerate((1000, 3, 0, router.JSON_SLICE_ITEMS + 1))
    ]  # fmt: skip
    body = builder.whole(results, 7)
    expected = json.dumps(body)
    encoded: list[int] = []  # items of the list each json.dumps call was given (0: not a list)
    dumps = json.dumps
    monkeypatch.setattr(json, "dumps", lambda value, **kw: encoded.append(len(value) if isinstance(value, list) else 0) or dumps(value, **kw))
    assert router.dumps_in_slices(body) == expected
    assert max(encoded) <= router.JSON_SLICE_ITEMS and len(encoded) > 8, encoded
    odd = {"a": {1: [2.5, None], None: "x", "s": float("nan")}, "b": list(range(3 * router.JSON_SLICE_ITEMS))}
    assert router.dumps_in_slices(odd) == dumps(odd)  # keys json.dumps names its own way (a review)


def test_text_offsets_put_a_token_after_the_replacement_an_unfinished_character_before_it_became() -> None:
    """An outside probe: a token of one stray byte (0xC6), then '*': both had offset 4, while the
    text had U+FFFD at 4 and '*' at 5. Each offset is where the token's own text starts; a
    character split across tokens starts where its first byte's token is."""
    from kvguard.workers.openai_responses import LogprobShaper

    class Vocab:
        def __init__(self, pieces: list[bytes]) -> None:
            self.pieces = pieces

        def token_bytes(self, token_id: int) -> bytes:
            return self.pieces[token_id]

        def text_bytes(self, token_id: int) -> bytes:
            return self.pieces[token_id]

    cases = {
        (b"ab", b"\xc6", b"*", b"c"): [0, 2, 3, 4],  # 'ab\ufffd*c'
        (b"ab", b"\xc3", b"\xa9", b"x"): [0, 2, 2, 3],  # 'ab\xe9x': the split character starts at 2
        (b"\xc6", b"\xc6", b"*"): [0, 1, 2],  # '\ufffd\ufffd*'
        (b"\x80", b"a"): [0, 1],  # '\ufffda'
    }
    for pieces, offsets in cases.items():
        shaper = LogprobShaper(Vocab(list(pieces)))
        got = shaper.completion([TokenLogprob(token_id=i, logprob=-1.0) for i in range(len(pieces))]).text_offset
        assert got == offsets, (pieces, got, b"".join(pieces).decode("utf-8", errors="replace"))


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_is_built_and_encoded_a_choice_at_a_time_as_json_dumps_writes_it(chat: bool) -> None:
    """An outside probe: a whole answer of logprobs built at once is a million small objects, and
    every full pass of the garbage collector walked them holding the GIL (0.1-0.4 s of every
    tenant's event loop). Each choice is now encoded before the next is built, and the text is
    the one json.dumps writes of the whole answer."""
    from kvguard.workers import router
    from kvguard.workers.openai_responses import ChoiceResult

    top = tuple((t, -float(t)) for t in range(3))
    results = [ChoiceResult(index=i, text=f"t{i}", finish_reason="length", completion_tokens=5,
                            logprobs=[TokenLogprob(token_id=97 + t, logprob=-0.5, top=top) for t in range(5)])
               for i in (2, 0, 1)]  # fmt: skip
    one, other = (ResponseBuilder("cmpl-x", "tiny", chat, _Bytes(), logprobs=True, echo=["e0 ", "e1 ", "e2 "]) for _ in range(2))
    other.created = one.created
    steps: list[str] = []
    build = other._whole_choice
    other._whole_choice = lambda c: steps.append(f"build {c.index}") or build(c)  # type: ignore[method-assign]

    def encode(value: object) -> str:
        steps.append("encode")
        return router.dumps_in_slices(value)

    assert other.whole_json(results, 7, encode) == json.dumps(one.whole(results, 7))
    assert steps == ["build 0", "encode", "build 1", "encode", "build 2", "encode", "encode"], steps  # the last: the head
