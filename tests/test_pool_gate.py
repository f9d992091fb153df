"""The readiness gate's rule (operator/pool_gate.py, pure): S7 for as long as a pod serves."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kvguard.operator.pool_gate import (
    CONTEXT_ANNOTATION,
    GATE_CONDITION,
    PAGE_ANNOTATION,
    RATIO_ANNOTATION,
    Move,
    PoolRequirement,
    Verdict,
    condition_patch,
    judge,
    kept_out,
    next_move,
    pod_facts,
    requirement_for,
)

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
LABELS = ("kvguard.io/model", "kvguard.io/revision", "kvguard.io/role")
REQ = PoolRequirement(2.0, 1024)


def pod(*, ready: bool = True, restarts: int = 0, gate: str | None = None, uid: str = "u1", annotations: Any = None) -> dict[str, Any]:
    conditions = [{"type": "ContainersReady", "status": "True" if ready else "False"}]
    if gate is not None:
        conditions.append({"type": GATE_CONDITION, "status": gate})
    return {
        "metadata": {"name": "m-r-decode-x", "namespace": "ns", "uid": uid,
                     "labels": {LABELS[0]: "m", LABELS[1]: "r", LABELS[2]: "decode"},
                     "annotations": {RATIO_ANNOTATION: "2", CONTEXT_ANNOTATION: "1024"} if annotations is None else annotations},
        "spec": {"nodeName": "node-40gb", "readinessGates": [{"conditionType": GATE_CONDITION}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7", "conditions": conditions,
                   "containerStatuses": [{"name": "engine", "restartCount": restarts}]},
    }  # fmt: skip


def test_S7_requirement_is_the_pods_own_revisions_raised_by_policy() -> None:
    facts = pod_facts(pod(), LABELS, 8001)
    assert facts.declared == REQ and facts.metrics_url == "http://10.0.0.7:8001/metrics"
    assert requirement_for(facts, None) == REQ
    assert requirement_for(facts, 3.0) == PoolRequirement(3.0, 1024)
    assert requirement_for(facts, 1.5) == REQ  # a policy never lowers the spec's ratio
    unannotated = pod_facts(pod(annotations={RATIO_ANNOTATION: "nan", CONTEXT_ANNOTATION: "1024"}), LABELS, 8001)
    assert unannotated.declared is None and next_move(unannotated, None, requirement_for(unannotated, None)) is Move.NOTHING


def test_S7_a_too_small_pool_is_judged_false_naming_pod_and_node() -> None:
    facts = pod_facts(pod(), LABELS, 8001)
    small = judge(facts, REQ, 1536, 1024, None, NOW)
    assert not small.verified and small.reason == "KVPoolTooSmall" and small.required == 2048
    assert "m-r-decode-x" in small.message and "node-40gb" in small.message and kept_out([small]) == [small]
    # A worker that admits a longer context than its revision declares is judged by its own.
    longer = judge(facts, REQ, 3000, 2048, None, NOW)
    assert not longer.verified and longer.context_length == 2048
    assert judge(facts, REQ, 2048, 1024, None, NOW).verified


def test_S7_unreadable_pools_are_kept_out_only_after_every_attempt() -> None:
    facts = pod_facts(pod(), LABELS, 8001)
    assert kept_out([judge(facts, REQ, None, None, "connection refused", NOW, 1)]) == []
    assert len(kept_out([judge(facts, REQ, None, None, "connection refused", NOW, 5)])) == 1


def test_S7_a_restarted_container_is_unverified_then_verified_again() -> None:
    good = judge(pod_facts(pod(), LABELS, 8001), REQ, 4096, 1024, None, NOW)
    verdict = Verdict("u1", 0, REQ, good)
    assert next_move(pod_facts(pod(gate="True"), LABELS, 8001), verdict, REQ) is Move.NOTHING
    crashed = pod_facts(pod(ready=False, restarts=1, gate="True"), LABELS, 8001)
    assert next_move(crashed, verdict, REQ) is Move.UNVERIFY
    assert next_move(pod_facts(pod(restarts=1, gate="False"), LABELS, 8001), verdict, REQ) is Move.VERIFY
    # An operator restart knows no verdict: a True gate on a pod that is not ready is taken away.
    assert next_move(crashed, None, REQ) is Move.UNVERIFY
    # Someone else flipped the condition: the remembered verdict is written again.
    assert next_move(pod_facts(pod(gate="False"), LABELS, 8001), verdict, REQ) is Move.PATCH
    # A tighter policy is a new requirement: verify again.
    assert next_move(pod_facts(pod(gate="True"), LABELS, 8001), verdict, PoolRequirement(4.0, 1024)) is Move.VERIFY


def test_S7_the_gate_counts_whole_pages_where_the_page_does_not_divide_the_context() -> None:
    """A review: the gate judged in tokens where the planner and the router count whole pages of
    whole contexts, so a pod between the two passed the gate that the router kept out. The page
    size reaches the gate by annotation, written only where it matters (no template changes, so no
    restarts, for the rest), and on pods of the same spec rendered by the operator."""
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.planner import plan
    from kvguard.operator.render import Owner, render_revision

    paged = pod(annotations={RATIO_ANNOTATION: "2", CONTEXT_ANNOTATION: "1000", PAGE_ANNOTATION: "700"})
    facts = pod_facts(paged, LABELS, 8001)
    assert facts.declared == PoolRequirement(2.0, 1000, 700) and requirement_for(facts, 3.0) == PoolRequirement(3.0, 1000, 700)
    assert not judge(facts, requirement_for(facts, None), 2100, 1000, None, NOW).verified  # 3 pages hold one request of 2
    assert judge(facts, requirement_for(facts, None), 2800, 1000, None, NOW).verified

    def annotations(context: int, page: int) -> dict[str, str]:
        body = {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "m"}, "spec": {
            "model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": "p"}},
                      "architecture": {"numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 2, "headDim": 16, "hiddenSize": 64,
                                       "vocabSize": 320, "dtype": "fp32", "totalParameters": 115008}},
            "pageSize": page, "contextLength": context, "kvPoolTokens": 8 * context, "engine": {"kind": "kvguard"},
            "hardware": {"device": "cpu", "memoryPerDevice": "256Mi"}}}  # fmt: skip
        spec = InferenceModel.model_validate(body).spec
        (decode,) = [o for o in render_revision(spec, plan(spec), Owner("m", "ns", "u"), "r1")
                     if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-decode")]
        return decode["spec"]["template"]["metadata"]["annotations"]

    assert annotations(1000, 16)[PAGE_ANNOTATION] == "16" and PAGE_ANNOTATION not in annotations(1024, 16)


def test_condition_patch_moves_the_transition_time_only_when_the_status_does() -> None:
    good = judge(pod_facts(pod(), LABELS, 8001), REQ, 4096, 1024, None, NOW)
    before = {"type": GATE_CONDITION, "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    (same,) = condition_patch(good, before, NOW)["status"]["conditions"]
    assert same["lastTransitionTime"] == "2025-01-01T00:00:00Z" and same["lastProbeTime"] == "2026-01-01T00:00:00Z"
    bad = judge(pod_facts(pod(), LABELS, 8001), REQ, 100, 1024, None, NOW)
    (moved,) = condition_patch(bad, before, NOW)["status"]["conditions"]
    assert moved["status"] == "False" and moved["lastTransitionTime"] == "2026-01-01T00:00:00Z"
