"""The continuous canary (spec.canary.continuous) on kmock, with the real suite against real processes.

A stable revision "starts leaking" by pointing its endpoints at the incident's build
(`unsafe_reject_path,no_tags`: over-length answered instead of refused), as a node or engine fault
would without any spec change. action alert: Degraded + Event + counter, nothing rolls. action
rollback with a kept revision: kvguard.io/rollback-to is set and the kept revision serves again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from kmock_api import ApiServer
from operator_harness import (
    CANARY_WAIT,
    DEPLOYMENTS,
    IM,
    NS,
    ROUTES,
    apply_model,
    condition,
    events_of,
    mark_ready,
    objects_of,
    patch_model,
    status_of,
    tiny_model,
    until,
)

from kvguard.operator import metrics
from kvguard.operator.rollout import ROLLBACK_ANNOTATION
from kvguard.workers.launcher import LocalDeployment

pytestmark = [pytest.mark.kmock(cls=ApiServer)]
INTERVAL = 10  # the smallest interval the CRD admits
T = TypeVar("T")


def continuous_model(action: str) -> dict[str, Any]:
    body = tiny_model()
    body["spec"]["canary"]["continuous"] = {"intervalSeconds": INTERVAL, "action": action}
    return body


async def stable(cluster: Any, body: dict[str, Any]) -> str:
    await apply_model(body)
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) >= 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("revision") == rev, "stable", CANARY_WAIT)
    return str(rev)


async def ready_until(cluster: Any, revision: str, done: Callable[[], T], what: str) -> T:
    """Play the Deployment controller as the real one does, level-based, until `done()`: the
    operator may write one of the revision's Deployments again after a single mark (under load it
    scaled the router up after prefill and decode, and that write was never marked observed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CANARY_WAIT
    while not (value := done()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {CANARY_WAIT:.0f} s waiting for {what}; status: {status_of(cluster)}")
        await mark_ready(cluster, revision)
        await asyncio.sleep(0.2)
    return value


def last_run(cluster: Any) -> dict[str, Any]:
    return dict((status_of(cluster).get("continuous") or {}).get("lastRun") or {})


async def test_continuous_canary_catches_a_stable_revision_that_starts_leaking(cluster: Any, incident_build: LocalDeployment) -> None:
    rev = await stable(cluster, continuous_model("alert"))
    schedule = await until(lambda: status_of(cluster).get("continuous"), "a continuous schedule")
    assert schedule["revision"] == rev and schedule["intervalSeconds"] == INTERVAL and schedule["action"] == "alert"
    run = await until(lambda: last_run(cluster).get("verdict") and last_run(cluster), "a first continuous run", CANARY_WAIT)
    assert run["verdict"] == "pass" and run["revision"] == rev, run
    assert condition(status_of(cluster), "Degraded")["status"] == "False"
    before = metrics.REGISTRY.get_sample_value("kvguard_operator_continuous_canary_failures_total",
                                               {"namespace": NS, "model": "tiny", "verdict": "fail"}) or 0  # fmt: skip

    ROUTES[rev] = incident_build  # the serving revision now answers over-length prompts (S2 broken)
    run = await until(lambda: last_run(cluster).get("verdict") == "fail" and last_run(cluster), "a failed continuous run", CANARY_WAIT)
    assert "over_length" in run["failedProbes"], run
    status = await until(lambda: condition(status_of(cluster), "Degraded")["status"] == "True" and status_of(cluster), "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "ContinuousCanaryFailed" and rev in degraded["message"] and "over_length" in degraded["message"]
    events = await until(lambda: events_of(cluster, "ContinuousCanaryFailed"), "a Warning Event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "tiny"
    await until(lambda: (metrics.REGISTRY.get_sample_value("kvguard_operator_continuous_canary_failures_total",
                                                           {"namespace": NS, "model": "tiny", "verdict": "fail"}) or 0) >= before + 1,
                "the failure counted (the alert's input)")  # fmt: skip
    # action alert: nothing rolls back by itself (S8: stable keeps serving)
    body = cluster.objects[IM, NS, "tiny"].raw
    assert ROLLBACK_ANNOTATION not in (body["metadata"].get("annotations") or {})
    assert status["revision"] == rev and condition(status, "Ready")["status"] == "True"


async def test_continuous_canary_with_action_rollback_returns_to_the_kept_revision(cluster: Any, incident_build: LocalDeployment) -> None:
    rev1 = await stable(cluster, continuous_model("rollback"))
    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
    await mark_ready(cluster, rev2)
    await until(lambda: status_of(cluster).get("revision") == rev2, "rev2 promoted", CANARY_WAIT)
    await until(lambda: all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n),
                "rev1 kept, scaled to zero")  # fmt: skip

    ROUTES[rev2] = incident_build
    pin = await until(lambda: (status_of(cluster).get("continuous") or {}).get("rollback"), "a rollback decided", CANARY_WAIT)
    assert pin["toRevision"] == rev1 and pin["fromRevision"] == rev2
    await until(lambda: events_of(cluster, "ContinuousCanaryRollback"), "the rollback Event")
    # The operator writes only status: the user's object is not annotated.
    assert ROLLBACK_ANNOTATION not in (cluster.objects[IM, NS, "tiny"].raw["metadata"].get("annotations") or {})
    await until(lambda: any(d["spec"]["replicas"] > 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n), "rev1 scaled up")
    status = await ready_until(cluster, rev1, lambda: status_of(cluster).get("revision") == rev1 and status_of(cluster), "rev1 serving again")
    assert status["rollout"]["rollback"] is True and status["targetRevision"] == rev2
    schedule = await until(lambda: (status_of(cluster).get("continuous") or {}).get("revision") == rev1 and status_of(cluster)["continuous"],
                           "a new schedule for the revision that serves now")  # fmt: skip
    assert schedule["rollback"]["toRevision"] == rev1  # held: rev2 is not rolled out again until the spec changes
