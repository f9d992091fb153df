"""Over-length probe (S2): a request that cannot fit must be refused before anything runs.

Cases: a prompt longer than the context length; a prompt longer than the smallest reported KV
pool (the incident: context 1M, pool 285k); a short prompt whose max_tokens exceeds the context;
and, sized per endpoint from the server's own `usage.prompt_tokens` (`_Calibration`), a prompt of
about half the context whose max_tokens reaches 16 tokens past it (each fits alone, not together:
vLLM, SGLang and our router refuse it with a 400; SGLang clamps max_new_tokens only further down,
in its scheduler, after that check) and a prompt just over the context (by at most one repeated
unit of filler). The last two are left out, with a note, where the server reports no usage or its
counts of repeated units are not linear (a tokenizer whose counts cannot be extrapolated).
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


UNIT_WORDS = 16
"""Filler words in the unit the calibrated prompts repeat: their counts grow by one unit's tokens."""
SUM_MARGIN_TOKENS = 16
"""How far prompt + max_tokens reaches past the context in the calibrated case."""


@dataclass(frozen=True)
class OverLengthCase:
    name: str
    words: int
    max_tokens: int
    min_prompt_tokens: int  # the prompt has at least this many tokens
    units: int = 0  # > 0: the prompt is the calibration unit repeated this often (on `apis` only)
    apis: tuple[str, ...] = ()  # the endpoints this case goes to; empty: every configured one

    def describe(self) -> str:
        where = f" on {'/'.join(self.apis)}" if self.apis else ""
        if self.units:  # sized from the server's own counts: exact
            return f"{self.name} ({self.min_prompt_tokens:,} prompt tokens, max_tokens={self.max_tokens:,}{where})"
        if self.max_tokens > OVER_LENGTH_MAX_TOKENS:
            return f"{self.name} (max_tokens={self.max_tokens:,}{where})"
        return f"{self.name} ({self.words:,} words, >= {self.min_prompt_tokens:,} tokens{where})"


@dataclass(frozen=True)
class _Calibration:
    """One endpoint's prompt tokens for `units` repeats of the unit: fixed + units * per_unit."""

    fixed: int
    per_unit: int

    def tokens(self, units: int) -> int:
        return self.fixed + units * self.per_unit


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
        if ctx.spec.over_length.check_max_tokens:
            cases += await self._calibrated_cases(ctx, context, notes)
        requests = [
            (case, api, stream)
            for case in cases
            for api in (case.apis or ctx.spec.over_length.apis)
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

    async def _calibrated_cases(self, ctx: RunContext, context: int, notes: list[Evidence]) -> list[OverLengthCase]:
        """Per endpoint, the two cases sized from the server's own counts (see the module doc)."""
        half = ctx.estimate.words_at_most(context // 2) // UNIT_WORDS  # units in about half the context
        if half < 4:
            notes.append(Note(message="prompt + max_tokens > context not checked: the context is too short to size it"))
            return []
        if half * UNIT_WORDS * BYTES_PER_WORD > ctx.spec.over_length.max_prompt_bytes:  # before any calibration request
            notes.append(Note(message="prompt + max_tokens > context and prompt just over the context not checked: their "
                                      "prompts (half the context and more) are over maxPromptBytes"))  # fmt: skip
            return []
        cases = []
        for api in ctx.spec.over_length.apis:
            calibration, why = await _calibrate(ctx, api, half)
            if calibration is None:
                notes.append(Note(message=f"prompt + max_tokens > context and prompt just over the context not checked on {api}: {why}"))
                continue
            prompt = calibration.tokens(half)
            max_tokens = context - prompt + SUM_MARGIN_TOKENS
            if prompt < SUM_MARGIN_TOKENS or prompt + 1 > context:  # then it is one of the cases above
                continue
            cases.append(OverLengthCase("prompt + max_tokens > context length", half * UNIT_WORDS,
                                        max_tokens, prompt, units=half, apis=(api,)))  # fmt: skip
            over = math.ceil((context + 1 - calibration.fixed) / calibration.per_unit)
            cases.append(OverLengthCase("prompt just over the context length", over * UNIT_WORDS, OVER_LENGTH_MAX_TOKENS,
                                        calibration.tokens(over), units=over, apis=(api,)))  # fmt: skip
        return [c for c in cases if not _too_big(c, ctx, notes)]

    async def _send(self, ctx: RunContext, case: OverLengthCase, api: str, stream: bool) -> Completion:
        prompt = _unit_prompt(ctx, case.units) if case.units else filler_text(case.words, ctx.spec.seed + 3000)
        label = f"{case.name}: {api}, stream={str(stream).lower()}, {case.words} words, max_tokens={case.max_tokens}"
        return await ctx.target.complete(
            prompt, api=api, max_tokens=case.max_tokens, stream=stream, label=label,  # type: ignore[arg-type]
            disconnect_after_chunks=1 if stream else None,
        )


def _unit_prompt(ctx: RunContext, units: int) -> str:
    return " ".join([filler_text(UNIT_WORDS, ctx.spec.seed + 3100)] * units)


def _too_big(case: OverLengthCase, ctx: RunContext, notes: list[Evidence]) -> bool:
    if case.words * BYTES_PER_WORD <= ctx.spec.over_length.max_prompt_bytes:
        return False
    notes.append(Note(message=f"case '{case.name}' skipped: prompt over maxPromptBytes"))
    return True


async def _calibrate(ctx: RunContext, api: str, half: int) -> tuple[_Calibration | None, str]:
    """The endpoint's counts of 1, `half` // 2 and `half` units (each fits: a one-token answer),
    read from usage.prompt_tokens: (the linear count they fit, "") or (None, why not). Three
    points: a count the third does not confirm is not extrapolated."""
    counts = []
    for units in (1, half // 2, half):
        out = await ctx.target.complete(_unit_prompt(ctx, units), api=api, max_tokens=1,  # type: ignore[arg-type]
                                        label=f"over-length calibration: {api}, {units} unit(s)")  # fmt: skip
        if not out.ok or out.prompt_tokens is None:
            return None, out.describe_failure() if not out.ok else "the server reports no usage.prompt_tokens"
        counts.append(out.prompt_tokens)
    per_unit, rest = divmod(counts[2] - counts[0], half - 1)
    calibration = _Calibration(counts[0] - per_unit, per_unit)
    if rest or per_unit <= 0 or calibration.tokens(half // 2) != counts[1]:
        return None, f"prompt token counts {counts} of 1/{half // 2}/{half} repeated units are not linear"
    return calibration, ""


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
