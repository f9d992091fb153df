"""S7's arithmetic, one definition for the planner, the readiness gates, the router and the launcher:
how many pool tokens `minKVRatio x contextLength` asks for, and how a ratio is shown.

Both are exact where float arithmetic is not: 1.1 x 50 is 55.000000000000001 in floats, so a pool of
exactly 55 tokens was judged below 1.1x and told to grow to 56 (an outside probe); and a pool of
1.9999x was printed "2.00x ... below minKVRatio 2".
"""

from __future__ import annotations

import math
from fractions import Fraction


def required_pool_tokens(min_ratio: float, context_length: int) -> int:
    """The fewest tokens that hold `min_ratio` x `context_length`, with the ratio read as written
    (its shortest decimal form: 1.1 is 11/10, not the binary float just above it)."""
    return math.ceil(Fraction(repr(float(min_ratio))) * context_length)


def ratio_text(pool_tokens: float, context_length: float) -> str:
    """`pool / context` to two decimals, rounded down: a shortfall never reads as the ratio it misses."""
    return f"{math.floor(pool_tokens / context_length * 100) / 100:.2f}x"
