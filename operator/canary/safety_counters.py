"""Safety-counter probe (S1, S3, S5): tag violations, checksum/HMAC failures and stale writes
must not increase while the suite runs.

Before = the snapshot taken when the suite started; after = now (this probe runs last). Increases
of the abort-tolerant counters inside the abort probe's window are reported but allowed (dropping a
late write from an aborted request is S5 doing its job). A counter that went *down* means a worker
restarted during the run, which is a failure of its own (S1: a violation never crashes a worker).
"""

from __future__ import annotations

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.metrics import counter_totals
from kvguard.operator.canary.report import CounterDeltas
from kvguard.operator.canary.spec import ProbeName


class SafetyCountersProbe(Probe):
    name = ProbeName.SAFETY_COUNTERS

    async def run(self, ctx: RunContext) -> Outcome:
        if not ctx.metrics_reachable:
            raise ProbeSkipped("no metrics reachable at the start of the run")
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
