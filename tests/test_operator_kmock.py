"""The real operator (kopf + kvguard.operator.handlers) against kmock's Kubernetes emulator.

What this proves: the handlers, the controller and kube.py drive a real HTTP API with real watch
streams; create/update/resume/Deployment events converge on the rendered objects; a blocked plan
changes nothing that runs (S7, S8); children carry the owner references that make deletion clean.
The canary gate (S7/S8) runs for real: the Kubernetes backend's endpoint resolution is pointed at
real `kvguard` router/prefill/decode processes on loopback (`LocalDeployment`), so the operator
scrapes real /metrics and runs the real canary suite; a revision can be mapped to a deployment
started with the incident's faults. What it does not prove: kmock has no scheduler, Deployment
controller, pods, DNS or garbage collector, so the test plays the Deployment controller (it sets
readyReplicas), resolves URLs itself and checks owner references instead of waiting for GC.
e2e/ runs the same flows on a real cluster.
"""

from __future__ import annotations

import asyncio
import copy
import logging
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
from waiting import stays, until

import kvguard.operator.handlers  # noqa: F401  (registers the operator's handlers)
from kvguard.operator import metrics
from kvguard.operator.backends.base import CanaryRunner, ModelRef, RevisionEndpoints, WorkerEndpoint
from kvguard.operator.backends.kubernetes import KubernetesBackend
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
    return body


def _serve(model_dir: Path, faults: str | None = None) -> LocalDeployment:
    extra = (("KVGUARD_FAULTS", faults),) if faults else ()
    # A generous transfer timeout: a canary request that times out on a loaded machine would fail the rollout.
    config = LocalServeConfig(model_dir=model_dir, kv_pool_tokens=4096, context_length=1024, page_size=16, extra_env=extra,
                              transfer_timeout_s=60.0)  # fmt: skip
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
    return RevisionEndpoints(router_url=deployment.router_url, workers=tuple(workers))


def objects_of(k8s: Any, resource: Any) -> dict[str, Any]:
    return {name: k8s.objects[key] for key in list(k8s.objects.keys()) if (key[0] == resource and (name := key[2]))
            and not k8s.objects[key].deleted}  # fmt: skip


def events_of(k8s: Any, reason: str) -> list[Any]:
    return [e for e in objects_of(k8s, EVENTS).values() if e["reason"] == reason]


async def promoted(k8s: Any, revision: str) -> None:
    """Until the RevisionPromoted event of `revision` is recorded. The controller records events
    after the status and the workload changes of the same step, so once it is there every write
    of the promotion has landed (the status alone says the step was decided, not that it was done)."""
    await until(lambda: [e for e in events_of(k8s, "RevisionPromoted") if f"revision {revision} is serving" in e["message"]],
                f"the RevisionPromoted event of {revision}")  # fmt: skip


class Operator:
    """kopf in its own thread and event loop (it cancels every task created after it starts, so
    pytest-asyncio's would die), like kopf.testing.KopfRunner; `restart` is a new process's worth
    of state: no canary task, no in-memory result, only what the API server holds."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()

    async def start(self, suite: Any = None) -> None:
        """`suite` replaces the canary suite runner of this operator process (default: the real one)."""
        handlers = kvguard.operator.handlers
        handlers._KUBE.clear()
        handlers._DRIVER.clear()
        if suite is not None:
            handlers._DRIVER.append((KubernetesBackend(handlers._kube(), resolve), CanaryRunner(suite)))
        settings = kopf.OperatorSettings()
        settings.posting.enabled = False  # kmock has no generateName; our Events are plain creates
        settings.watching.server_timeout = 5
        self.stop_flag = threading.Event()
        seen = len(list(self.kmock))
        self.thread = threading.Thread(
            target=asyncio.run,
            args=(kopf.operator(clusterwide=True, standalone=True, settings=settings, stop_flag=self.stop_flag),),
            daemon=True,
        )
        self.thread.start()
        for plural in ("inferencemodels", "deployments"):
            await until(lambda: any("watch" in str(r.url) and plural in str(r.url) for r in list(self.kmock)[seen:]),  # noqa: B023 - awaited in this iteration
                        f"kopf to watch {plural}")  # fmt: skip

    async def stop(self) -> None:
        self.stop_flag.set()
        assert self.thread is not None
        await asyncio.to_thread(self.thread.join, 15)
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
    kvguard.operator.handlers.ENDPOINT_RESOLVER[:] = [resolve]
    CLUSTER.append(kmock)
    op = Operator(kmock)
    await op.start()
    try:
        yield op
    finally:
        await op.stop()
        for revision in [r for r in ROUTES if r != "default"]:
            del ROUTES[revision]
        kvguard.operator.handlers.ENDPOINT_RESOLVER.clear()
        CLUSTER.pop()
        EMULATOR_URL.pop()
        kubernetes.client.ApiClient.set_default(None)


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


async def mark_ready(k8s: Any, revision: str) -> None:
    """Play the Deployment controller: report every replica of the revision's Deployments ready."""
    for name, obj in objects_of(k8s, DEPLOYMENTS).items():
        if obj["metadata"]["labels"]["kvguard.io/revision"] == revision:
            replicas = obj["spec"]["replicas"]
            await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                       {"status": {"replicas": replicas, "readyReplicas": replicas}}, "application/merge-patch+json")  # fmt: skip


def status_of(k8s: Any, name: str = "tiny") -> dict[str, Any]:
    return dict(k8s.objects[IM, NS, name].get("status") or {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


async def test_apply_renders_workloads_status_and_conditions(cluster: Any) -> None:
    await apply_model(tiny_model())
    deployments = await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3 and objects_of(cluster, DEPLOYMENTS),
                              "three Deployments")  # fmt: skip
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status")
    rev = status["targetRevision"]
    assert set(deployments) == {f"tiny-{rev}-prefill", f"tiny-{rev}-decode", f"tiny-{rev}-router"}
    decode = deployments[f"tiny-{rev}-decode"]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:4] == ["kvguard", "worker", "--role", "decode"]
    assert cmd[cmd.index("--kv-pool-tokens") + 1] == "4096"  # the plan's pool, not a guess
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "KVGUARD_TRANSFER_KEY", "valueFrom": {"secretKeyRef": {"name": f"tiny-{rev}-kv-transfer", "key": "key"}}} in container["env"]
    router_cmd = deployments[f"tiny-{rev}-router"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"http://tiny-{rev}-prefill.{NS}.svc:8000" in router_cmd
    services = await until(lambda: len(objects_of(cluster, SERVICES)) == 3 and objects_of(cluster, SERVICES), "Services")
    assert services[f"tiny-{rev}-decode"]["spec"]["selector"]["kvguard.io/role"] == "decode"
    secret = await until(lambda: objects_of(cluster, SECRETS).get(f"tiny-{rev}-kv-transfer"), "Secret")
    assert len(secret["data"]["key"]) >= 64
    netpol = await until(lambda: objects_of(cluster, NETPOLS).get(f"tiny-{rev}-decode"), "NetworkPolicy")
    transfer_rule = netpol["spec"]["ingress"][1]
    assert transfer_rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert transfer_rule["from"][0]["podSelector"]["matchLabels"]["kvguard.io/role"] == "prefill"
    assert status["phase"] == "Progressing" and status["kvRatio"] == 4.0
    assert condition(status, "KVPoolSufficient")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "True"
    assert status["plan"]["roles"]["decode"]["poolTokens"] == 4096

    assert status["rollout"]["state"] == "CanaryDeploying" and "revision" not in status
    assert "tiny" not in objects_of(cluster, SERVICES)  # nothing routes to an unverified revision (S7)
    await mark_ready(cluster, rev)  # the Deployment event triggers the next reconcile
    status = await until(lambda: status_of(cluster).get("phase") == "Ready" and status_of(cluster), "phase Ready", CANARY_WAIT)
    assert status["revision"] == rev and status["canary"] == "Passed"
    assert condition(status, "CanaryPassed")["status"] == "True"
    rollout = status["rollout"]
    assert rollout["state"] == "Stable" and rollout["canary"]["verdict"] == "pass"
    assert [(w["role"], w["poolTokens"], w["sufficient"]) for w in rollout["workers"]] == [("prefill", 4096, True), ("decode", 4096, True)]
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "RolloutComplete"
    model_service = await until(lambda: objects_of(cluster, SERVICES).get("tiny"), "the model Service")
    assert model_service["spec"]["selector"]["kvguard.io/revision"] == rev
    assert metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", {"namespace": NS, "model": "tiny", "role": "decode"}) == 4.0


async def test_S7_S8_blocked_change_leaves_running_revision_untouched(cluster: Any) -> None:
    await apply_model(tiny_model())
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status")
    rev = status["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("phase") == "Ready", "Ready", CANARY_WAIT)
    await promoted(cluster, rev)  # status is written before acting: wait for the acts too
    before = {kind: copy.deepcopy({n: o.raw for n, o in objects_of(cluster, kind).items()})
              for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)}  # fmt: skip
    blocked_before = metrics.REGISTRY.get_sample_value("kvguard_operator_blocked_plans_total", {"reason": "KVPoolTooSmall"}) or 0

    await patch_model("tiny", {"spec": {"kvPoolTokens": 1024}, "metadata": {"generation": 2}})  # 1x context < 2x
    status = await until(lambda: status_of(cluster).get("phase") == "Blocked" and status_of(cluster), "phase Blocked")
    kv = condition(status, "KVPoolSufficient")
    assert kv["status"] == "False" and kv["reason"] == "KVPoolTooSmall"
    assert "1,024 tokens = 1.00x context 1,024 < 2x required" in kv["message"]
    assert "Suggested fixes" in kv["message"]
    assert status["revision"] == rev and status["targetRevision"] != rev
    assert condition(status, "Ready")["status"] == "True"  # the stable revision still serves
    events = await until(lambda: events_of(cluster, "KVPoolTooSmall"), "Warning event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "tiny"

    def blocked_plans() -> float:
        return metrics.REGISTRY.get_sample_value("kvguard_operator_blocked_plans_total", {"reason": "KVPoolTooSmall"}) or 0

    await until(lambda: blocked_plans() > blocked_before, "the blocked plan counted")  # counted after the event is posted
    # Nothing to wait for that proves a negative: give any (wrong) follow-up write a window to land.
    await stays(lambda: {kind: {n: o.raw for n, o in objects_of(cluster, kind).items()} for kind in before} == before,
                "a blocked plan must not change anything that runs")  # fmt: skip
    assert blocked_plans() == blocked_before + 1


async def test_new_revision_rolls_out_beside_stable_then_replaces_it(cluster: Any) -> None:
    await apply_model(tiny_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await until(lambda: status_of(cluster).get("revision") == rev1, "rev1 stable", CANARY_WAIT)
    await promoted(cluster, rev1)  # the model Service too

    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
    assert objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev1  # S8
    await mark_ready(cluster, rev2)
    await until(lambda: status_of(cluster).get("revision") == rev2, "rev2 promoted", CANARY_WAIT)
    await until(lambda: objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev2, "traffic on rev2")
    scaled = await until(lambda: all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n)
                         and objects_of(cluster, DEPLOYMENTS), "rev1 scaled to zero, kept for rollback")  # fmt: skip
    assert scaled[f"tiny-{rev1}-decode"]["metadata"]["annotations"]["kvguard.io/replicas-before-scale-down"] == "1"
    states = [(h["revision"], h["state"]) for h in status_of(cluster)["history"]]
    assert states[:2] == [(rev2, "Stable"), (rev1, "Superseded")]


async def test_candidate_runs_at_canary_replicas_and_is_measured_again_at_full_scale_before_traffic(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"]["replicas"] = 2  # canaryReplicas defaults to 1
    await apply_model(body)
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    decode = objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]
    assert decode["spec"]["replicas"] == 1 and decode["metadata"]["annotations"]["kvguard.io/scale"] == "canary"
    await mark_ready(cluster, rev)
    await until(lambda: objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]["spec"]["replicas"] == 2, "the scale-up", CANARY_WAIT,
                lambda: status_of(cluster).get("rollout"))  # fmt: skip
    status = status_of(cluster)
    assert status["rollout"]["state"] == "Promoting" and status["rollout"]["canary"]["verdict"] == "pass"
    assert {w["worker"] for w in status["rollout"]["workers"]} == {f"tiny-{rev}-prefill-0", f"tiny-{rev}-decode-0"}
    assert "tiny" not in objects_of(cluster, SERVICES)  # no traffic before the full-scale measurement
    await mark_ready(cluster, rev)
    status = await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster), "promoted at full scale", CANARY_WAIT,
                         lambda: status_of(cluster).get("rollout"))  # fmt: skip
    assert status["rollout"]["measuredScale"] == "full"
    assert sorted(w["worker"] for w in status["rollout"]["workers"]) == [f"tiny-{rev}-decode-0", f"tiny-{rev}-decode-1", f"tiny-{rev}-prefill-0"]
    await until(lambda: objects_of(cluster, SERVICES).get("tiny"), "the model Service")


@pytest.mark.parametrize("allowed", [False, True])
async def test_fault_annotation_reaches_the_workers_only_where_fault_injection_is_allowed(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, allowed: bool
) -> None:
    if allowed:
        monkeypatch.setenv("KVGUARD_ALLOW_FAULT_INJECTION", "true")  # what manifests/testing/fault-injection sets
    body = tiny_model()
    body["metadata"]["annotations"] = {"kvguard.io/faults": "unsafe_reject_path,no_tags"}
    await apply_model(body)
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    for deployment in objects_of(cluster, DEPLOYMENTS).values():
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env.get("KVGUARD_FAULTS") == ("unsafe_reject_path,no_tags" if allowed else None)
    reason = "FaultInjection" if allowed else "FaultInjectionIgnored"
    event = await until(lambda: [e for e in objects_of(cluster, EVENTS).values() if e["reason"] == reason], f"a {reason} event")
    assert event[0]["type"] == "Warning"


async def test_invalid_spec_becomes_degraded_condition_not_a_crash(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"]["tensorParallel"] = 3  # does not divide 2 KV heads
    await apply_model(body)
    status = await until(lambda: status_of(cluster).get("phase") == "Degraded" and status_of(cluster), "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and "spec.roles.decode.tensorParallel" in degraded["message"]
    assert objects_of(cluster, DEPLOYMENTS) == {}
    await patch_model("tiny", {"spec": {"roles": {"decode": {"tensorParallel": 1}}}})
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "recovery once the spec is fixed")


async def test_children_are_owned_for_garbage_collection(cluster: Any) -> None:
    await apply_model(tiny_model(uid="uid-owner"))
    await until(lambda: len(objects_of(cluster, NETPOLS)) == 3 and len(objects_of(cluster, SECRETS)) == 1, "children")
    children = [o for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for o in objects_of(cluster, kind).values()]
    for child in children:
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "name": "tiny",
                         "uid": "uid-owner", "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: cluster.objects[IM, NS, "tiny"].deleted, "the model deleted")
    logging.getLogger(__name__).info("kmock has no garbage collector; owner references above are what a cluster's GC uses")


async def test_S8_failing_canary_scales_it_to_zero_and_leaves_stable_untouched(cluster: Any, incident_build: LocalDeployment) -> None:
    await apply_model(tiny_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await until(lambda: status_of(cluster).get("revision") == rev1, "rev1 stable", CANARY_WAIT)
    await promoted(cluster, rev1)  # every write of the promotion has landed
    stable_before = {n: copy.deepcopy(o.raw) for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)
                     for n, o in objects_of(cluster, kind).items()}  # fmt: skip

    await patch_model("tiny", {"spec": {"engine": {"version": "incident-build"}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    ROUTES[rev2] = incident_build
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "the canary beside stable")
    await mark_ready(cluster, rev2)
    status = await until(lambda: (s := status_of(cluster)).get("rollout", {}).get("state") == "RolledBack" and s,
                         "the canary rolled back", CANARY_WAIT)  # fmt: skip
    canary = condition(status, "CanaryPassed")
    assert canary["status"] == "False" and "canary fail" in canary["message"] and "over_length" in canary["message"]
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "CanaryFailed" and "kvguard.io/retry" in degraded["message"]
    assert status["revision"] == rev1 and status["phase"] == "Degraded" and status["canary"] == "Failed"
    assert condition(status, "Ready")["status"] == "True"
    assert "over_length" in status["rollout"]["canary"]["failedProbes"]
    assert all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev2 in n)
    events = await until(lambda: events_of(cluster, "CanaryFailed"), "Warning event")
    assert events[0]["type"] == "Warning" and f"revision {rev1} keeps serving" in events[0]["message"]

    def stable_now() -> dict[str, Any]:
        return {n: o.raw for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for n, o in objects_of(cluster, kind).items()
                if n in stable_before}  # fmt: skip

    # A negative: give any (wrong) follow-up write a window to land.
    await stays(lambda: stable_now() == stable_before, "S8: the stable revision and the model Service are unchanged")
    states = [(h["revision"], h["state"]) for h in status["history"]]
    assert states[:2] == [(rev2, "Failed"), (rev1, "Stable")]


async def never_finishes(url: str, *args: Any, **kwargs: Any) -> Any:
    await asyncio.Event().wait()  # a canary still running when the operator dies


async def test_S8_operator_restart_mid_rollout_resumes_without_double_promotion(operator: Operator) -> None:
    cluster = operator.kmock
    await operator.restart(suite=never_finishes)
    await apply_model(tiny_model())
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("rollout", {}).get("state") == "CanaryVerifying" and status_of(cluster)["rollout"].get("workers"),
                "pools measured, canary running")  # fmt: skip
    # A negative: the canary never finishes, so nothing may be promoted while it runs.
    await stays(lambda: status_of(cluster)["rollout"]["state"] == "CanaryVerifying" and "revision" not in status_of(cluster)
                and "tiny" not in objects_of(cluster, SERVICES), "no promotion while the canary runs", 0.5)  # fmt: skip
    await operator.restart()  # the running canary dies with the process; status holds the step
    status = await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster), "promoted after the restart", CANARY_WAIT)
    assert status["rollout"]["state"] == "Stable" and status["rollout"]["canary"]["verdict"] == "pass"
    await promoted(cluster, rev)  # recorded after the status says Stable
    # A negative: a second promotion (a new Event, or this one's count bumped) would land soon after the first.
    await stays(lambda: [e.get("count", 1) for e in events_of(cluster, "RevisionPromoted")] == [1], "exactly one promotion")
    await until(lambda: objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev, "traffic routed")
