"""P/D parity admission (sglang#19398), SGLang's KV canary and checksum in the renderer and the
policy: pure functions, the admission webhook's decision and the reconcile."""

from __future__ import annotations

import ast
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.operator.api import InferenceModelSpec, InferencePolicy
from kvguard.operator.pd_parity import mismatches, parity_problem
from kvguard.operator.planner import plan
from kvguard.operator.policy import evaluate
from kvguard.operator.reconcile import Observed, reconcile
from kvguard.operator.render import ADAPTERS, Owner, RenderError, RoleContext, render_revision
from kvguard.operator.webhook import INVALID, AdmissionDenied, check_admission

ROOT = Path(__file__).resolve().parent.parent


def spec_data(kind: str = "sglang", **changes: Any) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "examples/llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    data["engine"] = {"kind": kind, "image": f"{kind}:1", "version": "0.5.23" if kind == "sglang" else "0.33.0"}
    data["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    data.update(changes)
    return data


def spec(kind: str = "sglang", *, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
         **changes: Any) -> InferenceModelSpec:  # fmt: skip
    data = spec_data(kind, **changes)
    roles = data.setdefault("roles", {})
    for role, extra in (("prefill", prefill), ("decode", decode)):
        if extra:
            roles[role] = {**roles.get(role, {}), **extra}
    return InferenceModelSpec.model_validate(data)


def plan_beneath(s: InferenceModelSpec) -> Any:
    """The plan of `s` without its roles' extraArgs: the planner refuses those that name a flag the
    spec owns (engine_flags.py), so parity, the second line, is tested on what reaches it regardless."""
    roles = s.roles.model_copy(update={name: role.model_copy(update={"extra_args": None})
                                       for name, role in s.roles.worker_roles().items()})  # fmt: skip
    return plan(s.model_copy(update={"roles": roles}))


def commands(s: InferenceModelSpec) -> dict[str, list[str]]:
    owner = Owner("m", "ns", "u")
    return {r: ADAPTERS[s.engine.kind].command(RoleContext(s, plan(s), owner, "r1", r)) for r in ("prefill", "decode")}  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_rendered_roles_agree_by_construction(engine: str) -> None:
    s = spec(engine)
    assert mismatches(s, plan(s)) == [] and parity_problem(s, plan(s)) is None


@pytest.mark.parametrize(
    ("engine", "prefill", "decode", "setting", "values"),
    [
        # sglang#19398 itself: the KV dtype differs between the sides.
        ("sglang", {"extraArgs": ["--kv-cache-dtype", "fp8_e4m3"]}, None, "KV dtype", ("fp8_e4m3", "auto")),
        ("sglang", None, {"extraArgs": ["--page-size=16"]}, "page size", ("1", "16")),
        ("sglang", {"extraArgs": ["--revision", "v2"]}, None, "model revision", ("v2", "(engine default)")),
        ("sglang", None, {"extraArgs": ["--disaggregation-transfer-backend", "nixl"]}, "transfer backend", ("mooncake", "nixl")),
        ("sglang", {"extraArgs": ["--disaggregation-enable-kv-checksum"]}, None, "KV checksum", ("on", "off")),
        ("sglang", {"image": "sglang:2"}, None, "engine build (image)", ("sglang:2", "sglang:1")),
        ("vllm", None, {"extraArgs": ["--kv-cache-dtype", "fp8"]}, "KV dtype", ("auto", "fp8")),
        ("vllm", {"extraArgs": ["--block-size", "32"]}, None, "page size", ("32", "1")),
        ("vllm", None, {"extraArgs": ["--model", "other/model"]}, "model", ("meta-llama/Llama-3.1-8B-Instruct", "other/model")),
    ],
)
def test_a_mismatch_is_named_with_both_values(engine: str, prefill: dict[str, Any] | None, decode: dict[str, Any] | None,
                                             setting: str, values: tuple[str, str]) -> None:  # fmt: skip
    s = spec(engine, prefill=prefill, decode=decode)
    found = mismatches(s, plan_beneath(s))
    assert [(m.setting, m.prefill, m.decode) for m in found] == [(setting, *values)]
    problem = parity_problem(s, plan_beneath(s))
    assert problem is not None and "sglang#19398" in problem
    assert f"{setting}: prefill {values[0]}, decode {values[1]}" in problem


def test_the_same_override_on_both_sides_is_no_mismatch_and_the_last_value_wins() -> None:
    both = {"extraArgs": ["--kv-cache-dtype", "fp8_e5m2"]}
    s = spec(prefill=both, decode=both)
    assert mismatches(s, plan_beneath(s)) == []
    s = spec(prefill={"extraArgs": ["--kv-cache-dtype", "fp8_e5m2", "--kv-cache-dtype=auto"]})
    assert mismatches(s, plan_beneath(s)) == []  # argparse keeps the last: auto on both


def admission_body(s: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "m", "namespace": "ns", "uid": "u1"}, "spec": s}


def test_webhook_refuses_a_mismatch_naming_both_values() -> None:
    data = spec_data(roles={"prefill": {"extraArgs": ["--disaggregation-enable-kv-checksum"]}})
    with pytest.raises(AdmissionDenied) as denied:
        check_admission(admission_body(data), None, "CREATE", [])
    assert denied.value.code == INVALID
    assert "KV checksum: prefill on, decode off" in str(denied.value)
    check_admission(admission_body(spec_data()), None, "CREATE", [])  # the agreeing spec is admitted


def test_reconcile_refuses_a_mismatch_and_deploys_nothing() -> None:
    data = spec_data(roles={"decode": {"image": "sglang:2"}})
    outcome = reconcile(admission_body(data), Observed(), now=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert outcome.blocked_reason == "PDParityMismatch" and outcome.actions == []
    assert "engine build (image): prefill sglang:1, decode sglang:2" in outcome.status["message"]


def test_render_and_plan_refuse_what_admission_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvguard render` prints what the operator would create, and it creates nothing for a
    mismatched spec; `kvguard plan` would otherwise pass a spec `kubectl apply` is refused."""
    from kvguard.cli import main as cli_main

    manifest = tmp_path / "m.yaml"
    one_sided = spec_data(roles={"decode": {"extraArgs": ["--disaggregation-enable-kv-checksum"]}})
    manifest.write_text(yaml.safe_dump({**admission_body(one_sided), "metadata": {"name": "m"}}))
    for command in ("render", "plan"):
        assert cli_main([command, "-f", str(manifest)]) == 2
        err = capsys.readouterr().err
        assert f"kvguard {command}: " in err and "KV checksum: prefill off, decode on" in err and "sglang#19398" in err
    manifest.write_text(yaml.safe_dump({**admission_body(spec_data()), "metadata": {"name": "m"}}))
    assert cli_main(["render", "-f", str(manifest)]) == 0
    capsys.readouterr()


# --- SGLang's own switches in the renderer ---------------------------------------------------


def test_sglang_kv_canary_and_checksum_are_rendered_on_both_roles() -> None:
    s = spec(engine={"kind": "sglang", "image": "sglang:1", "kvCanary": {"mode": "log", "realData": "partial", "sweepInterval": 100}},
             kvTransfer={"checksum": True})  # fmt: skip
    for command in commands(s).values():
        joined = " ".join(command)
        assert "--kv-canary log --kv-canary-real-data partial --kv-canary-sweep-interval 100" in joined
        assert "--disaggregation-enable-kv-checksum" in command


def test_sglang_dp_attention_uses_the_spelling_of_the_version() -> None:
    role = {"tensorParallel": 8, "dataParallel": 8, "dataParallelAttention": True}
    modern = commands(spec(prefill=role, decode=role))["prefill"]
    assert "--attn-dp-size" in modern and modern[modern.index("--dp-size") + 1] == "1" and "--enable-dp-attention" not in modern
    old = commands(spec(engine={"kind": "sglang", "image": "i", "version": "0.5.4"}, prefill=role, decode=role))["prefill"]
    assert "--enable-dp-attention" in old and old[old.index("--dp-size") + 1] == "8"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (spec_data("vllm", engine={"kind": "vllm", "image": "v", "kvCanary": {"mode": "log"}}), "spec.engine.kvCanary"),
        (spec_data("vllm", kvTransfer={"checksum": True}), "spec.kvTransfer.checksum"),
        (spec_data(kvCacheDtype="fp4_e2m1"), "spec.kvCacheDtype"),
    ],
)
def test_options_an_engine_lacks_are_refused_by_field(data: dict[str, Any], field: str) -> None:
    s = InferenceModelSpec.model_validate(data)
    with pytest.raises(RenderError) as err:
        render_revision(s, plan(s), Owner("m", "ns", "u"), "r1")
    assert err.value.field == field


def test_sweep_interval_without_a_mode_is_a_schema_error() -> None:
    with pytest.raises(ValueError, match="sweepInterval requires mode"):
        spec(engine={"kind": "sglang", "image": "i", "kvCanary": {"sweepInterval": 5}})


# --- the policy --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "required", "compliant"),
    [(None, "log", False), ("log", "log", True), ("raise", "log", True), ("log", "raise", False), ("raise", "raise", True)],
)
def test_a_policy_can_require_sglangs_kv_canary(mode: str | None, required: str, compliant: bool) -> None:
    engine: dict[str, Any] = {"kind": "sglang", "image": "i"}
    if mode:
        engine["kvCanary"] = {"mode": mode}
    verdict = evaluate(spec(engine=engine), "ns", [InferencePolicy.model_validate({"metadata": {"name": "p"}, "spec": {"sglangKVCanary": required}})])
    assert verdict.compliant is compliant
    if not compliant:
        assert {(v.rule, v.field) for v in verdict.violations} == {("sglangKVCanary", "spec.engine.kvCanary.mode")}


def test_require_kv_integrity_is_met_by_kv_transfer_checksum() -> None:
    rule = InferencePolicy.model_validate({"metadata": {"name": "p"}, "spec": {"requireKVIntegrity": True}})
    assert not evaluate(spec(), "ns", [rule]).compliant
    assert evaluate(spec(kvTransfer={"checksum": True}), "ns", [rule]).compliant


def test_pd_parity_is_pure() -> None:
    tree = ast.parse((ROOT / "operator/pd_parity.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"kopf", "kubernetes", "torch", "aiohttp"}, imported
