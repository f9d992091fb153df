"""Abort probe (S4): a client that goes away must free everything, and leave nothing behind.

Disconnects a streaming request after a few chunks (mid-decode) and a long-prompt request shortly
after sending it (mid-prefill). Both ask for as many tokens as fit, so an engine that does not
propagate the abort keeps their pages busy until the generation ends on its own. After each cut,
when metrics are reachable, the KV pool's used tokens must fall back to the level measured before
it within a deadline: `poolRecoveryTimeoutSeconds`, and also `poolRecoveryFraction` of the time the
request would have needed to finish (its remaining tokens x the gap between its streamed chunks),
never less than 1 s. The second bound keeps the probe sharp on fast hardware, where a whole
generation may take less than the fixed timeout. Because that bound can be a second, a cut whose
pages come back late (after the deadline, before the timeout) is made once more, from a baseline
taken after they came back, and fails the probe only if it is late again: a healthy worker
descheduled once passes, an engine that ignores aborts is late every time. A cut whose pages come
back in time but after the 1 s floor is made once more too, and that one must be in time: the
deadline rests on an estimate of the engine's speed that load can stretch. Where the workers count
the tokens they generate, no estimate is needed for the plainest failure: a cut request that went
on to generate at least half of what it had left before its pages came back ran on; it is cut once
more, as a late one is (a correct decode whose router was descheduled runs on once, an engine that
ignores aborts after every cut), and fails the probe if that one runs on too (the counters assume a
quiet target, as the pool baseline does). Finally request B must still give its solo
output (an aborted request's pages were reused safely, S5), and no answer heard during the probe
(the cut streams included) may carry another request's nonce.

The reason counts only the disconnects that happened: a cut planned after N chunks of a stream
that ended sooner, or a prefill cut after the server already answered, is "not exercised"; with
none exercised the probe is skipped, since nothing about aborts was shown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, empty_answer, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.isolation import check_b, report_leaks
from kvguard.operator.canary.metrics import WorkerSnapshot, counter_totals, generated_tokens, total_used_tokens
from kvguard.operator.canary.prompts import filler_text
from kvguard.operator.canary.report import Evidence, NonceLeak, Note, PoolUsage
from kvguard.operator.canary.spec import ProbeName

POLL_INTERVAL_SECONDS = 0.05
MIN_RECOVERY_SECONDS = 1.0  # a correct engine frees within one scheduler step; scrapes add a little
# A cut request that went on to generate this share of the tokens it had left, before its pages came
# back, ran on: its abort was not propagated, whatever the timing says. A correct engine stops
# within a step or two; the least share the check is made on keeps those few tokens from counting.
RAN_ON_FRACTION = 0.5
MIN_TOKENS_LEFT = 32
SHORT_PROMPT_WORDS = 32


@dataclass
class Cuts:
    """Which planned disconnects really happened: a fast server may answer before the cut, and a
    reason must not claim a disconnect that was never exercised."""

    decode: int = 0
    prefill: int = 0
    late: int = 0  # cuts made again because the first one's pages came back after the deadline or the floor
    missed: list[str] = field(default_factory=list)

    @property
    def exercised(self) -> int:
        return self.decode + self.prefill


class AbortProbe(Probe):
    name = ProbeName.ABORT

    async def run(self, ctx: RunContext) -> Outcome:
        counter_names = ctx.spec.safety_counters.counters
        before = await ctx.snapshots()
        mark = len(ctx.heard)
        problems: list[str] = []
        evidence: list[Evidence] = []
        if total_used_tokens(before) is None:
            evidence.append(Note(message="pool usage not checked: no reachable metrics report KV usage"))
        cuts = Cuts()
        seconds_per_token = await self._disconnect_mid_decode(ctx, cuts, problems, evidence)
        await self._disconnect_mid_prefill(ctx, seconds_per_token, cuts, problems, evidence)
        b_compared = await self._isolation_after(ctx, problems, evidence) if ctx.spec.abort.check_isolation_after else False
        ctx.abort_window = (counter_totals(before, counter_names), counter_totals(await ctx.snapshots(), counter_names))
        report_leaks(ctx, mark, problems, evidence)  # the cut streams' text too
        if problems:
            evidence.sort(key=_rank)  # causes first: the table shows only a few rows
            return failed(problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        if not cuts.exercised:
            raise ProbeSkipped(f"no disconnect exercised: {'; '.join(cuts.missed) or 'none planned'}")
        return passed(self._summary(cuts, b_compared, evidence), evidence)

    def _summary(self, cuts: Cuts, b_compared: bool, evidence: list[Evidence]) -> str:
        recoveries = [e for e in evidence if isinstance(e, PoolUsage)]
        done = f"{cuts.decode} mid-decode and {cuts.prefill} mid-prefill disconnect(s)"
        missed = f" ({len(cuts.missed)} planned cut(s) not exercised: the server answered first)" if cuts.missed else ""
        missed += f" ({cuts.late} cut again after a late or slow recovery)" if cuts.late else ""
        pool = (
            f"KV pool back to its baseline after {len(recoveries)} of them (slowest {max(r.waited_seconds for r in recoveries):.2f} s)"
            if recoveries else "pool usage not checked (no metrics report KV usage)"
        )
        after = "; B still gives its solo output" if b_compared else ""
        return f"{done}{missed}: {pool}{after}"

    def _long_generation(self, ctx: RunContext, prompt_tokens: int) -> int:
        """As many tokens as fit after the prompt: a non-propagated abort then holds pages for long."""
        return max(ctx.spec.max_tokens, ctx.admissible_tokens(0) - prompt_tokens - 32)

    async def _disconnect_mid_decode(
        self, ctx: RunContext, cuts: Cuts, problems: list[str], evidence: list[Evidence]
    ) -> float | None:
        """Cut streams mid-decode; returns the measured seconds per streamed chunk, if any."""
        seconds_per_token: float | None = None
        # Never more than fits with max_tokens after it: at context 160 the 32 words were ~160 tokens
        # on a byte-level tokenizer, and a healthy server's 400 failed the probe (outside probe).
        words = min(SHORT_PROMPT_WORDS, ctx.estimate.words_at_most(ctx.admissible_tokens(ctx.spec.max_tokens)))
        prompt = filler_text(words, ctx.spec.seed + 4000)
        prompt_tokens = int(words * (ctx.estimate.tokens_per_word or 5) * 1.2)
        max_tokens = self._long_generation(ctx, prompt_tokens)

        async def cut_after(after: int, again: bool) -> Completion | None:
            nonlocal seconds_per_token
            out = await ctx.target.complete(
                prompt, api=ctx.spec.api, max_tokens=max_tokens, stream=True,
                disconnect_after_chunks=after, label=f"stream cut after {after} chunk(s)",
            )
            if out.status != 200 or (out.error and not out.disconnected):
                problems.append(f"streaming request to be aborted failed first: {out.describe_failure()}")
                evidence.append(out.evidence())
                return None
            if not out.disconnected:
                cuts.missed.append(f"{out.label}: stream finished before the cut ({out.chunks} chunks)")
                evidence.append(Note(message=cuts.missed[-1]))
                return None
            cuts.decode += not again  # a cut made again is counted in `late`
            seconds_per_token = out.seconds_per_chunk() or seconds_per_token
            return out

        for after in ctx.spec.abort.stream_disconnect_after_tokens:
            await self._judge_cut(
                ctx, cuts, partial(cut_after, after), lambda out: _natural_remaining_seconds(out, max_tokens),
                lambda out: max(0, max_tokens - out.chunks), problems, evidence,
            )
        return seconds_per_token

    async def _disconnect_mid_prefill(
        self, ctx: RunContext, seconds_per_token: float | None, cuts: Cuts, problems: list[str], evidence: list[Evidence]
    ) -> None:
        spec = ctx.spec.abort
        prompt_tokens = int(ctx.admissible_tokens(ctx.spec.max_tokens) * spec.prefill_prompt_fraction)
        words = ctx.estimate.words_at_most(prompt_tokens)
        prompt = filler_text(words, ctx.spec.seed + 5000)
        max_tokens = self._long_generation(ctx, prompt_tokens)
        natural = seconds_per_token * max_tokens if seconds_per_token else None

        async def cut_after(delay: float, again: bool) -> Completion | None:
            out = await ctx.target.disconnect_during_prefill(
                prompt, api=ctx.spec.api, max_tokens=max_tokens,
                after_seconds=delay, label=f"{words}-word prompt cut {delay:g} s after sending",
            )
            if not out.disconnected:
                if out.status != 200 or out.error:
                    problems.append(f"long request failed before the cut: {out.describe_failure()}")
                    evidence.append(out.evidence())
                else:
                    cuts.missed.append(f"{out.label}: answered before the cut; prefill abort not exercised")
                    evidence.append(Note(message=cuts.missed[-1]))
                return None
            cuts.prefill += not again
            return out

        for delay in spec.prefill_disconnect_after_seconds:
            await self._judge_cut(
                ctx, cuts, partial(cut_after, delay), lambda _: natural, lambda _: max_tokens, problems, evidence
            )

    async def _judge_cut(
        self,
        ctx: RunContext,
        cuts: Cuts,
        cut: Callable[[bool], Awaitable[Completion | None]],
        natural_seconds: Callable[[Completion], float | None],
        tokens_left: Callable[[Completion], int],
        problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        """Cut once, and once more if the pages came back only after MIN_RECOVERY_SECONDS.

        Where the workers count generated tokens, a cut request that generated most of what it had
        left before its pages came back ran on: the abort was not propagated. It is cut again, and
        fails the probe if that cut runs on too (or cannot be judged, or its pages are still held
        at the timeout). That verdict needs no estimate of the engine's speed (an estimate stretched by
        load once let an engine that ignores aborts pass in CI); the timing rules below judge the
        engines that count nothing, and the ones that free pages late without generating on.

        The deadline can be a second on a fast model, and a healthy worker descheduled for a second
        on a loaded node misses it once; an engine that ignores the abort misses it every time. So
        a late recovery is cut again (from a baseline taken after the late pages came back) and
        fails the probe only if that cut is late too, or cannot be judged. A recovery in time but
        slower than the floor is cut again as well, and that cut must be in time: the deadline
        rests on a speed estimate from a few chunk gaps, which a loaded node stretched to 3x the
        real one (a flaky-test audit), and then an engine that ignores aborts finished its
        generation "in time"; two such estimates in a row are much rarer, and a correct engine
        frees its pages in a tenth of a second. Pages still held at the fixed timeout fail at once:
        that is past every bound whatever the model's speed."""
        late: tuple[Completion, Recovery, float | None] | None = None
        slow: Recovery | None = None  # in time, but slower than a correct engine: confirmed by a second cut
        ran_on_once: tuple[str, Recovery] | None = None  # a run-on is confirmed by a second cut too
        for again in (False, True):
            baseline = await self._used(ctx)
            out = await cut(again)
            if out is None or baseline is None:
                break
            natural = natural_seconds(out)
            recovery = await self._await_recovery(ctx, baseline, natural)
            ran_on = recovery.ran_on(tokens_left(out))
            if ran_on and (again or not recovery.back):  # still held at the timeout: past every bound
                evidence.append(recovery.usage)
                problems.append(f"{out.label}: {ran_on}{' again' if again else ''}: the abort was not propagated")
                return
            if ran_on:
                # A router descheduled for a second on a loaded node lets a correct decode run on
                # once; an engine that ignores aborts runs on after every cut.
                cuts.late += 1
                ran_on_once = (f"{out.label}: {ran_on}", recovery)
                evidence.append(Note(message=f"{out.label}: {ran_on}; cutting once more"))
                continue
            if recovery.in_time and (again or recovery.waited_seconds <= MIN_RECOVERY_SECONDS):
                evidence.append(recovery.usage)
                return
            if recovery.back and not again:
                cuts.late += 1
                if recovery.in_time:
                    slow = recovery
                else:
                    late = (out, recovery, natural)
                evidence.append(Note(message=f"{out.label}: {recovery.describe(natural)}; cutting once more"))
                continue
            evidence.append(recovery.usage)
            problems.append(f"{out.label}: {recovery.describe(natural)}{' again' if again else ''}: "
                            "the abort did not free its pages")  # fmt: skip
            return
        if ran_on_once is not None:  # ran on once, and the cut made again could not be judged: no pass on that
            reason, recovery = ran_on_once
            evidence.append(recovery.usage)
            problems.append(f"{reason}, and the cut made again could not be judged: the abort was not propagated")
            return
        if slow is not None:  # in time once, and the cut made again could not be judged: the first stands
            evidence.append(slow.usage)
            return
        if late is not None:  # late once, and the cut made again could not be judged: no pass on that
            out, recovery, natural = late
            evidence.append(recovery.usage)
            problems.append(f"{out.label}: {recovery.describe(natural)}, and the cut made again could not "
                            "be judged: the abort did not free its pages in time")  # fmt: skip

    async def _isolation_after(self, ctx: RunContext, problems: list[str], evidence: list[Evidence]) -> bool:
        """B after the aborts must equal B alone; True when it was compared (an empty B proves nothing)."""
        prompt = ctx.spec.isolation.probe_prompt
        reference = await ctx.solo(prompt)
        if not reference.ok:
            problems.append(f"B failed: {reference.describe_failure()}")
            evidence.append(reference.evidence())
            return False
        after = await ctx.target.complete(prompt, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label="B after the aborts")
        if not reference.text and after.ok and not after.text:
            evidence.append(Note(message=f"B not compared: {empty_answer(reference)}"))
            return False
        check_b(after, reference, {}, problems, evidence)
        return True

    async def _used(self, ctx: RunContext) -> float | None:
        return total_used_tokens(await ctx.snapshots()) if ctx.metrics_urls else None

    async def _await_recovery(self, ctx: RunContext, baseline: float, natural_seconds: float | None) -> Recovery:
        """Poll used tokens until back at `baseline` or the fixed timeout (see module doc)."""
        spec = ctx.spec.abort
        deadline = recovery_deadline(spec.pool_recovery_timeout_seconds, spec.pool_recovery_fraction, natural_seconds)
        started = time.monotonic()
        samples: list[tuple[float, float]] = []
        used, back, late = baseline, False, False
        generated = TokensGenerated()
        while True:
            snapshots = await ctx.snapshots()
            used_now = total_used_tokens(snapshots)
            elapsed = time.monotonic() - started
            generated.read(snapshots)
            if used_now is not None:
                used = used_now
                samples.append((round(elapsed, 3), used))
                if used <= baseline + spec.pool_usage_tolerance_tokens:
                    back = True
                    # SGLang counts a request's tokens in its tokenizer process when the request
                    # ends, after the scheduler has freed (and reported) its pages: one more reading.
                    await asyncio.sleep(POLL_INTERVAL_SECONDS)
                    generated.read(await ctx.snapshots())
                    break
            # Late once a reading at or past the deadline still found them held (pages seen back by
            # the first reading after it are in time, as a poll's gap is not the engine's).
            late = late or elapsed >= deadline
            if elapsed >= spec.pool_recovery_timeout_seconds:
                break
            await asyncio.sleep(POLL_INTERVAL_SECONDS)
        usage = PoolUsage(
            baseline_tokens=round(baseline), final_tokens=round(used),
            waited_seconds=round(elapsed, 3), samples=[(t, round(u)) for t, u in samples[-40:]],
            generated_tokens=generated.total(),
        )
        return Recovery(deadline=deadline, back=back, in_time=back and not late, waited_seconds=elapsed,
                        held_tokens=used - baseline, usage=usage)  # fmt: skip


@dataclass
class TokensGenerated:
    """Tokens the workers generated after a cut, counted from the first scrape after it.

    Kept by worker: a worker missing from one scrape must not read as a jump in the sum."""

    at_cut: dict[str, float] = field(default_factory=dict)  # from the first scrape that read each worker
    since_cut: dict[str, float] = field(default_factory=dict)  # at each worker's latest scrape

    def read(self, snapshots: list[WorkerSnapshot]) -> None:
        now = generated_tokens(snapshots)
        self.at_cut = now | self.at_cut
        self.since_cut |= {url: max(0.0, count - self.at_cut[url]) for url, count in now.items()}

    def total(self) -> int | None:
        """None when no worker counts generated tokens."""
        return round(sum(self.since_cut.values())) if self.since_cut else None


@dataclass(frozen=True)
class Recovery:
    """How an aborted request's pages came back: in time, late (back after the deadline but
    before the fixed timeout), or not at all."""

    deadline: float
    back: bool
    in_time: bool
    waited_seconds: float
    held_tokens: float  # above the baseline at the end of the wait (when `back`, within tolerance)
    usage: PoolUsage

    def ran_on(self, tokens_left: int) -> str:
        """Why the cut request went on generating after the disconnect; "" when it did not (or
        the workers count no generated tokens, or it had too few left to tell)."""
        generated = self.usage.generated_tokens
        if generated is None or tokens_left < MIN_TOKENS_LEFT or generated < RAN_ON_FRACTION * tokens_left:
            return ""
        when = "before its pages came back" if self.back else f"in the {self.waited_seconds:.1f} s it was watched"
        return f"the generation ran on: {generated} tokens generated after the disconnect {when} (it had {tokens_left} left)"

    def describe(self, natural_seconds: float | None) -> str:
        natural = f"; it would have finished on its own in ~{natural_seconds:.1f} s" if natural_seconds else ""
        if self.back:
            return (f"KV pool back to its baseline only {self.waited_seconds:.1f} s after the disconnect "
                    f"(deadline {self.deadline:.1f} s{natural})")
        return (f"KV pool still holds {self.held_tokens:g} tokens {self.waited_seconds:.1f} s after the "
                f"disconnect (deadline {self.deadline:.1f} s{natural})")


def _rank(evidence: Evidence) -> int:
    """Leaks first (the gravest), notes last; the order within a rank is kept."""
    return 0 if isinstance(evidence, NonceLeak) else 2 if isinstance(evidence, Note) else 1


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
