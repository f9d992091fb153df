"""tests/rbac.py, the RBAC check the emulator tests run on every request of the operator's, judged
against the shipped installs as a real API server's authorizer would."""

from __future__ import annotations

import pytest
from rbac import RequestInfo, denied, install_grants, request_info


def test_requests_map_to_the_authorizers_attributes() -> None:
    assert request_info("GET", "/api/v1/namespaces/models/secrets/s", {}) == RequestInfo("get", "", "secrets", "models", "s")
    assert request_info("GET", "/apis/apps/v1/deployments", {"watch": "true"}) == RequestInfo("watch", "apps", "deployments", None, None)
    assert request_info("GET", "/apis/apps/v1/namespaces/m/deployments", {}) == RequestInfo("list", "apps", "deployments", "m", None)
    assert request_info("PATCH", "/api/v1/namespaces/m/pods/p/status", {}) == RequestInfo("patch", "", "pods/status", "m", "p")
    assert request_info("DELETE", "/api/v1/namespaces/m/secrets", {}) == RequestInfo("deletecollection", "", "secrets", "m", None)
    assert request_info("GET", "/api/v1/namespaces/m", {}) == RequestInfo("get", "", "namespaces", None, "m")
    for discovery in ("/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1", "/version"):
        assert request_info("GET", discovery, {}) is None


@pytest.mark.parametrize("install", ["manifests", "manifests/namespaced"])
def test_both_installs_refuse_what_the_operator_must_never_do(install: str) -> None:
    grants = install_grants(install, "models")
    never = [("GET", "/api/v1/namespaces/models/secrets/k", {}), ("GET", "/api/v1/secrets", {}),
             ("PATCH", "/apis/kvguard.io/v1alpha1/namespaces/models/inferencemodels/m", {}),  # only its status
             ("DELETE", "/api/v1/namespaces/models/pods/p", {}),
             ("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {})]  # fmt: skip
    assert len(denied(never, grants)) == len(never)
    allowed = [("POST", "/api/v1/namespaces/models/secrets", {}),
               ("PATCH", "/apis/kvguard.io/v1alpha1/namespaces/models/inferencemodels/m/status", {}),
               ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/kvguard-system/leases/kvguard-operator", {})]  # fmt: skip
    assert denied(allowed, grants) == []
    elsewhere = [("POST", "/apis/apps/v1/namespaces/other/deployments", {})]
    assert len(denied(elsewhere, grants)) == (1 if install == "manifests/namespaced" else 0)  # a Role per watched namespace
