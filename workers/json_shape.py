"""How much structure a request body may carry, checked on its bytes before any JSON is parsed.

Why: pydantic-core builds a body's arrays, objects and object members as Python objects, holding
the GIL throughout, so moving the parse to a tokenizer thread does not keep the router's event
loop serving. Those are what cost (1-2 us each; a number or a string in an array costs a tenth
of that): a 7.7 MB body of nested empty arrays held every tenant's requests for 4-5 s, and one
`logit_bias` of a million keys (refused only once built, for being over 1024) for 2.4 s. A
request needs a few per message, part or prompt (at most 4096 messages, 128 choices, 1024
logit_bias entries), so a body with more than MAX_JSON_ITEMS is refused here (413, as a body too
large), from three `bytes.count` passes in the common case, before the parser sees it. Every
member counts, a null one too, so the bound can refuse a conversation the models would accept:
4096 messages of role, content and 9 text parts fit; one of 50,000 parts does not.

Counted outside strings only: a prompt may quote a JSON document whose brackets and colons are
text. The exact count, needed only when the rough one exceeds the bound, strips the strings
first: a regex match per string, so there the number of strings is bounded first (a legitimate
body has a few per message or part).
"""

from __future__ import annotations

import re

MAX_JSON_ITEMS = 131_072
"""Arrays, objects and object members (`"key": value`) in one body. 4096 chat messages with up to
9 text parts each fit; a body of this many nested arrays or logit_bias entries held the GIL for
at most 0.13 s at a time here (2 loaded cores)."""
MAX_JSON_STRINGS = 262_144
"""Strings (keys included) in a body whose rough count is over MAX_JSON_ITEMS: the bound on the
exact count's regex work (~40 ms)."""

_STRING = re.compile(rb'"[^"]*"')  # after escapes are removed a string holds no quote


def json_shape_problem(raw: bytes) -> str | None:
    """Why `raw` carries more JSON structure than any request needs, or None. For a body that is
    not valid JSON the count covers its valid prefix at least, which is all a parser builds."""
    if _items(raw) <= MAX_JSON_ITEMS:
        return None  # the common case: within the bound even counting what is inside strings
    bare = _without_escapes(raw)
    if (strings := bare.count(b'"') // 2) > MAX_JSON_STRINGS:
        return (f"the request body has {strings} JSON strings beside over {MAX_JSON_ITEMS} brackets and colons, more "
                f"than the {MAX_JSON_STRINGS} the router parses with that many")  # fmt: skip
    if (items := _items(_STRING.sub(b"", bare))) > MAX_JSON_ITEMS:
        return (f"the request body has {items} JSON arrays, objects and object members, more than the "
                f"{MAX_JSON_ITEMS} the router parses")  # fmt: skip
    return None


def _items(raw: bytes) -> int:
    """Arrays, objects and members, if `raw` holds no strings; an upper bound if it does."""
    return raw.count(b"[") + raw.count(b"{") + raw.count(b":")


def _without_escapes(raw: bytes) -> bytes:
    """`raw` with every escaped backslash and escaped quote removed, so that each remaining quote
    opens or closes a string. Pairs of backslashes go first, left to right as a JSON parser reads
    them: `\\\\"` is an escaped backslash and then a closing quote."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")
