"""Readiness as `kubectl rollout status` judges it, and which pods an S7 scrape may read."""

from __future__ import annotations

from typing import Any

from kvguard.operator.workloads import deployment_state, model_revision_of, pod_is_serving, revision_views, secrets_missing


def deployment(role: str = "decode", wanted: int = 2, generation: int = 3, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"m-r-{role}", "generation": generation, "labels": {"kvguard.io/revision": "r", "kvguard.io/role": role}},
            "spec": {"replicas": wanted}, "status": status}  # fmt: skip


def test_ready_only_when_the_latest_spec_runs_on_every_replica_and_nothing_old_is_left() -> None:
    done = dict(observedGeneration=3, replicas=2, updatedReplicas=2, readyReplicas=2)
    assert deployment_state(deployment(**done)).is_ready
    stale = deployment_state(deployment(**{**done, "observedGeneration": 2}))  # the controller has not seen the new spec
    assert not stale.is_ready and "not yet observed" in (stale.waiting() or "")
    rolling = deployment_state(deployment(**{**done, "updatedReplicas": 1}))  # ready, but one runs the old spec
    assert not rolling.is_ready and "1/2 updated" in (rolling.waiting() or "")
    leftover = deployment_state(deployment(**{**done, "replicas": 3}))  # an old replica still terminating
    assert not leftover.is_ready and "terminating" in (leftover.waiting() or "")
    assert not deployment_state(deployment(**{**done, "readyReplicas": 1})).is_ready


def test_scaled_to_zero_only_once_no_pod_is_left() -> None:
    going = deployment_state(deployment(wanted=0, observedGeneration=3, replicas=1, readyReplicas=1))
    assert not going.at_zero
    gone = deployment_state(deployment(wanted=0, observedGeneration=3))
    assert gone.at_zero
    assert revision_views([gone])["r"].scaled_to_zero and not revision_views([going])["r"].scaled_to_zero


def pod(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "p"}, "status": {"phase": "Running", "podIP": "10.0.0.1",
                                                                    "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    for key, value in changes.items():
        body["metadata" if key == "deletionTimestamp" else "status"][key] = value
    return body


def test_s7_scrapes_only_running_ready_pods_that_are_not_terminating() -> None:
    assert pod_is_serving(pod())
    assert not pod_is_serving(pod(deletionTimestamp="2026-01-01T00:00:00Z"))
    assert not pod_is_serving(pod(conditions=[{"type": "Ready", "status": "False"}]))
    assert not pod_is_serving(pod(phase="Pending"))
    assert not pod_is_serving(pod(podIP=None))


def test_S3_the_secrets_a_pod_waits_for_are_read_from_the_kubelets_config_error() -> None:
    def pod(*statuses: tuple[str, str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
        containers = [{"name": name, "state": {"waiting": {"reason": reason, "message": message}}} for name, reason, message in statuses]
        return {"metadata": {"namespace": "ns", "labels": labels or {}},
                "status": {"initContainerStatuses": containers[:1], "containerStatuses": containers[1:]}}  # fmt: skip

    waiting = pod(("init", "CreateContainerConfigError", 'secret "m-r1-kv-transfer-0a1b2c3d" not found'),
                  ("engine", "CreateContainerConfigError", 'secrets "other" not found'),
                  ("side", "ImagePullBackOff", 'secret "pull" not found'),  # another reason: not a config error
                  ("more", "CreateContainerConfigError", "couldn't find key key in Secret ns/present"))  # fmt: skip
    assert secrets_missing(waiting) == {"m-r1-kv-transfer-0a1b2c3d", "other"}
    assert secrets_missing({"status": {"containerStatuses": [{"name": "engine", "state": {"running": {}}}]}}) == set()
    assert secrets_missing({}) == set()
    labelled = pod(labels={"kvguard.io/model": "m", "kvguard.io/revision": "r1"})
    assert model_revision_of(labelled) == ("ns", "m", "r1") and model_revision_of(pod()) is None
