"""Greedy and seeded sampling (temperature, top-k, top-p).

The random draw for a request's i-th generated token depends only on (seed, i): the request's
generator is reseeded per token. So a seeded request samples the same tokens whatever shares its
batch, and whether its first token was sampled on a prefill worker and the rest on a decode
worker or all in one engine."""

from __future__ import annotations

import torch

from kvguard.workers.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Next token per row of float32 `logits` [B, vocab]; stays on the device (no host sync)."""
    tokens = logits.argmax(dim=-1)
    for row, request in enumerate(requests):
        if not request.params.greedy:
            tokens[row] = _sample_row(logits[row], request)
    return tokens


def _sample_row(logits: torch.Tensor, request: Request) -> torch.Tensor:
    params = request.params
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    assert request.generator is not None
    request.generator.manual_seed(token_seed(request.seed, len(request.output_ids)))
    return torch.multinomial(probs, 1, generator=request.generator)[0]


def token_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for the index-th generated token (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
