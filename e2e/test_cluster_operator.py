"""The operator flows of tests/test_operator_kmock.py against a real cluster (KUBECONFIG set).

Needs: the CRDs and the operator installed (`kubectl apply -k manifests/`) and a namespace you may
write to (KVGUARD_E2E_NAMESPACE, default "kvguard-e2e"). Worker pods only become ready with the
worker image (KVGUARD_E2E_WORKER_IMAGE) and the tiny model on a PVC (KVGUARD_E2E_MODEL_PVC, default
"kvguard-e2e-models", folder "tiny-0": what e2e/harness_cluster.py writes there); these flows check
what the operator writes, so they pass without them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from waiting import wait_for as wait_on

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is unset: no cluster to run against"),
]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NS = os.environ.get("KVGUARD_E2E_NAMESPACE", "kvguard-e2e")
GROUP, VERSION, PLURAL = "kvguard.io", "v1alpha1", "inferencemodels"
MODEL_LABEL = "kvguard.io/model"


@pytest.fixture(scope="module")
def kube() -> Any:
    from kubernetes import client, config

    config.load_kube_config()
    return client


def wait_for(fetch: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    return wait_on(fetch, what, timeout, 2)


def status_of(kube: Any, name: str) -> dict[str, Any]:
    obj = kube.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    return obj.get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


def children(kube: Any, name: str) -> dict[str, list[Any]]:
    selector = f"{MODEL_LABEL}={name}"
    core, apps, net = kube.CoreV1Api(), kube.AppsV1Api(), kube.NetworkingV1Api()
    return {
        "Deployment": apps.list_namespaced_deployment(NS, label_selector=selector).items,
        "Service": core.list_namespaced_service(NS, label_selector=selector).items,
        "NetworkPolicy": net.list_namespaced_network_policy(NS, label_selector=selector).items,
    }


@pytest.fixture
def model(kube: Any) -> Iterator[Callable[[str, dict[str, Any]], str]]:
    """Creates InferenceModels from examples; deletes them (and waits for their children to go)."""
    created: list[str] = []

    def create(example: str, spec_updates: dict[str, Any]) -> str:
        body = yaml.safe_load((EXAMPLES / example).read_text())
        name = f"e2e-{example.removesuffix('.yaml')}"
        body["metadata"] = {"name": name, "namespace": NS}
        body["spec"].update(spec_updates)
        kube.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
        created.append(name)
        return name

    yield create
    for name in created:
        kube.CustomObjectsApi().delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
        wait_for(lambda n=name: not any(children(kube, n).values()), f"{name}'s children to be garbage-collected")


def tiny_spec() -> dict[str, Any]:
    spec = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]
    spec["model"]["source"] = {"pvc": {"claimName": os.environ.get("KVGUARD_E2E_MODEL_PVC", "kvguard-e2e-models"), "path": "tiny-0"}}
    if image := os.environ.get("KVGUARD_E2E_WORKER_IMAGE"):
        spec["engine"]["image"] = image
    return spec


def test_cluster_apply_renders_workloads_then_a_blocked_change_touches_nothing(kube: Any, model: Any) -> None:
    name = model("tiny-cpu.yaml", tiny_spec())
    status = wait_for(lambda: status_of(kube, name).get("targetRevision") and status_of(kube, name), "a planned revision")
    revision = status["targetRevision"]
    assert condition(status, "KVPoolSufficient")["status"] == "True"
    assert status["plan"]["roles"]["decode"]["poolTokens"] == 4096
    objs = wait_for(lambda: (found := children(kube, name)) and len(found["Deployment"]) == 3 and found, "three Deployments")
    assert {d.metadata.name for d in objs["Deployment"]} == {f"{name}-{revision}-{r}" for r in ("prefill", "decode", "router")}
    for deployment in objs["Deployment"]:
        container = deployment.spec.template.spec.containers[0]
        assert container.security_context.read_only_root_filesystem is True
        assert container.security_context.run_as_non_root is True
        assert deployment.metadata.owner_references[0].kind == "InferenceModel"
    decode = next(d for d in objs["Deployment"] if d.metadata.name.endswith("-decode"))
    command = decode.spec.template.spec.containers[0].command
    assert command[command.index("--kv-pool-tokens") + 1] == "4096"  # the plan's pool
    decode_policy = next(p for p in objs["NetworkPolicy"] if p.metadata.name.endswith("-decode"))
    assert any(r.ports and r.ports[0].port == 9000 for r in decode_policy.spec.ingress)  # KV from prefill only
    secret_names = {s.metadata.name for s in kube.CoreV1Api().list_namespaced_secret(NS).items}
    key_refs = {e.value_from.secret_key_ref.name for d in objs["Deployment"] for e in d.spec.template.spec.containers[0].env or []
                if e.name == "KVGUARD_TRANSFER_KEY"}  # fmt: skip
    assert len(key_refs) == 1 and key_refs <= secret_names  # one Secret per revision, every role reads it
    assert next(iter(key_refs)).startswith(f"{name}-{revision}-kv-transfer-")  # S3: a random suffix nobody could claim first
    before = {d.metadata.name: d.metadata.generation for d in objs["Deployment"]}

    patch = {"spec": {"contextLength": 4096, "kvPoolTokens": 4096}}  # 1.0x < 2.0x: blocked (S7)
    kube.CustomObjectsApi().patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, patch)
    blocked = wait_for(lambda: (s := status_of(kube, name)).get("phase") == "Blocked" and s, "phase Blocked")
    assert condition(blocked, "KVPoolSufficient")["status"] == "False"
    assert "1.00x context 4,096 < 2x required" in condition(blocked, "KVPoolSufficient")["message"]
    after = {d.metadata.name: d.metadata.generation for d in children(kube, name)["Deployment"]}
    assert after == before  # S8: nothing that runs changed


def test_cluster_incident_is_blocked_and_renders_nothing(kube: Any, model: Any) -> None:
    name = model("incident.yaml", {})
    status = wait_for(lambda: (s := status_of(kube, name)).get("phase") == "Blocked" and s, "phase Blocked")
    assert condition(status, "KVPoolSufficient")["status"] == "False"
    assert children(kube, name)["Deployment"] == []  # S7: nothing rendered for a blocked plan


def test_cluster_a_field_removed_from_the_spec_is_removed_from_the_deployment(kube: Any, model: Any) -> None:
    """Server-side apply: the operator owns the fields it renders, so one it stops rendering goes."""
    spec = tiny_spec()
    spec["roles"]["decode"]["nodeSelector"] = {"kvguard.io/e2e-pool": "none"}  # pods stay Pending: fine here
    name = model("tiny-cpu.yaml", spec)
    revision = wait_for(lambda: status_of(kube, name).get("targetRevision"), "a planned revision")
    decode = f"{name}-{revision}-decode"
    apps = kube.AppsV1Api()
    wait_for(lambda: (apps.read_namespaced_deployment(decode, NS).spec.template.spec.node_selector or {}).get("kvguard.io/e2e-pool"),
             "the nodeSelector rendered")  # fmt: skip
    patch = {"spec": {"roles": {"decode": {"nodeSelector": None}}}}  # placement: the same revision, updated in place
    kube.CustomObjectsApi().patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, patch)
    wait_for(lambda: "kvguard.io/e2e-pool" not in (apps.read_namespaced_deployment(decode, NS).spec.template.spec.node_selector or {}),
             "the nodeSelector removed from the Deployment")  # fmt: skip
    assert status_of(kube, name)["targetRevision"] == revision


def test_cluster_a_planted_transfer_secret_is_never_used(kube: Any, model: Any) -> None:
    """The operator may not read Secrets (RBAC: create and delete): one planted under the name a
    revision's key could have had is simply never chosen, and never touched."""
    import base64

    from kvguard.operator.api import InferenceModelSpec
    from kvguard.operator.revision import revision_of

    spec = tiny_spec()
    revision = revision_of(InferenceModelSpec.model_validate(spec))
    secret = f"e2e-tiny-cpu-{revision}-kv-transfer"
    core = kube.CoreV1Api()
    core.create_namespaced_secret(NS, {"metadata": {"name": secret, "labels": {"kvguard.io/revision": revision}},
                                       "stringData": {"key": "chosen-by-someone-else"}})  # fmt: skip
    try:
        name = model("tiny-cpu.yaml", spec)
        objs = wait_for(lambda: (found := children(kube, name)) and len(found["Deployment"]) == 3 and found, "three Deployments")
        key_refs = {e.value_from.secret_key_ref.name for d in objs["Deployment"] for e in d.spec.template.spec.containers[0].env or []
                    if e.name == "KVGUARD_TRANSFER_KEY"}  # fmt: skip
        assert len(key_refs) == 1 and secret not in key_refs  # no pod ever gets the planted key
        assert base64.b64decode(core.read_namespaced_secret(secret, NS).data["key"]) == b"chosen-by-someone-else"  # untouched
    finally:
        core.delete_namespaced_secret(secret, NS)


@pytest.mark.skipif(not os.environ.get("KVGUARD_E2E_WORKER_IMAGE"),
                    reason="needs worker pods that reach container creation (KVGUARD_E2E_WORKER_IMAGE)")  # fmt: skip
def test_cluster_a_deleted_transfer_secret_is_replaced_and_every_pod_moves_to_it(kube: Any, model: Any) -> None:
    """Someone deletes a revision's KV-transfer Secret; a new pod of the revision cannot start
    (CreateContainerConfigError). The operator, which may not read Secrets, learns it from that
    pod, creates a Secret under a new name, and every Deployment's pod template names it."""
    name = model("tiny-cpu.yaml", tiny_spec())
    objs = wait_for(lambda: (found := children(kube, name)) and len(found["Deployment"]) == 3 and found, "three Deployments")

    def key_refs(deployments: list[Any]) -> set[str]:
        return {e.value_from.secret_key_ref.name for d in deployments for e in d.spec.template.spec.containers[0].env or []
                if e.name == "KVGUARD_TRANSFER_KEY"}  # fmt: skip

    (first,) = key_refs(objs["Deployment"])
    core = kube.CoreV1Api()
    core.delete_namespaced_secret(first, NS)
    router = next(d for d in objs["Deployment"] if d.metadata.name.endswith("-router"))
    for pod in core.list_namespaced_pod(NS, label_selector=f"{MODEL_LABEL}={name},kvguard.io/role=router").items:
        core.delete_namespaced_pod(pod.metadata.name, NS)  # its replacement needs the Secret to start
    moved = wait_for(lambda: (refs := key_refs(children(kube, name)["Deployment"])) and first not in refs and refs,
                     "every Deployment naming a new Secret", timeout=240)  # fmt: skip
    (second,) = moved
    assert second.startswith(f"{name}-") and core.read_namespaced_secret(second, NS).metadata.owner_references[0].kind == "InferenceModel"
    assert router.metadata.name in {d.metadata.name for d in children(kube, name)["Deployment"]}


@pytest.mark.skipif(not os.environ.get("KVGUARD_E2E_WORKER_IMAGE"), reason="needs worker pods (KVGUARD_E2E_WORKER_IMAGE)")
def test_cluster_two_pods_of_each_worker_role_answer_every_request(kube: Any, model: Any) -> None:
    """A request's calls must all reach the pod holding its KV (prefill's call and its ticket,
    decode's call and the token channel it names). Through a Service's virtual IP they were spread
    over pods, and with two replicas about half failed; the router now resolves the headless
    worker Services to the pods (`--discovery dns`). Every request answers, the same greedy text."""
    from harness_cluster import port_forward
    from openai import OpenAI

    spec = tiny_spec()
    spec["roles"] = {"prefill": {"replicas": 2}, "decode": {"replicas": 2}, "router": {"replicas": 1}}
    name = model("tiny-cpu.yaml", spec)
    wait_for(lambda: status_of(kube, name).get("phase") == "Ready", "phase Ready", timeout=600)
    services = {s.metadata.name: s for s in children(kube, name)["Service"]}
    assert all(s.spec.cluster_ip == "None" for n, s in services.items() if n.endswith(("-prefill", "-decode")))
    with port_forward(NS, f"svc/{name}", 8000) as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        served = client.models.list().data[0].id
        texts = [client.completions.create(model=served, prompt="one prompt, every pod", max_tokens=8, temperature=0).choices[0].text
                 for _ in range(16)]  # fmt: skip
    assert len(set(texts)) == 1 and texts[0]
