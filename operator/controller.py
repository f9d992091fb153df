"""The operator's controller: event-driven, cached, one leader, backing off (async glue, no kopf).

kopf (handlers.py) feeds it watch events and owns the label-selected watches and the indexes of
children and policies; everything else is here:

- Reads come from memory: the models as last seen on their watch (or written by us), their
  children from the index, policies from theirs. A pass costs API requests only for what it
  changes (and for a ConfigMap the spec names, cached for `configmap_ttl`).
- A work queue of model keys: each model's events coalesce, one pass per model at a time,
  `workers` models in parallel (workqueue.py).
- Requeue only when something is awaited (the outcome says so), with exponential backoff and
  jitter while nothing changes, never past the awaited thing's deadline; failures of any kind
  (HTTP, transport, a stale status, a bug) back off exponentially per model too. A periodic
  resync is a safety net that costs a model at rest one request (its transfer Secret created
  again: 409 while it exists), and one LIST of InferenceModels per watched namespace.
- Leadership (leader.py): every replica keeps its caches warm; only the Lease holder runs
  passes. Losing the Lease stops everything it runs in the background at once: the workers, the
  requeue timers, every canary run and scrape request. Status writes are conditional on the
  version read (a 409 re-reads and decides again), so even a write racing the hand-over is lost
  by the stale writer, never by the truth.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvguard.commands.operator import watched_namespaces
from kvguard.operator import metrics
from kvguard.operator.api import InferencePolicy
from kvguard.operator.backends.base import CanaryRunner, ForeignObjectError
from kvguard.operator.backends.kubernetes import ChildIndex, KubernetesBackend, Resolver
from kvguard.operator.backends.pod_gate import PodGate
from kvguard.operator.driver import DriverMemory, PassResult, StatusConflict, model_ref, observe, requeue_delay, run_pass
from kvguard.operator.kube import Kube, KubeError, ObjectRef
from kvguard.operator.leader import LeaderElector, LeaseConfig
from kvguard.operator.reconcile import EventSpec, Outcome
from kvguard.operator.workloads import owner_key
from kvguard.operator.workqueue import Backoff, WorkQueue, stop_workers

log = logging.getLogger(__name__)

ModelKey = tuple[str, str]
"""(namespace, name) of an InferenceModel."""

FAULT_INJECTION_ENV = "KVGUARD_ALLOW_FAULT_INJECTION"


def fault_injection_allowed() -> bool:
    """Test clusters only (manifests/testing/fault-injection): honour the kvguard.io/faults annotation."""
    return os.environ.get(FAULT_INJECTION_ENV, "").strip().lower() in ("1", "true", "yes")


def _float_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    workers: int = 8
    """Models reconciled in parallel (each pass is mostly waiting on the API server)."""
    wait: Backoff = Backoff(base=5.0, cap=60.0, jitter=0.2)
    """Requeue while something is awaited and nothing changes: 5 s, 10 s, ... up to 60 s."""
    errors: Backoff = Backoff(base=1.0, cap=300.0, jitter=0.2)
    """After a failed pass: 1 s, 2 s, ... up to 5 min."""
    resync_seconds: float = 600.0
    """Every model is looked at again this often (free at rest: no change, no request)."""
    configmap_ttl: float = 300.0
    lease: LeaseConfig = LeaseConfig()
    identity: str = ""

    @classmethod
    def from_env(cls) -> ControllerSettings:
        lease = LeaseConfig(
            name=os.environ.get("KVGUARD_LEASE_NAME", "kvguard-operator"),
            namespace=os.environ.get("KVGUARD_LEASE_NAMESPACE") or os.environ.get("POD_NAMESPACE") or "kvguard-system",
            duration=_float_env("KVGUARD_LEASE_DURATION", 15.0), renew_deadline=_float_env("KVGUARD_LEASE_RENEW_DEADLINE", 10.0),
            retry_period=_float_env("KVGUARD_LEASE_RETRY_PERIOD", 2.0),
        )  # fmt: skip
        return cls(
            workers=int(_float_env("KVGUARD_WORKERS", 8)), resync_seconds=_float_env("KVGUARD_RESYNC_SECONDS", 600.0),
            wait=Backoff(_float_env("KVGUARD_WAIT_BASE", 5.0), _float_env("KVGUARD_WAIT_CAP", 60.0), 0.2),
            errors=Backoff(_float_env("KVGUARD_ERROR_BASE", 1.0), _float_env("KVGUARD_ERROR_CAP", 300.0), 0.2),
            configmap_ttl=_float_env("KVGUARD_CONFIGMAP_TTL", 300.0), lease=lease,
            identity=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip


class ApiModelStore:
    """InferenceModel status and events on the API server (`driver.ModelStore`)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    async def write_status(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> Mapping[str, Any]:
        meta = body["metadata"]
        ref = ObjectRef("InferenceModel", meta["name"], meta.get("namespace"))
        try:
            return await self.kube.apatch_status(ref, status, meta.get("resourceVersion"))
        except KubeError as exc:
            if exc.status in (404, 409):  # changed or gone since read: re-read (None: forget it)
                raise StatusConflict(str(exc)) from exc
            raise

    async def reread(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        meta = body["metadata"]
        return await self.kube.aget(ObjectRef("InferenceModel", meta["name"], meta.get("namespace")))

    async def record_event(self, body: Mapping[str, Any], event: EventSpec, now: dt.datetime) -> None:
        await self.kube.arecord_event(body, type_=event.type, reason=event.reason, message=event.message, now=now)


def newer(candidate: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    """Is `candidate` a later version than `current`? resourceVersions are opaque to clients, but
    etcd's are integers: compare them when both are, otherwise trust the latest arrival."""
    if current is None:
        return True
    a = str((candidate.get("metadata") or {}).get("resourceVersion") or "")
    b = str((current.get("metadata") or {}).get("resourceVersion") or "")
    return not (a.isdigit() and b.isdigit()) or int(a) >= int(b)


class Controller:
    """One per operator process. See the module docstring."""

    def __init__(
        self,
        kube: Kube,
        children: ChildIndex,
        policies: Callable[[], Iterable[InferencePolicy]],
        settings: ControllerSettings | None = None,
        *,
        runner: CanaryRunner | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.settings = settings or ControllerSettings.from_env()
        self.kube = kube
        self.backend = KubernetesBackend(kube, children, resolver)
        self.runner = runner or CanaryRunner()
        self.continuous = CanaryRunner(runner.suite) if runner is not None else CanaryRunner()
        """The continuous canary's runs (spec.canary.continuous), apart from rollout canaries."""
        self.store = ApiModelStore(kube)
        self.memory = DriverMemory()
        self.queue: WorkQueue[ModelKey] = WorkQueue()
        self.models: dict[ModelKey, Mapping[str, Any]] = {}
        self._policies = policies
        self._waits: dict[ModelKey, int] = {}
        self._failures: dict[ModelKey, int] = {}
        self._event_retries: dict[ModelKey, int] = {}  # passes in a row that left Events unposted
        self._configmaps = ConfigMapCache(self.settings.configmap_ttl)
        self._tasks: list[asyncio.Task[None]] = []
        self.gate = PodGate(kube, lambda: list(self._policies()), self.enqueue)
        """S7 while pods serve: the readiness gate of every engine pod (backends/pod_gate.py)."""
        self.elector = LeaderElector(kube, self.settings.identity, self.settings.lease, self._started_leading, self._stopped_leading)
        kube.write_guard = self._write_guard
        self._elector_task: asyncio.Task[None] | None = None
        self.passes = 0
        """Passes run by this process (tests and the scale benchmark read it)."""
        self.retries: collections.deque[tuple[ModelKey, int, float, str]] = collections.deque(maxlen=256)
        """Recent failed passes: (model, attempt, backoff delay, error), newest last."""

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._elector_task = asyncio.get_running_loop().create_task(self.elector.run(), name="kvguard leader election")

    async def stop(self) -> None:
        await self.elector.release()
        if self._elector_task is not None:
            self._elector_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._elector_task
        await self._stop_work()

    @property
    def leading(self) -> bool:
        return self.elector.leading

    def _write_guard(self, _method: str, path: str) -> str | None:
        """Only the holder of a fresh Lease writes (the Lease itself is the elector's to write)."""
        if "/leases" in path or self.elector.holds_lease():
            return None
        return "this replica does not hold a fresh Lease (another replica may lead)"

    async def _started_leading(self) -> None:
        metrics.LEADER.set(1)
        self.backend.forget_everything()  # what this replica knew before (if it led before) may be stale
        self._tasks = [asyncio.get_running_loop().create_task(self._lead(), name="kvguard resync")]
        self.gate.start()

    async def _stopped_leading(self) -> None:
        metrics.LEADER.set(0)
        await self._stop_work()

    async def _stop_work(self) -> None:
        """Everything this replica runs for models stops now: another replica drives from here."""
        await self.gate.stop()
        tasks, self._tasks = self._tasks, []
        await stop_workers(tasks)
        self.queue.clear()
        self.runner.cancel_all()
        self.continuous.cancel_all()
        metrics.forget_all_models()
        self.memory.clear()
        self.backend.forget_everything()  # a later leader may re-apply, or delete or make Secrets: never trust this memory then
        self._waits.clear()
        self._failures.clear()
        self._event_retries.clear()

    # --- what kopf tells us ---------------------------------------------------------------------
    def model_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        if event_type == "DELETED":
            self.models.pop(key, None)
        elif newer(body, self.models.get(key)):
            self.models[key] = body
        self.enqueue(key)

    def child_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        owner = owner_key(body)
        if event_type == "DELETED":  # a standby keeps nothing for later: it starts over when it leads
            self.backend.child_left(body, model_known=self.leading and owner in self.models)
        if owner is not None:
            self.enqueue(owner)

    def pod_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        self.gate.pod_event(event_type, body)
        if event_type != "DELETED" and (model := self.backend.transfer_secret_missing(body)) is not None:
            self.enqueue(model)

    def policies_changed(self) -> None:
        self.gate.recheck_all()
        for key in list(self.models):
            self.enqueue(key)

    def enqueue(self, key: ModelKey) -> None:
        if self.leading:
            self.queue.add(key)

    # --- the work -------------------------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.process(key)
            finally:
                self.queue.done(key)

    async def _lead(self) -> None:
        """The passes of a leader: its workers start after a first LIST, then every model is passed,
        and again once per resync period. A standby's cache may hold models deleted while its watch
        was down, and a new leader passed them (reads and writes of a model that is gone) until its
        first resync, 10 minutes on (a review). Keys enqueued meanwhile (a policy, pod or child
        event) wait in the queue: a review saw a pass of such a model during the LIST when the
        workers ran from the start."""
        await self._drop_vanished()
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._worker(), name=f"kvguard worker {i}") for i in range(self.settings.workers)]
        while True:
            for key in list(self.models):
                self.queue.add(key)
            await asyncio.sleep(self.settings.wait.spread(self.settings.resync_seconds))
            await self._drop_vanished()

    async def _drop_vanished(self) -> None:
        """Forget the models the API server no longer has. A DELETED lost to a relist (a watch
        answered 410 Gone after a long disconnect) never comes: kopf does not synthesize one as
        client-go's informers do, and the model stayed cached, passed at every resync and kept
        its metrics for good (an outside probe). One LIST per watched namespace per resync; a
        model cached (or replaced) after the LIST was sent is kept, and so is every model of a
        namespace whose LIST failed. Whatever the failure, the resync goes on (a review: only a
        KubeError was caught, and anything else would have ended the resync task for good)."""
        before = dict(self.models)
        namespaces: list[str | None] = [*watched_namespaces([], os.environ)] or [None]
        listed = await asyncio.gather(*(self._uids_in(namespace) for namespace in namespaces))  # at once: each may take 30 s
        present = {uid for uids in listed if uids is not None for uid in uids}
        unlisted = {namespace or "" for namespace, uids in zip(namespaces, listed, strict=True) if uids is None}
        if "" in unlisted:  # ("" for all of them)
            return
        for key, body in before.items():
            if key[0] in unlisted or self.models.get(key) is not body or body is None:
                continue
            if str((body.get("metadata") or {}).get("uid")) not in present:
                log.warning("%s/%s: gone from the API server without a DELETED event; forgotten", *key)
                self.model_event("DELETED", body)

    async def _uids_in(self, namespace: str | None) -> set[str] | None:
        """The uids of the InferenceModels in `namespace` (every one when None); None when the
        LIST failed, whatever the failure."""
        try:
            return {str((m.get("metadata") or {}).get("uid")) for m in await self.kube.alist("InferenceModel", namespace)}
        except Exception as exc:  # noqa: BLE001 - a resync must outlive any one failed LIST
            log.warning("resync: could not list InferenceModels%s (%s); none of them forgotten",
                        f" in {namespace}" if namespace else "", exc)  # fmt: skip
            return None

    async def process(self, key: ModelKey) -> None:
        """One pass for one model, and when to look at it again."""
        body = self.models.get(key)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self._forget(key)
            return
        started = time.monotonic()
        self.passes += 1
        try:
            result = await self._pass(key, body)
        except ForeignObjectError:
            self.queue.requeue(key, 0.0)  # the next pass reports it (Degraded, naming the object)
            return
        except Exception as exc:  # noqa: BLE001 - every failure takes the same backoff path
            self._failed(key, exc)
            return
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        self._failures.pop(key, None)
        if result is None:
            self._forget(key)
            return
        if key in self.models and newer(result.body, self.models[key]):  # (not if deleted meanwhile)
            self.models[key] = result.body
        self._schedule(key, result)

    async def _pass(self, key: ModelKey, body: Mapping[str, Any]) -> PassResult | None:
        observed = await observe(
            body, self.backend, self.runner, self.memory, policies=list(self._policies()),
            architecture_config=await self._architecture_config(body), fault_injection_allowed=fault_injection_allowed(),
            pools=self.gate.pools(*key), continuous=self.continuous,
        )  # fmt: skip

        async def canary_done() -> None:
            self.enqueue(key)

        def recorded(outcome: Outcome) -> None:
            # What a decision counts once, taken once it is in status, before an action can fail:
            # a retried pass does not decide it again (a failed run counted after the actions
            # went uncounted; an outside probe).
            if outcome.blocked_reason and outcome.events:
                metrics.BLOCKED_PLANS.labels(outcome.blocked_reason).inc()
            if outcome.continuous_verdict not in (None, "pass"):
                metrics.CONTINUOUS_FAILURES.labels(key[0], key[1], outcome.continuous_verdict).inc()

        result = await run_pass(body, observed, self.store, self.backend, self.runner, self.memory, on_canary_done=canary_done,
                                continuous=self.continuous, on_recorded=recorded)  # fmt: skip
        if result is not None:
            _count(result.outcome, key)  # one result per pass: a pass whose action failed counts `error` (_failed)
        return result

    def _schedule(self, key: ModelKey, result: PassResult) -> None:
        outcome = result.outcome
        waits = 0 if result.wrote_status else self._waits.get(key, -1) + 1
        self._waits[key] = waits
        base, cap = self.settings.wait.base, self.settings.wait.cap
        delay = requeue_delay(outcome, waits, base=base, cap=cap, jitter=self.settings.wait.spread)
        if self.memory.outbox.get(key):  # Events waiting for the API server: soon (backing off), not at the next resync
            tries = self._event_retries.get(key, 0)
            self._event_retries[key] = tries + 1
            soon = self.settings.errors.delay(tries)
            delay = soon if delay is None else min(delay, soon)
        else:
            self._event_retries.pop(key, None)
        self.queue.requeue(key, delay)

    def _failed(self, key: ModelKey, exc: BaseException) -> None:
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = self.settings.errors.delay(failures)
        asked = exc.retry_after if isinstance(exc, KubeError) else None
        if asked is not None:  # throttled (429) or unavailable (503): no sooner than the API server asked
            delay = max(delay, min(asked, self.settings.errors.cap))
        self.retries.append((key, failures, delay, f"{type(exc).__name__}: {exc}"))
        metrics.RECONCILES.labels("error").inc()
        level = logging.WARNING if isinstance(exc, KubeError | StatusConflict) else logging.ERROR
        log.log(level, "reconcile of %s/%s failed (%s); retrying in %.1f s", *key, exc, delay, exc_info=level == logging.ERROR)
        self.queue.requeue(key, delay)

    def _forget(self, key: ModelKey) -> None:
        """The model is gone: its metrics, canary, memory and timers go with it."""
        metrics.forget_model(*key)
        self.runner.forget((key[0] or "default", key[1]))
        self.continuous.forget((key[0] or "default", key[1]))
        self.memory.forget(key)
        self.backend.forget_model(key)
        self.queue.forget(key)
        self._waits.pop(key, None)
        self._event_retries.pop(key, None)
        self._failures.pop(key, None)

    async def _architecture_config(self, body: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str | None]:
        spec = body.get("spec")
        model = spec.get("model") if isinstance(spec, Mapping) else None
        if not isinstance(model, Mapping):  # not an object: reconcile reports the spec Degraded, naming the field
            return None, None
        ref = model.get("architectureConfigMap")
        if not isinstance(ref, Mapping) or model.get("architecture") or not ref.get("name"):
            return None, None
        namespace = body["metadata"].get("namespace") or "default"
        name, key = str(ref["name"]), str(ref.get("key") or "config.json")
        cm = self._configmaps.get((namespace, name), time.monotonic())
        if cm is None:
            cm = await self.kube.aget(ObjectRef("ConfigMap", name, namespace))
            if cm is not None:  # a missing one is asked for again at the next pass (reconcile's recheck timer)
                cm = self._configmaps.put((namespace, name), cm, time.monotonic())
        return parse_config_json(cm, name, key)


class ConfigMapCache:
    """The ConfigMaps models name for their architecture, (namespace, name) -> its data, each for
    `ttl` seconds from its read. Entries past it are dropped whenever one is added: they were only
    ever replaced, so a tenant naming many ConfigMaps of up to 1 MiB (then deleting them) grew the
    operator without bound (outside probe). Pure: the caller gives the time."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[tuple[str, str], tuple[float, Mapping[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ref: tuple[str, str], now: float) -> Mapping[str, Any] | None:
        entry = self._entries.get(ref)
        return entry[1] if entry is not None and now - entry[0] <= self.ttl else None

    def put(self, ref: tuple[str, str], configmap: Mapping[str, Any], now: float) -> Mapping[str, Any]:
        """Keep `configmap`'s data (not its metadata) from `now`; returns what is kept."""
        for old in [r for r, (read_at, _) in self._entries.items() if now - read_at > self.ttl]:
            del self._entries[old]
        kept = {"data": configmap.get("data")}
        self._entries[ref] = (now, kept)
        return kept


def parse_config_json(cm: Mapping[str, Any] | None, name: str, key: str) -> tuple[Mapping[str, Any] | None, str | None]:
    if cm is None:
        return None, f"ConfigMap {name} not found"
    text = (cm.get("data") or {}).get(key)
    if text is None:
        return None, f"ConfigMap {name} has no key {key}"
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:  # nested deeper than Python parses: not a config either
        return None, f"{key} is not JSON: {exc}"
    return (config, None) if isinstance(config, dict) else (None, f"{key} is not a JSON object")


def _count(outcome: Outcome, key: ModelKey) -> None:
    result = "ok" if outcome.blocked_reason is None else ("blocked" if outcome.plan is not None else "invalid")
    metrics.RECONCILES.labels(result).inc()
    metrics.record_plan(key[0], key[1], outcome.plan)


__all__ = ["Controller", "ControllerSettings", "fault_injection_allowed", "model_ref"]
