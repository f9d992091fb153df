"""Abort probe (S4): a client that goes away must free everything, and leave nothing behind.

Disconnects a streaming request after a few chunks (mid-decode) and a long-prompt request shortly
after sending it (mid-prefill). Both ask for as many tokens as fit, so an engine that does not
propagate the abort keeps their pages busy for a long time. Then:
- request B must still give its solo output (an aborted request's pages were reused safely, S5);
- when metrics are reachable, the KV pool's used tokens must fall back to the level measured
  before the aborts within `poolRecoveryTimeoutSeconds`.
"""

from __future__ import annotations

import asyncio
import time

from kvguard.operator.canary.base import Outcome, Probe, RunContext, failed, passed
from kvguard.operator.canary.isolation import check_b
from kvguard.operator.canary.metrics import counter_totals, total_used_tokens
from kvguard.operator.canary.prompts import filler_text
from kvguard.operator.canary.report import Evidence, Note, PoolUsage
from kvguard.operator.canary.spec import ProbeName

POLL_INTERVAL_SECONDS = 0.1


class AbortProbe(Probe):
    name = ProbeName.ABORT

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.abort
        counter_names = ctx.spec.safety_counters.counters
        before = await ctx.snapshots()
        baseline_used = total_used_tokens(before)
        problems: list[str] = []
        evidence: list[Evidence] = []
        await self._disconnect_mid_decode(ctx, problems, evidence)
        await self._disconnect_mid_prefill(ctx, problems, evidence)
        if spec.check_isolation_after:
            await self._isolation_after(ctx, problems, evidence)
        if baseline_used is None:
            evidence.append(Note(message="pool usage not checked: no reachable metrics report KV usage"))
        else:
            await self._await_pool_recovery(ctx, baseline_used, problems, evidence)
        ctx.abort_window = (counter_totals(before, counter_names), counter_totals(await ctx.snapshots(), counter_names))
        if problems:
            return failed(problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        return passed("aborted requests left no trace" + ("" if baseline_used is None else "; pool usage recovered"), evidence)

    def _long_generation(self, ctx: RunContext, prompt_tokens: int) -> int:
        """As many tokens as fit after the prompt: a non-propagated abort then holds pages for long."""
        return max(ctx.spec.max_tokens, ctx.admissible_tokens(0) - prompt_tokens - 32)

    async def _disconnect_mid_decode(self, ctx: RunContext, problems: list[str], evidence: list[Evidence]) -> None:
        prompt = filler_text(32, ctx.spec.seed + 4000)
        prompt_tokens = int(32 * (ctx.estimate.tokens_per_word or 5) * 1.2)
        for after in ctx.spec.abort.stream_disconnect_after_tokens:
            out = await ctx.target.complete(
                prompt, api=ctx.spec.api, max_tokens=self._long_generation(ctx, prompt_tokens), stream=True,
                disconnect_after_chunks=after, label=f"stream cut after {after} chunk(s)",
            )
            if out.status != 200 or (out.error and not out.disconnected):
                problems.append(f"streaming request to be aborted failed first: {out.describe_failure()}")
                evidence.append(out.evidence())
            elif not out.disconnected:
                evidence.append(Note(message=f"{out.label}: stream finished before the cut ({out.chunks} chunks)"))

    async def _disconnect_mid_prefill(self, ctx: RunContext, problems: list[str], evidence: list[Evidence]) -> None:
        spec = ctx.spec.abort
        budget = ctx.admissible_tokens(ctx.spec.max_tokens)
        prompt_tokens = int(budget * spec.prefill_prompt_fraction)
        words = ctx.estimate.words_at_most(prompt_tokens)
        prompt = filler_text(words, ctx.spec.seed + 5000)
        for delay in spec.prefill_disconnect_after_seconds:
            out = await ctx.target.disconnect_during_prefill(
                prompt, api=ctx.spec.api, max_tokens=self._long_generation(ctx, prompt_tokens),
                after_seconds=delay, label=f"{words}-word prompt cut {delay:g} s after sending",
            )
            if out.disconnected:
                continue
            if out.status != 200 or out.error:
                problems.append(f"long request failed before the cut: {out.describe_failure()}")
                evidence.append(out.evidence())
            else:
                evidence.append(Note(message=f"{out.label}: answered before the cut; prefill abort not exercised"))

    async def _isolation_after(self, ctx: RunContext, problems: list[str], evidence: list[Evidence]) -> None:
        prompt = ctx.spec.isolation.probe_prompt
        reference = await ctx.solo(prompt)
        if not reference.ok:
            problems.append(f"B failed: {reference.describe_failure()}")
            evidence.append(reference.evidence())
            return
        after = await ctx.target.complete(prompt, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label="B after the aborts")
        check_b(after, reference, {}, problems, evidence)

    async def _await_pool_recovery(
        self, ctx: RunContext, baseline: float, problems: list[str], evidence: list[Evidence]
    ) -> None:
        spec = ctx.spec.abort
        started = time.monotonic()
        samples: list[tuple[float, float]] = []
        used = baseline
        while True:
            used_now = total_used_tokens(await ctx.snapshots())
            elapsed = time.monotonic() - started
            if used_now is not None:
                used = used_now
                samples.append((round(elapsed, 3), used))
                if used <= baseline + spec.pool_usage_tolerance_tokens:
                    break
            if elapsed >= spec.pool_recovery_timeout_seconds:
                problems.append(
                    f"KV pool usage still {used:g} tokens {elapsed:.1f} s after the aborts (baseline {baseline:g}): "
                    "pages of aborted requests were not freed"
                )
                break
            await asyncio.sleep(POLL_INTERVAL_SECONDS)
        evidence.append(PoolUsage(baseline_tokens=baseline, final_tokens=used, waited_seconds=round(time.monotonic() - started, 3), samples=samples[-50:]))
