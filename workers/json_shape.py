"""How much structure a request body may carry, checked on its bytes before any JSON is parsed.

Why: pydantic-core builds a body's arrays, objects and object members as Python objects, holding
the GIL throughout, so moving the parse to a tokenizer thread does not keep the router's event
loop serving. Those are what cost (1-2 us each; a number or a string in an array costs a tenth
of that): a 7.7 MB body of nested empty arrays held every tenant's requests for 4-5 s, and one
`logit_bias` of a million keys (refused only once built, for being over 1024) for 2.4 s. A
request needs a few per message, part or prompt (at most 4096 messages, 128 choices, 1024
logit_bias entries), so a body with more than MAX_JSON_ITEMS is refused here (413, as a body too
large), from a few `bytes.count` passes in the common case, before the parser sees it. Every
member counts, a null one too, so the bound can refuse a conversation the models would accept:
4096 messages of role, content and 9 text parts fit; one of 50,000 parts does not.

Numbers cost a tenth as much each, but 8 MB holds four million of them, and integers thousands
of digits long cost more: an outside probe's 2-6 connections sending such bodies (all refused in the
end) made another tenant's requests 15-60x slower. So values (array elements and members) are
bounded by the most a valid request to this router holds, and digits per value by the longest
number any parameter takes.

Counted outside strings only: a prompt may quote a JSON document whose brackets and colons are
text. The exact count, needed only when a rough one exceeds its bound (or, for the digits, which
are bounded per value, whenever a body with strings has more than one number's worth: a string's
commas are no values), strips the strings first: a regex match per string, so there the number of
strings is bounded first (a legitimate body has a few per message or part).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_JSON_ITEMS = 131_072
"""Arrays, objects and object members (`"key": value`) in one body. 4096 chat messages with up to
9 text parts each fit; a body of this many nested arrays or logit_bias entries held the GIL for
at most 0.13 s at a time here (2 loaded cores)."""
MAX_JSON_STRINGS = 262_144
"""Strings (keys included) in a body whose rough counts are over a bound: the bound on the exact
count's regex work (~40 ms), and more than any request holds."""
MAX_NUMBER_DIGITS = 20
"""Digits per value, on average, outside strings: the longest number a field takes is a seed
below 2**64. 2,000 integers of 4,000 digits (8 MB, few values) took 0.06-0.09 s to parse, and
0.45 s with the text of the refusal that quotes them (a review measured both)."""

_STRING = re.compile(rb'"[^"]*"')  # after escapes are removed a string holds no quote
_DIGITS = b"0123456789"


@dataclass(frozen=True)
class _Counts:
    """What a body's bytes hold: upper bounds when `raw` holds strings, exact once they are gone."""

    items: int  # arrays, objects and object members
    values: int  # array elements and members: a comma between each two, plus one
    digits: int

    @classmethod
    def of(cls, raw: bytes) -> _Counts:
        items = raw.count(b"[") + raw.count(b"{") + raw.count(b":")
        return cls(items, raw.count(b",") + 1, len(raw) - len(raw.translate(None, _DIGITS)))

    def problem(self, max_values: int) -> str | None:
        if self.items > MAX_JSON_ITEMS:
            return (f"the request body has {self.items} JSON arrays, objects and object members, more than the "
                    f"{MAX_JSON_ITEMS} the router parses")  # fmt: skip
        if self.values > max_values:
            return (f"the request body has {self.values} JSON values, more than the {max_values} any request to "
                    f"this router holds (its token-id prompts at the context length, for every choice)")  # fmt: skip
        if self.digits > MAX_NUMBER_DIGITS * self.values:
            return (f"the request body's numbers have {self.digits} digits, more than {MAX_NUMBER_DIGITS} per value; "
                    f"no parameter takes a number that long")  # fmt: skip
        return None


def json_shape_problem(raw: bytes, *, max_values: int) -> str | None:
    """Why `raw` carries more JSON structure than any request needs, or None. `max_values` bounds
    the array elements and members (numbers cost pydantic ~0.1 us each: 4 million one-digit token
    ids held the GIL for 0.4 s); the router allows every choice a token-id prompt of the context
    length. For a body that is not valid JSON the count covers its valid prefix at least, which is
    all a parser builds."""
    rough = _Counts.of(raw)
    if rough.problem(max_values) is None and (rough.digits <= MAX_NUMBER_DIGITS or b'"' not in raw):
        # The common case: within the bounds even counting what is inside strings. The digits'
        # bound is per value, and a string's commas are no values: it holds on rough counts only
        # where nothing is in strings or there are too few digits to matter (an outside review:
        # 400,000 commas in `user` let 1,850 integers of 4,000 digits through unstripped).
        return None
    bare = _without_escapes(raw)
    if (strings := bare.count(b'"') // 2) > MAX_JSON_STRINGS:
        return f"the request body has {strings} JSON strings, more than the {MAX_JSON_STRINGS} the router parses"
    return _Counts.of(_STRING.sub(b"", bare)).problem(max_values)


def _without_escapes(raw: bytes) -> bytes:
    """`raw` with every escaped backslash and escaped quote removed, so that each remaining quote
    opens or closes a string. Pairs of backslashes go first, left to right as a JSON parser reads
    them: `\\\\"` is an escaped backslash and then a closing quote."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")
