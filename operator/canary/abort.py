"""Abort probe (S4): a client that goes away must free everything, and leave nothing behind.

Disconnects a streaming request after a few chunks (mid-decode) and a long-prompt request shortly
after sending it (mid-prefill). Both ask for as many tokens as fit, so an engine that does not
propagate the abort keeps their pages busy until the generation ends on its own. After each cut,
when metrics are reachable, the KV pool's used tokens must fall back to the level measured before
it within a deadline: `poolRecoveryTimeoutSeconds`, and also `poolRecoveryFraction` of the time the
request would have needed to finish (its remaining tokens x the gap between its streamed chunks),
never less than 1 s. The second bound keeps the probe sharp on fast hardware, where a whole
generation may take less than the fixed timeout. Finally request B must still give its solo
output (an aborted request's pages were reused safely, S5).
"""

from __future__ import annotations

import asyncio
import time

from kvguard.operator.canary.base import Outcome, Probe, RunContext, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.isolation import check_b
from kvguard.operator.canary.metrics import counter_totals, total_used_tokens
from kvguard.operator.canary.prompts import filler_text
from kvguard.operator.canary.report import Evidence, Note, PoolUsage
from kvguard.operator.canary.spec import ProbeName

POLL_INTERVAL_SECONDS = 0.05
MIN_RECOVERY_SECONDS = 1.0  # a correct engine frees within one scheduler step; scrapes add a little
SHORT_PROMPT_WORDS = 32


class AbortProbe(Probe):
    name = ProbeName.ABORT

    async def run(self, ctx: RunContext) -> Outcome:
        counter_names = ctx.spec.safety_counters.counters
        before = await ctx.snapshots()
        problems: list[str] = []
        evidence: list[Evidence] = []
        if total_used_tokens(before) is None:
            evidence.append(Note(message="pool usage not checked: no reachable metrics report KV usage"))
        seconds_per_token = await self._disconnect_mid_decode(ctx, problems, evidence)
        await self._disconnect_mid_prefill(ctx, seconds_per_token, problems, evidence)
        if ctx.spec.abort.check_isolation_after:
            await self._isolation_after(ctx, problems, evidence)
        ctx.abort_window = (counter_totals(before, counter_names), counter_totals(await ctx.snapshots(), counter_names))
        if problems:
            return failed(problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        return passed(self._summary(ctx, evidence), evidence)

    def _summary(self, ctx: RunContext, evidence: list[Evidence]) -> str:
        spec = ctx.spec.abort
        recoveries = [e for e in evidence if isinstance(e, PoolUsage)]
        cuts = f"{len(spec.stream_disconnect_after_tokens)} mid-decode and {len(spec.prefill_disconnect_after_seconds)} mid-prefill disconnect(s)"
        pool = (
            f"KV pool back to its baseline after {len(recoveries)} of them (slowest {max(r.waited_seconds for r in recoveries):.2f} s)"
            if recoveries else "pool usage not checked (no metrics report KV usage)"
        )
        after = "; B still gives its solo output" if spec.check_isolation_after else ""
        return f"{cuts}: {pool}{after}"

    def _long_generation(self, ctx: RunContext, prompt_tokens: int) -> int:
        """As many tokens as fit after the prompt: a non-propagated abort then holds pages for long."""
        return max(ctx.spec.max_tokens, ctx.admissible_tokens(0) - prompt_tokens - 32)

    async def _disconnect_mid_decode(
        self, ctx: RunContext, problems: list[str], evidence: list[Evidence]
    ) -> float | None:
        """Cut streams mid-decode; returns the measured seconds per streamed chunk, if any."""
        seconds_per_token: float | None = None
        prompt = filler_text(SHORT_PROMPT_WORDS, ctx.spec.seed + 4000)
        prompt_tokens = int(SHORT_PROMPT_WORDS * (ctx.estimate.tokens_per_word or 5) * 1.2)
        max_tokens = self._long_generation(ctx, prompt_tokens)
        for after in ctx.spec.abort.stream_disconnect_after_tokens:
            baseline = await self._used(ctx)
            out = await ctx.target.complete(
                prompt, api=ctx.spec.api, max_tokens=max_tokens, stream=True,
                disconnect_after_chunks=after, label=f"stream cut after {after} chunk(s)",
            )
            if out.status != 200 or (out.error and not out.disconnected):
                problems.append(f"streaming request to be aborted failed first: {out.describe_failure()}")
                evidence.append(out.evidence())
                continue
            if not out.disconnected:
                evidence.append(Note(message=f"{out.label}: stream finished before the cut ({out.chunks} chunks)"))
                continue
            seconds_per_token = out.seconds_per_chunk() or seconds_per_token
            natural = _natural_remaining_seconds(out, max_tokens)
            await self._await_recovery(ctx, out.label, baseline, natural, problems, evidence)
        return seconds_per_token

    async def _disconnect_mid_prefill(
        self, ctx: RunContext, seconds_per_token: float | None, problems: list[str], evidence: list[Evidence]
    ) -> None:
        spec = ctx.spec.abort
        prompt_tokens = int(ctx.admissible_tokens(ctx.spec.max_tokens) * spec.prefill_prompt_fraction)
        words = ctx.estimate.words_at_most(prompt_tokens)
        prompt = filler_text(words, ctx.spec.seed + 5000)
        max_tokens = self._long_generation(ctx, prompt_tokens)
        natural = seconds_per_token * max_tokens if seconds_per_token else None
        for delay in spec.prefill_disconnect_after_seconds:
            baseline = await self._used(ctx)
            out = await ctx.target.disconnect_during_prefill(
                prompt, api=ctx.spec.api, max_tokens=max_tokens,
                after_seconds=delay, label=f"{words}-word prompt cut {delay:g} s after sending",
            )
            if not out.disconnected:
                if out.status != 200 or out.error:
                    problems.append(f"long request failed before the cut: {out.describe_failure()}")
                    evidence.append(out.evidence())
                else:
                    evidence.append(Note(message=f"{out.label}: answered before the cut; prefill abort not exercised"))
                continue
            await self._await_recovery(ctx, out.label, baseline, natural, problems, evidence)

    async def _isolation_after(self, ctx: RunContext, problems: list[str], evidence: list[Evidence]) -> None:
        prompt = ctx.spec.isolation.probe_prompt
        reference = await ctx.solo(prompt)
        if not reference.ok:
            problems.append(f"B failed: {reference.describe_failure()}")
            evidence.append(reference.evidence())
            return
        after = await ctx.target.complete(prompt, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label="B after the aborts")
        check_b(after, reference, {}, problems, evidence)

    async def _used(self, ctx: RunContext) -> float | None:
        return total_used_tokens(await ctx.snapshots()) if ctx.metrics_urls else None

    async def _await_recovery(
        self,
        ctx: RunContext,
        label: str,
        baseline: float | None,
        natural_seconds: float | None,
        problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        """Poll used tokens until back at `baseline`; fail past the deadline (see module doc)."""
        if baseline is None:
            return
        spec = ctx.spec.abort
        deadline = recovery_deadline(spec.pool_recovery_timeout_seconds, spec.pool_recovery_fraction, natural_seconds)
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
            if elapsed >= deadline:
                natural = f"; it would have finished on its own in ~{natural_seconds:.1f} s" if natural_seconds else ""
                problems.append(
                    f"{label}: KV pool still holds {used - baseline:g} tokens {elapsed:.1f} s after the "
                    f"disconnect (deadline {deadline:.1f} s{natural}): the abort did not free its pages"
                )
                break
            await asyncio.sleep(POLL_INTERVAL_SECONDS)
        evidence.append(
            PoolUsage(baseline_tokens=baseline, final_tokens=used, waited_seconds=round(time.monotonic() - started, 3), samples=samples[-40:])
        )


def _natural_remaining_seconds(out: Completion, max_tokens: int) -> float | None:
    per_chunk = out.seconds_per_chunk()
    if per_chunk is None:
        return None
    return per_chunk * max(0, max_tokens - out.chunks)


def recovery_deadline(timeout: float, fraction: float, natural_seconds: float | None) -> float:
    """Seconds an aborted request's pages may stay in use after the disconnect."""
    if natural_seconds is None:
        return timeout
    return min(timeout, max(MIN_RECOVERY_SECONDS, fraction * natural_seconds))
