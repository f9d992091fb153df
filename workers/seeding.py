"""Seeds derived from a request's seed: pure arithmetic (no torch), shared by the engine's sampler and
the router (which gives each of a request's `n` choices a seed of its own)."""

from __future__ import annotations

MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix(z: int) -> int:
    """splitmix64's finaliser: every input bit affects every output bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def token_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for the index-th generated token (any int seed, negative included)."""
    return _mix((seed * 0x9E3779B97F4A7C15 + index + 1) & MASK64) & 0x7FFFFFFFFFFFFFFF


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice-th completion (n > 1): choice 0 keeps the request's own seed,
    so `n: 1` and the first of `n: 4` sample the same text; the others are independent of it and
    of the seeds a client might pick next to it (seed + 1, ...)."""
    if choice == 0:
        return seed
    return _mix((seed ^ (0xD1B54A32D192ED03 * choice)) & MASK64)
