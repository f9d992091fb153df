"""Safety-counter probe (S1, S3, S5): tag violations, checksum/HMAC failures and stale writes
must not increase while the suite runs.

Before = the snapshot taken when the suite started; after = now (this probe runs last). Increases
of the abort-tolerant counters inside the abort probe's window are reported but allowed (dropping a
late write from an aborted request is S5 doing its job). A counter that went *down* means a worker
restarted during the run, which is a failure of its own (S1: a violation never crashes a worker).

SGLang's read-time KV canary (`--kv-canary log|raise`) has no counter: its violations are log
lines (`engine_logs`). When engine logs are given, every violation logged during the run fails
this probe too, with the slot and reason SGLang reported.
"""

from __future__ import annotations

import asyncio

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.engine_logs import KVCanaryViolation, parse_violations
from kvguard.operator.canary.metrics import counter_totals
from kvguard.operator.canary.report import CounterDeltas, Note
from kvguard.operator.canary.spec import ProbeName


class SafetyCountersProbe(Probe):
    name = ProbeName.SAFETY_COUNTERS

    async def run(self, ctx: RunContext) -> Outcome:
        violations = await _logged_violations(ctx)
        if not ctx.metrics_reachable:
            if ctx.engine_logs:
                return _judge_logs(ctx, violations)
            raise ProbeSkipped("no metrics reachable at the start of the run and no engine logs given")
        if violations:
            return _judge_logs(ctx, violations)
        spec = ctx.spec.safety_counters
        before = counter_totals(ctx.start_snapshots, spec.counters)
        after_snapshots = await ctx.snapshots()
        after = counter_totals(after_snapshots, spec.counters)
        if not before and not after:
            engines = sorted({s.engine for s in ctx.start_snapshots if s.reachable})
            raise ProbeSkipped(f"none of the configured counters is exposed (engines seen: {', '.join(engines)})")
        deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in sorted(set(before) | set(after))}
        tolerated = self._tolerated(ctx)
        problems = []
        for name, delta in deltas.items():
            if delta < 0:
                problems.append(f"{name} went down by {-delta:g}: a worker restarted during the run")
            elif delta - tolerated.get(name, 0.0) > 0:
                problems.append(f"{name} increased by {delta - tolerated.get(name, 0.0):g}")
        reachable_at_start = {s.url for s in ctx.start_snapshots if s.reachable}
        for snap in after_snapshots:
            if snap.url in reachable_at_start and not snap.reachable:
                problems.append(f"{snap.url} stopped answering during the run ({snap.error})")
        note = f"tolerated during the abort probe: {tolerated}" if any(tolerated.values()) else ""
        evidence = [CounterDeltas(deltas=deltas, before=before, after=after, note=note)]
        if problems:
            return failed("; ".join(problems), evidence)
        return passed(f"{len(deltas)} counter(s) unchanged", evidence)

    def _tolerated(self, ctx: RunContext) -> dict[str, float]:
        if ctx.abort_window is None:
            return {}
        start, end = ctx.abort_window
        return {
            name: max(0.0, end.get(name, 0.0) - start.get(name, 0.0))
            for name in ctx.spec.safety_counters.abort_tolerant_counters
        }


async def _logged_violations(ctx: RunContext) -> list[tuple[str, KVCanaryViolation]]:
    texts = await asyncio.gather(*(log.appended() for log in ctx.engine_logs))
    return [(log.name, v) for log, text in zip(ctx.engine_logs, texts, strict=True) for v in parse_violations(text)]


def _judge_logs(ctx: RunContext, violations: list[tuple[str, KVCanaryViolation]]) -> Outcome:
    logs = len(ctx.engine_logs)
    if not violations:
        return passed(f"no SGLang kv_canary violation logged in {logs} engine log(s) (no metrics to read)")
    evidence = [Note(message=f"{path}: {v.line}") for path, v in violations[:20]]
    first = violations[0][1]
    return failed(f"SGLang's KV canary logged {len(violations)} violation(s) during the run; first: {first.describe()}", evidence)
