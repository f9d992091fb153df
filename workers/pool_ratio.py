"""S7's arithmetic, one definition for the planner, the readiness gates, the router and the launcher:
how many pool tokens `minKVRatio x contextLength` asks for, and how a ratio is shown.

Both are exact where float arithmetic is not: 1.1 x 50 is 55.000000000000001 in floats, so a pool of
exactly 55 tokens was judged below 1.1x and told to grow to 56 (an outside probe); and a pool of
1.9999x was printed "2.00x ... below minKVRatio 2".
"""

from __future__ import annotations

import math
from fractions import Fraction

DEFAULT_MIN_KV_RATIO = 2.0
"""S7: a KV pool holds at least this many full contexts unless a spec or flag says more."""

MAX_KV_RATIO = 100.0
"""The largest minKVRatio: 100 contexts per pool is far past any real need, and an unbounded
ratio (1e308) makes minKVRatio x contextLength infinite, which the planner cannot round to tokens."""


def required_pool_tokens(min_ratio: float, context_length: int, page_size: int = 1) -> int:
    """The fewest tokens that hold `min_ratio` x `context_length`, with the ratio read as written
    (its shortest decimal form: 1.1 is 11/10, not the binary float just above it). With pages, in
    whole pages of whole-page contexts: a request takes ceil(context / page) pages, so a pool of 3
    pages of 700 (2,100 tokens, 2.1 x a 1,000 context) holds one full-length request, not two (an
    outside probe). Where the page divides the context, this is the token count rounded up to pages."""
    return math.ceil(Fraction(repr(float(min_ratio))) * pages_per_context(context_length, page_size)) * page_size


def pages_per_context(context_length: int, page_size: int) -> int:
    """Pages a full-length request takes."""
    return -(-context_length // page_size)


def longest_context(pool_tokens: int, min_ratio: float, page_size: int = 1) -> int:
    """The longest context a pool of `pool_tokens` holds `min_ratio` times (`required_pool_tokens`
    inverted): whole pages of it."""
    pages = math.floor(Fraction(pool_tokens // page_size) / Fraction(repr(float(min_ratio))))
    return pages * page_size


def ratio_down(pool_tokens: float, context_length: float, decimals: int = 4) -> float:
    """`pool / context` rounded down to `decimals`, in exact arithmetic: a shortfall never reads
    as the ratio it misses, and an exact ratio never as the one below it (1130 / 1000 in floats
    is 1.1299999..., which read 1.1299 beside a pool judged sufficient at 1.13)."""
    scale = 10**decimals
    return math.floor(Fraction(pool_tokens) * scale / Fraction(context_length)) / scale


def ratio_number(value: float) -> str:
    """A ratio as people write it (`2`, `2.5`), never as another value: `:g` keeps six digits, so a
    minimum of 4.0000001 read "4" beside a 4.00x pool refused as below it (an outside probe), and a
    pod annotation written so (`render`) was read back by the pool gate as 4."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def ratio_text(pool_tokens: float, context_length: float) -> str:
    """`pool / context` to two decimals, rounded down (`ratio_down`)."""
    return f"{ratio_down(pool_tokens, context_length, 2):.2f}x"
