"""The backend interface: "run this revision's workloads and tell me what is ready and where".

The rollout state machine (`kvguard.operator.rollout`) decides, through the one reconcile both
drivers run (`kvguard.operator.driver.run_pass`); a backend carries the workload actions out on
some platform: `KubernetesBackend` (Deployments/Services through kube.py) or the local backend
(processes on loopback). Both use the helpers below to execute a decision, scrape the candidate's
workers and run the canary suite off the reconcile path, so the same machine and the same suite
drive both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvguard.operator.api import TrafficRouter
from kvguard.operator.canary.client import session_without_redirects
from kvguard.operator.canary.engine_logs import EngineLog
from kvguard.operator.canary.metrics import WorkerSnapshot, fetch_all
from kvguard.operator.canary.report import CanaryReport
from kvguard.operator.canary.spec import CanarySpec
from kvguard.operator.canary.suite import run_suite
from kvguard.operator.rollout import (
    Action,
    CanaryResult,
    CancelCanary,
    DeleteRevision,
    DeployRevision,
    RevisionView,
    RouteTraffic,
    RunCanary,
    Scale,
    ScaleRevision,
    SetTrafficWeight,
    WorkerReport,
)
from kvguard.operator.traffic import Share, traffic_split

if TYPE_CHECKING:
    from kvguard.operator.api import InferenceModelSpec, KVPlan
    from kvguard.operator.render import RenderedRevision

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ModelRef:
    """Which InferenceModel (the Kubernetes backend needs the uid for owner references)."""

    namespace: str
    name: str
    uid: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


@dataclass(frozen=True)
class RevisionRequest:
    """Everything needed to run the spec's revision: the spec and its (passing) plan."""

    model: ModelRef
    revision: str
    spec: InferenceModelSpec
    plan: KVPlan
    faults: str = ""
    """Test-only KVGUARD_FAULTS of this revision's workers (part of its revision id); empty: none."""
    rendered: RenderedRevision | None = None
    """The revision's Kubernetes objects as reconcile rendered them (the Kubernetes backend applies
    these; the local backend runs processes from spec and plan)."""


class ForeignObjectError(Exception):
    """An object with the name of one of the model's children exists and the operator did not
    create it (e.g. a squatted Deployment or Service name). Never used, never modified."""

    def __init__(self, description: str, ref: tuple[str, str, str | None] | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.ref = ref
        """(kind, name, namespace) of the object, for the backend to look at it again."""


@dataclass(frozen=True)
class WorkerEndpoint:
    """One prefill/decode worker process (pod) and where its /metrics are."""

    name: str
    role: str
    metrics_url: str
    log: EngineLog | None = None  # where the engine reports what its metrics do not (SGLang's KV canary)


@dataclass(frozen=True)
class RevisionEndpoints:
    """Where a revision answers: its router's base URL (no /v1) and every worker's metrics."""

    router_url: str | None
    workers: tuple[WorkerEndpoint, ...] = ()
    routers: tuple[WorkerEndpoint, ...] = ()
    """Every router process (pod) and its /metrics: what the analysis of live traffic reads."""

    def metrics_urls(self) -> tuple[tuple[str, str, str], ...]:
        """(role, name, /metrics URL) of every router and worker of the revision."""
        return tuple((e.role, e.name, e.metrics_url) for e in (*self.routers, *self.workers))


@dataclass(frozen=True)
class Observation:
    """The backend's view of one model: every revision it runs, and which one users reach."""

    revisions: Mapping[str, RevisionView] = field(default_factory=dict)
    serving: str | None = None


class Backend(Protocol):
    """A platform that runs revisions. Every method is idempotent; none blocks the event loop."""

    async def ensure_revision(self, request: RevisionRequest, scale: Scale = "full") -> None:
        """Create or update the revision's router/prefill/decode at canary or full replicas."""
        ...

    async def scale_revision(self, model: ModelRef, revision: str, replicas: int | None) -> None:
        """Scale every workload of the revision; 0 stops it, None restores what it had before 0."""
        ...

    async def delete_revision(self, model: ModelRef, revision: str) -> None:
        """Remove every object/process of the revision."""
        ...

    async def observe(self, model: ModelRef) -> Observation:
        """Readiness of every revision present, and the revision user traffic goes to."""
        ...

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        """The revision's router URL and each worker's metrics URL."""
        ...

    async def route_traffic(self, model: ModelRef, revision: str) -> None:
        """Send user traffic to the revision (all of it; no split)."""
        ...

    async def split_traffic(self, request: RevisionRequest, shares: tuple[Share, ...]) -> None:
        """Apply the objects that split user traffic by `shares` (spec.rollout.trafficRouter
        gatewayAPI / inferencePool: the HTTPRoute, and the InferencePools), and remove those the
        spec no longer calls for. No shares: nothing splits (trafficRouter service)."""
        ...

    async def still_foreign(self, model: ModelRef, found: Sequence[ForeignObjectError]) -> Sequence[ForeignObjectError]:
        """Of the objects that blocked the model because someone else owns them, those still there."""
        ...


# --- helpers every driver shares ----------------------------------------------------------------


def worker_report(worker: str, role: str, snapshot: WorkerSnapshot) -> WorkerReport:
    """A scraped /metrics (kvguard, SGLang or vLLM, via the canary's parser) as the machine's input."""
    if not snapshot.reachable:
        return WorkerReport(worker, role, error=snapshot.error)
    if not snapshot.pools:
        return WorkerReport(worker, role, context_length=snapshot.context_length,
                            error=f"exposes no KV pool size ({snapshot.engine} metrics)")  # fmt: skip
    smallest = min(p.capacity_tokens for p in snapshot.pools)
    return WorkerReport(worker, role, pool_tokens=smallest, context_length=snapshot.context_length)


async def scrape_workers(endpoints: RevisionEndpoints, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> list[WorkerReport]:
    """Every worker's reported KV pool and context length, from its /metrics (S7)."""
    if not endpoints.workers:
        return []
    async with session_without_redirects() as session:
        snapshots = await fetch_all(session, [w.metrics_url for w in endpoints.workers], timeout)
    return [worker_report(w.name, w.role, s) for w, s in zip(endpoints.workers, snapshots, strict=True)]


SuiteRunner = Callable[..., Coroutine[Any, Any, CanaryReport]]


class CanaryRunner:
    """One canary suite per model at a time, off the reconcile path (an asyncio task per model,
    keyed by revision and attempt). The result stays in memory until the rollout records it in
    status; after an operator restart nothing is here and the machine asks for a new run."""

    def __init__(self, suite: SuiteRunner = run_suite) -> None:
        self._suite = suite
        self._tasks: dict[tuple[str, str], tuple[str, str, asyncio.Task[CanaryReport]]] = {}
        self._results: dict[tuple[str, str], CanaryResult] = {}
        self._callbacks: set[asyncio.Future[None]] = set()  # on_done calls in flight (the loop holds tasks weakly)

    def start(
        self,
        model: tuple[str, str],
        run: RunCanary,
        url: str,
        *,
        spec: CanarySpec,
        baseline_url: str | None,
        metrics_urls: Sequence[str],
        engine_logs: Sequence[EngineLog] = (),
        on_done: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if self.running(model, run.revision, run.attempt):
            return
        self.cancel(model)
        task = asyncio.create_task(
            self._suite(url, spec, baseline_url=baseline_url, metrics_urls=list(metrics_urls),
                        engine_logs=list(engine_logs)),
            name=f"canary {model[0]}/{model[1]} {run.revision}",
        )
        self._tasks[model] = (run.revision, run.attempt, task)
        task.add_done_callback(lambda t: self._finished(model, run, t, on_done))
        log.info("canary of %s/%s revision %s started against %s", *model, run.revision, url)

    def _finished(self, model: tuple[str, str], run: RunCanary, task: asyncio.Task[CanaryReport],
                  on_done: Callable[[], Awaitable[None]] | None) -> None:  # fmt: skip
        current = self._tasks.get(model)
        if current is None or current[2] is not task:
            return
        del self._tasks[model]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:  # run_suite never raises for the target's misbehaviour: a bug or I/O
            result = CanaryResult(run.revision, run.attempt, "cannot_run", f"canary crashed: {error!r}")
        else:
            report = task.result()
            result = CanaryResult.from_report(report, run.revision, run.attempt)
            log.info("canary of %s/%s revision %s: %s (%s)", *model, run.revision, report.verdict.value, report.reason)
        self._results[model] = result
        if on_done is not None:
            callback = asyncio.ensure_future(on_done())
            self._callbacks.add(callback)
            callback.add_done_callback(self._callbacks.discard)

    @property
    def suite(self) -> SuiteRunner:
        return self._suite

    def running(self, model: tuple[str, str], revision: str, attempt: str) -> bool:
        current = self._tasks.get(model)
        return current is not None and current[:2] == (revision, attempt) and not current[2].done()

    def result(self, model: tuple[str, str]) -> CanaryResult | None:
        return self._results.get(model)

    def cancel(self, model: tuple[str, str], revision: str | None = None) -> None:
        """Stop the run (of `revision`, or any) and drop its result: a result outlives neither the
        rollout that asked for it nor a new rollout of the same revision (an outside probe: a revision
        rolled out again went by its earlier verdict, pass or fail, without a canary)."""
        current = self._tasks.get(model)
        if current is not None and (revision is None or current[0] == revision):
            current[2].cancel()
            del self._tasks[model]
        result = self._results.get(model)
        if result is not None and (revision is None or result.revision == revision):
            del self._results[model]

    def forget(self, model: tuple[str, str]) -> None:
        self.cancel(model)
        self._results.pop(model, None)

    def cancel_all(self) -> None:
        """Stop every run (leadership lost: another operator replica drives from now on)."""
        for model in list(self._tasks):
            self.cancel(model)
        self._results.clear()

    @property
    def active(self) -> int:
        return sum(1 for _, _, task in self._tasks.values() if not task.done())


async def execute(
    backend: Backend,
    request: RevisionRequest | None,
    actions: Sequence[Action],
    runner: CanaryRunner,
    canary_spec: CanarySpec,
    on_canary_done: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Carry out the workload actions of a decision, in order (conditions and events are the
    caller's: they go to its status and event sink). `request` is required for DeployRevision."""
    model = request.model if request is not None else None
    for action in actions:
        if isinstance(action, DeployRevision):
            assert request is not None and action.revision == request.revision, "DeployRevision is for the spec's revision"
            await backend.ensure_revision(request, action.scale)
        elif isinstance(action, ScaleRevision):
            assert model is not None
            await backend.scale_revision(model, action.revision, action.replicas)
        elif isinstance(action, DeleteRevision):
            assert model is not None
            runner.cancel(model.key, action.revision)
            await backend.delete_revision(model, action.revision)
        elif isinstance(action, RouteTraffic):
            assert model is not None
            await backend.route_traffic(model, action.revision)
            if request is not None:  # all of it; under service nothing splits (what another router left goes)
                splitting = request.spec.rollout.traffic_router is not TrafficRouter.SERVICE
                await backend.split_traffic(request, traffic_split(action.revision, None, 0) if splitting else ())
        elif isinstance(action, SetTrafficWeight):
            assert request is not None, "SetTrafficWeight needs the spec (its trafficRouter and gateway)"
            await backend.split_traffic(request, traffic_split(action.stable, action.candidate, action.weight))
        elif isinstance(action, CancelCanary):
            assert model is not None
            runner.cancel(model.key, action.revision)
        elif isinstance(action, RunCanary):
            assert model is not None
            await _start_canary(backend, model, action, runner, canary_spec, on_canary_done)


async def _start_canary(
    backend: Backend,
    model: ModelRef,
    run: RunCanary,
    runner: CanaryRunner,
    spec: CanarySpec,
    on_done: Callable[[], Awaitable[None]] | None,
) -> None:
    if run.baseline_match == "tolerant":  # the same model, other numerics: by logprobs, not text
        spec = spec.for_changed_numerics()
    elif run.baseline_match in ("none", "unknown"):  # (perhaps) another model: its text is no golden reference
        spec = spec.model_copy(update={"golden": spec.golden.model_copy(update={"compare_baseline": False})})
    target = await backend.endpoints(model, run.revision)
    # Another model for sure: no baseline at all. The isolation probe would otherwise judge two
    # tenants who got the same answer alone by the old model's answers (e2e: a healthy weights
    # change rolled back); without one it notes them. `unknown` keeps it (RolloutState docs).
    baseline = await backend.endpoints(model, run.baseline) if run.baseline and run.baseline_match != "none" else None
    if target.router_url is None:
        log.warning("canary of %s/%s revision %s: no router URL yet", *model.key, run.revision)
        return
    runner.start(
        model.key, run, target.router_url, spec=spec,
        baseline_url=baseline.router_url if baseline else None,
        metrics_urls=[w.metrics_url for w in target.workers],
        engine_logs=[w.log for w in target.workers if w.log is not None], on_done=on_done,
    )  # fmt: skip
