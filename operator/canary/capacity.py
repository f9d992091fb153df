"""Capacity probe (S7): every worker's *reported* KV pool holds at least ratio x context length.

The planner's numbers are a prediction; this reads what each running worker says it allocated
(see `metrics` for where each engine reports it). A metrics endpoint that exposes no pool at all
(a router) is listed and ignored; one that cannot be scraped fails, since S7 needs every worker.
"""

from __future__ import annotations

import math

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.metrics import WorkerSnapshot
from kvguard.operator.canary.report import CapacityReading, Evidence, Note
from kvguard.operator.canary.spec import ProbeName
from kvguard.workers.pool_ratio import ratio_down, required_pool_tokens


class CapacityProbe(Probe):
    name = ProbeName.CAPACITY

    async def run(self, ctx: RunContext) -> Outcome:
        if not ctx.metrics_urls:
            raise ProbeSkipped("no metrics URLs given")
        snapshots = await ctx.snapshots()
        if not any(s.reachable for s in snapshots):
            errors = "; ".join(f"{s.url}: {s.error}" for s in snapshots)
            raise ProbeSkipped(f"no metrics URL is reachable ({errors})")
        if not any(s.pools or s.unreadable_pools for s in snapshots):
            engines = sorted({s.engine for s in snapshots if s.reachable})
            raise ProbeSkipped(f"no worker reports a KV pool size (engines seen: {', '.join(engines)})")
        required = ctx.spec.capacity.required_ratio()  # the model's minKVRatio, filled in by InferenceModelSpec
        problems: list[str] = []
        evidence: list[Evidence] = []
        for snap in snapshots:
            self._judge_worker(snap, ctx.info.context_length, required, problems, evidence)
        if problems:
            return failed(problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        pools = sum(len(s.pools) for s in snapshots)
        return passed(f"{pools} pool(s) >= {required:g} x context length", evidence)

    def _judge_worker(
        self,
        snap: WorkerSnapshot,
        fallback_context: int | None,
        required: float,
        problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        if not snap.reachable:
            problems.append(f"{snap.url} did not report: {snap.error}")
            evidence.append(Note(message=f"{snap.url}: {snap.error}"))
            return
        if snap.unreadable_pools:
            problems.append(f"{snap.url}: reports a KV pool size that is not a number ({'; '.join(snap.unreadable_pools)}): "
                            "S7 cannot be judged on it")  # fmt: skip
        if not snap.pools:
            if not snap.unreadable_pools:
                evidence.append(Note(message=f"{snap.url} ({snap.engine}) exposes no KV pool (router?)"))
            return
        context = snap.context_length or fallback_context
        for pool in snap.pools:
            worker = f"{snap.url}" + (f" [{pool.pool}]" if pool.pool else "")
            evidence.append(
                CapacityReading(
                    worker=worker, source=pool.source, capacity_tokens=pool.capacity_tokens,
                    context_length=context, ratio=ratio_down(pool.capacity_tokens, context) if context else None,
                    required_ratio=required,
                )
            )
            if not context:
                problems.append(f"{worker}: context length unknown, cannot judge a pool of {pool.capacity_tokens:g} tokens")
            elif pool.capacity_tokens < required_pool_tokens(required, context):  # S7 on whole tokens
                problems.append(
                    f"{worker}: KV pool {math.floor(pool.capacity_tokens)} tokens = {ratio_down(pool.capacity_tokens, context, 2):.2f} x context length {context}, "
                    f"needs >= {required:g}"
                )
