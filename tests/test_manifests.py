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

    for obj in rendered:
        if obj["apiVersion"].startswith(("kvguard.io/", "kopf.dev/")):
            continue  # custom kinds: covered by tests/test_crds.py
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_rbac_is_least_privilege(rendered: list[dict[str, Any]]) -> None:
    bindings = by_kind(rendered, "ClusterRoleBinding") + by_kind(rendered, "RoleBinding")
    assert all(b["roleRef"]["name"] not in ("cluster-admin", "admin", "edit") for b in bindings)
    for role in by_kind(rendered, "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            if "secrets" in rule["resources"]:
                assert not {"get", "list", "watch"} & set(rule["verbs"]), "no cluster-wide secret reads"


def test_operator_runs_restricted_with_peering(rendered: list[dict[str, Any]]) -> None:
    (deployment,) = by_kind(rendered, "Deployment")
    assert deployment["metadata"]["namespace"] == "kvguard-system" and deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    assert "--standalone" not in container["args"]  # peering on
    assert by_kind(rendered, "ClusterKopfPeering")[0]["metadata"]["name"] == "kvguard"
    names = {c["metadata"]["name"] for c in by_kind(rendered, "CustomResourceDefinition")}
    assert {"inferencemodels.kvguard.io", "inferencepolicies.kvguard.io"} <= names


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
