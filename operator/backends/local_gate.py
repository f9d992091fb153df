"""S7 while a local worker serves: the readiness gate's verdicts on worker processes.

On a cluster the operator's readiness gate (backends/pod_gate.py) scrapes every engine pod once it
is ready, judges its reported pool with `pool_gate.judge`, and the controller feeds the verdicts
into `driver.observe(pools=...)`, whose reconcile writes `status.pools` and a `Degraded` condition
naming the pod and node. Locally the router keeps a worker whose pool is below the ratio out of
rotation (workers/router.py `--min-kv-ratio`); this module gives the model's status the same
verdicts, by the same rule: every running engine worker of every revision is scraped (its
/metrics, as a pod is) and judged by `pool_gate.judge` against its revision's requirement. The
local driver (`local_rollout.roll_out`) and `kvguard status --local` both read it, so both show
Degraded naming the worker: `<model>-<revision>-<worker>` in place of the pod, and
`local:<port> (pid N)` in place of the node (the port is the one the router addresses it by).

A verdict is kept for as long as the same process (PID, restart count) runs under the same
requirement, as the cluster keeps one per pod incarnation: a process's pool does not change while
it lives; a restarted worker is judged again. A worker not answering /health yet is `Verifying`
(the cluster does not judge a pod whose containers are not ready either), so a slow start never
counts towards KVPoolUnreadable.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.backends.base import SCRAPE_TIMEOUT_SECONDS, worker_report
from kvguard.operator.backends.local import LocalRevision, LocalState, LocalWorker, ProcessTable, healthy
from kvguard.operator.canary.client import session_without_redirects
from kvguard.operator.canary.metrics import fetch_all
from kvguard.operator.pool_gate import PodFacts, PodPool, PoolRequirement, Verdict, judge, unverified

LOCAL_NAMESPACE = "local"
Ready = Callable[[LocalWorker], bool]
"""Whether a worker process is up and answering (its /health), i.e. ready to be judged."""


def worker_pod_name(model: str | None, revision: str, worker: LocalWorker) -> str:
    """Named as its pod is on a cluster (`<model>-<revision>-<worker>`): same status either way."""
    return f"{model or 'model'}-{revision}-{worker.name}"


def worker_node(worker: LocalWorker) -> str:
    """Where the worker runs, in the place of a pod's node: the port the router addresses it by and its PID."""
    return f"local:{worker.port}" + (f" (pid {worker.pid})" if worker.pid is not None else "")


def worker_facts(model: str | None, revision: str, worker: LocalWorker) -> PodFacts:
    """A worker process as the gate's `PodFacts`: its PID is its uid, its restarts its incarnation."""
    return PodFacts(
        name=worker_pod_name(model, revision, worker), namespace=LOCAL_NAMESPACE, uid=f"pid-{worker.pid}", model=model or "",
        revision=revision, role=worker.role, node=worker_node(worker), ip="127.0.0.1", metrics_port=worker.metrics_port,
        gated=True, containers_ready=True, terminating=False, restarts=worker.restarts, gate=None,
    )  # fmt: skip


def revision_requirement(record: LocalRevision, applied_spec: PoolRequirement | None) -> PoolRequirement | None:
    """The revision's own requirement (recorded when it was created, as a pod's annotations are
    on a cluster); for a revision recorded before it was kept, the spec last applied. None:
    nothing to judge against.

    Not raised by an InferencePolicy tightened since, as the cluster's gate raises it: the local
    router enforces the ratio its revision started with (`--min-kv-ratio`), so a verdict against a
    higher one would report workers "kept out of rotation" that still serve. The stricter policy
    applies to the next revision, whose plan it blocks."""
    return record.requirement() or applied_spec


def applied_requirement(state: LocalState) -> PoolRequirement | None:
    if not state.spec:
        return None
    spec = InferenceModelSpec.model_validate(state.spec)  # as `kvguard apply --local` stored it
    return PoolRequirement(spec.min_kv_ratio, spec.context_length, spec.page_size)


@dataclass
class LocalPoolGate:
    """The verdicts on one state folder's workers; keep one per driver (a fresh one judges anew)."""

    ready: Ready = healthy
    alive: Ready = field(default_factory=lambda: ProcessTable().alive)
    """Whether the worker's process runs at all (a dead one is said so, not "restarted")."""
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)
    verdicts: dict[tuple[str, str], Verdict] = field(default_factory=dict)
    """(revision, worker name) -> the last verdict on it."""

    async def pools(self, state: LocalState) -> list[PodPool]:
        """The verdict on every engine worker of every revision that runs (status.pools)."""
        applied = applied_requirement(state)
        targets: list[tuple[str, LocalWorker, PodFacts, PoolRequirement]] = []
        for revision, record in sorted(state.revisions.items()):
            requirement = revision_requirement(record, applied)
            if record.scaled_to_zero or requirement is None:
                continue
            targets += [(revision, w, worker_facts(state.model, revision, w), requirement) for w in record.engine_workers()]
        live = {(r, w.name) for r, w, _, _ in targets}
        for gone in set(self.verdicts) - live:  # a worker removed, or its revision stopped: no verdict left behind
            del self.verdicts[gone]
        stale = [t for t in targets if not self._covered(t)]
        ready = await asyncio.to_thread(lambda: [self.ready(w) for _, w, _, _ in stale])
        now = self.clock()
        scrape = [t for t, up in zip(stale, ready, strict=True) if up]
        for (revision, worker, facts, requirement), up in zip(stale, ready, strict=True):
            if not up:  # starting (or stopping): out of rotation until judged, like a pod not ready
                why = "starting" if self.alive(worker) else "process not running (the next `kvguard apply` restarts it)"
                self.verdicts[(revision, worker.name)] = Verdict(facts.uid, facts.restarts, requirement, unverified(facts, requirement, now, why))
        await self._judge(scrape, now)
        return [self.verdicts[(r, w.name)].pool for r, w, _, _ in targets]

    def _covered(self, target: tuple[str, LocalWorker, PodFacts, PoolRequirement]) -> bool:
        """A final verdict on this process under this requirement already stands (no scrape)."""
        revision, worker, facts, requirement = target
        verdict = self.verdicts.get((revision, worker.name))
        return verdict is not None and verdict.covers(facts, requirement) and verdict.pool.reason in ("KVPoolVerified", "KVPoolTooSmall")

    async def _judge(self, targets: Sequence[tuple[str, LocalWorker, PodFacts, PoolRequirement]], now: dt.datetime) -> None:
        if not targets:
            return
        async with session_without_redirects() as session:
            snapshots = await fetch_all(session, [w.metrics_url for _, w, _, _ in targets], SCRAPE_TIMEOUT_SECONDS)
        for (revision, worker, facts, requirement), snapshot in zip(targets, snapshots, strict=True):
            previous = self.verdicts.get((revision, worker.name))
            unreadable = previous.pool.unreadable_scrapes if previous is not None and previous.covers(facts, requirement) else 0
            report = worker_report(facts.name, worker.role, snapshot)
            tries = unreadable + 1 if report.pool_tokens is None else 0
            pool = judge(facts, requirement, report.pool_tokens, report.context_length, report.error, now, tries)
            self.verdicts[(revision, worker.name)] = Verdict(facts.uid, facts.restarts, requirement, pool)


__all__ = ["LocalPoolGate", "revision_requirement", "worker_facts", "worker_node", "worker_pod_name"]
