"""kube.py against the emulator (tests/kmock_api.py): server-side apply removes what is no longer
rendered, status writes are conditional on resourceVersion, lists carry label selectors, and a
transport failure is one error type. The emulator's own rules are checked first, because the
operator tests rely on them standing in for the API server's."""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock_api import ApiServer, client_configuration, declare_kvguard_resources, selector_matches, server_side_apply

from kvguard.operator.kube import Kube, KubeError, ObjectRef, TransportError

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.timeout(60)]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def kube(kmock: Any) -> Kube:
    url = declare_kvguard_resources(kmock)
    return Kube(__import__("kubernetes").client.ApiClient(client_configuration(url)))


def deployment(**template_spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "labels": {"app": "x"}, "annotations": {"a": "1"}},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "c", "image": "i"}], **template_spec}}},
    }  # fmt: skip


def test_server_side_apply_of_one_manager_removes_what_it_no_longer_applies() -> None:
    first = deployment(nodeSelector={"gpu": "h100"})
    live = server_side_apply({}, None, first)
    live["status"] = {"readyReplicas": 1}  # someone else's field
    second = deployment()
    second["metadata"]["annotations"] = {}
    after = server_side_apply(live, first, second)
    assert "nodeSelector" not in after["spec"]["template"]["spec"] and after["metadata"]["annotations"] == {}
    assert after["status"] == {"readyReplicas": 1}


def test_selectors() -> None:
    labels = {"a": "1", "b": "2"}
    assert selector_matches("a=1,b=2", labels) and selector_matches("a==1,c!=3,!c,b", labels)
    assert not selector_matches("a=1,b=3", labels) and not selector_matches("c", labels)


async def test_apply_creates_then_removes_dropped_fields(kube: Kube, kmock: Any) -> None:
    created = await kube.aapply(deployment(nodeSelector={"gpu": "h100"}))
    assert created["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]
    updated = await kube.aapply(deployment())
    assert "nodeSelector" not in updated["spec"]["template"]["spec"]
    assert updated["metadata"]["generation"] == 2
    applies = [r for r in list(kmock) if r.method == "PATCH"]
    assert all(r.params == {"fieldManager": "kvguard", "force": "true"} for r in applies)
    assert all(r.headers["Content-Type"] == "application/apply-patch+yaml" for r in applies)


async def test_status_writes_are_conditional_on_the_version_read(kube: Kube) -> None:
    await kube.acreate({"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "m", "namespace": "ns"}})
    ref = ObjectRef("InferenceModel", "m", "ns")
    read = await kube.aget(ref)
    assert read is not None
    version = read["metadata"]["resourceVersion"]
    written = await kube.apatch_status(ref, {"phase": "Pending"}, version)
    with pytest.raises(KubeError) as stale:
        await kube.apatch_status(ref, {"phase": "Ready"}, version)  # decided on the version before
    assert stale.value.status == 409 and stale.value.retriable
    await kube.apatch_status(ref, {"phase": "Ready"}, written["metadata"]["resourceVersion"])
    assert (await kube.aget(ref) or {})["status"]["phase"] == "Ready"


async def test_lists_send_the_selector_and_metadata_reads_drop_data(kube: Kube, kmock: Any) -> None:
    await kube.aapply(deployment())
    other = deployment()
    other["metadata"].update(name="e", labels={"app": "y"})
    await kube.aapply(other)
    assert [d["metadata"]["name"] for d in await kube.alist("Deployment", "ns", {"app": "x"})] == ["d"]
    assert any(r.params.get("labelSelector") == "app=x" for r in list(kmock))
    await kube.acreate({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"}, "data": {"key": "c2VjcmV0"}})
    meta = await kube.aget_metadata(ObjectRef("Secret", "s", "ns"))
    assert meta is not None and meta["metadata"]["name"] == "s" and "data" not in meta
    fetch = [r for r in list(kmock) if r.method == "GET" and r.url.path.endswith("/secrets/s")]
    assert "PartialObjectMetadata" in fetch[-1].headers["Accept"]


async def test_the_emulator_refuses_changes_to_immutable_fields_as_the_api_server_does(kube: Kube) -> None:
    first = deployment()
    first["spec"]["selector"] = {"matchLabels": {"app": "x"}}
    await kube.aapply(first)
    moved = copy.deepcopy(first)
    moved["spec"]["selector"] = {"matchLabels": {"app": "y"}}
    with pytest.raises(KubeError) as refused:
        await kube.aapply(moved)
    assert refused.value.status == 422 and "spec.selector" in str(refused.value)
    first["spec"]["replicas"] = 3  # anything else still changes
    assert (await kube.aapply(first))["spec"]["replicas"] == 3
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k", "namespace": "ns"}, "immutable": True, "data": {"key": "YQ=="}}
    await kube.acreate(secret)
    with pytest.raises(KubeError) as refused:
        await kube.amerge_patch(ObjectRef("Secret", "k", "ns"), {"data": {"key": "Yg=="}})
    assert refused.value.status == 422


def resetting_server() -> tuple[str, threading.Event]:
    """A TCP server that accepts and closes every connection: a transport failure, not an HTTP one."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", stop


async def test_transport_failures_are_one_retriable_error() -> None:
    import kubernetes

    url, stop = resetting_server()
    cfg = client_configuration(url)
    cfg.retries = 0
    kube = Kube(kubernetes.client.ApiClient(cfg))
    try:
        with pytest.raises(TransportError) as failed:
            await asyncio.wait_for(kube.aget(ObjectRef("InferenceModel", "m", "ns")), 30)
        assert failed.value.status == 0 and failed.value.retriable
    finally:
        stop.set()


# --- pods/log: where SGLang reports its KV-canary violations (issue 16) --------------------------


async def test_pod_log_reads_the_recent_lines_of_one_container(kube: Kube, kmock: Any) -> None:
    kmock.pod_logs["ns", "p", "engine"].append((0.0, "long ago"))  # older than any sinceSeconds asked
    kmock.write_pod_log("ns", "p", "now")
    kmock.write_pod_log("ns", "p", "other container", container="sidecar")
    assert await kube.apod_log("ns", "p", "engine", since_seconds=60, limit_bytes=1 << 20) == "now\n"
    assert await kube.apod_log("ns", "p", "engine", since_seconds=60, limit_bytes=2) == "no"
    assert await kube.apod_log("ns", "absent", "engine", since_seconds=60, limit_bytes=100) == ""
    (request,) = [r for r in list(kmock) if r.url.path.endswith("/p/log") and r.params.get("limitBytes") == "2"]
    assert request.params["container"] == "engine" and request.params["sinceSeconds"] == "60"


async def test_the_canary_fails_on_a_violation_an_sglang_pod_logs_during_the_run(kube: Kube, kmock: Any) -> None:
    """The operator's canary reads every SGLang pod's log through the API (pods/log): a violation
    logged while the suite runs fails the safety-counter probe, naming the slot; a line an hour
    older than the run does not count."""
    import time

    from test_canary_fakes import Behaviour, RunningServer
    from test_canary_protocol import SGLANG_LINE

    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import KubernetesBackend, PodLog
    from kvguard.operator.canary import CanarySpec, ProbeName, ProbeStatus, Verdict, run_suite

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "m-r1-decode-0", "namespace": "ns",
        "labels": {"kvguard.io/model": "m", "kvguard.io/revision": "r1", "kvguard.io/role": "decode",
                   "kvguard.io/engine": "sglang"}},
        "spec": {"containers": [{"name": "engine", "image": "sglang"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip
    await kube.acreate(pod)
    kmock.pod_logs["ns", "m-r1-decode-0", "engine"].append((time.time() - 3600, SGLANG_LINE))
    endpoints = await KubernetesBackend(kube, index=None).endpoints(ModelRef("ns", "m"), "r1")  # type: ignore[arg-type]
    (worker,) = endpoints.workers
    assert isinstance(worker.log, PodLog) and worker.log.name == "pod/m-r1-decode-0 (ns)"
    spec = CanarySpec().only([ProbeName.DETERMINISM, ProbeName.SAFETY_COUNTERS])

    class Violate:  # the engine logs a violation while the suite runs
        def __call__(self, event: object) -> None:
            if getattr(event, "kind", "") == "finished" and getattr(event, "probe", None) == ProbeName.DETERMINISM:
                kmock.write_pod_log("ns", "m-r1-decode-0", SGLANG_LINE.replace("slot_idx=12", "slot_idx=99"))

    with RunningServer(Behaviour(metrics_style="none")) as server:
        clean = await run_suite(server.url, spec, engine_logs=[worker.log])
        dirty = await run_suite(server.url, spec, engine_logs=[worker.log], progress=Violate())
    assert clean.verdict == Verdict.PASS, clean.reason
    result = dirty.probe(ProbeName.SAFETY_COUNTERS)
    assert result is not None and result.status == ProbeStatus.FAIL and "slot 99" in result.reason
    assert "pod/m-r1-decode-0 (ns)" in str(result.evidence)


def owned_deployment(name: str, secret: str | None) -> dict[str, Any]:
    """A Deployment of model m (uid u) revision r1 whose pods read the transfer key from `secret`."""
    env = [] if secret is None else [{"name": "KVGUARD_TRANSFER_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": "key"}}}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "ns",
                     "labels": {"kvguard.io/model": "m", "kvguard.io/revision": "r1", "app.kubernetes.io/managed-by": "kvguard-operator"},
                     "ownerReferences": [{"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "name": "m", "uid": "u",
                                          "controller": True}]},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "engine", "image": "i", "env": env}]}}},
    }  # fmt: skip


async def test_S3_the_transfer_secret_gets_a_random_name_and_a_restarted_operator_finds_it_without_reading_secrets(
    kube: Kube, kmock: Any
) -> None:
    """RBAC gives the operator create and delete on Secrets, never get: a new revision's Secret is
    named with a random suffix (nobody could create it first), and an operator that starts (empty
    watch cache) takes the name from the revision's own Deployments, so the pods keep their key."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend
    from kvguard.operator.render import Owner

    def calls(method: str) -> int:
        return len([r for r in list(kmock) if r.method == method and "/secrets" in r.url.path])

    owner = Owner(name="m", namespace="ns", uid="u")
    planted = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "m-r1-kv-transfer", "namespace": "ns"}, "data": {"key": "YQ=="}}
    await kube.acreate(planted)  # someone guessed the old, fixed name
    reads = calls("GET")
    first = await KubernetesBackend(kube, DictChildIndex()).ensure_transfer_secret(owner, "r1")
    assert calls("GET") == reads  # no Secret is ever read
    assert first.startswith("m-r1-kv-transfer-") and len(first) == len("m-r1-kv-transfer-") + 8
    created = await kube.aget(ObjectRef("Secret", first, "ns"))
    assert created is not None and created["metadata"]["ownerReferences"][0]["uid"] == "u" and created["immutable"] is True
    assert (await kube.aget(ObjectRef("Secret", "m-r1-kv-transfer", "ns")) or {})["data"] == {"key": "YQ=="}  # untouched

    await kube.acreate(owned_deployment("m-r1-router", None))
    await kube.acreate(owned_deployment("m-r1-decode", first))  # what ensure_revision applied, not in the new cache yet
    reads, creates = calls("GET"), calls("POST")
    restarted = KubernetesBackend(kube, DictChildIndex())
    assert await restarted.ensure_transfer_secret(owner, "r1") == first
    assert await restarted.ensure_transfer_secret(owner, "r1") == first  # remembered: no more calls
    assert calls("GET") == reads and calls("POST") == creates + 1  # one dry-run create under the recorded name (409: it is there)
    assert (await kube.aget(ObjectRef("Secret", first, "ns")) or {})["data"] == created["data"]  # the pods' key, kept

    # The watch cache keeps no pod template: the name is found in the Deployments' annotation there.
    from kvguard.operator.render import TRANSFER_SECRET_ANNOTATION
    from kvguard.operator.workloads import child_projection

    annotated = owned_deployment("m-r1-prefill", first)
    annotated["metadata"]["annotations"] = {TRANSFER_SECRET_ANNOTATION: first}
    index = DictChildIndex()
    index.put(child_projection(annotated))
    deployment_reads = len([r for r in list(kmock) if r.method == "GET" and "/deployments" in r.url.path])
    assert await KubernetesBackend(kube, index).ensure_transfer_secret(owner, "r1") == first
    assert len([r for r in list(kmock) if r.method == "GET" and "/deployments" in r.url.path]) == deployment_reads

    deletes = len([r for r in list(kmock) if r.method == "DELETE"])
    await restarted.delete_revision(ModelRef("ns", "m", "u"), "r1")  # the Secret goes with its revision
    assert await kube.aget(ObjectRef("Secret", first, "ns")) is None
    # First: only the Deployments name it, so a stop (a failover) once they went left the key for
    # the model's life (outside probe).
    kinds = [r.url.path.split("/")[-2] for r in list(kmock)[deletes:] if r.method == "DELETE"]
    assert kinds[0] == "secrets" and "deployments" in kinds, kinds


async def test_S3_a_model_created_again_under_its_name_gets_a_secret_of_its_own(kube: Kube, kmock: Any) -> None:
    """Outside probe: the operator remembered a revision's Secret by model name and revision (a
    hash of the spec), so a model deleted and created again with the same spec got the old
    model's Secret name, which the garbage collector had deleted: its pods could not start, and
    anyone who may create Secrets could plant the key under the name its Deployments show."""
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend
    from kvguard.operator.render import Owner

    backend = KubernetesBackend(kube, DictChildIndex())
    old = await backend.ensure_transfer_secret(Owner(name="m", namespace="ns", uid="u"), "r1")
    await kube.adelete(ObjectRef("Secret", old, "ns"))  # the garbage collector, once the model is gone
    # Even before the model's deletion event is handled, the new model (a new uid) is a new key.
    new = await backend.ensure_transfer_secret(Owner(name="m", namespace="ns", uid="u2"), "r1")
    assert new != old and (await kube.aget(ObjectRef("Secret", new, "ns")) or {})["metadata"]["ownerReferences"][0]["uid"] == "u2"
    creates = len([r for r in list(kmock) if r.method == "POST" and r.url.path.endswith("/secrets")])
    backend.forget_model(("ns", "m"))  # the deletion event: nothing of the model is remembered
    assert await backend.ensure_transfer_secret(Owner(name="m", namespace="ns", uid="u2"), "r1") not in (old, new)
    assert len([r for r in list(kmock) if r.method == "POST" and r.url.path.endswith("/secrets")]) == creates + 1


def tiny_revision_request(revision: str) -> Any:
    from kvguard.operator.api import InferenceModelSpec
    from kvguard.operator.backends.base import ModelRef, RevisionRequest
    from kvguard.operator.planner import plan

    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    spec = InferenceModelSpec.model_validate(raw)
    return RevisionRequest(ModelRef("ns", "tiny", "uid-1"), revision, spec, plan(spec))


async def watched_deployments(kube: Kube, index: Any) -> list[dict[str, Any]]:
    """Refill the watch-cache stand-in from the API server; the revision's Deployments."""
    index.objects.clear()
    for kind in ("Deployment", "Service", "NetworkPolicy"):
        for obj in await kube.alist(kind, "ns", {"kvguard.io/model": "tiny"}):
            index.put({**obj, "kind": kind})
    return [o for o in index.objects.values() if o["kind"] == "Deployment"]


async def test_S3_a_deleted_transfer_secret_is_replaced_under_a_new_name_that_every_pod_template_reads(
    kube: Kube, kmock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside probes, two sessions: the operator may neither watch nor read Secrets. A revision's
    Secret deleted under a running operator first stayed gone (new pods could not start); then it
    came back under its old name with a new key, so restarted pods read a key the running ones did
    not hold, and no transfer between the two authenticated. A pass after SECRET_RECHECK_SECONDS
    asks with a dry-run create (nothing stored), and, the Secret gone, creates one under a new name
    that every Deployment's pod template then reads: Kubernetes rolls all of the revision's pods
    onto the one new key. A watch cache still showing the old name does not make a third."""
    from kvguard.operator.backends import kubernetes as backend_module
    from kvguard.operator.render import transfer_secret_of

    def secret_calls(method: str, dry_run: bool = False) -> int:
        return len([r for r in list(kmock) if r.method == method and "/secrets" in r.url.path
                    and (r.params.get("dryRun") == "All") == dry_run])  # fmt: skip

    def template_key_refs(deployment: dict[str, Any]) -> set[str]:
        containers = deployment["spec"]["template"]["spec"]["containers"]
        return {e["valueFrom"]["secretKeyRef"]["name"] for c in containers for e in c.get("env", [])
                if (e.get("valueFrom") or {}).get("secretKeyRef")}  # fmt: skip

    request = tiny_revision_request("r1")
    index = backend_module.DictChildIndex()
    backend = backend_module.KubernetesBackend(kube, index)
    await backend.ensure_revision(request)
    (first,) = {transfer_secret_of(d) for d in await watched_deployments(kube, index)}
    await kube.adelete(ObjectRef("Secret", first, "ns"))
    await backend.ensure_revision(request)  # within the recheck: nothing asked
    assert secret_calls("POST", dry_run=True) == 0 and await kube.aget(ObjectRef("Secret", first, "ns")) is None

    monkeypatch.setattr(backend_module, "SECRET_RECHECK_SECONDS", 0.0)
    await backend.ensure_revision(request)  # finds it gone, creates a new one, applies
    await backend.ensure_revision(request)  # the watch cache still shows `first`: no third Secret
    assert secret_calls("POST", dry_run=True) == 2 and secret_calls("POST") == 2
    assert secret_calls("GET") == 1  # this test's own read above: the operator reads none
    assert await kube.aget(ObjectRef("Secret", first, "ns")) is None  # a dry run stores nothing
    deployments = await watched_deployments(kube, index)
    (second,) = {transfer_secret_of(d) for d in deployments}
    assert second != first and len(deployments) == 3
    assert all(template_key_refs(d) == {second} for d in deployments)  # a new template: the pods roll
    again = await kube.aget(ObjectRef("Secret", second, "ns"))
    assert again is not None and again["metadata"]["ownerReferences"][0]["uid"] == "uid-1"

    await backend.ensure_revision(request)  # settled: the new Secret is there, nothing else moves
    assert secret_calls("POST") == 2 and {transfer_secret_of(d) for d in await watched_deployments(kube, index)} == {second}


async def test_S3_a_replica_leading_again_takes_the_secret_its_successor_gave_the_revision(kube: Kube) -> None:
    """Outside probe: replica A remembered revision r1's Secret S1. While B led, r1 was deleted
    (superseded) and revived (a rollback), with a new Secret S2. A, leading again within the
    recheck, rendered r1 with S1, which no longer existed: new pods could not start. What the live
    Deployments read (their annotation in the watch cache) wins over memory, and a replica forgets
    its Secrets when it stops leading (Controller._stop_work)."""
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend
    from kvguard.operator.render import transfer_secret_of

    request = tiny_revision_request("r1")
    model = request.model
    index = DictChildIndex()  # both replicas' watches feed the same view

    async def watched() -> set[str | None]:
        return {transfer_secret_of(d) for d in await watched_deployments(kube, index)}

    a, b = KubernetesBackend(kube, index), KubernetesBackend(kube, index)
    await a.ensure_revision(request)
    (s1,) = await watched()
    before = set(index.objects)
    await b.delete_revision(model, "r1")
    await watched()
    for key in before - set(index.objects):  # the DELETED events every replica handles
        a.forget(key)
    await b.ensure_revision(request)
    (s2,) = await watched()
    assert s2 != s1 and await kube.aget(ObjectRef("Secret", s1, "ns")) is None
    await a.ensure_revision(request)  # A leads again (it kept its memory here: the index decides)
    assert await watched() == {s2}


@pytest.mark.parametrize("installed", [True, False])
async def test_an_operator_given_namespaces_starts_only_once_the_api_serves_inference_models(
    kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    """Outside probe: with namespaces given, kopf looks for its resources only when it starts, so
    an operator that started before its CRDs existed would never serve InferenceModels. The
    preflight asks API discovery (open to every authenticated client) and refuses to start."""
    from kvguard.commands.operator import cluster_problem

    if installed:
        url = declare_kvguard_resources(kmock)
    else:
        kmock.resources.load_bundled()
        url = str(kmock.url).rstrip("/")
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c", "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {}}], "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))  # $KUBECONFIG, read at import
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # Off the loop: the emulator answers on it.
    assert await asyncio.to_thread(cluster_problem) is None  # every namespace: kopf watches for CRDs, so it need not wait
    problem = await asyncio.to_thread(cluster_problem, needs_crds=True)
    assert (problem is None) is installed
    if not installed:
        assert problem is not None and "serves no InferenceModels yet" in problem and "install the CRDs first" in problem


async def test_S3_a_full_secret_quota_keeps_the_revisions_secret_rather_than_failing_every_pass(
    kube: Kube, kmock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit: a ResourceQuota on count/secrets refuses the dry-run create with 403 before it looks
    at the name, so the check that a revision's Secret is there failed, and with it every pass of
    the model (applies included), each time the recheck came round. A refusal that cannot tell
    keeps the name (a Secret really gone shows in its pods)."""
    from kvguard.operator.backends import kubernetes as backend_module
    from kvguard.operator.render import Owner

    owner = Owner(name="m", namespace="ns", uid="u")
    backend = backend_module.KubernetesBackend(kube, backend_module.DictChildIndex())
    name = await backend.ensure_transfer_secret(owner, "r1")
    kmock.secret_quota = 1  # full: this namespace holds one Secret
    monkeypatch.setattr(backend_module, "SECRET_RECHECK_SECONDS", 0.0)
    assert await backend.ensure_transfer_secret(owner, "r1") == name
    refused = [r for r in list(kmock) if r.method == "POST" and "/secrets" in r.url.path and r.params.get("dryRun") == "All"]
    assert len(refused) == 1 and await kube.aget(ObjectRef("Secret", name, "ns")) is not None


async def test_a_watch_cache_behind_the_operators_own_apply_is_not_taken_for_an_edit(kube: Kube, kmock: Any) -> None:
    """The labels-and-annotations check (an edit bumps no generation) must not read the old
    digest annotation of a watch cache that has not yet seen this process's apply as someone
    else's edit: compared by resourceVersion, it applies nothing more."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend

    model = ModelRef("ns", "m", "u")
    index = DictChildIndex()
    backend = KubernetesBackend(kube, index)
    first, second = owned_deployment("m-r1-decode", None), owned_deployment("m-r1-decode", None)
    second["spec"]["replicas"] = 2

    def patches() -> int:
        return len([r for r in list(kmock) if r.method == "PATCH" and "/deployments/" in r.url.path])

    await backend.apply(first, model)
    index.put({**(await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) or {}), "kind": "Deployment"})  # the cache: first
    await backend.apply(second, model)
    assert patches() == 2
    await backend.apply(second, model)  # the cache still shows `first` (an older resourceVersion)
    assert patches() == 2
    index.put({**(await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) or {}), "kind": "Deployment"})  # caught up
    await backend.apply(second, model)
    assert patches() == 2


async def test_a_label_an_admission_webhook_rewrites_on_every_write_is_not_fought(kube: Kube, kmock: Any) -> None:
    """Audit: with edits of its labels and annotations applied over, an operator whose writes a
    mutating webhook rewrites (one of its labels given another value on every write) would apply
    for ever. What the write itself returned decides: a mismatch the API server made is no edit."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend

    class MutatingWebhook(Kube):
        async def aapply(self, manifest: Any, **kwargs: Any) -> dict[str, Any]:
            await super().aapply(manifest, **kwargs)
            ref = ObjectRef("Deployment", manifest["metadata"]["name"], "ns")
            return await self.amerge_patch(ref, {"metadata": {"labels": {"app": "rewritten"}}})

    model = ModelRef("ns", "m", "u")
    index = DictChildIndex()
    backend = KubernetesBackend(MutatingWebhook(kube._api), index)
    desired = owned_deployment("m-r1-decode", None)
    desired["metadata"]["labels"]["app"] = "x"
    await backend.apply(desired, model)
    live = await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) or {}
    assert live["metadata"]["labels"]["app"] == "rewritten"
    index.put({**live, "kind": "Deployment"})
    def applies() -> int:
        return len([r for r in list(kmock) if r.method == "PATCH" and "apply-patch" in r.headers.get("Content-Type", "")])

    before = applies()
    await backend.apply(desired, model)
    assert applies() == before
    # Only that label is left alone: an edit of another one of the operator's is still applied over.
    edited = await kube.amerge_patch(ObjectRef("Deployment", "m-r1-decode", "ns"), {"metadata": {"labels": {"kvguard.io/revision": "bogus"}}})
    index.put({**edited, "kind": "Deployment"})
    await backend.apply(desired, model)
    assert applies() == before + 1


async def test_a_revisions_deployment_the_watch_cache_lacks_is_found_by_name_scaled_and_relabelled(kube: Kube, kmock: Any) -> None:
    """A Deployment whose labels someone took off leaves the watch cache, not the cluster: scaling
    its revision reads it by name and puts its labels back, even when its replicas are already
    right (a failed canary at zero), and deleting the revision deletes it."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend

    model = ModelRef("ns", "m", "u")
    backend = KubernetesBackend(kube, DictChildIndex())  # an empty cache: it shows none of them
    hidden = owned_deployment("m-r1-decode", None)
    hidden["spec"]["replicas"] = 0
    del hidden["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    await kube.acreate(hidden)
    foreign = owned_deployment("m-r1-prefill", None)
    foreign["metadata"]["ownerReferences"] = []  # not the model's: never touched
    await kube.acreate(foreign)
    await backend.scale_revision(model, "r1", 0)
    relabelled = await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) or {}
    assert relabelled["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvguard-operator" and relabelled["spec"]["replicas"] == 0
    await backend.delete_revision(model, "r1")
    assert await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) is None
    assert await kube.aget(ObjectRef("Deployment", "m-r1-prefill", "ns")) is not None


async def test_a_failed_pass_keeps_the_note_to_put_a_childs_labels_back(kube: Kube) -> None:
    """Audit: the record of a child that left the watch (its labels taken off) was dropped before
    its read; a transient API error ended that pass, and the retried one had nothing left to do,
    so the child stayed unlabelled (for a revision parked at zero, for good)."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend
    from kvguard.operator.kube import KubeError
    from kvguard.operator.workloads import child_projection

    class OneTimeout(Kube):
        failures = 1

        async def aget_metadata(self, ref: ObjectRef) -> dict[str, Any] | None:
            if self.failures:
                self.failures -= 1
                raise KubeError(500, "etcdserver: request timed out")
            return await super().aget_metadata(ref)

    created = await kube.acreate(owned_deployment("m-r1-decode", None)) or {}
    await kube.amerge_patch(ObjectRef("Deployment", "m-r1-decode", "ns"), {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
    backend = KubernetesBackend(OneTimeout(kube._api), DictChildIndex())
    backend.child_left(child_projection({**created, "kind": "Deployment"}), model_known=True)  # the watch's DELETED: its previous state
    with pytest.raises(KubeError):
        await backend.observe(ModelRef("ns", "m", "u"))
    await backend.observe(ModelRef("ns", "m", "u"))  # the retried pass
    live = await kube.aget(ObjectRef("Deployment", "m-r1-decode", "ns")) or {}
    assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvguard-operator"


async def test_a_workers_service_made_with_a_virtual_ip_is_replaced_by_its_headless_one(kube: Kube, kmock: Any) -> None:
    """An earlier release gave the kvguard engine's prefill and decode Services a virtual IP; they
    are headless now (the router resolves them to the pods, workers/discovery.py). A Service's
    clusterIP is immutable (422), so the operator deletes the old Service and applies the new one,
    as `kubectl apply --force` would, instead of failing the model's every pass."""
    from kvguard.operator.backends.base import ModelRef
    from kvguard.operator.backends.kubernetes import DictChildIndex, KubernetesBackend

    meta = owned_deployment("m-r1-prefill", None)["metadata"]
    old = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
           "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.12", "selector": {"kvguard.io/role": "prefill"},
                    "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]}}  # fmt: skip
    await kube.acreate(old)
    headless = copy.deepcopy(old)
    del headless["spec"]["clusterIP"]
    headless["spec"]["clusterIP"] = "None"
    with pytest.raises(KubeError) as refused:  # what the API server answers a plain apply
        await kube.aapply(headless)
    assert refused.value.status == 422 and "clusterIP" in str(refused.value)
    uid = (await kube.aget(ObjectRef("Service", "m-r1-prefill", "ns")) or {})["metadata"]["uid"]
    await KubernetesBackend(kube, DictChildIndex()).apply(headless, ModelRef("ns", "m", "u"))
    live = await kube.aget(ObjectRef("Service", "m-r1-prefill", "ns")) or {}
    assert live["spec"]["clusterIP"] == "None" and live["metadata"]["uid"] != uid  # a new object
    assert live["metadata"]["ownerReferences"][0]["uid"] == "u"


def test_a_throttled_get_is_not_retried_inside_the_client() -> None:
    """A review of Retry-After (95783af): urllib3's default retries answered a GET's (or a DELETE's)
    429 with Retry-After by sleeping what it asked and sending it again, three times, uncapped,
    in a request thread, before the caller's own wait began: 4 requests and 3 s for Retry-After:
    1. The answer goes to the caller at once, which waits as the API server asked."""
    import http.server
    import json
    import time

    import kubernetes

    hits: list[str] = []

    class Throttling(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.command)
            body = json.dumps({"kind": "Status", "code": 429, "message": "too many requests"}).encode()
            self.send_response(429)
            for name, value in (("Retry-After", "1"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Throttling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kube = Kube(kubernetes.client.ApiClient(client_configuration(f"http://127.0.0.1:{server.server_port}")))
        started = time.monotonic()
        with pytest.raises(KubeError) as raised:
            kube.list("InferenceModel", "ns")
        assert (raised.value.status, raised.value.retry_after, hits) == (429, 1.0, ["GET"])
        assert time.monotonic() - started < 0.9
    finally:
        server.shutdown()
        server.server_close()
