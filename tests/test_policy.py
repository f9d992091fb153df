"""The pure InferencePolicy evaluator: one table row per rule, scope, combination (S7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvguard.operator import engine_flags
from kvguard.operator.api import EngineKind, InferenceModel, InferenceModelSpec, InferencePolicy
from kvguard.operator.planner import flag_check_plan
from kvguard.operator.policy import (
    PolicyVerdict,
    applies_to,
    describe_violations,
    evaluate,
    required_flag_problem,
    version_at_least,
    version_key,
)
from kvguard.operator.render import ADAPTERS, Owner, RoleContext, with_stand_in_source

ROOT = Path(__file__).resolve().parent.parent


def tiny_spec(**changes: Any) -> InferenceModelSpec:
    """The sample tiny CPU model (kvguard engine, pool 4,096 tokens = 4x context 1,024)."""
    data = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())["spec"]
    data.update(changes)
    return InferenceModel.model_validate({"metadata": {"name": "m"}, "spec": data}).spec


def sglang_spec(**engine: Any) -> InferenceModelSpec:
    data = yaml.safe_load((ROOT / "examples/llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    data["engine"] = {"kind": "sglang", **engine}
    return InferenceModelSpec.model_validate(data)


def policy(name: str = "p", **spec: Any) -> InferencePolicy:
    return InferencePolicy.model_validate({"metadata": {"name": name}, "spec": spec})


def rules_and_fields(verdict: PolicyVerdict) -> set[tuple[str, str]]:
    return {(v.rule, v.field) for v in verdict.violations}


def test_no_policies_is_compliant() -> None:
    verdict = evaluate(tiny_spec(), "ns", [])
    assert verdict.compliant and verdict.violations == [] and verdict.policies == []


def default_policy() -> InferencePolicy:
    return InferencePolicy.model_validate(yaml.safe_load((ROOT / "manifests/samples/inferencepolicy-default.yaml").read_text()))


def test_the_shipped_default_policy_admits_the_tiny_sample() -> None:
    assert evaluate(tiny_spec(), "ns", [default_policy()]).compliant


def test_the_shipped_default_policy_refuses_an_old_sglang_without_kv_checksums() -> None:
    verdict = evaluate(sglang_spec(version="0.5.4"), "ns", [default_policy()])
    assert {"minEngineVersions", "requireKVIntegrity"} <= {v.rule for v in verdict.violations}
    fixed = sglang_spec(version="0.5.22", extraArgs=["--disaggregation-enable-kv-checksum"])
    assert evaluate(fixed, "ns", [default_policy()]).compliant, describe_violations(evaluate(fixed, "ns", [default_policy()]).violations)


@pytest.mark.parametrize(
    ("spec_changes", "rules", "expected"),
    [
        # S7 minKVRatio: the declared floor, and the planned pools (4,096 tokens = 4x context 1,024).
        ({"minKVRatio": 1.5}, {"minKVRatio": 2.0}, {("minKVRatio", "spec.minKVRatio")}),
        ({"minKVRatio": 2.0}, {"minKVRatio": 2.0}, set()),
        ({"minKVRatio": 4.5}, {"minKVRatio": 4.5},
         {("minKVRatio", "spec.roles.prefill"), ("minKVRatio", "spec.roles.decode")}),
        ({"minKVRatio": 4.0}, {"minKVRatio": 4.0}, set()),  # exactly 4x passes
        # maxContextLength
        ({}, {"maxContextLength": 1024}, set()),
        ({}, {"maxContextLength": 1023}, {("maxContextLength", "spec.contextLength")}),
        # minEngineVersions: unset, older, newer, another engine's minimum, an unreadable version
        ({}, {"minEngineVersions": {"kvguard": "0.1.0"}}, {("minEngineVersions", "spec.engine.version")}),
        ({"engine": {"kind": "kvguard", "version": "0.1.0"}}, {"minEngineVersions": {"kvguard": "0.1.1"}},
         {("minEngineVersions", "spec.engine.version")}),
        ({"engine": {"kind": "kvguard", "version": "0.10.0"}}, {"minEngineVersions": {"kvguard": "0.9"}}, set()),
        ({}, {"minEngineVersions": {"sglang": "0.5.22"}}, set()),
        ({"engine": {"kind": "kvguard", "version": "latest"}}, {"minEngineVersions": {"kvguard": "0.1"}},
         {("minEngineVersions", "spec.engine.version")}),
        # requiredCanaryProbes: enabled, disabled, named in another spelling, unknown to the suite
        ({}, {"requiredCanaryProbes": ["isolation", "over_length"]}, set()),
        ({"canary": {"isolation": {"enabled": False}}}, {"requiredCanaryProbes": ["isolation"]},
         {("requiredCanaryProbes", "spec.canary.isolation.enabled")}),
        ({"canary": {"overLength": {"enabled": False}}}, {"requiredCanaryProbes": ["overLength"]},
         {("requiredCanaryProbes", "spec.canary.overLength.enabled")}),
        ({"canary": {"safetyCounters": {"enabled": False}}}, {"requiredCanaryProbes": ["safety-counters"]},
         {("requiredCanaryProbes", "spec.canary.safetyCounters.enabled")}),
        ({}, {"requiredCanaryProbes": ["telepathy"]}, {("requiredCanaryProbes", "spec.canary")}),
        # requireKVIntegrity: kvguard's tags and checksums have no off switch in the spec (S1, S3)
        ({}, {"requireKVIntegrity": True}, set()),
        # requiredEngineFlags for another engine do not apply
        ({}, {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--enable-metrics"]}]}, set()),
    ],
)  # fmt: skip
def test_each_rule_on_the_tiny_model(spec_changes: dict[str, Any], rules: dict[str, Any], expected: set[tuple[str, str]]) -> None:
    verdict = evaluate(tiny_spec(**spec_changes), "ns", [policy(**rules)])
    assert rules_and_fields(verdict) == expected
    assert verdict.compliant is (not expected)


@pytest.mark.parametrize(
    ("engine", "rules", "expected"),
    [
        # --enable-metrics is rendered by the SGLang adapter itself: on the command line without extraArgs.
        ({}, {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--enable-metrics"]}]}, set()),
        ({}, {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--enable-hierarchical-cache"]}]},
         {("requiredEngineFlags", "spec.engine.extraArgs")}),
        ({"extraArgs": ["--enable-hierarchical-cache"]},
         {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--enable-hierarchical-cache"]}]}, set()),
        ({"extraArgs": ["--schedule-policy=lpm"]},
         {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--schedule-policy"]}]}, set()),
        ({"extraArgs": ["--schedule-policy=fcfs"]},
         {"requiredEngineFlags": [{"engine": "sglang", "flags": ["--schedule-policy=lpm"]}]},
         {("requiredEngineFlags", "spec.engine.extraArgs")}),
        # S3: SGLang's KV checksum is opt-in, and only checked when both roles have it.
        ({}, {"requireKVIntegrity": True}, {("requireKVIntegrity", "spec.kvTransfer.checksum")}),
        ({"extraArgs": ["--disaggregation-enable-kv-checksum"]}, {"requireKVIntegrity": True}, set()),
        # The example: SGLang >= 0.5.22 carries the upstream fixes.
        ({"version": "0.5.4"}, {"minEngineVersions": {"sglang": "0.5.22"}}, {("minEngineVersions", "spec.engine.version")}),
        ({"version": "0.5.22rc1"}, {"minEngineVersions": {"sglang": "0.5.22"}}, {("minEngineVersions", "spec.engine.version")}),
        ({"version": "v0.5.22"}, {"minEngineVersions": {"sglang": "0.5.22"}}, set()),
        ({"version": "0.5.22.post1"}, {"minEngineVersions": {"sglang": "0.5.22"}}, set()),
    ],
)  # fmt: skip
def test_engine_rules_on_sglang(engine: dict[str, Any], rules: dict[str, Any], expected: set[tuple[str, str]]) -> None:
    assert rules_and_fields(evaluate(sglang_spec(**engine), "ns", [policy(**rules)])) == expected


def test_vllm_cannot_satisfy_kv_integrity() -> None:
    data = sglang_spec().model_dump(by_alias=True)
    data["engine"] = {"kind": "vllm"}
    verdict = evaluate(InferenceModelSpec.model_validate(data), "ns", [policy(requireKVIntegrity=True)])
    assert rules_and_fields(verdict) == {("requireKVIntegrity", "spec.engine.kind")}


def test_the_checksum_flag_on_both_roles_is_required_message_names_them() -> None:
    verdict = evaluate(sglang_spec(), "ns", [policy(requireKVIntegrity=True)])
    assert "prefill, decode" in verdict.violations[0].message


def test_an_unplannable_spec_is_a_violation_naming_the_planner_field() -> None:
    spec = tiny_spec(roles={"decode": {"tensorParallel": 3}})  # 3 does not divide 2 KV heads
    verdict = evaluate(spec, "ns", [policy()])
    assert [(v.rule, v.field) for v in verdict.violations] == [("minKVRatio", "spec.roles.decode.tensorParallel")]


def test_architecture_from_a_configmap_defers_the_pool_check_to_reconcile() -> None:
    data = tiny_spec(minKVRatio=5.0).model_dump(by_alias=True, exclude_none=True)  # the pool is 4x: unplannable here
    del data["model"]["architecture"]
    data["model"]["architectureConfigMap"] = {"name": "tiny-config"}
    spec = InferenceModelSpec.model_validate(data)
    assert evaluate(spec, "ns", [policy(minKVRatio=5.0)]).compliant
    assert rules_and_fields(evaluate(spec, "ns", [policy(minKVRatio=5.0, maxContextLength=512)])) == {
        ("maxContextLength", "spec.contextLength")
    }


def test_a_ratio_just_below_the_minimum_does_not_read_as_equal_to_it() -> None:
    """Outside probe: 1.9999999999999998 under a minimum of 2 read "2 is below the policy's minimum 2"."""
    (violation,) = evaluate(tiny_spec(minKVRatio=1.9999999999999998), "ns", [policy(minKVRatio=2.0)]).violations
    assert violation.message.startswith("1.9999999999999998 is below the policy's minimum 2")


def _from_a_configmap(spec: InferenceModelSpec) -> InferenceModelSpec:
    data = spec.model_dump(by_alias=True, exclude_none=True)
    del data["model"]["architecture"]
    data["model"]["architectureConfigMap"] = {"name": "config"}
    return InferenceModelSpec.model_validate(data)


def test_flag_rules_read_the_rendered_command_lines_without_a_plan_too() -> None:
    """Outside probe: with the architecture in a ConfigMap, the flag rules read engine.extraArgs
    alone -- a compliant kvTransfer.checksum was refused, and a role's own extraArgs turning the
    KV canary off got through."""
    checked = _from_a_configmap(sglang_spec(image="lmsysorg/sglang:v0.5.22").model_copy(
        update={"kv_transfer": sglang_spec().kv_transfer.model_copy(update={"checksum": True})}))  # fmt: skip
    assert evaluate(checked, "ns", [policy(requireKVIntegrity=True)]).compliant
    data = sglang_spec(image="lmsysorg/sglang:v0.5.22", extraArgs=["--kv-canary", "raise"]).model_dump(by_alias=True, exclude_none=True)
    data["roles"]["decode"]["extraArgs"] = ["--kv-canary", "none"]
    bypass = _from_a_configmap(InferenceModelSpec.model_validate(data))
    assert not evaluate(bypass, "ns", [policy(sglangKVCanary="raise")]).compliant


def test_a_precomputed_plan_is_used_instead_of_planning_again() -> None:
    from kvguard.operator.planner import plan

    spec = tiny_spec()
    kv_plan = plan(spec).model_copy(deep=True)
    kv_plan.roles["decode"].pool_tokens = 1024  # as if decode's pool were 1x context
    verdict = evaluate(spec, "ns", [policy()], kv_plan=kv_plan)
    assert rules_and_fields(verdict) == {("minKVRatio", "spec.roles.decode")}


def test_several_policies_all_must_pass_and_each_violation_names_its_policy() -> None:
    policies = [policy("zeta", maxContextLength=512), policy("alpha", minKVRatio=3.0), policy("ok")]
    verdict = evaluate(tiny_spec(), "ns", policies)
    assert not verdict.compliant
    assert [(v.policy, v.rule) for v in verdict.violations] == [("alpha", "minKVRatio"), ("zeta", "maxContextLength")]
    assert verdict.policies == ["alpha", "ok", "zeta"]


@pytest.mark.parametrize(
    ("scope", "namespace", "labels", "applies"),
    [
        ({}, "anything", None, True),
        ({"namespaces": ["prod", "staging"]}, "prod", None, True),
        ({"namespaces": ["prod", "staging"]}, "dev", None, False),
        ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prod"}}}, "prod", None, True),
        ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prod"}}}, "dev", None, False),
        ({"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]}}, "kube-system", None, False),
        # Labels the operator cannot see: the policy applies (fail closed)...
        ({"namespaceSelector": {"matchLabels": {"env": "prod"}}}, "dev", None, True),
        # ...unless the caller knows the labels.
        ({"namespaceSelector": {"matchLabels": {"env": "prod"}}}, "dev", {"env": "dev"}, False),
        ({"namespaceSelector": {"matchLabels": {"env": "prod"}}}, "x", {"env": "prod"}, True),
        ({"namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "Exists"}]}}, "x", {}, False),
        ({"namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "DoesNotExist"}]}}, "x", {}, True),
        ({"namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "In", "values": ["a", "b"]}]}},
         "x", {"env": "b"}, True),
        ({"namespaces": ["prod"], "namespaceSelector": {"matchLabels": {"env": "prod"}}}, "prod", {"env": "dev"}, False),
    ],
)  # fmt: skip
def test_namespace_scope(scope: dict[str, Any], namespace: str, labels: dict[str, str] | None, applies: bool) -> None:
    assert applies_to(policy(**scope), namespace, labels) is applies


def test_a_policy_out_of_scope_is_not_evaluated() -> None:
    verdict = evaluate(tiny_spec(), "dev", [policy(namespaces=["prod"], maxContextLength=1)])
    assert verdict.compliant and verdict.policies == []


def test_describe_violations_names_field_rule_and_policy() -> None:
    verdict = evaluate(tiny_spec(minKVRatio=1.5), "ns", [policy("default", minKVRatio=2.0)])
    text = describe_violations(verdict.violations)
    assert text == "spec.minKVRatio: 1.5 is below the policy's minimum 2 (InferencePolicy default, rule minKVRatio)"


@pytest.mark.parametrize(
    ("older", "newer"),
    [("0.5.4", "0.5.22"), ("0.5.22rc1", "0.5.22"), ("0.5.22.dev3", "0.5.22a1"), ("0.5.22", "0.5.22.post1"),
     ("0.9.9", "0.10"), ("v0.11.0", "0.11.1"), ("1.0rc1", "1.0rc2"), ("1.0.post1", "1.0.post2")],
)  # fmt: skip
def test_version_order(older: str, newer: str) -> None:
    assert version_key(older) < version_key(newer)
    assert version_at_least(newer, older) and not version_at_least(older, newer)


def test_versions_equal_up_to_trailing_zeros_and_local_tags() -> None:
    assert version_key("0.5") == version_key("0.5.0") == version_key("v0.5.0+cu129")


@pytest.mark.parametrize("bad", ["", "latest", "0.5.x", "1..2", "0.5.22-cu129"])
def test_unreadable_versions_raise(bad: str) -> None:
    with pytest.raises(ValueError, match="not a version"):
        version_key(bad)


_release = st.lists(st.integers(0, 30), min_size=1, max_size=4).map(lambda xs: ".".join(map(str, xs)))
_suffix = st.sampled_from(["", "rc1", "rc2", "a1", "b3", ".dev1", ".post1", ".post2"])


@given(_release, _suffix, _release, _suffix)
def test_version_order_agrees_with_pep440(r1: str, s1: str, r2: str, s2: str) -> None:
    from packaging.version import Version  # test-only reference (not an operator dependency)

    a, b = r1 + s1, r2 + s2
    assert (version_key(a) < version_key(b)) == (Version(a) < Version(b))
    assert (version_key(a) == version_key(b)) == (Version(a) == Version(b))


# --- requiredEngineFlags a model can meet --------------------------------------------------------


def _owned_on_both_lines(data: dict[str, Any]) -> set[str]:
    """The owned flags the renderer writes on both the prefill and the decode line of `data`."""
    spec = with_stand_in_source(InferenceModelSpec.model_validate(data), "c")
    kind = spec.engine.kind
    owned = engine_flags.KVGUARD_OWNED if kind is EngineKind.KVGUARD else engine_flags.OWNED[kind]
    found = []
    for role in ("prefill", "decode"):
        command = ADAPTERS[kind].command(RoleContext(spec, flag_check_plan(spec), Owner("m", "ns", "u"), "r1", role))  # type: ignore[arg-type]
        found.append({arg for arg in command if arg in owned})
    return found[0] & found[1]


def _variants(kind: str) -> list[dict[str, Any]]:
    """Specs of one engine that between them render every owned flag the renderer can write."""
    if kind == "kvguard":
        base = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())["spec"]
        transfer = {"maxBatch": "1Mi", "timeoutSeconds": 7, "bootstrapTimeoutSeconds": 9, "encryption": "aes-gcm"}
        return [base, {**base, "kvTransfer": transfer}]
    base = yaml.safe_load((ROOT / "examples/llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    base["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct", "revision": "r1"}
    base["engine"] = {"kind": kind, "image": f"{kind}:1", "version": "0.5.23" if kind == "sglang" else "0.11.0"}
    if kind == "vllm":
        base["engine"]["routerImage"] = "vllm-router:1"
    shaped = {"tensorParallel": 2, "dataParallel": 2, "expertParallel": 2}
    dp_attention = {**shaped, "dataParallelAttention": True}
    variants = [base, {**base, "kvPoolTokens": 100_000, "roles": {"prefill": shaped, "decode": shaped}}]
    if kind == "sglang":
        old = {**base["engine"], "version": "0.5.21"}
        for engine in (base["engine"], old):
            variants.append({**base, "engine": engine, "roles": {"prefill": dp_attention, "decode": dp_attention}})
    for data in variants:
        data["model"] = {**data["model"], "architecture": {**data["model"]["architecture"], "numExperts": 8,
                                                          "expertParameters": 1_000_000}}  # fmt: skip
    return variants


@pytest.mark.parametrize("kind", ["kvguard", "sglang", "vllm"])
def test_the_owned_flags_a_policy_may_require_are_those_rendered_on_both_worker_lines(kind: str) -> None:
    """`policy.required_flag_problem` refuses a required owned flag outside RENDERED_ON_WORKERS: the
    set must be exactly what the renderer writes on prefill and decode (a flag it writes that is
    missing would refuse a policy models can meet; one it never writes, admit one they cannot)."""
    rendered: set[str] = set()
    for data in _variants(kind):
        rendered |= _owned_on_both_lines(data)
    assert rendered == set(engine_flags.RENDERED_ON_WORKERS[EngineKind(kind)])


@pytest.mark.parametrize(("engine", "flag", "says"), [
    ("kvguard", "--enable-metrics", "not a kvguard worker flag"),
    ("kvguard", "--min-kv-ratio", "the operator does not write --min-kv-ratio on both"),
    ("kvguard", "--stream-interval", "the operator does not write --stream-interval on both"),  # decode only
    ("kvguard", "--page-size=16", "never as --page-size=16: require --page-size alone"),
    ("sglang", "--tp", "is set by spec.roles.*.tensorParallel"),  # the renderer spells it --tp-size
    ("sglang", "--dtype", "no sglang model could comply"),
    ("vllm", "--model", "no vllm model could comply"),  # vllm serve takes the model as an argument
    ("vllm", "--max-model-len=4096", "require --max-model-len alone"),
    ("sglang", "", "'' is not a flag"),
    ("sglang", "enable-metrics", "'enable-metrics' is not a flag"),
    ("vllm", "--", "'--' is not a flag"),
])  # fmt: skip
def test_a_required_flag_no_model_could_carry_is_a_problem(engine: str, flag: str, says: str) -> None:
    problem = required_flag_problem(EngineKind(engine), flag)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize(("engine", "flag"), [
    ("kvguard", "--header-timeout"), ("kvguard", "--max-running-requests=8"), ("kvguard", "--page-size"),
    ("sglang", "--enable-metrics"), ("sglang", "--schedule-policy=lpm"), ("sglang", "--tp-size"),
    ("sglang", "--disaggregation-enable-kv-checksum"), ("vllm", "--enable-prefix-caching"), ("vllm", "--max-model-len"),
    ("sglang", "--speculative-algorithm=EAGLE"),
])  # fmt: skip
def test_a_required_flag_a_model_can_carry_is_no_problem(engine: str, flag: str) -> None:
    assert required_flag_problem(EngineKind(engine), flag) is None
