"""The pure pieces of the progressive scenarios' cluster variant, here, without a cluster.

progressive_cluster.py can only run against a real cluster; what it computes can be checked on
what the operator really renders: the smaller-pool Pod built from a rendered decode Deployment,
the revision weights read off a rendered HTTPRoute, the EndpointSlice check, the Gateway of
e2e/install/gateway the scenarios' models attach to; and the traffic recorder's accounting by
`x-kvguard-revision` against a loopback server answering as two revisions' routers do.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import NAME
from harness_cluster import kubectl
from progressive import FORWARDED_FOR, STEPS, Traffic, base_body
from progressive_cluster import DEFAULT_GATEWAY, POOL_FLAG, pod_condition, ready_endpoint_of, revision_weights, smaller_pool_pod
from waiting import wait_for

from kvguard.operator.api import InferenceModel
from kvguard.operator.planner import plan
from kvguard.operator.pool_gate import CONTEXT_ANNOTATION, GATE_CONDITION, RATIO_ANNOTATION
from kvguard.operator.render import LABEL_REVISION, Owner, render_revision
from kvguard.operator.traffic import render_http_route, traffic_split
from kvguard.workers.openai_api import REVISION_HEADER

REPO = Path(__file__).resolve().parent.parent
OWNER = Owner(name=NAME, namespace="kvguard-e2e", uid="uid-1")
SOURCE = {"pvc": {"claimName": "kvguard-e2e-models", "path": "tiny-0"}, "revision": "seed-0"}


def model() -> InferenceModel:
    parent = {"name": DEFAULT_GATEWAY[0], "namespace": DEFAULT_GATEWAY[1]}
    return InferenceModel.model_validate(base_body(SOURCE, "0.1.0", STEPS, [parent], image="worker:e2e"))


def rendered(kind: str, name: str) -> dict[str, Any]:
    spec = model().spec
    objects = render_revision(spec, plan(spec), OWNER, "abc123")
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_smaller_pool_pod_is_the_stable_decode_template_with_only_its_pool_changed() -> None:
    deployment = rendered("Deployment", f"{NAME}-abc123-decode")
    template = deployment["spec"]["template"]
    pod = smaller_pool_pod(deployment, 1024)
    assert pod["kind"] == "Pod" and pod["metadata"]["name"] == f"{NAME}-abc123-decode-smaller-pool"
    # Same labels: the revision's decode Service (and the operator's pod watch) select it.
    assert pod["metadata"]["labels"] == template["metadata"]["labels"] and pod["metadata"]["labels"][LABEL_REVISION] == "abc123"
    assert "pod-template-hash" not in pod["metadata"]["labels"] and "ownerReferences" not in pod["metadata"]
    # Judged by its revision's requirement, through the same readiness gate.
    annotations = pod["metadata"]["annotations"]
    assert annotations[RATIO_ANNOTATION] == template["metadata"]["annotations"][RATIO_ANNOTATION] and CONTEXT_ANNOTATION in annotations
    assert pod["spec"]["readinessGates"] == [{"conditionType": GATE_CONDITION}]
    (before,), (after,) = template["spec"]["containers"], pod["spec"]["containers"]
    at = before["command"].index(POOL_FLAG)
    assert after["command"][at + 1] == "1024" and before["command"][at + 1] != "1024"
    assert [a for i, a in enumerate(after["command"]) if i != at + 1] == [a for i, a in enumerate(before["command"]) if i != at + 1]
    assert {k: v for k, v in after.items() if k != "command"} == {k: v for k, v in before.items() if k != "command"}
    assert deployment["spec"]["template"] == template  # the Deployment it was built from is untouched
    with pytest.raises(ValueError, match=POOL_FLAG):
        smaller_pool_pod(rendered("Deployment", f"{NAME}-abc123-router"), 1024)  # the router has no pool


def test_revision_weights_read_the_rendered_http_route() -> None:
    spec = model().spec
    route = render_http_route(OWNER, spec.rollout, traffic_split("aaa111", "bbb222", 10))
    assert revision_weights(route, NAME) == {"aaa111": 90, "bbb222": 10}
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": DEFAULT_GATEWAY[0], "namespace": DEFAULT_GATEWAY[1]}]  # fmt: skip
    assert revision_weights({}, NAME) == {}


def test_the_e2e_gateway_takes_the_scenarios_routes() -> None:
    """e2e/install/gateway renders offline and declares the Gateway the models' parentRefs name,
    listening on HTTP and admitting routes from the scenarios' namespace (any)."""
    binary = kubectl()
    if binary is None:
        pytest.skip("no kubectl (run scripts/install-kubectl.py .venv)")
    out = subprocess.run([binary, "kustomize", str(REPO / "e2e" / "install" / "gateway")], check=True, capture_output=True, text=True)
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    gateway = docs["Gateway", DEFAULT_GATEWAY[0]]
    assert gateway["metadata"]["namespace"] == DEFAULT_GATEWAY[1] and ("Namespace", DEFAULT_GATEWAY[1]) in docs
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTP" and listener["allowedRoutes"]["namespaces"]["from"] == "All"
    assert docs["GatewayClass", gateway["spec"]["gatewayClassName"]]["spec"]["controllerName"].startswith("gateway.envoyproxy.io/")


def test_a_pod_is_out_of_rotation_unless_an_endpoint_slice_lists_it_ready() -> None:
    slices = [{"endpoints": [{"targetRef": {"kind": "Pod", "name": "a"}, "conditions": {"ready": True}},
                             {"targetRef": {"kind": "Pod", "name": "small"}, "conditions": {"ready": False}}]}]  # fmt: skip
    assert ready_endpoint_of(slices, "a") and not ready_endpoint_of(slices, "small") and not ready_endpoint_of([], "a")
    pod = {"status": {"conditions": [{"type": GATE_CONDITION, "status": "False", "reason": "KVPoolTooSmall"}]}}
    assert pod_condition(pod, GATE_CONDITION) == pod["status"]["conditions"][0] and pod_condition(pod, "Ready") is None


class _Routers(BaseHTTPRequestHandler):
    """Answers as two revisions' routers behind one URL: every 4th request by `cand` with a 500."""

    served = 0
    lock = threading.Lock()
    forwarded: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.lock:
            type(self).served += 1
            n = type(self).served
            type(self).forwarded.append(self.headers.get(FORWARDED_FOR[0]))
        revision, status = ("cand", 500) if n % 4 == 0 else ("stable", 200)
        body = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": " Paris", "finish_reason": "length", "logprobs": None}]}  # fmt: skip
        if status != 200:
            body = {"error": {"message": "injected", "type": "server_error", "code": "engine_error"}}
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header(REVISION_HEADER, revision)
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def routers() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Routers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_traffic_records_who_answered_each_request_by_its_revision_header(routers: str) -> None:
    with Traffic(routers, clients=2) as traffic:
        wait_for(lambda: len(traffic.answers) >= 20, "20 answers")
    served = traffic.served()
    assert set(served) == {"stable", "cand"} and sum(served.values()) == len(traffic.answers)
    assert set(traffic.by("stable")) == {200} and set(traffic.by("cand")) == {500}  # errors are counted, named
    assert traffic.by(None) == [] and not traffic.connection_errors
    assert traffic.since(len(traffic.answers)) == [] and traffic.since(0) == traffic.answers
    assert traffic.sent_since(0.0) == traffic.answers and traffic.sent_since(time.monotonic()) == []
    assert set(_Routers.forwarded) == {FORWARDED_FOR[1]}  # every client request says it came through a proxy
