"""The pure reconcile: level-based and idempotent; a blocked plan applies nothing (S7, S8).

The canary gate itself is tested in test_rollout.py; here it is fed a passing canary result."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import yaml

from kvguard.operator.api import InferenceModelSpec, InferencePolicy
from kvguard.operator.reconcile import FAULTS_ANNOTATION, DeploymentState, Observed, deployment_state, reconcile, revision_views
from kvguard.operator.render import SCALE_ANNOTATION
from kvguard.operator.revision import revision_of
from kvguard.operator.rollout import CanaryResult, DeployRevision, RouteTraffic, RunCanary, WorkerReport

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
POOLS = (WorkerReport("p", "prefill", 4096, 1024), WorkerReport("d", "decode", 4096, 1024))


def body(example: str = "tiny-cpu.yaml") -> dict[str, Any]:
    b = yaml.safe_load((EXAMPLES / example).read_text())
    b["metadata"].update(namespace="ns", uid="u1", generation=3)
    b["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    return b


def ready(rev: str, name: str = "tiny-cpu", **kwargs: object) -> Observed:
    deployments = [DeploymentState(f"{name}-{rev}-{r}", rev, r, 1, 1) for r in ("prefill", "decode", "router")]
    return Observed(revisions=revision_views(deployments), **kwargs)  # type: ignore[arg-type]


def promote(b: dict[str, Any]) -> dict[str, Any]:
    """Drive the first rollout to Stable: deploy, scrape (reports), canary passes."""
    first = reconcile(b, Observed(), now=NOW)
    rev = first.status["targetRevision"]
    assert first.status["phase"] == "Progressing" and first.status["observedGeneration"] == 3
    assert DeployRevision(rev) in first.actions and not any(isinstance(a, RouteTraffic) for a in first.actions)
    b["status"] = first.status
    verifying = reconcile(b, ready(rev), now=NOW)
    assert verifying.scrape == rev and verifying.requeue_after == 0  # scraped before the next pass, at once
    b["status"] = verifying.status
    verifying = reconcile(b, ready(rev, worker_reports=POOLS), now=NOW)
    assert verifying.status["canary"] == "Running" and verifying.status["revision"] is None
    b["status"] = verifying.status
    (run,) = [a for a in verifying.actions if isinstance(a, RunCanary)]  # the runner's result carries its key
    second = reconcile(b, ready(rev, canary=CanaryResult(rev, run.attempt, "pass", "7 probe(s) passed")), now=NOW + dt.timedelta(seconds=5))
    assert second.status["revision"] == rev and second.status["phase"] == "Ready" and second.status["canary"] == "Passed"
    assert RouteTraffic(rev) in second.actions
    b["status"] = second.status
    return b


def test_reconcile_is_idempotent_and_promotes_only_after_the_canary() -> None:
    b = promote(body())
    rev = b["status"]["revision"]
    third = reconcile(b, ready(rev, serving=rev), now=NOW + dt.timedelta(seconds=60))
    assert third.status == b["status"] and third.events == []
    assert third.actions == [DeployRevision(rev), RouteTraffic(rev)]


def test_S7_S8_blocked_plan_applies_and_deletes_nothing() -> None:
    b = promote(body())
    b["spec"]["kvPoolTokens"] = 1024
    out = reconcile(b, ready(b["status"]["revision"]), now=NOW)
    assert out.actions == []
    assert out.status["phase"] == "Blocked" and out.status["revision"] == b["status"]["revision"]
    assert [e.reason for e in out.events] == ["KVPoolTooSmall"]
    again = reconcile({**b, "status": out.status}, ready(b["status"]["revision"]), now=NOW)
    assert again.events == []  # one Warning per blocked revision, not one per reconcile


def _deploying_a_candidate() -> tuple[dict[str, Any], str, Any, str]:
    """A promoted model whose changed spec is deploying a candidate: (its body, the stable
    revision, the pass that started the candidate, the candidate)."""
    b = promote(body())
    stable = b["status"]["revision"]
    changed = body()
    changed["spec"]["contextLength"] = 512
    changed["status"] = b["status"]
    deploying = reconcile(changed, ready(stable, serving=stable), now=NOW + dt.timedelta(seconds=60))
    candidate = deploying.status["targetRevision"]
    assert candidate != stable and deploying.status["history"][0]["state"] == "Candidate"
    return b, stable, deploying, candidate


def test_a_spec_back_at_the_stable_revision_mid_canary_supersedes_the_candidate() -> None:
    """Outside probe (apply, interrupted apply of a changed spec, apply of the first spec again):
    the candidate read Candidate in history and CanaryPassed spoke of its deployment for ever."""
    b, stable, deploying, candidate = _deploying_a_candidate()
    back = reconcile({**b, "status": deploying.status}, ready(stable, serving=stable), now=NOW + dt.timedelta(seconds=90))
    assert back.status["phase"] == "Ready" and back.status["revision"] == stable and back.status["canary"] == "Passed"
    history = [(h["revision"], h["state"]) for h in back.status["history"]]
    assert history[:2] == [(candidate, "Superseded"), (stable, "Stable")]
    assert back.status["history"][0]["message"] == f"replaced by {stable} before it served"
    passed = next(c for c in back.status["conditions"] if c["type"] == "CanaryPassed")
    assert (passed["status"], passed["reason"]) == ("True", "StableRevision") and candidate not in passed["message"]


def test_a_blocked_spec_mid_canary_supersedes_the_candidate() -> None:
    """Outside probe: a spec whose pool is too small replaced a deploying candidate; its
    Deployments went, but history read [blocked Blocked, candidate Candidate] for ever (the
    Blocked entry was recorded first, and only the newest entry was looked at)."""
    _, stable, deploying, candidate = _deploying_a_candidate()
    blocked_spec = body()
    blocked_spec["spec"]["kvPoolTokens"] = 1024
    blocked = reconcile({**blocked_spec, "status": deploying.status}, ready(stable, serving=stable), now=NOW + dt.timedelta(seconds=90))
    assert blocked.status["phase"] == "Blocked" and blocked.status["revision"] == stable
    history = [(h["revision"], h["state"]) for h in blocked.status["history"]]
    blocked_revision = history[0][0]
    assert history == [(blocked_revision, "Blocked"), (candidate, "Superseded"), (stable, "Stable")]
    assert blocked.status["history"][1]["message"] == f"replaced by {blocked_revision} before it served"
    assert [e.reason for e in blocked.events].count("KVPoolTooSmall") == 1
    again = reconcile({**blocked_spec, "status": blocked.status}, ready(stable, serving=stable), now=NOW + dt.timedelta(seconds=120))
    assert again.status["history"] == blocked.status["history"] and again.events == []  # one Warning per blocked revision


def test_every_condition_speaks_for_the_generation_a_pass_judged() -> None:
    """Outside probe: during the rollout of generation 4, Degraded (False, AsExpected) still said
    observedGeneration 3, which metav1 tools read as out of date. A condition a pass leaves as it
    was holds for the spec it judged: its generation moves, its transition time does not."""
    b = promote(body())
    before = {c["type"]: c for c in b["status"]["conditions"]}
    changed = body()
    changed["metadata"]["generation"] = 4
    changed["spec"]["contextLength"] = 512
    changed["status"] = b["status"]
    out = reconcile(changed, ready(b["status"]["revision"], serving=b["status"]["revision"]), now=NOW + dt.timedelta(seconds=60))
    assert out.status["observedGeneration"] == 4
    assert {c["type"]: c["observedGeneration"] for c in out.status["conditions"]} == dict.fromkeys(before, 4)
    degraded = next(c for c in out.status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False" and degraded["lastTransitionTime"] == before["Degraded"]["lastTransitionTime"]


def test_bad_input_is_a_condition_never_an_exception() -> None:
    for spec in ({}, {"contextLength": -1}, {"model": 3}):
        b = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": spec}
        out = reconcile(b, Observed(), now=NOW)
        assert out.status["phase"] == "Degraded" and out.actions == []
        degraded = next(c for c in out.status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "spec." in degraded["message"]


def test_missing_generation_is_tolerated() -> None:
    b = body()
    del b["metadata"]["generation"]
    assert reconcile(b, Observed(), now=NOW).status["observedGeneration"] is None


def test_fault_annotation_is_honoured_only_when_the_operator_allows_fault_injection() -> None:
    b = body()
    b["metadata"]["annotations"] = {FAULTS_ANNOTATION: "unsafe_reject_path,no_tags"}
    clean = revision_of(InferenceModelSpec.model_validate(b["spec"]))

    ignored = reconcile(b, Observed(), now=NOW)
    assert ignored.revision == clean and ignored.faults == ""
    assert [e.reason for e in ignored.events if e.type == "Warning"] == ["FaultInjectionIgnored"]

    allowed = reconcile(b, Observed(fault_injection_allowed=True), now=NOW)
    assert allowed.faults == "unsafe_reject_path,no_tags"
    assert allowed.revision not in (None, clean)  # a faulty build is its own revision, never patched in place
    assert "FaultInjection" in [e.reason for e in allowed.events]
    b["status"] = allowed.status
    assert reconcile(b, Observed(fault_injection_allowed=True), now=NOW).events == []  # said once per revision

    b["metadata"]["annotations"] = {FAULTS_ANNOTATION: "corrupt_chunk=2"}
    bad = reconcile(b, Observed(fault_injection_allowed=True), now=NOW)
    assert bad.actions == [] and bad.status["phase"] == "Degraded"
    assert f"metadata.annotations[{FAULTS_ANNOTATION}]" in bad.status["message"]


def test_canary_scale_is_read_back_from_the_deployments() -> None:
    states = [DeploymentState(f"m-r-{r}", "r", r, 1, 1, scale="canary" if r == "decode" else "full") for r in ("prefill", "decode", "router")]
    assert revision_views(states)["r"].scale == "canary"
    assert deployment_state({"metadata": {"annotations": {SCALE_ANNOTATION: "canary"}}, "spec": {"replicas": 1}}).scale == "canary"
    assert deployment_state({"metadata": {}, "spec": {"replicas": 1}}).scale == "full"


TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 320,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip


def from_config_map(b: dict[str, Any]) -> dict[str, Any]:
    del b["spec"]["model"]["architecture"]
    b["spec"]["model"]["architectureConfigMap"] = {"name": "tiny-config"}
    return b


def test_policy_is_evaluated_on_the_resolved_spec_and_the_rendered_command_lines() -> None:
    """An architecture from a ConfigMap is planned and rendered before policy: a required flag that
    the renderer puts on the command line is there (before, only engine.extraArgs was checked)."""
    policy = InferencePolicy.model_validate({"metadata": {"name": "flags"}, "spec": {
        "requiredEngineFlags": [{"engine": "kvguard", "flags": ["--kv-pool-tokens", "--page-size"]}]}})  # fmt: skip
    b = from_config_map(body())
    out = reconcile(b, Observed(architecture_config=TINY_HF_CONFIG, policies=(policy,)), now=NOW)
    compliant = next(c for c in out.status["conditions"] if c["type"] == "PolicyCompliant")
    assert compliant["status"] == "True", compliant["message"]
    assert out.rendered is not None and "--kv-pool-tokens" in out.rendered.worker_commands()["decode"]
    strict = InferencePolicy.model_validate({"metadata": {"name": "strict"}, "spec": {
        "requiredEngineFlags": [{"engine": "kvguard", "flags": ["--no-such-flag"]}]}})  # fmt: skip
    blocked = reconcile(b, Observed(architecture_config=TINY_HF_CONFIG, policies=(strict,)), now=NOW)
    violation = next(c for c in blocked.status["conditions"] if c["type"] == "PolicyCompliant")
    assert violation["status"] == "False" and "spec.engine.extraArgs: --no-such-flag" in violation["message"]
    assert blocked.status["phase"] == "Blocked" and not [a for a in blocked.actions if isinstance(a, DeployRevision)]


def test_a_foreign_object_blocks_by_name_and_is_looked_at_again() -> None:
    b = promote(body())
    out = reconcile(b, ready(b["status"]["revision"], foreign_objects=("Deployment ns/tiny-cpu-x-decode exists ...",)), now=NOW)
    degraded = next(c for c in out.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ForeignObject" and "Deployment ns/tiny-cpu-x-decode" in degraded["message"]
    assert out.actions == [] and out.requeue_after and out.status["revision"] == b["status"]["revision"]  # S8
    # The spec is fine: no condition sends anyone to it (an outside probe read "until the spec is fixed").
    messages = {c["type"]: c["message"] for c in out.status["conditions"]}
    assert not any("spec" in messages[t] for t in ("KVPoolSufficient", "PolicyCompliant", "Progressing")), messages
    assert messages["Progressing"] == "rollout halted until the object in the way is gone"


def test_a_waiting_rollout_says_when_its_deadline_falls() -> None:
    b = body()
    b["spec"]["rollout"] = {"progressDeadlineSeconds": 120}
    first = reconcile(b, Observed(), now=NOW)
    assert first.requeue_after and first.deadline_in == 120
    b["status"] = first.status
    later = reconcile(b, Observed(), now=NOW + dt.timedelta(seconds=100))
    assert later.deadline_in == 20
    failed = reconcile(b, Observed(), now=NOW + dt.timedelta(seconds=121))
    assert failed.status["rollout"]["state"] in ("Failed", "RolledBack") and "progressDeadlineSeconds" in failed.status["rollout"]["message"]


def test_the_architecture_configmap_cache_keeps_data_for_its_ttl_and_drops_what_expired() -> None:
    """Entries were only ever replaced: a tenant naming many 1 MiB ConfigMaps (then deleting them)
    grew the operator without bound (outside probe)."""
    from kvguard.operator.controller import ConfigMapCache

    cache = ConfigMapCache(ttl=300)
    kept = cache.put(("ns", "a"), {"metadata": {"managedFields": ["x" * 1000]}, "data": {"config.json": "{}"}}, now=0)
    assert kept == {"data": {"config.json": "{}"}} and cache.get(("ns", "a"), now=300) == kept
    assert cache.get(("ns", "a"), now=301) is None
    for i in range(100):
        cache.put(("ns", f"m{i}"), {"data": {}}, now=1000 + i)
    assert len(cache) == 100  # "a" expired: dropped when the first of these came
    cache.put(("ns", "late"), {"data": {}}, now=1500)
    assert len(cache) == 1 + sum(1 for i in range(100) if 1500 - (1000 + i) <= 300)


def test_an_architecture_config_nested_deeper_than_python_parses_is_a_field_error_not_a_traceback() -> None:
    from kvguard.operator.controller import parse_config_json

    config, error = parse_config_json({"data": {"config.json": "[" * 100_000 + "]" * 100_000}}, "deep", "config.json")
    assert config is None and error is not None and error.startswith("config.json is not JSON")


def test_the_canary_column_speaks_of_a_target_paused_before_its_rollout() -> None:
    """A review: with a new spec paused before its rollout started, the printer column's
    `status.canary` said the earlier revision's "Passed" while CanaryPassed said Unknown."""
    b = promote(body())
    rev = b["status"]["revision"]
    b["metadata"]["annotations"] = {"kvguard.io/pause": "true"}
    b["spec"]["contextLength"] = 512  # a new revision
    paused = reconcile(b, ready(rev, serving=rev), now=NOW + dt.timedelta(seconds=60))
    assert paused.status["targetRevision"] != rev and paused.status["rollout"]["revision"] == rev
    assert paused.status["canary"] == "NotRun"
    canary = next(c for c in paused.status["conditions"] if c["type"] == "CanaryPassed")
    assert (canary["status"], canary["reason"]) == ("Unknown", "CanaryNotRun")


def test_a_step_failed_while_paused_is_history_at_once_and_stays_so_through_a_spec_change() -> None:
    """A review: a candidate that failed while its traffic step was paused was written to history
    only at the resume, and a spec set back to the stable revision first recorded it Superseded
    "before it served" (it had served 10%, and failed)."""
    from kvguard.operator.rollout import CanarySummary, RolloutState, RolloutStatus

    _, stable, deploying, candidate = _deploying_a_candidate()
    paused = body()
    paused["spec"]["contextLength"] = 512
    paused["spec"]["rollout"] = {"trafficRouter": "gatewayAPI", "gateway": {"parentRefs": [{"name": "gw"}]},
                                 "steps": [{"weight": 10, "pause": 600}, {"weight": 100}]}
    paused["metadata"].setdefault("annotations", {})["kvguard.io/pause"] = "true"
    at = "2026-01-01T00:05:00Z"
    rollout = RolloutStatus(state=RolloutState.PAUSED, paused_from=RolloutState.SHIFTING, paused_reason="TrafficStep",
                            paused_message="m", revision=candidate, baseline=stable, step=0, weight=10, step_since=at,
                            analysis_at=at, canary=CanarySummary(revision=candidate, attempt="", verdict="pass", reason="ok"))
    paused["status"] = {**deploying.status, "rollout": rollout.model_dump(mode="json", by_alias=True, exclude_none=True)}
    deployments = [DeploymentState(f"tiny-cpu-{stable}-{r}", stable, r, 1, 1) for r in ("prefill", "decode", "router")]
    deployments += [DeploymentState(f"tiny-cpu-{candidate}-{r}", candidate, r, 1, 0) for r in ("prefill", "decode", "router")]
    seen = Observed(revisions=revision_views(deployments), serving=stable)
    failed = reconcile(paused, seen, now=NOW + dt.timedelta(seconds=400))
    assert "CandidateNotReady" in [e.reason for e in failed.events]
    assert (failed.status["history"][0]["revision"], failed.status["history"][0]["state"]) == (candidate, "Failed")
    back = body()  # the first spec again (the stable revision), the pause removed
    back["status"] = failed.status
    resumed = reconcile(back, seen, now=NOW + dt.timedelta(seconds=500))
    entries = [(h["revision"], h["state"], h.get("message") or "") for h in resumed.status["history"]]
    assert (candidate, "Failed") in [(r, s) for r, s, _ in entries]
    assert not any(r == candidate and "before it served" in m for r, s, m in entries), entries
