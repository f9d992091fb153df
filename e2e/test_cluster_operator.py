"""The operator flows of tests/test_operator_kmock.py against a real cluster (KUBECONFIG set).

Needs: the CRDs installed (`kubectl apply -k manifests/`), the operator running, and a namespace
you may write to (KVGUARD_E2E_NAMESPACE, default "kvguard-e2e"). Pods will not become ready
without the worker image and a `models` PVC; the test checks what the operator writes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is unset: no cluster to run against"),
]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_cluster_apply_blocked_and_delete() -> None:
    from kubernetes import client, config

    config.load_kube_config()
    ns = os.environ.get("KVGUARD_E2E_NAMESPACE", "kvguard-e2e")
    api = client.CustomObjectsApi()
    body = yaml.safe_load((EXAMPLES / "incident.yaml").read_text())
    body["metadata"] = {"name": "e2e-incident", "namespace": ns}
    api.create_namespaced_custom_object("kvguard.io", "v1alpha1", ns, "inferencemodels", body)
    try:
        deadline = time.time() + 60
        status: dict = {}
        while time.time() < deadline and status.get("phase") != "Blocked":
            time.sleep(2)
            status = api.get_namespaced_custom_object("kvguard.io", "v1alpha1", ns, "inferencemodels", "e2e-incident").get("status") or {}
        assert status.get("phase") == "Blocked"
        deployments = client.AppsV1Api().list_namespaced_deployment(ns, label_selector="kvguard.io/model=e2e-incident")
        assert deployments.items == []  # S7: nothing rendered for a blocked plan
    finally:
        api.delete_namespaced_custom_object("kvguard.io", "v1alpha1", ns, "inferencemodels", "e2e-incident")
