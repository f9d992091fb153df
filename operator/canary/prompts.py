"""Prompt text for the probes, and sizing it in tokens without knowing the tokenizer (pure).

Prompts are space-separated pseudo-random words. With a byte-level tokenizer a word costs its bytes
(the worst case); BPE tokenizers spend at least one token per space-separated word. A calibration
request (its `usage.prompt_tokens`) narrows the estimate when the server reports usage; without it
the bounds below stay safe in both directions: "at most N tokens" assumes one token per byte,
"at least N tokens" assumes one token per word.
"""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass

from kvguard.operator.canary.spec import LONG_PROMPT_MIN_TOKENS, MAX_CONTEXT_TOKENS

WORD_LETTERS = "bcdfghjklmnpqrstvwxz"  # no hex letters a-f: filler can never spell part of a nonce
WORD_LENGTH = 4
BYTES_PER_WORD = WORD_LENGTH + 1  # the leading space
CALIBRATION_WORDS = 64
USAGE_TEMPLATE_TOKENS = 256  # what a chat template may add around the calibration prompt
USAGE_MIN_WORDS_PER_TOKEN = 4  # no tokenizer packs more filler words than this into one token
FALLBACK_PROMPT_TOKENS = 1024  # without a known limit: long enough to span many pages of any page size


def make_nonce(length: int) -> str:
    """A secret that no model output contains by chance: hex digits, from the OS's CSPRNG."""
    return secrets.token_hex((length + 1) // 2)[:length]


MAX_FILLER_WORDS = MAX_CONTEXT_TOKENS * USAGE_MIN_WORDS_PER_TOKEN
"""The most filler words any prompt is built of: the longest context the canary sizes prompts from,
at the most words a tokenizer packs into a token. The list is built synchronously on the operator's
event loop, where no timeout can stop it: a long-request fraction of 1e300 built one until memory
ran out (outside probe), so a count above this is refused here whatever asked for it."""


def filler_words(count: int, seed: int) -> list[str]:
    if count > MAX_FILLER_WORDS:
        raise ValueError(f"{count:,} filler words asked for; at most {MAX_FILLER_WORDS:,} (the longest context)")
    rng = random.Random(seed)
    return ["".join(rng.choices(WORD_LETTERS, k=WORD_LENGTH)) for _ in range(count)]


def filler_text(words: int, seed: int, nonce: str | None = None, nonce_every: int = 48) -> str:
    """`words` filler words; with a nonce, it opens the text and recurs every `nonce_every` words
    so that every KV page written for this prompt holds a copy of it."""
    parts = filler_words(max(words, 1), seed)
    if nonce is not None:
        parts = [nonce if i % nonce_every == 0 else w for i, w in enumerate(parts)]
    return " ".join(parts)


@dataclass(frozen=True)
class TokenEstimate:
    """Tokens per filler word: measured (calibrated) or unknown (then bounds are worst-case)."""

    tokens_per_word: float | None = None

    @classmethod
    def from_usage(cls, prompt_tokens: int | None, words: int = CALIBRATION_WORDS) -> TokenEstimate:
        """Measured from one answer's usage.prompt_tokens, when it is possible at all: no tokenizer
        makes more tokens than bytes (a chat template adds a bounded few), and none fewer than a
        token per USAGE_MIN_WORDS_PER_TOKEN filler words. A count outside that is not believed
        (the estimate stays unknown: worst-case bounds): sized from a count three times too
        high, the over-length probe sent prompts the server rightly accepted, and failed it as
        the incident (an outside probe)."""
        if not prompt_tokens or prompt_tokens <= 0:
            return cls(None)
        if not words / USAGE_MIN_WORDS_PER_TOKEN <= prompt_tokens <= words * BYTES_PER_WORD + USAGE_TEMPLATE_TOKENS:
            return cls(None)
        return cls(prompt_tokens / words)

    def words_at_most(self, tokens: int) -> int:
        """Words whose prompt stays at or under `tokens` tokens."""
        per_word = self.tokens_per_word * 1.15 if self.tokens_per_word else float(BYTES_PER_WORD)
        return max(1, math.floor(tokens / per_word))

    def tokens_for(self, words: int) -> str:
        """The estimated tokens of `words` filler words, as text ("~N" measured, "<=N" worst case)."""
        if self.tokens_per_word:
            return f"~{round(words * self.tokens_per_word):,}"
        return f"<={words * BYTES_PER_WORD:,}"

    def words_at_least(self, tokens: int) -> int:
        """Words whose prompt has more than `tokens` tokens."""
        per_word = self.tokens_per_word * 0.85 if self.tokens_per_word else 1.0
        return math.ceil(tokens / per_word) + 8


def admissible_prompt_tokens(
    context_length: int | None, min_pool_tokens: float | None, reserve_tokens: int
) -> int:
    """The longest prompt every node should accept, leaving `reserve_tokens` for generation.

    Without any known limit, FALLBACK_PROMPT_TOKENS; never above MAX_CONTEXT_TOKENS (a pool a
    server reports can be any number, and the prompt is built in memory).
    """
    limits = [int(x) for x in (context_length, min_pool_tokens) if x]
    limit = min(min(limits), MAX_CONTEXT_TOKENS) if limits else FALLBACK_PROMPT_TOKENS
    return max(LONG_PROMPT_MIN_TOKENS, limit - reserve_tokens - 16)
