"""RBAC as a real API server applies it, for the requests the operator sends to the emulator.

kmock authorizes nothing, so a request the shipped roles do not allow (a verb or a resource
missing from `manifests/rbac.yaml` or the namespaced Roles) would pass every emulator test and
fail with 403 on a real cluster. `denied` maps each request to its RBAC attributes (verb, API
group, resource[/subresource], namespace, name: the Kubernetes authorizer's request info) and
checks them against the rules an install binds to the operator's ServiceAccount.
Discovery (`/api`, `/apis/...` without a resource, `/version`) is allowed to every authenticated
user by the default `system:discovery` role, so it is not checked.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVICE_ACCOUNT = ("kvguard-system", "kvguard-operator")
OPERATOR_AGENTS = ("kvguard-operator/", "kopf/")
"""User-Agent prefixes of the operator's two clients (its own Kube client, and kopf's)."""


@dataclass(frozen=True)
class RequestInfo:
    verb: str
    group: str
    resource: str  # "pods" or "pods/status"
    namespace: str | None
    name: str | None


@dataclass(frozen=True)
class Grant:
    rule: Mapping[str, Any]
    namespace: str | None  # None: a ClusterRole's rule, in force everywhere

    def allows(self, info: RequestInfo) -> bool:
        if self.namespace is not None and info.namespace != self.namespace:
            return False
        rule = self.rule
        names = rule.get("resourceNames") or []
        return (
            _has(rule.get("apiGroups"), info.group)
            and _has(rule.get("resources"), info.resource)
            and _has(rule.get("verbs"), info.verb)
            and (not names or info.name in names)
        )


def _has(values: Sequence[str] | None, wanted: str) -> bool:
    return bool(values) and ("*" in values or wanted in values)  # type: ignore[operator]


def request_info(method: str, path: str, params: Mapping[str, str]) -> RequestInfo | None:
    """The authorizer's view of a request; None for discovery and other non-resource paths."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":  # /namespaces/NS/RESOURCE...: a namespaced resource
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
    if method == "GET":
        verb = "get" if name else ("watch" if params.get("watch") in ("true", "1") else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    if verb is None:
        return None
    return RequestInfo(verb, group, f"{resource}/{sub}" if sub else resource, namespace, name)


def install_grants(kustomization: str, model_namespace: str) -> list[Grant]:
    """Every rule bound to the operator's ServiceAccount by `kubectl kustomize <kustomization>`.
    A namespaced install's Roles for watched namespaces are shipped for `models`: they are taken
    to be in `model_namespace`."""
    from test_manifests import kubectl

    out = subprocess.run([kubectl(), "kustomize", str(ROOT / kustomization)], check=True, capture_output=True, text=True)
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    roles = {(o["kind"], (o["metadata"].get("namespace")), o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    grants: list[Grant] = []
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any((s.get("namespace"), s.get("name")) == SERVICE_ACCOUNT for s in binding.get("subjects") or []):
            continue
        ref = binding["roleRef"]
        bound_in = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], bound_in if ref["kind"] == "Role" else None, ref["name"])]
        where = None if bound_in is None else (model_namespace if bound_in == "models" else bound_in)
        grants += [Grant(rule, where) for rule in role.get("rules") or []]
    return grants


def denied(requests: Iterable[tuple[str, str, Mapping[str, str]]], grants: Sequence[Grant]) -> list[str]:
    """`METHOD path` of each request no grant allows (each once)."""
    refused: dict[str, None] = {}
    for method, path, params in requests:
        info = request_info(method, path, params)
        if info is not None and not any(g.allows(info) for g in grants):
            refused[f"{method} {path} ({info.verb} {info.group or 'core'}/{info.resource})"] = None
    return list(refused)


def operator_requests(kmock: Any, since: int = 0) -> list[tuple[str, str, Mapping[str, str]]]:
    """The requests the emulator got from the operator's clients (from its `since`-th request on)."""
    found = []
    for request in list(kmock)[since:]:
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        if agent.startswith(OPERATOR_AGENTS):
            found.append((str(request.method).split(".")[-1].upper(), request.url.path, dict(request.params)))
    return found
