"""Stop strings, matched as the text streams in, in time linear in the text generated.

A request's text grows by a few characters per token. The obvious check -- search the whole text
for every stop string, then hold back the longest suffix that is a prefix of one -- costs
O(len(stop)^2) per token; with a 1 MB stop string that stalled the engine thread for everyone
(issue 11). Here every stop string has a Knuth-Morris-Pratt automaton whose state is "how many
characters of this stop string the text currently ends with": each new character advances every
automaton in amortised O(1), the hold-back is simply the largest state, and each character is
released exactly once. Building the automata is O(total stop length), once per request.

Semantics: the request stops at the first stop string to be *completed* in the text (on a tie, the
longest one); the text before it is the output and the stop string itself is never emitted. Until
`armed` (min_tokens not reached yet) completed stop strings are passed over, as vLLM does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class _Automaton:
    __slots__ = ("pattern", "fail", "state")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.fail = _failure(pattern)
        self.state = 0  # the text ends with pattern[:state]

    def pass_over(self) -> None:
        """A completion that did not stop the request (not armed) is ordinary text: hold back only
        the part of it that may start the next occurrence."""
        if self.state == len(self.pattern):
            self.state = self.fail[self.state - 1]

    def advance(self, char: str) -> bool:
        """Feed one character; True when the pattern has just been completed."""
        pattern, k = self.pattern, self.state
        if k == len(pattern):  # completed earlier in this delta but passed over: go on from its border
            k = self.fail[k - 1]
        while k and pattern[k] != char:
            k = self.fail[k - 1]
        if pattern[k] == char:
            k += 1
        self.state = k
        return k == len(pattern)


class StopMatcher:
    """Feed text deltas; get back what may be shown now, and whether a stop string ended it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._automata = [_Automaton(s) for s in stops if s]
        self._held: deque[str] = deque()  # text not released yet (a possible start of a stop string)
        self._held_chars = 0
        self._front = 0  # characters of _held[0] already released
        self.stopped = False

    def feed(self, text: str, *, armed: bool = True, final: bool = False) -> str:
        """The text that can be released after `text` arrived. Once a stop string completes (while
        `armed`), returns the text before it and sets `stopped`; nothing is accepted afterwards."""
        if self.stopped:
            return ""
        if not self._automata:
            return self._release_all(text)
        for offset, char in enumerate(text):
            completed = [a for a in self._automata if a.advance(char)]
            if completed and armed:
                stop_len = max(len(a.pattern) for a in completed)
                self.stopped = True
                return self._release_before_stop(text[: offset + 1], stop_len)
        for automaton in self._automata:
            automaton.pass_over()
        self._held.append(text)
        self._held_chars += len(text)
        if final:
            return self._release(self._held_chars)
        hold = max(a.state for a in self._automata)
        return self._release(self._held_chars - hold)

    def _release_all(self, text: str) -> str:
        return text if not self._held else self._release(self._held_chars) + text

    def _release_before_stop(self, consumed: str, stop_len: int) -> str:
        self._held.append(consumed)
        self._held_chars += len(consumed)
        released = self._release(self._held_chars - stop_len)
        self._held.clear()
        self._held_chars = self._front = 0
        return released

    def _release(self, chars: int) -> str:
        """Take `chars` characters off the front of the held text. Each character is copied out
        once: a partly released piece stays where it is, with `_front` marking how much of it went."""
        out: list[str] = []
        while chars > 0 and self._held:
            piece = self._held[0]
            available = len(piece) - self._front
            take = min(available, chars)
            out.append(piece[self._front : self._front + take] if take < len(piece) else piece)
            self._held_chars -= take
            chars -= take
            if take == available:
                self._held.popleft()
                self._front = 0
            else:
                self._front += take
        return "".join(out)
