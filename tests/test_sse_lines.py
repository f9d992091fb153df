"""The canary's SSE line splitter (`operator/canary/sse_lines.py`): CR, LF and CRLF end a line, as
the standard and the official OpenAI client say, however the bytes are chunked."""

from __future__ import annotations

import itertools

import pytest

from kvguard.operator.canary.sse_lines import SseLines


def split(chunks: list[bytes]) -> list[tuple[int, bytes]]:
    splitter = SseLines()
    lines = [line for chunk in chunks for line in splitter.feed(chunk)]
    return lines + splitter.finish()


STREAM = b"data: a\r\n\r\ndata: b\r\rdata: c\n\n: note\rtail"
EXPECTED = [(0, b"data: a"), (9, b""), (11, b"data: b"), (19, b""), (20, b"data: c"), (28, b""), (29, b": note"), (36, b"tail")]


def test_every_line_end_and_offset_in_one_chunk() -> None:
    assert split([STREAM]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_any_chunking_gives_the_same_lines(size: int) -> None:
    """A CRLF split between two chunks is one line end; a CR at a chunk's end followed by
    anything else is a line end of its own."""
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert split(chunks) == EXPECTED


def test_every_split_point_of_cr_then_lf() -> None:
    for cut in range(len(b"x\r\ny")):
        assert split([b"x\r\ny"[:cut], b"x\r\ny"[cut:]]) == [(0, b"x"), (3, b"y")]
    assert split([b"x\r", b"", b"\ny"]) == [(0, b"x"), (3, b"y")]  # an empty read between them changes nothing
    assert split([b"x\r", b"\r\n"]) == [(0, b"x"), (2, b"")]  # CR, then CRLF: two line ends


def test_a_stream_ending_without_a_line_end_gives_its_last_line_once() -> None:
    splitter = SseLines()
    assert list(splitter.feed(b"data: x")) == []
    assert splitter.finish() == [(0, b"data: x")]
    assert splitter.finish() == []


def test_a_long_line_in_many_chunks_is_joined_once() -> None:
    chunks = list(itertools.repeat(b"y" * 1000, 1000)) + [b"\n"]
    assert split(chunks) == [(0, b"y" * 1_000_000)]


def test_a_chunk_is_split_one_line_at_a_time() -> None:
    """One decompressed read can hold 786 KiB of line ends: split whole before the caller's line
    bound or its yield to the loop ran, it held the canary's loop for 0.5 s (review). The caller
    takes lines as they are split, and one that stops early splits no further."""
    lines = SseLines().feed(b"a\n" * 1_000_000)
    assert next(lines) == (0, b"a") and next(lines) == (2, b"a")
