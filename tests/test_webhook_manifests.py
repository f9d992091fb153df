"""manifests/webhook/: the registration, the Service, the operator patch and both TLS options agree
with each other and with `kvguard.operator.webhook` (names, path, ports, Secret, DNS names); the
self-signed script's certificate is served by the operator's webhook server and verifies."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import reserved_port

from kvguard.operator import webhook

ROOT = Path(__file__).resolve().parent.parent
SERVICE_DNS = "kvguard-operator-webhook.kvguard-system.svc"


def render(folder: str) -> list[dict[str, Any]]:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    found = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    if not found:
        pytest.skip("no kubectl: run scripts/install-kubectl.py .venv (make does it)")
    out = subprocess.run([found, "kustomize", str(ROOT / folder)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_registration_points_at_the_handler_through_the_service() -> None:
    objs = render("manifests")
    config = one(objs, "ValidatingWebhookConfiguration", "kvguard-inferencemodels")
    models, policies = config["webhooks"]
    for hook, path, resource, scope in ((models, webhook.WEBHOOK_ID, "inferencemodels", "Namespaced"),
                                        (policies, webhook.POLICY_WEBHOOK_ID, "inferencepolicies", "Cluster")):  # fmt: skip
        # kopf routes by handler id: a wrong path admits everything
        assert hook["clientConfig"]["service"]["path"] == f"/{path}"
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["rules"] == [{"apiGroups": ["kvguard.io"], "apiVersions": ["v1alpha1"], "resources": [resource],
                                  "operations": ["CREATE", "UPDATE"], "scope": scope}]  # fmt: skip
    assert policies["clientConfig"]["service"] == {**models["clientConfig"]["service"], "path": f"/{webhook.POLICY_WEBHOOK_ID}"}
    service_ref = models["clientConfig"]["service"]
    service = one(objs, "Service", service_ref["name"])
    assert service["metadata"]["namespace"] == service_ref["namespace"] == "kvguard-system"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == service_ref["port"]]

    pod = one(objs, "Deployment", "kvguard-operator")["spec"]["template"]["spec"]
    assert service["spec"]["selector"].items() <= one(objs, "Deployment", "kvguard-operator")["spec"]["template"]["metadata"]["labels"].items()
    container = pod["containers"][0]
    (container_port,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert container_port["containerPort"] == webhook.DEFAULT_PORT
    env = {e["name"]: e.get("value") for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["KVGUARD_WEBHOOK_CERT_DIR"]]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"] == {"secretName": "kvguard-webhook-tls", "optional": True} and mount["readOnly"] is True
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "kvguard-system/kvguard-webhook"


def test_cert_manager_option_issues_the_secret_the_operator_mounts() -> None:
    objs = render("manifests/webhook/cert-manager")
    certificate = one(objs, "Certificate", "kvguard-webhook")  # the name inject-ca-from refers to
    assert certificate["metadata"]["namespace"] == "kvguard-system"
    assert certificate["spec"]["secretName"] == "kvguard-webhook-tls"
    assert SERVICE_DNS in certificate["spec"]["dnsNames"]
    ca_issuer = one(objs, "Issuer", certificate["spec"]["issuerRef"]["name"])
    assert one(objs, "Certificate", "kvguard-webhook-ca")["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]


@pytest.fixture
def port() -> Iterator[int]:
    with reserved_port() as held:  # until the test ends: no one else can take it before the server binds it
        yield held


async def test_self_signed_script_certificate_is_served_and_verifies(tmp_path: Path, port: int) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI")
    subprocess.run(["sh", str(ROOT / "manifests/webhook/self-signed.sh"), "--out", str(tmp_path)], check=True)
    server = webhook.webhook_server({"KVGUARD_WEBHOOK_CERT_DIR": str(tmp_path), "KVGUARD_WEBHOOK_ADDR": "127.0.0.1",
                                     "KVGUARD_WEBHOOK_PORT": str(port)})  # fmt: skip

    async def no_requests(*_: Any, **__: Any) -> Any:
        raise AssertionError("no request expected")

    serving = server(no_requests)
    client_config = await serving.__anext__()  # listening now; what kopf would put in a managed config
    try:
        assert client_config["caBundle"]  # ca.crt, for the API server
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=SERVICE_DNS)
        assert writer.get_extra_info("peercert")["subject"] == ((("commonName", SERVICE_DNS),),)
        writer.close()
        with pytest.raises(ssl.SSLCertVerificationError):  # the name the API server uses must match
            await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="other.svc")
    finally:
        await serving.aclose()
