"""`kubectl kustomize manifests/` renders, the objects validate, and the install is least-privilege."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def kubectl() -> str:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    found = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    if not found:
        pytest.skip("no kubectl: run scripts/install-kubectl.py .venv (make does it)")
    return found


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "manifests")], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_objects_validate_against_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    built_in = [obj for obj in rendered if not obj["apiVersion"].startswith(("kvguard.io/", "kopf.dev/"))]  # custom kinds: tests/test_crds.py
    assert {"Deployment", "ClusterRole", "ServiceAccount"} <= {obj["kind"] for obj in built_in}  # the install, not an empty render
    for obj in built_in:
        kubernetes_validate.validate(obj, "1.30", strict=True)  # raises on the first field the schema refuses


def rules(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [rule for role in by_kind(objs, kind) for rule in role["rules"]]


def test_rbac_is_least_privilege(rendered: list[dict[str, Any]]) -> None:
    bindings = by_kind(rendered, "ClusterRoleBinding") + by_kind(rendered, "RoleBinding")
    assert all(b["roleRef"]["name"] not in ("cluster-admin", "admin", "edit") for b in bindings)
    for rule in rules(rendered, "ClusterRole") + rules(rendered, "Role"):
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        if "secrets" in rule["resources"]:
            assert set(rule["verbs"]) <= {"create", "delete"}, "no reads of Secrets anywhere: never get, list or watch"
        if {"inferencemodels", "inferencepolicies"} & set(rule["resources"]):
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, "the operator writes only status"
        if "inferencemodels/finalizers" in rule["resources"]:
            assert rule["verbs"] == ["update"] and rule["resources"] == ["inferencemodels/finalizers"]


def owner_finalizer_rights(objs: list[dict[str, Any]], kind: str) -> set[str]:
    return {v for rule in rules(objs, kind) if "inferencemodels/finalizers" in rule["resources"] for v in rule["verbs"]}


def test_both_installs_may_set_block_owner_deletion_on_the_children(rendered: list[dict[str, Any]]) -> None:
    """Outside probe: every child's ownerReference sets blockOwnerDeletion, which an API server with
    OwnerReferencesPermissionEnforcement (OpenShift's default) allows only to a user who may update
    the owner's finalizers; neither install granted it, so no child would ever be created there."""
    from kvguard.operator.render import Owner

    reference = Owner(name="tiny", namespace="models", uid="uid-tiny").reference()
    assert reference["blockOwnerDeletion"] is True
    assert owner_finalizer_rights(rendered, "ClusterRole") == {"update"}
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "manifests" / "namespaced")], check=True, capture_output=True, text=True)
    namespaced = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    assert owner_finalizer_rights(namespaced, "Role") == {"update"}


def test_operator_runs_restricted_with_a_leader_elected_by_lease(rendered: list[dict[str, Any]]) -> None:
    (deployment,) = by_kind(rendered, "Deployment")
    assert deployment["metadata"]["namespace"] == "kvguard-system" and deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (lease_role,) = [r for r in by_kind(rendered, "Role") if r["metadata"]["name"] == "kvguard-operator-leader-election"]
    assert lease_role["metadata"]["namespace"] == "kvguard-system"
    assert all(rule["resources"] == ["leases"] for rule in lease_role["rules"])
    assert not by_kind(rendered, "ClusterKopfPeering"), "kopf peering is replaced by the Lease"
    assert "clusterkopfpeerings" not in {r for rule in rules(rendered, "ClusterRole") for r in rule["resources"]}
    names = {c["metadata"]["name"] for c in by_kind(rendered, "CustomResourceDefinition")}
    assert names == {"inferencemodels.kvguard.io", "inferencepolicies.kvguard.io"}


def test_the_namespaced_install_grants_nothing_outside_its_namespaces() -> None:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "manifests" / "namespaced")], check=True, capture_output=True, text=True)
    objs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for obj in objs:
        if not obj["apiVersion"].startswith("kvguard.io/"):
            import kubernetes_validate

            kubernetes_validate.validate(obj, "1.30", strict=True)
    for rule in rules(objs, "ClusterRole"):  # cluster-wide: read only, and only policies and CRDs
        assert set(rule["verbs"]) <= {"get", "list", "watch"} and set(rule["resources"]) <= {"inferencepolicies", "customresourcedefinitions"}
    (deployment,) = by_kind(objs, "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    watched = set(env["WATCH_NAMESPACES"].split(","))
    workload_roles = {r["metadata"]["namespace"] for r in by_kind(objs, "Role") if r["metadata"]["name"] == "kvguard-operator"}
    assert workload_roles == watched == {"models"}, "a Role in every watched namespace, and only there"
    for binding in by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvguard-operator", "namespace": "kvguard-system"}]
    workload = next(r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "kvguard-operator")
    resources = {res for rule in workload["rules"] for res in rule["resources"]}
    assert {"deployments", "services", "networkpolicies", "secrets", "inferencemodels/status"} <= resources


def test_the_operator_command_watches_what_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard.commands.operator import kopf_argv, watched_namespaces

    assert watched_namespaces([], {"WATCH_NAMESPACES": "models, team-b"}) == ["models", "team-b"]
    assert watched_namespaces(["only"], {"WATCH_NAMESPACES": "models"}) == ["only"]
    assert kopf_argv(["models", "team-b"])[-2:] == ["--namespace=models", "--namespace=team-b"]
    assert "--all-namespaces" in kopf_argv(watched_namespaces([], {})) and "--standalone" in kopf_argv([])


@pytest.mark.parametrize(("flags", "environ", "scanning_off"), [
    (["models"], None, True), ([], "models", True), ([], None, False),
    ([], " , ", False),  # outside probe: no namespace in it means every namespace, so scanning stays on
])
def test_an_operator_given_namespaces_runs_kopf_without_scanning_them(monkeypatch: pytest.MonkeyPatch, flags: list[str],
                                                                       environ: str | None, scanning_off: bool) -> None:  # fmt: skip
    """The namespaced install may not list or watch namespaces: `kvguard operator --namespace`
    tells its handlers (through WATCH_NAMESPACES), which turn kopf's namespace scanning off."""
    import asyncio
    import types

    import kopf
    import kopf.cli

    from kvguard.cli import build_parser
    from kvguard.commands import operator as command
    from kvguard.operator import handlers

    monkeypatch.setenv("WATCH_NAMESPACES", "")  # so that what `run` sets is undone after the test
    monkeypatch.delenv("WATCH_NAMESPACES")
    if environ is not None:
        monkeypatch.setenv("WATCH_NAMESPACES", environ)
    monkeypatch.setattr(command, "cluster_problem", lambda **_: None)
    started: list[list[str]] = []
    monkeypatch.setattr(kopf.cli, "main", lambda argv, standalone_mode: started.append(argv))
    args = build_parser().parse_args(["operator", *(f"--namespace={n}" for n in flags)])
    assert command.run(args) == 0 and started
    settings = kopf.OperatorSettings()

    async def configure_only() -> None:  # the startup handler's settings, not the controller it builds
        monkeypatch.setattr(handlers, "Controller", lambda *a, **k: types.SimpleNamespace(start=lambda: None))
        monkeypatch.setenv("KVGUARD_METRICS_PORT", "0")
        await handlers.configure(settings=settings, memo=kopf.Memo(kvguard_kube=object()), inference_policies={},
                                 **{name: {} for name in handlers.CHILD_INDEXES})  # fmt: skip

    asyncio.run(configure_only())
    assert settings.scanning.disabled is scanning_off
    assert ("--all-namespaces" not in started[0]) is scanning_off  # kopf serves exactly what it does not scan


def test_sample_model_is_valid() -> None:
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.planner import plan

    model = InferenceModel.model_validate(yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text()))
    assert plan(model.spec).verdict == "pass"


def test_fault_injection_is_off_in_the_install_and_on_only_in_the_e2e_overlay(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvguard.operator.controller import fault_injection_allowed

    def operator_env(objs: list[dict[str, Any]]) -> dict[str, str]:
        (deployment,) = by_kind(objs, "Deployment")
        return {e["name"]: e.get("value", "") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "KVGUARD_ALLOW_FAULT_INJECTION" not in operator_env(rendered)
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "e2e" / "install")], check=True, capture_output=True, text=True)
    testing = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    env = operator_env(testing)
    assert env["KVGUARD_ALLOW_FAULT_INJECTION"] == "true" and "KVGUARD_WEBHOOK_CERT_DIR" in env  # the base, plus the switch
    monkeypatch.setenv("KVGUARD_ALLOW_FAULT_INJECTION", env["KVGUARD_ALLOW_FAULT_INJECTION"])
    assert fault_injection_allowed()


@pytest.mark.parametrize("install", ["manifests", "manifests/namespaced"])
def test_an_operator_pod_is_ready_only_once_its_webhook_listens(install: str) -> None:
    """Outside probe: the operator had no readiness probe, so a pod whose webhook was off (no TLS
    Secret yet) or not yet listening (a rolling restart) was an endpoint of the webhook Service,
    and with failurePolicy Fail every model write it was sent was refused."""
    from kvguard.operator.webhook import DEFAULT_PORT

    out = subprocess.run([kubectl(), "kustomize", str(ROOT / install)], check=True, capture_output=True, text=True)
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    (deployment,) = by_kind(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["tcpSocket"]["port"] == "webhook" and ports["webhook"] == DEFAULT_PORT
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == "kvguard-operator-webhook"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["webhook"]
    (configuration,) = by_kind(objects, "ValidatingWebhookConfiguration")
    assert {w["failurePolicy"] for w in configuration["webhooks"]} == {"Fail"}  # why readiness matters


@pytest.mark.parametrize("install", ["manifests", "manifests/namespaced"])
def test_each_install_applies_in_one_pass(install: str) -> None:
    """Outside probes: the base, then the namespaced install, held the default InferencePolicy
    beside its CRD. On a fresh cluster kubectl cannot map a kind whose CRD the same apply creates,
    and the webhook refuses policy writes until its TLS exists: the apply failed and the policy
    never existed. It is its own step (`kubectl apply -k manifests/samples`), after TLS."""
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / install)], check=True, capture_output=True, text=True)
    rendered = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    custom = [f"{o['kind']}/{o['metadata']['name']}" for o in rendered if o["apiVersion"].startswith("kvguard.io/")]
    assert custom == [] and len(by_kind(rendered, "CustomResourceDefinition")) == 2
    samples = subprocess.run([kubectl(), "kustomize", str(ROOT / "manifests" / "samples")], check=True, capture_output=True, text=True)
    assert [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(samples.stdout) if d] == [("InferencePolicy", "default")]
