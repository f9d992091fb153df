"""Over-length probe (S2): a request that cannot fit must be refused before anything runs.

Cases: a prompt longer than the context length; a prompt longer than the smallest reported KV
pool (the incident: context 1M, pool 285k); a short prompt whose max_tokens exceeds the context.
Each goes to every configured endpoint, streamed and not. The verdict per request:
- any HTTP 200 fails, whatever the body says (the incident's engine answered 200 with another
  user's text; an SSE error frame after a 200 means the request was admitted);
- a 5xx, a timeout or a dropped connection fails (not a clean intake rejection);
- a 400, 413 or 422 passes if it carries no generated text: the statuses engines refuse a request
  with for what it asks (OpenAI, vLLM, SGLang and ours: 400; TGI: 422; a body limit in front:
  413). The nested OpenAI/vLLM body `{"error": {...}}` and SGLang's flat `{"object": "error", ...}`
  are both accepted; a code other than `context_length_exceeded` is noted, not failed, since other
  engines use other codes;
- a 404 or 405 says the endpoint is not served at all: nothing to reject there, so it is noted and
  proves nothing (a probe in which every request got one is skipped);
- any other 4xx (401, 403, 429, ...) refused the caller, not the length: it fails, since it says
  nothing about what the engine does with an over-length prompt.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.prompts import BYTES_PER_WORD, filler_text
from kvguard.operator.canary.report import Evidence, Note
from kvguard.operator.canary.spec import ProbeName

OVER_LENGTH_MAX_TOKENS = 4
LENGTH_REJECTION_STATUSES = frozenset({400, 413, 422})
NOT_SERVED_STATUSES = frozenset({404, 405})


@dataclass(frozen=True)
class OverLengthCase:
    name: str
    words: int
    max_tokens: int
    min_prompt_tokens: int  # the prompt has at least this many tokens

    def describe(self) -> str:
        if self.max_tokens > OVER_LENGTH_MAX_TOKENS:
            return f"{self.name} (max_tokens={self.max_tokens:,})"
        return f"{self.name} ({self.words:,} words, >= {self.min_prompt_tokens:,} tokens)"


class OverLengthProbe(Probe):
    name = ProbeName.OVER_LENGTH

    async def run(self, ctx: RunContext) -> Outcome:
        context = ctx.info.context_length
        if not context:
            raise ProbeSkipped(
                "context length unknown: no usable max_model_len in /v1/models, no /server_info context_length, no "
                "metrics; pass --context-length or set spec.canary.contextLength"
            )
        notes: list[Evidence] = []
        cases = self._cases(ctx, context, notes)
        requests = [
            (case, api, stream)
            for case in cases
            for api in ctx.spec.over_length.apis
            for stream in ctx.spec.over_length.streaming
        ]
        # Concurrent: a correct engine answers each at once; a broken one must not make us wait
        # for its generations one after another.
        results = await asyncio.gather(*(self._send(ctx, c, api, stream) for c, api, stream in requests))
        problems: list[str] = []
        evidence: list[Evidence] = []
        for result in results:
            problem, note = judge_rejection(result)
            if problem:
                problems.append(problem)
                evidence.append(result.evidence())
            elif note:
                notes.append(Note(message=note))
        if problems:
            return failed(f"{len(problems)} of {len(results)} over-length request(s) not rejected cleanly; first: {problems[0]}", evidence + notes)
        if not results:
            raise ProbeSkipped("every case was over maxPromptBytes")
        rejected = sum(r.status in LENGTH_REJECTION_STATUSES for r in results)
        if not rejected:
            raise ProbeSkipped(f"no endpoint tested is served (HTTP {sorted({r.status for r in results if r.status is not None})}): set overLength.apis")
        what = "; ".join(case.describe() for case in cases)
        endpoints = f"{'/'.join(ctx.spec.over_length.apis)} x stream={'/'.join(str(x).lower() for x in ctx.spec.over_length.streaming)}"
        source = ctx.info.context_length_source
        return passed(
            f"{rejected} over-length requests rejected with 4xx and no tokens ({endpoints}; context {context:,} "
            f"from {source}): {what}", notes,
        )

    def _cases(self, ctx: RunContext, context: int, notes: list[Evidence]) -> list[OverLengthCase]:
        spec = ctx.spec.over_length
        over_context = math.ceil(context * spec.context_factor)
        wanted = [OverLengthCase("prompt > context length", ctx.estimate.words_at_least(over_context), OVER_LENGTH_MAX_TOKENS, over_context)]
        pool = ctx.info.min_pool_tokens
        if spec.check_pool and pool:
            over_pool = math.ceil(pool * 1.05) + 16
            wanted.append(OverLengthCase(f"prompt > KV pool ({pool:,} tokens)", ctx.estimate.words_at_least(over_pool), OVER_LENGTH_MAX_TOKENS, over_pool))
        if spec.check_max_tokens:
            wanted.append(OverLengthCase("max_tokens > context length", 8, context + 1, 8))
        cases = []
        for case in wanted:
            if case.words * BYTES_PER_WORD > spec.max_prompt_bytes:
                notes.append(Note(message=f"case '{case.name}' skipped: prompt over maxPromptBytes"))
            else:
                cases.append(case)
        return cases

    async def _send(self, ctx: RunContext, case: OverLengthCase, api: str, stream: bool) -> Completion:
        prompt = filler_text(case.words, ctx.spec.seed + 3000)
        label = f"{case.name}: {api}, stream={str(stream).lower()}, {case.words} words, max_tokens={case.max_tokens}"
        return await ctx.target.complete(
            prompt, api=api, max_tokens=case.max_tokens, stream=stream, label=label,  # type: ignore[arg-type]
            disconnect_after_chunks=1 if stream else None,
        )


def judge_rejection(result: Completion) -> tuple[str | None, str | None]:
    """(problem, note) for one over-length request; a None problem means a clean rejection."""
    if result.status is None:
        return f"{result.label}: no HTTP response ({result.error})", None
    if result.status == 200:
        got = f"{result.chunks} chunk(s) of text" if result.chunks else "no text"
        return f"{result.label}: accepted with HTTP 200 ({got}) instead of a 4xx", None
    if not 400 <= result.status < 500:
        return f"{result.label}: HTTP {result.status}, expected a 4xx rejection", None
    if result.text or result.chunks:
        return f"{result.label}: HTTP {result.status} but text was generated", None
    if result.status in NOT_SERVED_STATUSES:
        return None, f"{result.label}: HTTP {result.status}: the endpoint is not served, nothing was tested there"
    if result.status not in LENGTH_REJECTION_STATUSES:
        return (
            f"{result.label}: HTTP {result.status} refuses the caller, not the length "
            f"(expected {'/'.join(map(str, sorted(LENGTH_REJECTION_STATUSES)))})"
        ), None
    if result.error and "context_length_exceeded" not in result.body:
        return None, f"{result.label}: rejected with HTTP {result.status} ({result.error}) without code context_length_exceeded"
    return None, None
