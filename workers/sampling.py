"""Greedy and seeded sampling (temperature, top-k, top-p), one generator per request so a
request's samples do not depend on what else is in its batch."""

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
    return torch.multinomial(probs, 1, generator=request.generator)[0]
