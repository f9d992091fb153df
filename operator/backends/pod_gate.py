"""The readiness gate `kvguard.io/kv-pool-verified` on a cluster: watch, scrape, patch pods/status.

The rule is `pool_gate.py` (pure); this carries it out. kopf feeds every pod the operator labels
(`pod_event`, engine pods of every revision, the stable one included); each pod's key goes through
a work queue of its own (one check per pod at a time, events coalesce), and a check:

- reads the pod as last seen and the requirement of its revision (pod annotations, raised by the
  InferencePolicies of its namespace);
- when its containers are ready and no verdict covers it: scrapes the pod's own /metrics (its IP and
  metrics port: kvguard, SGLang and vLLM names, canary/metrics.py) and judges the smallest pool;
- writes the condition with a strategic-merge patch of the `status` subresource (`pods/status`:
  a patch of the pod itself cannot change status on a real API server), only when it differs;
- records a Warning Event on the pod for a pool too small (or unreadable after every attempt);
- tells the controller the model's pools changed, so its pass writes `status.pools` and the
  `Degraded` condition naming the pod and node (reconcile.py).

A pod whose pool cannot be read yet (the engine still warming up its metrics) is scraped again
with backoff. Verdicts live in memory: a restarted operator verifies again (pods that serve keep
their True condition meanwhile; only a container restart takes it away, see pool_gate.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvguard.operator.api import InferencePolicy
from kvguard.operator.backends.base import SCRAPE_TIMEOUT_SECONDS, worker_report
from kvguard.operator.backends.kubernetes import metrics_port
from kvguard.operator.canary.client import session_without_redirects
from kvguard.operator.canary.metrics import fetch_all
from kvguard.operator.kube import Kube, KubeError
from kvguard.operator.policy import policy_min_kv_ratio
from kvguard.operator.pool_gate import (
    MAX_UNREADABLE_ATTEMPTS,
    Move,
    PodFacts,
    PodPool,
    Verdict,
    condition_matches,
    condition_patch,
    judge,
    next_move,
    pod_facts,
    requirement_for,
    unverified,
)
from kvguard.operator.render import LABEL_MODEL, LABEL_REVISION, LABEL_ROLE
from kvguard.operator.workqueue import Backoff, WorkQueue, stop_workers

log = logging.getLogger(__name__)

PodKey = tuple[str, str]
"""(namespace, pod name)."""
ModelKey = tuple[str, str]
LABELS = (LABEL_MODEL, LABEL_REVISION, LABEL_ROLE)
RETRY = Backoff(2.0, 60.0, 0.2)
"""Scrapes of a pod whose pool could not be read (its metrics not up yet): 2 s, 4 s, ... 60 s."""


class PodGate:
    """One per operator process; runs only while it leads (`start`/`stop`)."""

    def __init__(
        self, kube: Kube, policies: Callable[[], Sequence[InferencePolicy]], on_change: Callable[[ModelKey], None],
        *, workers: int = 2, retry: Backoff = RETRY, clock: Callable[[], dt.datetime] | None = None,
    ) -> None:  # fmt: skip
        self.kube = kube
        self._policies = policies
        self._on_change = on_change
        self._workers = workers
        self._retry = retry
        self._clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.pods: dict[PodKey, Mapping[str, Any]] = {}
        """Every labelled pod as last seen on the watch (kept while not leading: warm cache)."""
        self.verdicts: dict[PodKey, Verdict] = {}
        self.queue: WorkQueue[PodKey] = WorkQueue()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker(), name=f"kvguard pod gate {i}") for i in range(self._workers)]
        for key in list(self.pods):
            self.queue.add(key)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await stop_workers(tasks)
        self.queue.clear()
        self.verdicts.clear()

    # --- inputs ---------------------------------------------------------------------------------
    def pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        model = (key[0], str((meta.get("labels") or {}).get(LABEL_MODEL) or ""))
        if event_type == "DELETED":
            self.pods.pop(key, None)
            self.queue.forget(key)
            if self.verdicts.pop(key, None) is not None:
                self._on_change(model)
            return
        self.pods[key] = body
        if self._tasks:
            self.queue.add(key)

    def recheck_all(self) -> None:
        """Policies changed: every requirement may have."""
        for key in list(self.pods):
            self.queue.add(key)

    def pools(self, namespace: str, model: str) -> list[PodPool]:
        """The verdicts on the model's pods that still exist (status.pools)."""
        found = []
        for key, verdict in self.verdicts.items():
            pod = self.pods.get(key)
            labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
            if pod is not None and key[0] == namespace and labels.get(LABEL_MODEL) == model:
                found.append(verdict.pool)
        return found

    # --- the work -------------------------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.check(key)
            except Exception as exc:  # noqa: BLE001 - a failed check is retried like an unreadable pool
                log.warning("readiness gate of pod %s/%s failed (%s); retrying", *key, exc)
                self.queue.requeue(key, self._retry.delay(3))
            finally:
                self.queue.done(key)

    async def check(self, key: PodKey) -> None:
        pod = self.pods.get(key)
        if pod is None:
            return
        facts = pod_facts(pod, LABELS, metrics_port(pod))
        requirement = requirement_for(facts, policy_min_kv_ratio(facts.namespace, list(self._policies())))
        verdict = self.verdicts.get(key)
        move = next_move(facts, verdict, requirement)
        if move is Move.NOTHING or requirement is None:
            return
        now = self._clock()
        if move is Move.UNVERIFY:
            self.verdicts[key] = Verdict(facts.uid, facts.restarts, requirement, unverified(facts, requirement, now))
        elif move is Move.VERIFY:
            previous = verdict.pool.unreadable_scrapes if verdict is not None and verdict.covers(facts, requirement) else 0
            self.verdicts[key] = Verdict(facts.uid, facts.restarts, requirement, await self._scrape(facts, requirement, now, previous))
        await self._write(facts, pod, self.verdicts[key].pool, now)
        pool = self.verdicts[key].pool
        if pool.reason == "KVPoolUnreadable":
            self.queue.requeue(key, self._retry.delay(min(pool.unreadable_scrapes, MAX_UNREADABLE_ATTEMPTS)))
        if verdict is None or verdict.pool != pool:
            self._on_change((facts.namespace, facts.model))

    async def _scrape(self, facts: PodFacts, requirement: Any, now: dt.datetime, unreadable: int) -> PodPool:
        url = facts.metrics_url
        if url is None:
            return judge(facts, requirement, None, None, "the pod has no IP", now, unreadable + 1)
        async with session_without_redirects() as session:
            (snapshot,) = await fetch_all(session, [url], SCRAPE_TIMEOUT_SECONDS)
        report = worker_report(facts.name, facts.role, snapshot)
        tries = unreadable + 1 if report.pool_tokens is None else 0
        return judge(facts, requirement, report.pool_tokens, report.context_length, report.error, now, tries)

    async def _write(self, facts: PodFacts, pod: Mapping[str, Any], pool: PodPool, now: dt.datetime) -> None:
        if condition_matches(pool, facts.gate):
            return
        try:
            await self.kube.apatch_pod_status(facts.namespace, facts.name, condition_patch(pool, facts.gate, now))
        except KubeError as exc:
            if exc.status == 404:  # gone meanwhile: its DELETED event follows
                return
            raise
        log.info("pod %s/%s: %s=%s (%s)", facts.namespace, facts.name, "kv-pool-verified", pool.verified, pool.message)
        if pool.reason == "KVPoolTooSmall" or (pool.reason == "KVPoolUnreadable" and pool.unreadable_scrapes >= MAX_UNREADABLE_ATTEMPTS):
            await self.kube.arecord_event(pod, type_="Warning", reason=pool.reason, message=pool.message, now=now)


__all__ = ["PodGate"]
