"""Picking the next token: logit processing (min_tokens, logit_bias, penalties), greedy or seeded
sampling (temperature, top-k, top-p, min-p), and the log-probabilities a request asked for.

The random draw for a request's i-th generated token depends only on (seed, i): the request's
generator is reseeded per token. So a seeded request samples the same tokens whatever shares its
batch, and whether its first token was sampled on a prefill worker and the rest on a decode
worker or all in one engine. Penalties depend on the request's own output so far, which the decode
worker holds from its first token on (the one prefill sampled), so they agree across P/D too.

Work per token is O(vocab) per row that needs processing plus O(new tokens) to update the penalty
counts: never a pass over the request's whole history (issue 11).
Logprobs are the model's raw distribution (log-softmax of the logits, before temperature, penalties
and bias), as vLLM reports them by default: what a canary compares between two builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvguard.workers.protocol import TokenLogprob
from kvguard.workers.request import Request
from kvguard.workers.seeding import token_seed

LOGPROB_FLOOR = -9999.0  # what an underflowed log-probability is reported as (JSON has no -inf)


@dataclass
class LogitsState:
    """Per-request state of the logit processors, on the logits' device; made at the first sample."""

    counts: torch.Tensor  # [vocab] how often each token was generated so far (float)
    counted: int  # output tokens already in `counts`
    seen: torch.Tensor | None  # [vocab] bool: in the prompt or the output (repetition penalty)
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    banned: torch.Tensor | None  # end tokens masked until min_tokens are out

    @classmethod
    def create(cls, request: Request, vocab: int, device: torch.device) -> LogitsState:
        params = request.params
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.tensor([t for t in request.prompt_ids if t < vocab], dtype=torch.int64, device=device)
            seen[prompt] = True
        bias_ids = bias_values = None
        if params.logit_bias:
            bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)
            bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        banned = None
        if params.min_tokens and request.end_token_ids:
            ends = [t for t in request.end_token_ids if t < vocab]
            banned = torch.tensor(ends, dtype=torch.int64, device=device) if ends else None
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return cls(counts, 0, seen, bias_ids, bias_values, banned)

    def update(self, output_ids: list[int]) -> None:
        """Count the tokens generated since the last call (amortised O(1) per token)."""
        new = output_ids[self.counted :]
        if new:
            index = torch.tensor(new, dtype=torch.int64, device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones_like(index, dtype=self.counts.dtype))
            if self.seen is not None:
                self.seen[index] = True
            self.counted = len(output_ids)


@dataclass
class Sampled:
    """One step's picks: `tokens` [B] on the device; `logprobs` for the rows that asked."""

    tokens: torch.Tensor
    logprobs: LogprobRows | None = None

    def logprob_records(self, token_list: list[int]) -> dict[int, TokenLogprob]:
        """row -> its token's record (one host sync for all the rows that asked)."""
        return self.logprobs.records(token_list) if self.logprobs is not None else {}


@dataclass
class LogprobRows:
    rows: list[int]
    chosen: torch.Tensor  # [R] log-probability of the picked token
    top_values: torch.Tensor | None  # [R, K] best alternatives, K = the largest number asked for
    top_ids: torch.Tensor | None
    wanted: list[int]  # alternatives each row asked for (<= K)

    def records(self, token_list: list[int]) -> dict[int, TokenLogprob]:
        chosen = self.chosen.clamp(min=LOGPROB_FLOOR).tolist()
        values = self.top_values.clamp(min=LOGPROB_FLOOR).tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = {}
        for i, row in enumerate(self.rows):
            n = self.wanted[i]
            top = tuple(zip(ids[i][:n], values[i][:n])) if ids is not None and values is not None else ()
            out[row] = TokenLogprob(token_id=token_list[row], logprob=chosen[i], top=top)
        return out


def sample(logits: torch.Tensor, requests: list[Request]) -> Sampled:
    """Next token per row of float32 `logits` [B, vocab]; stays on the device (no host sync)."""
    tokens = logits.argmax(dim=-1)
    for row, request in enumerate(requests):
        params = request.params
        if params.greedy and not params.penalized:
            continue
        processed = _process(logits[row], request)
        tokens[row] = processed.argmax() if params.greedy else _draw(processed, request)
    return Sampled(tokens, _logprobs(logits, tokens, requests))


def _process(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """min_tokens, logit_bias, then repetition/frequency/presence penalties (vLLM's order)."""
    params = request.params
    if not params.penalized:
        return logits
    if request.logits_state is None:
        request.logits_state = LogitsState.create(request, logits.shape[-1], logits.device)
    state = request.logits_state
    state.update(request.output_ids)
    logits = logits.clone()
    if state.banned is not None and len(request.output_ids) < params.min_tokens:
        logits[state.banned] = float("-inf")
    if state.bias_ids is not None and state.bias_values is not None:
        logits.index_add_(0, state.bias_ids, state.bias_values)
    if state.seen is not None:
        penalty = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(state.seen, scaled, logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * state.counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (state.counts > 0).to(logits.dtype)
    return logits


def _draw(logits: torch.Tensor, request: Request) -> torch.Tensor:
    params = request.params
    # A tiny repetition penalty can push a logit to +inf; clamp so softmax stays a distribution
    # (the +inf tokens share the mass) instead of NaN that would fail the whole batch's step.
    finite = torch.finfo(logits.dtype).max
    logits = torch.nan_to_num(logits / params.temperature, nan=float("-inf"), posinf=finite)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    assert request.generator is not None
    request.generator.manual_seed(token_seed(request.seed, len(request.output_ids)))
    return torch.multinomial(probs, 1, generator=request.generator)[0]


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> LogprobRows | None:
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return None
    wanted = [int(requests[i].params.logprobs or 0) for i in rows]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    k = min(max(wanted), logprobs.shape[-1])
    if k == 0:
        return LogprobRows(rows, chosen, None, None, wanted)
    top = logprobs.topk(k, dim=-1)
    return LogprobRows(rows, chosen, top.values, top.indices, wanted)
