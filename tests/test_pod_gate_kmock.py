"""S7 for as long as a pod serves: the readiness gate kvguard.io/kv-pool-verified, on kmock.

The real operator (kopf, the controller, backends/pod_gate.py) watches pods on the emulator and
scrapes each one's /metrics for real: a pod's IP is 127.0.0.1 and its `metrics` port is that of a
real `kvguard` worker on loopback (one with the planned pool, one started with a smaller pool,
standing for a node with less GPU memory). kmock has no kubelet: the test plays it (it sets
`ContainersReady`, as a kubelet does when the probes pass) and checks the gate condition the
operator writes through `pods/status` (kmock, like a real API server, drops status changes sent
to the pod itself: tests/kmock_api.py). It does not prove that a real kubelet then keeps the pod
out of its Service's endpoints: that is the kubelet's documented readiness-gate behaviour (a pod
is Ready only when every gate's condition is True), checked by e2e/ on a cluster.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kmock as km
import pytest
from kmock_api import ApiServer
from operator_harness import (
    DEPLOYMENTS,
    EXAMPLES,
    NS,
    SECRETS,
    condition,
    events_of,
    http,
    objects_of,
    stable_revision,
    status_of,
    until,
)

from kvguard.operator.pool_gate import GATE_CONDITION
from kvguard.workers.launcher import LocalDeployment, LocalServeConfig

pytestmark = [pytest.mark.kmock(cls=ApiServer)]
PODS = "/api/v1/namespaces/" + NS + "/pods"
POD_RESOURCE = km.resource("", "v1", "pods")


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir: Path) -> Any:
    """The same build on a smaller card: 1,536 tokens = 1.5x context 1,024, below the 2x required."""
    deployment = LocalDeployment(LocalServeConfig(model_dir=tiny_model_dir, kv_pool_tokens=1536, context_length=1024, page_size=16,
                                                  allow_small_pool=True)).start()  # a node that sized it so
    yield deployment
    deployment.stop()


def pod_from(deployment: Any, name: str, node: str, metrics_url: str, port_name: str = "metrics") -> dict[str, Any]:
    """What the ReplicaSet controller and the scheduler make of the Deployment's template: a pod
    bound to `node`, its engine's metrics port that of a real worker on loopback."""
    template = copy.deepcopy(deployment.raw["spec"]["template"])
    spec = template["spec"]
    spec["nodeName"] = node
    port = urlsplit(metrics_url).port
    for container in spec["containers"]:
        container["ports"] = [{**p, "containerPort": port} if p.get("name") == port_name else p for p in container.get("ports", [])]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name, "namespace": NS}, "spec": spec}


async def kubelet_starts(name: str, restarts: int = 0) -> None:
    """The kubelet's report once the engine container runs and its probes pass (Ready stays False:
    a readiness gate is not True yet)."""
    status = {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "10.0.0.1",
              "conditions": [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "False"}],
              "containerStatuses": [{"name": "engine", "ready": True, "restartCount": restarts}]}  # fmt: skip
    await http("PATCH", f"{PODS}/{name}/status", {"status": status}, "application/merge-patch+json")


def gate_of(k8s: Any, name: str) -> dict[str, Any] | None:
    pod = objects_of(k8s, POD_RESOURCE).get(name)
    return next((c for c in (pod or {}).get("status", {}).get("conditions", []) if c["type"] == GATE_CONDITION), None)


async def test_S7_gate_admits_a_pod_whose_pool_meets_the_ratio_and_keeps_a_smaller_stable_pod_out(
    cluster: Any, serving: LocalDeployment, small_pool: LocalDeployment
) -> None:
    rev = await stable_revision(cluster)
    decode = objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]
    assert decode["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": GATE_CONDITION}]
    assert "readinessGates" not in objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-router"]["spec"]["template"]["spec"]

    # A pod of the stable revision on an 80 GB node: its pool (4,096 = 4x context) meets 2x.
    await http("POST", PODS, pod_from(decode, "tiny-decode-a", "node-80gb", serving.metrics_urls["decode"]))
    assert gate_of(cluster, "tiny-decode-a") is None  # not ready yet: nothing to verify
    await kubelet_starts("tiny-decode-a")
    gate = await until(lambda: gate_of(cluster, "tiny-decode-a"), "the gate condition of the good pod")
    assert gate["status"] == "True" and gate["reason"] == "KVPoolVerified", gate
    assert "4096 tokens = 4.00x context 1024 >= 2x required" in gate["message"]
    pools = await until(lambda: status_of(cluster).get("pools"), "status.pools")
    assert [(p["pod"], p["node"], p["verified"], p["poolTokens"], p["required"]) for p in pools] == [
        ("tiny-decode-a", "node-80gb", True, 4096, 2048)]  # fmt: skip
    assert condition(status_of(cluster), "Degraded")["status"] == "False"

    # It is rescheduled onto a 40 GB node (no spec change): the engine sizes a smaller pool.
    await http("DELETE", f"{PODS}/tiny-decode-a")
    await http("POST", PODS, pod_from(decode, "tiny-decode-b", "node-40gb", small_pool.metrics_urls["decode"]))
    await kubelet_starts("tiny-decode-b")
    gate = await until(lambda: gate_of(cluster, "tiny-decode-b"), "the gate condition of the small pod")
    assert gate["status"] == "False" and gate["reason"] == "KVPoolTooSmall", gate
    assert "node node-40gb" in gate["message"] and "1536 tokens = 1.50x context 1024 < 2x required (2048 tokens)" in gate["message"]
    status = await until(lambda: condition(status_of(cluster), "Degraded")["status"] == "True" and status_of(cluster),
                         "Degraded naming the pod")  # fmt: skip
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "PodKVPoolTooSmall" and "tiny-decode-b" in degraded["message"] and "node-40gb" in degraded["message"]
    assert status["revision"] == rev and condition(status, "Ready")["status"] == "True"  # nothing rolled (S8)
    # The deleted pod's verdict goes once its DELETED event is handled, which kopf may do after b's.
    await until(lambda: [p["pod"] for p in status_of(cluster).get("pools") or []] == ["tiny-decode-b"], "the deleted pod's verdict gone")
    pod_events = await until(lambda: [e for e in events_of(cluster, "KVPoolTooSmall") if e["involvedObject"]["kind"] == "Pod"],
                             "a Warning Event on the pod")  # fmt: skip
    assert pod_events[0]["type"] == "Warning" and pod_events[0]["involvedObject"]["name"] == "tiny-decode-b"
    model_events = await until(lambda: events_of(cluster, "PodKVPoolTooSmall"), "a Warning Event on the model")
    assert model_events[0]["involvedObject"]["name"] == "tiny"


async def test_S7_a_container_restart_takes_the_gate_away_until_the_pool_is_verified_again(cluster: Any, serving: LocalDeployment) -> None:
    rev = await stable_revision(cluster)
    decode = objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]
    await http("POST", PODS, pod_from(decode, "tiny-decode-c", "node-80gb", serving.metrics_urls["decode"]))
    await kubelet_starts("tiny-decode-c")
    first = await until(lambda: (g := gate_of(cluster, "tiny-decode-c")) and g["status"] == "True" and g, "verified")
    # The engine container crashes: the kubelet reports it not ready (the gate condition stays).
    crashed = {"conditions": [{"type": "ContainersReady", "status": "False"}, {"type": "Ready", "status": "False"}],
               "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 1}]}  # fmt: skip
    await http("PATCH", f"{PODS}/tiny-decode-c/status", {"status": crashed}, "application/strategic-merge-patch+json")
    gate = await until(lambda: (g := gate_of(cluster, "tiny-decode-c")) and g["status"] == "False" and g, "unverified on restart")
    assert gate["reason"] == "Verifying"
    await kubelet_starts("tiny-decode-c", restarts=1)
    again = await until(lambda: (g := gate_of(cluster, "tiny-decode-c")) and g["status"] == "True" and g, "verified again")
    assert again["lastProbeTime"] >= first["lastProbeTime"]


class _Raw:
    """A rendered Deployment in the shape `pod_from` reads (kmock's stored objects have `.raw`)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw


def rendered_decode(example: str) -> Any:
    """The decode Deployment the operator renders for an example (pure render, no rollout needed:
    the gate judges any engine pod by its own labels and annotations)."""
    import yaml

    from kvguard.operator.api import InferenceModelSpec
    from kvguard.operator.planner import plan
    from kvguard.operator.render import Owner, render_rollout_revision

    body = yaml.safe_load((EXAMPLES / example).read_text())
    body["spec"]["engine"].setdefault("image", "registry.example/engine:pinned")  # the example leaves these to the user
    body["spec"]["model"].setdefault("source", {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"})
    spec = InferenceModelSpec.model_validate(body["spec"])
    rendered = render_rollout_revision(spec, plan(spec), Owner(name="big", namespace=NS, uid="uid-big"), "r9")
    return _Raw(next(o for o in rendered.objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-decode")))


@pytest.mark.parametrize("style", ["sglang", "vllm"])
async def test_S7_gate_judges_sglang_and_vllm_pods_by_their_own_metrics(cluster: Any, style: str) -> None:
    from test_canary_fakes import Behaviour, RunningServer

    decode = rendered_decode("llama-3.1-8b-sglang-h100.yaml")
    annotations = decode.raw["spec"]["template"]["metadata"]["annotations"]
    context = int(annotations["kvguard.io/context-length"])
    required = math.ceil(float(annotations["kvguard.io/min-kv-ratio"]) * context)
    port_name = "http"  # SGLang and vLLM serve /metrics beside their API
    with RunningServer(Behaviour(context_length=context, pool_tokens=required * 2, metrics_style=style)) as good, \
         RunningServer(Behaviour(context_length=context, pool_tokens=required - 1, metrics_style=style)) as small:  # fmt: skip
        for name, server, node in ((f"big-{style}-a", good, "h100-80gb"), (f"big-{style}-b", small, "a100-40gb")):
            pod = pod_from(decode, name, node, server.metrics_url, port_name=port_name)
            await http("POST", PODS, pod)
            await kubelet_starts(name)
        ok = await until(lambda: gate_of(cluster, f"big-{style}-a"), f"the gate of the good {style} pod")
        bad = await until(lambda: gate_of(cluster, f"big-{style}-b"), f"the gate of the small {style} pod")
    assert ok["status"] == "True" and ok["reason"] == "KVPoolVerified", ok
    assert bad["status"] == "False" and bad["reason"] == "KVPoolTooSmall" and "a100-40gb" in bad["message"], bad


async def test_S3_a_pod_that_cannot_find_the_transfer_secret_makes_the_operator_replace_it_within_a_pass(
    cluster: Any, serving: LocalDeployment
) -> None:
    """Someone deletes the revision's KV-transfer Secret. The operator may not watch Secrets, but
    it watches its pods: one the kubelet cannot start (CreateContainerConfigError, `secret "NAME"
    not found`) makes it check at once, not after SECRET_RECHECK_SECONDS (5 minutes), and it moves
    the revision's Deployments to a new Secret, so every pod rolls onto one new key."""
    from kvguard.operator.render import transfer_secret_of

    rev = await stable_revision(cluster)
    decode = objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]
    first = transfer_secret_of(decode)
    assert first is not None and first in objects_of(cluster, SECRETS)
    await http("DELETE", f"/api/v1/namespaces/{NS}/secrets/{first}")
    await http("POST", PODS, pod_from(decode, "tiny-decode-b", "node-80gb", serving.metrics_urls["decode"]))
    waiting = {"reason": "CreateContainerConfigError", "message": f'secret "{first}" not found'}
    status = {"phase": "Pending", "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 0, "state": {"waiting": waiting}}]}
    await http("PATCH", f"{PODS}/tiny-decode-b/status", {"status": status}, "application/merge-patch+json")

    def moved() -> set[str | None] | None:
        named = {transfer_secret_of(d) for d in objects_of(cluster, DEPLOYMENTS).values()}
        return named if first not in named else None

    named = await until(moved, "every Deployment naming a new Secret")
    (second,) = named
    assert second is not None and second != first
    assert set(objects_of(cluster, SECRETS)) == {second}  # the old one is not brought back
    for deployment in objects_of(cluster, DEPLOYMENTS).values():  # a new pod template: the pods roll
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        assert next(e for e in env if e["name"] == "KVGUARD_TRANSFER_KEY")["valueFrom"]["secretKeyRef"]["name"] == second
    assert not [r for r in list(cluster) if r.method == "GET" and "/secrets" in r.url.path]  # never read
