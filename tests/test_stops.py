"""Stop strings matched as text streams in (workers/stops.py): the same answer as searching the whole
text, released as early as it is safe, in work linear in the text (issue 11, item 5)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.workers.stops import StopMatcher

ALPHABET = "abé"  # few letters, so stop strings occur and overlap often


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Search after every character: the first stop string completed (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True
    return text, False


def stream(deltas: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    released = []
    for i, delta in enumerate(deltas):
        released.append(matcher.feed(delta, final=i == len(deltas) - 1))
        if matcher.stopped:
            break
    return "".join(released), matcher.stopped, released


@settings(max_examples=400, deadline=None)
@given(
    deltas=st.lists(st.text(ALPHABET, max_size=4), min_size=1, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=4),
)
def test_streamed_matching_equals_searching_the_whole_text(deltas: list[str], stops: list[str]) -> None:
    text = "".join(deltas)
    out, stopped, released = stream(deltas, stops)
    assert (out, stopped) == reference(text, stops)
    for i in range(len(released)):  # nothing released is ever a stop string's start that later completed
        assert not any(s in "".join(released[: i + 1]) for s in stops)


def test_text_is_held_only_while_it_may_start_a_stop_string() -> None:
    matcher = StopMatcher(["<end>"])
    assert matcher.feed("hello <e") == "hello "
    assert matcher.feed("n") == ""
    assert matcher.feed("x") == "<enx"  # not the stop string after all: released at once
    assert matcher.feed("ok<end>more") == "ok" and matcher.stopped
    assert matcher.feed("later") == ""


def test_no_stop_strings_releases_everything() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == "abc" and matcher.feed("d", final=True) == "d"


def test_completed_stop_strings_are_passed_over_until_armed() -> None:
    """min_tokens: a stop string generated too early is text like any other (vLLM)."""
    matcher = StopMatcher(["ab"])
    assert matcher.feed("xab", armed=False) == "xab"
    assert matcher.feed("ab", armed=True) == "" and matcher.stopped


def test_a_long_stop_string_that_keeps_almost_matching_stays_linear() -> None:
    """The issue's attack shape: text that is always a long prefix of the stop string. Each
    character is released once and each automaton step is amortised O(1): 200k characters
    against a 1024-character stop string finish in one pass (the old check was O(len(stop)^2)
    per token, ~10^11 steps here)."""
    stop = "a" * 1023 + "b"
    matcher = StopMatcher([stop])
    released = sum(len(matcher.feed("a")) for _ in range(200_000))
    assert released == 200_000 - 1023  # the last 1023 "a"s may still become the stop string
    assert matcher.feed("b") == "" and matcher.stopped
