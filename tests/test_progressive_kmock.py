"""The Kubernetes side of traffic in steps, against kmock (the API server stand-in) and real router,
prefill and decode processes: the HTTPRoute's weights at each step, validated against the upstream
Gateway API CRD, analysis on live traffic between steps, and the old revision kept running for
scaleDownDelaySeconds before it is scaled to zero. Waits on conditions only."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock as km
import pytest
import yaml
from crd_admission import admit
from kmock_api import ApiServer
from operator_harness import (
    CANARY_WAIT,
    DEPLOYMENTS,
    NS,
    apply_model,
    assert_scaled_down_when_due,
    http,
    mark_ready,
    objects_of,
    patch_model,
    promoted,
    second_revision_ready,
    status_of,
    tiny_model,
    until,
)

from kvguard.operator.traffic import route_weights
from kvguard.workers.launcher import LocalDeployment

pytestmark = [pytest.mark.kmock(cls=ApiServer)]

HTTPROUTES = km.resource("gateway.networking.k8s.io", "v1", "httproutes")
UPSTREAM = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "crds" / "gateway.networking.k8s.io_httproutes.yaml"
if not UPSTREAM.is_file():
    UPSTREAM = Path("/work/shared/reference/crds/gateway.networking.k8s.io_httproutes.yaml")


def progressive_model() -> dict[str, Any]:
    body = tiny_model()
    body["spec"]["rollout"] = {
        "trafficRouter": "gatewayAPI", "gateway": {"parentRefs": [{"name": "gw", "namespace": "gateway-system"}]},
        "steps": [{"weight": 50}, {"weight": 100}],
        # the same processes stand in for both revisions here, so their latencies are alike by construction
        "analysis": {"intervalSeconds": 1, "minRequests": 1},
        "bakeSeconds": 0, "scaleDownDelaySeconds": 4,
    }  # fmt: skip
    return body


def route(cluster: Any) -> dict[str, Any] | None:
    live = objects_of(cluster, HTTPROUTES).get("tiny")
    return None if live is None else json.loads(json.dumps(live.raw))  # a plain copy of the stored object


def valid_upstream(obj: dict[str, Any]) -> dict[str, Any]:
    if not UPSTREAM.is_file():
        return obj  # the weights are still checked; the schema comes from ../shared (absent here)
    stored, rejections = admit(copy.deepcopy({k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec")}), yaml.safe_load(UPSTREAM.read_text()))
    assert rejections == [], rejections
    return stored


@contextlib.asynccontextmanager
async def live_traffic(serving: LocalDeployment) -> AsyncIterator[None]:
    """Real completions through the router for as long as the block runs (what the analysis reads)."""
    stop = asyncio.Event()

    async def client() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{serving.router_url}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            while not stop.is_set():
                body = {"model": model, "prompt": "steps", "max_tokens": 4, "temperature": 0}
                async with session.post(f"{serving.router_url}/v1/completions", json=body) as resp:
                    await resp.read()

    task = asyncio.create_task(client())
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_http_route_weights_follow_the_steps_then_the_old_revision_scales_down_after_the_delay(
    cluster: Any, serving: LocalDeployment
) -> None:
    await apply_model(progressive_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await promoted(cluster, rev1)
    first = await until(lambda: route(cluster), "the HTTPRoute", CANARY_WAIT)
    assert route_weights(valid_upstream(first)) == {f"tiny-{rev1}-router": 100}  # a first rollout: all of it at once

    async with live_traffic(serving):
        await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
        rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
        await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
        await mark_ready(cluster, rev2)
        half = await until(lambda: (r := route(cluster)) and route_weights(r).get(f"tiny-{rev2}-router") == 50 and r,
                           "the HTTPRoute at step 1 (50%)", CANARY_WAIT)  # fmt: skip
        assert route_weights(valid_upstream(half)) == {f"tiny-{rev1}-router": 50, f"tiny-{rev2}-router": 50}
        assert status_of(cluster)["revision"] == rev1  # S8: stable until every step passed
        # The promotion's own status, read the moment it is written (the pass writes status before it
        # acts): a later read may already be the scale-down's, on a machine slow enough to let the
        # delay run out while the traffic below winds down.
        status = await until(lambda: status_of(cluster).get("revision") == rev2 and status_of(cluster),
                             "rev2 promoted after its analysis", CANARY_WAIT)  # fmt: skip
        rev1_replicas = {n: d["spec"]["replicas"] for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n}
    assert {r["name"] for r in status["rollout"]["analysis"]} >= {"safety", "errorRatio", "ttft", "itl"}
    assert all(r["phase"] == "Successful" for r in status["rollout"]["analysis"]), status["rollout"]["analysis"]
    assert status["rollout"]["weight"] == 100 and status["rollout"]["scaleDownRevision"] == rev1
    assert all(replicas > 0 for replicas in rev1_replicas.values()), "kept running for an instant rollback"
    await promoted(cluster, rev2)  # the promotion pass has acted
    assert route_weights(valid_upstream(route(cluster))) == {f"tiny-{rev2}-router": 100}
    await until(lambda: all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n),
                "rev1 scaled to zero after scaleDownDelaySeconds", 60)  # fmt: skip
    await assert_scaled_down_when_due(cluster, rev1, status["rollout"]["scaleDownAt"])
    assert "scaleDownRevision" not in status_of(cluster)["rollout"]


ROUTE_PATH = "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes/tiny"


async def test_an_http_route_deleted_or_edited_by_hand_is_applied_again_and_one_no_longer_wanted_is_deleted(
    cluster: Any, serving: LocalDeployment
) -> None:
    """Outside probe: HTTPRoutes are not watched (RBAC gives the operator them by name only), and
    the apply cache trusted its own memory: a route deleted mid-step stayed gone, one edited by
    hand kept the edit (the analysis judged a weight not served), and switching trafficRouter to
    service left the route sending 50% to the old revision after it was scaled to zero."""
    body = progressive_model()
    body["spec"]["rollout"]["steps"] = [{"weight": 50, "pause": "1h"}, {"weight": 100}]  # holds step 1
    rev1, rev2 = await second_revision_ready(cluster, body)
    half = {f"tiny-{rev1}-router": 50, f"tiny-{rev2}-router": 50}
    await until(lambda: (r := route(cluster)) and route_weights(r) == half, "the HTTPRoute at step 1 (50%)", CANARY_WAIT)
    path = ROUTE_PATH.format(ns=route(cluster)["metadata"]["namespace"])  # type: ignore[index]

    await http("DELETE", path)
    await until(lambda: route(cluster), "the deleted HTTPRoute applied again")
    assert route_weights(route(cluster)) == half  # type: ignore[arg-type]
    edited = copy.deepcopy(route(cluster)["spec"])  # type: ignore[index]
    for ref in edited["rules"][0]["backendRefs"]:
        ref["weight"] = 100 if rev2 in ref["name"] else 0
    await http("PATCH", path, {"spec": edited}, "application/merge-patch+json")
    await until(lambda: (r := route(cluster)) and route_weights(r) != {f"tiny-{rev1}-router": 0, f"tiny-{rev2}-router": 100},
                "the hand-edited HTTPRoute applied again")  # fmt: skip
    assert route_weights(route(cluster)) == half  # type: ignore[arg-type]

    await patch_model("tiny", {"spec": {"rollout": {"trafficRouter": "service", "steps": [{"weight": 100}]}}})
    await until(lambda: route(cluster) is None, "the HTTPRoute the spec no longer calls for deleted")
    assert status_of(cluster)["revision"] == rev2  # promoted: service mode moves all at once


POOLS = km.resource("inference.networking.k8s.io", "v1", "inferencepools")


async def test_inference_pools_an_earlier_operator_made_are_deleted_when_the_router_switches(
    operator: Any, cluster: Any, serving: LocalDeployment
) -> None:
    """Outside probe: the sweep of traffic objects knew only what its own process had applied, so
    after a restart or a leader hand-over, switching trafficRouter from inferencePool left both
    revisions' InferencePools behind. The first sweep of a process looks for every revision's."""
    body = progressive_model()
    body["spec"]["rollout"].update(trafficRouter="inferencePool", steps=[{"weight": 10, "pause": "1h"}, {"weight": 100}])
    rev1, rev2 = await second_revision_ready(cluster, body)
    await until(lambda: (r := route(cluster)) and route_weights(r).get(f"tiny-{rev2}") == 10, "the route at 10% on pools", CANARY_WAIT)
    assert sorted(objects_of(cluster, POOLS)) == sorted([f"tiny-{rev1}", f"tiny-{rev2}"])

    await operator.stop()  # a restart (or a hand-over): the next process knows nothing it applied
    await patch_model("tiny", {"spec": {"rollout": {"trafficRouter": "gatewayAPI"}}})
    await operator.start()
    await until(lambda: (r := route(cluster)) and route_weights(r).get(f"tiny-{rev2}-router") == 10, "the route on Services")
    await until(lambda: not objects_of(cluster, POOLS), "the InferencePools no route names deleted")
    backend = operator.controller.backend
    assert any(key[1] == "tiny" for key in backend._traffic)
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: not any(key[1] == "tiny" for key in (*backend._traffic, *backend._traffic_swept)),
                "what the backend kept of the deleted model forgotten")  # fmt: skip


async def test_a_pool_applied_before_a_foreign_one_blocked_the_switch_is_deleted_when_the_switch_is_reverted(
    cluster: Any, serving: LocalDeployment
) -> None:
    """Outside probe: the traffic objects of a pass were recorded only once all were applied, so
    when a foreign InferencePool refused the second, the first (ours) was never swept. A foreign
    one is never touched, here or anywhere (docs/operator.md, "Foreign objects")."""
    body = progressive_model()
    body["spec"]["rollout"]["steps"] = [{"weight": 10, "pause": "1h"}, {"weight": 100}]
    rev1, rev2 = await second_revision_ready(cluster, body)
    await until(lambda: (r := route(cluster)) and route_weights(r).get(f"tiny-{rev2}-router") == 10, "the route at 10%", CANARY_WAIT)
    ns = route(cluster)["metadata"]["namespace"]  # type: ignore[index]
    foreign = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
               "metadata": {"name": f"tiny-{rev2}", "namespace": ns, "labels": {"team": "someone-else"}},
               "spec": {"selector": {"matchLabels": {"app": "theirs"}}, "targetPorts": [{"number": 9000}]}}  # fmt: skip
    await http("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", foreign)
    await patch_model("tiny", {"spec": {"rollout": {"trafficRouter": "inferencePool"}}})
    await until(lambda: f"tiny-{rev1}" in objects_of(cluster, POOLS), "our pool for rev1 applied before the foreign one refused")
    await until(lambda: any(c["type"] == "Degraded" and c["reason"] == "ForeignObject" for c in status_of(cluster).get("conditions", [])),
                "Degraded: ForeignObject")  # fmt: skip
    await patch_model("tiny", {"spec": {"rollout": {"trafficRouter": "gatewayAPI"}}})
    await until(lambda: f"tiny-{rev1}" not in objects_of(cluster, POOLS), "our rev1 pool deleted once no route names it")
    theirs = json.loads(json.dumps(objects_of(cluster, POOLS)[f"tiny-{rev2}"].raw))
    assert theirs["metadata"]["labels"] == {"team": "someone-else"} and theirs["spec"]["targetPorts"] == [{"number": 9000}]
