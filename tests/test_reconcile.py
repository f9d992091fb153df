"""The pure reconcile: level-based and idempotent; a blocked plan applies nothing (S7, S8)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import yaml

from kvguard.operator.reconcile import DeploymentState, Observed, reconcile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
KEY = b"k" * 32


def body(example: str = "tiny-cpu.yaml") -> dict[str, Any]:
    b = yaml.safe_load((EXAMPLES / example).read_text())
    b["metadata"].update(namespace="ns", uid="u1", generation=3)
    b["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    return b


def ready(rev: str, name: str = "tiny-cpu") -> Observed:
    deployments = [DeploymentState(f"{name}-{rev}-{r}", rev, r, 1, 1) for r in ("prefill", "decode", "router")]
    return Observed(deployments=deployments, revisions_present=frozenset({rev}))


def test_reconcile_is_idempotent_and_promotes_a_ready_revision() -> None:
    first = reconcile(body(), Observed(), now=NOW, transfer_key=KEY)
    rev = first.status["targetRevision"]
    assert first.status["phase"] == "Progressing" and first.status["observedGeneration"] == 3
    b = body()
    b["status"] = first.status
    second = reconcile(b, ready(rev), now=NOW + dt.timedelta(seconds=5), transfer_key=KEY)
    assert second.status["revision"] == rev and second.status["phase"] == "Ready"
    b["status"] = second.status
    third = reconcile(b, ready(rev), now=NOW + dt.timedelta(seconds=60), transfer_key=KEY)
    assert third.status == second.status and third.events == [] and third.delete == []
    assert [m["metadata"]["name"] for m in third.apply] == [m["metadata"]["name"] for m in second.apply]


def test_S7_S8_blocked_plan_applies_and_deletes_nothing() -> None:
    b = body()
    first = reconcile(b, Observed(), now=NOW, transfer_key=KEY)
    b["status"] = reconcile({**b, "status": first.status}, ready(first.status["targetRevision"]), now=NOW, transfer_key=KEY).status
    b["spec"]["kvPoolTokens"] = 1024
    out = reconcile(b, ready(b["status"]["revision"]), now=NOW, transfer_key=KEY)
    assert out.apply == [] and out.create_only == [] and out.delete == []
    assert out.status["phase"] == "Blocked" and out.status["revision"] == b["status"]["revision"]
    assert [e.reason for e in out.events] == ["KVPoolTooSmall"]
    again = reconcile({**b, "status": out.status}, ready(b["status"]["revision"]), now=NOW, transfer_key=KEY)
    assert again.events == []  # one Warning per blocked revision, not one per reconcile


def test_bad_input_is_a_condition_never_an_exception() -> None:
    for spec in ({}, {"contextLength": -1}, {"model": 3}):
        b = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": spec}
        out = reconcile(b, Observed(), now=NOW, transfer_key=KEY)
        assert out.status["phase"] == "Degraded" and out.apply == []
        degraded = next(c for c in out.status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "spec." in degraded["message"]


def test_missing_generation_is_tolerated() -> None:
    b = body()
    del b["metadata"]["generation"]
    assert reconcile(b, Observed(), now=NOW, transfer_key=KEY).status["observedGeneration"] is None
