"""How much structure a request body may carry, checked on its bytes before any JSON is parsed.

Why: pydantic-core builds every JSON array and object of a body as Python objects, holding the GIL
throughout, so moving the parse to a tokenizer thread does not keep the router's event loop
serving. Arrays and objects are what cost (about 1 us each; a number or a short string costs well
under a tenth of that): a 7.7 MB body of nested empty arrays held every tenant's requests for 4-5 s
before it was refused. No request the API accepts needs more than a few per message or prompt
(at most 4096 messages, 128 choices), so a body with more is refused here, from two `bytes.count`
passes in the common case, before the parser sees it.

Counted outside strings only: a prompt may quote a JSON document whose brackets are text. The
exact count, needed only when the brackets alone exceed the bound, strips the strings first: a
regex match per string, so there the number of strings is bounded first (a legitimate body has a
few per message or part).
"""

from __future__ import annotations

import re

MAX_JSON_CONTAINERS = 65_536
"""Arrays and objects in one body: 4096 messages with a list of text parts each fit many times
over; parsing this many costs under 0.1 s of the GIL."""
MAX_JSON_STRINGS = 262_144
"""Strings (keys included) in a body with over MAX_JSON_CONTAINERS brackets: the bound on the exact
count's regex work (~40 ms)."""

_STRING = re.compile(rb'"[^"]*"')  # after escapes are removed a string holds no quote


def json_shape_problem(raw: bytes) -> str | None:
    """Why `raw` carries more JSON structure than any request needs, or None. For a body that is
    not valid JSON the count covers its valid prefix at least, which is all a parser builds."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_CONTAINERS:
        return None  # the common case: within the bound even counting the brackets inside strings
    bare = _without_escapes(raw)
    if (strings := bare.count(b'"') // 2) > MAX_JSON_STRINGS:
        return (f"the request body has over {MAX_JSON_CONTAINERS} brackets and {strings} JSON strings, more than "
                f"the {MAX_JSON_STRINGS} any request with that many needs")  # fmt: skip
    outside = _STRING.sub(b"", bare)
    if (containers := outside.count(b"[") + outside.count(b"{")) > MAX_JSON_CONTAINERS:
        return (f"the request body has {containers} JSON arrays and objects, more than the {MAX_JSON_CONTAINERS} "
                "any request needs")  # fmt: skip
    return None


def _without_escapes(raw: bytes) -> bytes:
    """`raw` with every escaped backslash and escaped quote removed, so that each remaining quote
    opens or closes a string. Pairs of backslashes go first, left to right as a JSON parser reads
    them: `\\\\"` is an escaped backslash and then a closing quote."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")
