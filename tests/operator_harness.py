"""The real operator (kopf + kvguard.operator.handlers) against the emulator (kmock_api.ApiServer):
the fixtures and helpers the operator tests share (registered for every test by conftest.py).

The canary gate runs for real: the Kubernetes backend's endpoint resolution is pointed at real
`kvguard` router/prefill/decode processes on loopback (`LocalDeployment`), so the operator scrapes
real /metrics and runs the real canary suite; a revision can be mapped to a deployment started
with the incident's faults. kmock has no scheduler, Deployment controller, pods, DNS or garbage
collector, so the tests play the Deployment controller (`mark_ready`), resolve URLs themselves and
check owner references instead of waiting for GC. e2e/ runs the same flows on a real cluster.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as dt
import functools
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock as km
import kopf
import kubernetes
import pytest
import yaml
from kmock_api import client_configuration, declare_kvguard_resources
from rbac import Grant, denied, install_grants, operator_requests
from waiting import stays, until  # noqa: F401 - re-exported for the operator tests

import kvguard.operator.handlers  # noqa: F401  (registers the operator's handlers)
from kvguard.commands.operator import WATCH_NAMESPACES_ENV
from kvguard.operator.backends.base import ModelRef, RevisionEndpoints, WorkerEndpoint
from kvguard.operator.controller import Controller, ControllerSettings
from kvguard.operator.workqueue import Backoff
from kvguard.workers.launcher import LocalDeployment, LocalServeConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NS = "models"
IM = km.resource("kvguard.io", "v1alpha1", "inferencemodels")
DEPLOYMENTS = km.resource("apps", "v1", "deployments")
SERVICES = km.resource("", "v1", "services")
SECRETS = km.resource("", "v1", "secrets")
NETPOLS = km.resource("networking.k8s.io", "v1", "networkpolicies")
EVENTS = km.resource("", "v1", "events")
EMULATOR_URL: list[str] = []

CANARY_WAIT = 180.0  # a canary runs real requests: seconds on a quiet machine, many more on a loaded one
# A lean canary (capacity, golden, over-length, safety counters) keeps each rollout to seconds.
FAST_CANARY = {"determinism": {"enabled": False}, "isolation": {"enabled": False}, "abort": {"enabled": False},
               "overLength": {"apis": ["completions"], "streaming": [False]}, "requestTimeoutSeconds": 10}  # fmt: skip
CLUSTER: list[Any] = []
"""The kmock of the running test (the resolver reads Deployment replicas from it)."""
ROUTES: dict[str, LocalDeployment] = {}
"""revision -> the processes that answer for it; anything else answers with the default."""


@kopf.on.login()
def _login(**_: Any) -> kopf.ConnectionInfo:  # test-only: point kopf at the emulator
    return kopf.ConnectionInfo(server=EMULATOR_URL[-1], insecure=True)


def tiny_model(name: str = "tiny", uid: str = "uid-tiny") -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": NS, "uid": uid, "resourceVersion": "1", "generation": 1}
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}, "revision": "r1"}
    body["spec"]["canary"] = copy.deepcopy(FAST_CANARY)
    # The old revision goes to zero at promotion (the delay is tested in test_progressive_kmock.py).
    body["spec"]["rollout"] = {"scaleDownDelaySeconds": 0}
    return body


def _serve(model_dir: Path, faults: str | None = None) -> LocalDeployment:
    extra = (("KVGUARD_FAULTS", faults),) if faults else ()
    config = LocalServeConfig(model_dir=model_dir, kv_pool_tokens=4096, context_length=1024, page_size=16, extra_env=extra)
    return LocalDeployment(config).start()


@pytest.fixture(scope="module")
def serving(tiny_model_dir: Path) -> Any:
    """Real router/prefill/decode processes standing in for every revision's pods."""
    deployment = _serve(tiny_model_dir)
    ROUTES["default"] = deployment
    yield deployment
    deployment.stop()
    ROUTES.clear()


@pytest.fixture(scope="module")
def incident_build(tiny_model_dir: Path) -> Any:
    """The incident's engine build: over-length 'rejected' via a placeholder token, no page tags."""
    deployment = _serve(tiny_model_dir, "unsafe_reject_path,no_tags")
    yield deployment
    deployment.stop()


async def resolve(model: ModelRef, revision: str) -> RevisionEndpoints:
    """One worker per replica of the revision's Deployment (a pod each), all answered by the same
    real process of that role: kmock has no pods to list."""
    deployment = ROUTES.get(revision, ROUTES["default"])
    urls = deployment.metrics_urls
    deployments = objects_of(CLUSTER[-1], DEPLOYMENTS) if CLUSTER else {}
    workers = []
    for role in ("prefill", "decode"):
        live = deployments.get(f"{model.name}-{revision}-{role}")
        replicas = int(live["spec"]["replicas"]) if live is not None else 1
        workers += [WorkerEndpoint(f"{model.name}-{revision}-{role}-{i}", role, urls[role]) for i in range(replicas)]
    routers = (WorkerEndpoint(f"{model.name}-{revision}-router-0", "router", urls["router"]),)
    return RevisionEndpoints(router_url=deployment.router_url, workers=tuple(workers), routers=routers)


def objects_of(k8s: Any, resource: Any) -> dict[str, Any]:
    return {name: k8s.objects[key] for key in list(k8s.objects.keys()) if (key[0] == resource and (name := key[2]))
            and not k8s.objects[key].deleted}  # fmt: skip


def events_of(k8s: Any, reason: str) -> list[dict[str, Any]]:
    return [e for e in objects_of(k8s, EVENTS).values() if e["reason"] == reason]


async def promoted(k8s: Any, revision: str) -> None:
    """Until the RevisionPromoted event of `revision` is recorded. The controller posts events
    after the status write and the workload changes, so once it is there the promotion pass is
    over: a snapshot taken now is one no later write of that pass can change."""
    await until(lambda: [e for e in events_of(k8s, "RevisionPromoted") if f"revision {revision} is serving" in e["message"]],
                f"the RevisionPromoted event of {revision}")  # fmt: skip


def fast_settings(**changes: Any) -> ControllerSettings:
    """The controller's settings with test-sized Lease timing (a standby takes over in seconds)."""
    base = ControllerSettings.from_env()
    # 6 s: a leader's thread stalled for a few seconds on a loaded machine must not hand the Lease
    # over behind a test's back (the takeovers the tests make happen are forced, not waited for).
    lease = dataclasses.replace(base.lease, duration=6.0, renew_deadline=4.0, retry_period=0.3)
    values: dict[str, Any] = {"lease": lease, "wait": Backoff(0.5, 5.0, 0.2), "errors": Backoff(0.2, 5.0, 0.2), **changes}
    return dataclasses.replace(base, **values)


class Operator:
    """kopf in its own thread and event loop (it cancels every task created after it starts, so
    pytest-asyncio's would die), like kopf.testing.KopfRunner; `restart` is a new process's worth
    of state: no canary task, no in-memory result, only what the API server holds. Several can
    run against one emulator: each has its own memo, controller and identity."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.memo = kopf.Memo()

    @property
    def controller(self) -> Controller:
        return self.memo["kvguard"]

    async def start(self, suite: Any = None, settings: ControllerSettings | None = None, *, kube: Any = None,
                    wait_for_watches: bool = True, namespaces: tuple[str, ...] = ()) -> None:  # fmt: skip
        """`suite` replaces the canary suite runner of this operator process (default: the real one);
        `kube`, the controller's API client (default: one on the emulator); `namespaces`: watch
        only these, as the namespaced install runs it (default: every namespace)."""
        self.memo = kopf.Memo(kvguard_suite=suite, kvguard_settings=settings or fast_settings(), kvguard_resolver=resolve,
                              kvguard_kube=kube)  # fmt: skip
        os.environ[WATCH_NAMESPACES_ENV] = ",".join(namespaces)  # as `kvguard operator --namespace` sets it for its handlers
        settings_ = kopf.OperatorSettings()
        settings_.posting.enabled = False  # kmock has no generateName; our Events are plain creates
        settings_.watching.server_timeout = 5
        self.stop_flag = threading.Event()
        seen = len(list(self.kmock))
        self.thread = threading.Thread(
            target=asyncio.run,
            args=(kopf.operator(clusterwide=not namespaces, namespaces=namespaces, standalone=True, settings=settings_,
                                stop_flag=self.stop_flag, memo=self.memo),),  # fmt: skip
            daemon=True,
        )
        self.thread.start()
        if wait_for_watches:
            for plural in ("inferencemodels", "deployments"):
                await until(lambda: any("watch" in str(r.url) and plural in str(r.url) for r in list(self.kmock)[seen:]),  # noqa: B023 - awaited in this iteration
                            f"kopf to watch {plural}")  # fmt: skip
        await until(lambda: "kvguard" in self.memo, "the controller to start")

    async def stop(self) -> None:
        self.stop_flag.set()
        assert self.thread is not None
        await asyncio.to_thread(self.thread.join, 60)  # a loaded machine: kopf's graceful exit took over 15 s
        assert not self.thread.is_alive(), "kopf did not stop"

    async def restart(self, suite: Any = None) -> None:
        await self.stop()
        await self.start(suite)


@pytest.fixture
async def operator(kmock: Any, monkeypatch: pytest.MonkeyPatch, serving: LocalDeployment) -> AsyncIterator[Operator]:
    url = declare_kvguard_resources(kmock)
    EMULATOR_URL.append(url)
    client_configuration(url, make_default=True)
    monkeypatch.setenv("KVGUARD_METRICS_PORT", "0")
    monkeypatch.setenv(WATCH_NAMESPACES_ENV, "")  # restored after the test, whatever `start` set it to
    CLUSTER.append(kmock)
    op = Operator(kmock)
    await op.start()
    try:
        yield op
    finally:
        await op.stop()
        for revision in [r for r in ROUTES if r != "default"]:
            del ROUTES[revision]
        CLUSTER.pop()
        EMULATOR_URL.pop()
        kubernetes.client.ApiClient.set_default(None)
    assert_rbac_allows(kmock, "manifests")


def assert_rbac_allows(kmock: Any, install: str, since: int = 0) -> None:
    """kmock authorizes nothing: every request the operator sent (from the emulator's `since`-th
    on) must be one the shipped roles of `install` (a kustomization: `manifests` cluster-wide,
    `manifests/namespaced`) allow."""
    sent = operator_requests(kmock, since)
    assert sent, "no request of the operator's was recognised (its User-Agent?)"
    refused = denied(sent, _install_grants(install))
    assert not refused, f"the RBAC of {install}/ would refuse: {refused}"


@functools.cache
def _install_grants(install: str) -> list[Grant]:
    return install_grants(install, NS)


@pytest.fixture
async def cluster(operator: Operator) -> Any:
    return operator.kmock


async def http(method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, EMULATOR_URL[-1] + path, json=body, headers={"Content-Type": content_type}) as resp:
            assert resp.status < 300, await resp.text()
            return await resp.json()


async def apply_model(body: dict[str, Any]) -> None:
    await http("POST", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels", body)


async def patch_model(name: str, patch: dict[str, Any]) -> None:
    await http("PATCH", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/{name}", patch,
               "application/merge-patch+json")  # fmt: skip


REVISION_DEPLOYMENTS = 3  # prefill, decode and router of a kvguard-engine revision


async def mark_ready(k8s: Any, revision: str) -> None:
    """Play the Deployment controller: it has seen the latest spec (observedGeneration) and every
    replica runs it (updatedReplicas) and is Ready (readyReplicas); no old replica is left.
    Waits for all of the revision's Deployments first: the operator may still be applying them
    when its status names the revision, and one never marked would stall the rollout."""

    def of_revision() -> dict[str, Any]:
        return {name: obj for name, obj in objects_of(k8s, DEPLOYMENTS).items()
                if obj["metadata"]["labels"]["kvguard.io/revision"] == revision}  # fmt: skip

    deployments = await until(lambda: len(of_revision()) >= REVISION_DEPLOYMENTS and of_revision(),
                              f"the Deployments of revision {revision}")  # fmt: skip
    for name, obj in deployments.items():
        replicas = obj["spec"]["replicas"]
        status = {"observedGeneration": obj["metadata"].get("generation"), "replicas": replicas,
                  "updatedReplicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}  # fmt: skip
        await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status", {"status": status},
                   "application/merge-patch+json")  # fmt: skip


async def assert_scaled_down_when_due(k8s: Any, revision: str, scale_down_at: str) -> None:
    """The previous stable `revision` went to zero no earlier than the scaleDownAt its promotion set
    (both are the operator's clock, in whole seconds). Checked on the scale-down's own Event (posted
    after the scaling, so waited for), not by looking whether it still runs at some moment: how late
    a test looks depends on the machine."""
    events = await until(lambda: [e for e in events_of(k8s, "PreviousRevisionScaledDown") if f"revision {revision} " in e["message"]],
                         f"the PreviousRevisionScaledDown event of {revision}")  # fmt: skip
    due = dt.datetime.fromisoformat(scale_down_at)
    assert all(dt.datetime.fromisoformat(e["firstTimestamp"]) >= due for e in events), (scale_down_at, events)


def status_of(k8s: Any, name: str = "tiny") -> dict[str, Any]:
    return dict(k8s.objects[IM, NS, name].get("status") or {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


async def never_finishes(url: str, *args: Any, **kwargs: Any) -> Any:
    await asyncio.Event().wait()  # a canary still running when the operator dies


async def stable_revision(cluster: Any) -> str:
    """The tiny model applied, its revision made ready by hand (no kubelet here), promoted."""
    await apply_model(tiny_model())
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster).get("phase") == "Ready", "stable", CANARY_WAIT)
    await promoted(cluster, rev)
    return str(rev)


async def second_revision_ready(cluster: Any, body: dict[str, Any]) -> tuple[str, str]:
    """`body` rolled out and serving (rev1), then a new revision (spec.model.source.revision r2, rev2)
    at full scale and ready: its canary, or its traffic steps, start."""
    await apply_model(body)
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await promoted(cluster, rev1)
    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
    await mark_ready(cluster, rev2)
    return str(rev1), str(rev2)


async def two_revisions(cluster: Any, scale_down_delay: int, history: int = 2) -> tuple[str, str]:
    """A first revision promoted, then a second one promoted over it."""
    body = tiny_model()
    body["spec"]["rollout"] = {"scaleDownDelaySeconds": scale_down_delay}
    body["spec"]["revisionHistoryLimit"] = history
    rev1, rev2 = await second_revision_ready(cluster, body)
    await promoted(cluster, rev2)
    return rev1, rev2
