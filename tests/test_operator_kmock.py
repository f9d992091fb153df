"""The real operator (kopf + kvguard.operator.handlers) against kmock's Kubernetes emulator.

What this proves: the handlers, the controller and kube.py drive a real HTTP API with real watch
streams; create/update/resume/Deployment events converge on the rendered objects; a blocked plan
changes nothing that runs (S7, S8); children carry the owner references that make deletion clean.
What it does not: kmock has no scheduler, Deployment controller or garbage collector, so the test
plays the Deployment controller (it sets readyReplicas) and checks owner references instead of
waiting for garbage collection. e2e/ runs the same flows on a real cluster.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock as km
import kopf
import kubernetes
import pytest
import yaml

import kvguard.operator.handlers  # noqa: F401  (registers the operator's handlers)
from kvguard.operator import metrics

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NS = "models"
IM = km.resource("kvguard.io", "v1alpha1", "inferencemodels")
DEPLOYMENTS = km.resource("apps", "v1", "deployments")
SERVICES = km.resource("", "v1", "services")
SECRETS = km.resource("", "v1", "secrets")
NETPOLS = km.resource("networking.k8s.io", "v1", "networkpolicies")
EVENTS = km.resource("", "v1", "events")
EMULATOR_URL: list[str] = []

pytestmark = pytest.mark.timeout(60)


@kopf.on.login()
def _login(**_: Any) -> kopf.ConnectionInfo:  # test-only: point kopf at the emulator
    return kopf.ConnectionInfo(server=EMULATOR_URL[-1], insecure=True)


def tiny_model(name: str = "tiny", uid: str = "uid-tiny") -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": NS, "uid": uid, "resourceVersion": "1", "generation": 1}
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}, "revision": "r1"}
    return body


def objects_of(k8s: Any, resource: Any) -> dict[str, Any]:
    return {name: k8s.objects[key] for key in list(k8s.objects.keys()) if (key[0] == resource and (name := key[2]))
            and not k8s.objects[key].deleted}  # fmt: skip


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    kmock.resources.load_bundled()
    kmock.resources["kvguard.io/v1alpha1/inferencemodels"] = km.ResourceInfo(
        kind="InferenceModel", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )  # fmt: skip
    url = str(kmock.url).rstrip("/")
    EMULATOR_URL.append(url)
    cfg = kubernetes.client.Configuration()
    cfg.host = url
    kubernetes.client.Configuration.set_default(cfg)
    kubernetes.client.ApiClient.set_default(kubernetes.client.ApiClient(cfg))
    monkeypatch.setenv("KVGUARD_METRICS_PORT", "0")
    kvguard.operator.handlers._KUBE.clear()
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # kmock has no generateName; our Events are plain creates
    settings.watching.server_timeout = 5
    # kopf cancels every task created after it starts (pytest-asyncio's fixture tasks included),
    # so it gets its own thread and event loop, like kopf.testing.KopfRunner does.
    stop = threading.Event()
    thread = threading.Thread(
        target=asyncio.run,
        args=(kopf.operator(clusterwide=True, standalone=True, settings=settings, stop_flag=stop),),
        daemon=True,
    )
    thread.start()
    try:
        await until(lambda: any("watch" in str(r.url) and "inferencemodels" in str(r.url) for r in list(kmock)),
                    "kopf to watch inferencemodels")  # fmt: skip
        await until(lambda: any("watch" in str(r.url) and "deployments" in str(r.url) for r in list(kmock)),
                    "kopf to watch deployments")  # fmt: skip
        yield kmock
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "kopf did not stop"
        EMULATOR_URL.pop()
        kubernetes.client.ApiClient.set_default(None)


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
    netpol = await until(lambda: objects_of(cluster, NETPOLS).get(f"tiny-{rev}-decode-transfer"), "NetworkPolicy")
    transfer_rule = netpol["spec"]["ingress"][0]
    assert transfer_rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert transfer_rule["from"][0]["podSelector"]["matchLabels"]["kvguard.io/role"] == "prefill"
    assert status["phase"] == "Progressing" and status["kvRatio"] == 4.0
    assert condition(status, "KVPoolSufficient")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "True"
    assert status["plan"]["roles"]["decode"]["poolTokens"] == 4096

    await mark_ready(cluster, rev)  # the Deployment event triggers the next reconcile
    status = await until(lambda: status_of(cluster).get("phase") == "Ready" and status_of(cluster), "phase Ready")
    assert status["revision"] == rev
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
    await until(lambda: status_of(cluster).get("phase") == "Ready", "Ready")
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
    events = await until(lambda: [e for e in objects_of(cluster, EVENTS).values() if e["reason"] == "KVPoolTooSmall"], "Warning event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "tiny"
    await asyncio.sleep(0.5)  # let any (wrong) follow-up writes land before comparing
    after = {kind: {n: o.raw for n, o in objects_of(cluster, kind).items()} for kind in before}
    assert after == before, "a blocked plan must not change anything that runs"
    assert metrics.REGISTRY.get_sample_value("kvguard_operator_blocked_plans_total", {"reason": "KVPoolTooSmall"}) == blocked_before + 1


async def test_new_revision_rolls_out_beside_stable_then_replaces_it(cluster: Any) -> None:
    await apply_model(tiny_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await until(lambda: status_of(cluster).get("revision") == rev1, "rev1 stable")

    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
    assert objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev1  # S8
    await mark_ready(cluster, rev2)
    await until(lambda: status_of(cluster).get("revision") == rev2, "rev2 promoted")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "rev1 Deployments deleted")
    assert all(rev2 in name for name in objects_of(cluster, DEPLOYMENTS))
    await until(lambda: f"tiny-{rev1}-kv-transfer" not in objects_of(cluster, SECRETS), "rev1 Secret deleted")
    assert objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev2
    states = [(h["revision"], h["state"]) for h in status_of(cluster)["history"]]
    assert states[:2] == [(rev2, "Stable"), (rev1, "Superseded")]


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
    await until(lambda: len(objects_of(cluster, NETPOLS)) == 1 and len(objects_of(cluster, SECRETS)) == 1, "children")
    children = [o for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for o in objects_of(cluster, kind).values()]
    for child in children:
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "name": "tiny",
                         "uid": "uid-owner", "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: cluster.objects[IM, NS, "tiny"].deleted, "the model deleted")
    logging.getLogger(__name__).info("kmock has no garbage collector; owner references above are what a cluster's GC uses")
