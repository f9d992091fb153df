"""S7 at admission: extraArgs cannot re-set what the spec already sets on the engine's command line
(context length, pool, memory fraction, page size, parallelism, KV dtype, model, wiring). A later
copy of a flag wins in argparse, so the engine would run a configuration the planner never saw.

The cases are an outside probe's: per-role extraArgs were not checked at all, and abbreviations
(`--context-len`), aliases (`--tensor-parallel-size`), vLLM's underscores and most `kvguard worker`
flags went through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.operator import engine_flags
from kvguard.operator.api import EngineKind, InferenceModelSpec
from kvguard.operator.planner import plan
from kvguard.operator.render import ADAPTERS, Owner, RoleContext
from kvguard.operator.webhook import INVALID, AdmissionDenied, check_admission

ROOT = Path(__file__).resolve().parent.parent


def spec_data(kind: str) -> dict[str, Any]:
    if kind == "kvguard":
        data = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())["spec"]
        data["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
        return data
    data = yaml.safe_load((ROOT / "examples/llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    data["engine"] = {"kind": kind, "image": f"{kind}:1", "version": "0.5.23" if kind == "sglang" else "0.33.0"}
    if kind == "vllm":
        data["engine"]["routerImage"] = "vllm-router:1"
    data["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    return data


def worker_command(spec: InferenceModelSpec, role: str) -> list[str]:
    return ADAPTERS[spec.engine.kind].command(RoleContext(spec, plan(spec), Owner("m", "ns", "u"), "r1", role))  # type: ignore[arg-type]


def admit(spec: dict[str, Any]) -> None:
    body = {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}
    check_admission(body, None, "CREATE", [])


def with_args(kind: str, where: str, args: list[str]) -> dict[str, Any]:
    data = spec_data(kind)
    if where == "engine":
        data["engine"]["extraArgs"] = args
    else:
        data.setdefault("roles", {}).setdefault(where, {})["extraArgs"] = args
    return data


REFUSED = [
    # (engine, where, args, field named in the message)
    ("sglang", "decode", ["--context-length", "999999"], "spec.contextLength"),  # per-role: never checked before
    ("sglang", "decode", ["--mem-fraction-static", "0.99"], "spec.memoryFraction"),
    ("vllm", "prefill", ["--max-model-len", "999999"], "spec.contextLength"),
    ("vllm", "decode", ["--gpu-memory-utilization=0.99"], "spec.memoryFraction"),
    ("sglang", "engine", ["--context-len", "999999"], "spec.contextLength"),  # argparse abbreviations
    ("sglang", "engine", ["--mem-fraction", "0.99"], "spec.memoryFraction"),
    ("vllm", "engine", ["--max-model", "999999"], "spec.contextLength"),
    ("vllm", "engine", ["--kv-cache-memory", "80G"], "spec.kvPoolTokens"),
    ("vllm", "engine", ["--max_model_len=999999"], "spec.contextLength"),  # vLLM reads _ as -
    ("sglang", "engine", ["--tensor-parallel-size", "2"], "spec.roles.*.tensorParallel"),  # an alias
    ("sglang", "decode", ["--tp", "2"], "spec.roles.decode.tensorParallel"),
    ("vllm", "engine", ["-tp=2"], "spec.roles.*.tensorParallel"),
    ("vllm", "engine", ["--model", "other/model"], "spec.model.source"),
    ("sglang", "prefill", ["--disaggregation-mode", "decode"], "the operator"),
    ("vllm", "engine", ["--kv-transfer-config", "{}"], "spec.kvTransfer"),
    ("kvguard", "engine", ["--kv-pool", "5"], "spec.kvPoolTokens"),
    ("kvguard", "engine", ["--kv-memory-fraction", "0.99"], "spec.memoryFraction"),
    ("kvguard", "engine", ["--min-kv-ratio", "0.01"], "minKVRatio"),
    ("kvguard", "engine", ["--transfer-encryption", "none"], "spec.kvTransfer.encryption"),
    ("kvguard", "engine", ["--role", "router"], "the operator"),
    ("kvguard", "engine", ["--device=cuda"], "spec.hardware.device"),
    # a regression probe of the above: vLLM's dotted JSON arguments, single-dash prefixes, the model's shape
    ("vllm", "decode", ["--kv-transfer-config.kv_load_failure_policy=recompute"], "spec.kvTransfer"),
    ("vllm", "engine", ["-t", "2"], "spec.roles.*.tensorParallel"),
    ("vllm", "engine", ["--dtype", "float32"], "spec.model.architecture.dtype"),
    ("vllm", "engine", ["--hf-overrides", "{}"], "spec.model.architecture"),
    ("vllm", "engine", ["--config", "args.yaml"], "a file of arguments"),
    ("sglang", "engine", ["--json-model-override-args", "{}"], "spec.model.architecture"),
    ("vllm", "decode", ["--max-num-batched-tokens", "196608"], "spec.engine.extraArgs"),  # read by the plan, there only
    ("kvguard", "engine", ["--max_running_requests", "4"], "--max-running-requests"),  # the worker's own parser refuses it
    ("kvguard", "engine", ["-h"], "not a kvguard worker flag"),
]


@pytest.mark.parametrize("kind, where, args, field", REFUSED, ids=[f"{k}-{w}-{a[0]}" for k, w, a, _ in REFUSED])
def test_an_extra_arg_naming_a_flag_the_spec_sets_is_refused_by_field(kind: str, where: str, args: list[str], field: str) -> None:
    with pytest.raises(AdmissionDenied) as denied:
        admit(with_args(kind, where, args))
    path = "spec.engine.extraArgs" if where == "engine" else f"spec.roles.{where}.extraArgs"
    assert denied.value.code == INVALID
    assert f"{path}: {args[0]}" in str(denied.value) and field in str(denied.value), str(denied.value)


ALLOWED = [
    ("sglang", "engine", ["--schedule-policy=lpm", "--chunked-prefill-size", "-1"]),  # -1: a value, not a flag
    ("sglang", "engine", ["--disaggregation-enable-kv-checksum"]),  # adds a safety check: policy's business
    ("sglang", "decode", ["--enable-metrics"]),
    ("vllm", "engine", ["--max-num-seqs", "64", "--enforce-eager"]),
    ("kvguard", "engine", ["--max-running-requests", "4", "--header-timeout=3"]),
]


@pytest.mark.parametrize("kind, where, args", ALLOWED, ids=[f"{k}-{w}-{a[0]}" for k, w, a in ALLOWED])
def test_tuning_flags_the_spec_does_not_set_are_admitted(kind: str, where: str, args: list[str]) -> None:
    data = with_args(kind, where, args)
    if where != "engine" and kind != "kvguard":  # the same on both sides: P/D parity
        data["roles"]["prefill" if where == "decode" else "decode"] = dict(data["roles"][where])
    admit(data)  # raises AdmissionDenied on a refusal
    assert worker_command(InferenceModelSpec.model_validate(data), "decode")[-len(args):] == args  # rendered as written, last


SAFETY_FLAGS = {"--disaggregation-enable-kv-checksum", "--kv-canary", "--kv-canary-real-data", "--kv-canary-sweep-interval",
                "--enable-metrics"}  # fmt: skip


@pytest.mark.parametrize("kind", ["sglang", "vllm", "kvguard"])
def test_every_flag_the_renderer_writes_on_a_worker_is_owned(kind: str) -> None:
    """The owned lists cannot fall behind the adapters: each flag of a worker's rendered command
    (with every optional part on) is owned, or an additive safety flag."""
    data = spec_data(kind)
    data["engine"]["streamInterval"] = 4
    if kind == "sglang":
        data["engine"]["kvCanary"] = {"mode": "log"}
        data["kvTransfer"] = {**data.get("kvTransfer", {}), "checksum": True}
    spec = InferenceModelSpec.model_validate(data)
    owned = engine_flags.OWNED[EngineKind(kind)]
    for role in ("prefill", "decode"):
        command = worker_command(spec, role)
        engine_args = command[3:] if command[:2] == ["python3", "-m"] else command  # not the interpreter's -m
        flags = {name for token in engine_args if (name := engine_flags.flag_name(token)) is not None}
        assert flags - owned.keys() - SAFETY_FLAGS == set(), (role, command)


def test_the_flags_the_plan_reads_are_read_as_vllm_reads_them() -> None:
    """`--max_num_batched_tokens` (and abbreviations) changed vLLM's activation reserve while the plan
    read only the hyphenated spelling: a blocked spec passed (a regression probe)."""
    with pytest.raises(AdmissionDenied) as denied:
        admit(with_args("vllm", "engine", ["--max_num_seqs", "0"]))
    assert "--max-num-seqs needs a positive integer, got '0'" in str(denied.value)
    spelled = plan(InferenceModelSpec.model_validate(with_args("vllm", "engine", ["--max-num-batched-tokens", "196608"])))
    underscored = plan(InferenceModelSpec.model_validate(with_args("vllm", "engine", ["--max_num_batched_tokens", "196608"])))
    assert spelled.roles["decode"].pool_tokens == underscored.roles["decode"].pool_tokens


def test_vllm_without_a_router_image_is_refused_naming_it() -> None:
    """The field's description says required for vllm (vllm-router is not in the vllm image); an
    outside probe found it admitted, rendering `vllm-router` in an image that has no such command."""
    data = spec_data("vllm")
    del data["engine"]["routerImage"]
    with pytest.raises(AdmissionDenied) as denied:
        admit(data)
    assert "spec.engine.routerImage: required for vllm" in str(denied.value)


# --- speculative decoding in extraArgs needs its draft layers in the plan (S7) -----------------------
# An outside probe: SGLang EAGLE flags in extraArgs with extraDraftLayers 0 planned a pool at 2.01x
# (PASS) that the same spec, with its one draft layer declared, plans at 1.93x (blocked).

EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
         "--speculative-num-steps", "3"]  # fmt: skip
VLLM_EAGLE = ["--speculative-config", '{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}']
SPECULATIVE = [
    # (engine, where, args): every spelling the engine's parser reads as a speculative flag
    ("sglang", "engine", EAGLE),
    ("sglang", "engine", ["--speculative-algorithm=EAGLE3"]),
    ("sglang", "decode", ["--speculative_algorithm", "NEXTN"]),  # per-role, underscores
    ("sglang", "engine", ["--speculative-alg", "EAGLE"]),  # an abbreviation argparse resolves
    ("sglang", "prefill", ["--speculative-draft-model", "some/draft"]),  # SGLang's alias of --speculative-draft-model-path
    ("sglang", "engine", ["--speculative-eagle-topk", "4"]),
    ("vllm", "engine", VLLM_EAGLE),
    ("vllm", "decode", ["--speculative-config.method=eagle"]),  # a dotted JSON argument
    ("vllm", "engine", ["--speculative_config={\"method\": \"eagle3\"}"]),
    ("vllm", "engine", ["--speculative-model", "some/draft", "--num-speculative-tokens", "3"]),  # vLLM before 0.8
]


@pytest.mark.parametrize("kind, where, args", SPECULATIVE, ids=[f"{k}-{w}-{a[0]}" for k, w, a in SPECULATIVE])
def test_speculative_flags_without_declared_draft_layers_are_refused_by_field(kind: str, where: str, args: list[str]) -> None:
    with pytest.raises(AdmissionDenied) as denied:
        admit(with_args(kind, where, args))
    path = "spec.engine.extraArgs" if where == "engine" else f"spec.roles.{where}.extraArgs"
    assert denied.value.code == INVALID
    message = str(denied.value)
    assert message.startswith(f"{path}: {args[0]}") and "declare the draft layers" in message, message
    assert "spec.model.extraDraftLayers is 0" in message


@pytest.mark.parametrize("kind, args", [("sglang", EAGLE), ("vllm", VLLM_EAGLE)])
def test_speculative_flags_with_declared_draft_layers_are_admitted_and_rendered(kind: str, args: list[str]) -> None:
    data = with_args(kind, "engine", args)
    data["model"]["extraDraftLayers"] = 1
    admit(data)  # raises AdmissionDenied on a refusal
    spec = InferenceModelSpec.model_validate(data)
    assert worker_command(spec, "decode")[-len(args):] == args
    without = InferenceModelSpec.model_validate(spec_data(kind))
    assert plan(spec).roles["decode"].bytes_per_token == plan(without).roles["decode"].bytes_per_token * 33 // 32  # 32 layers + 1


def test_speculative_flags_are_for_the_plan_cli_and_render_what_they_are_for_admission(tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The probe's spec: `kvguard plan` passed it (exit 0 at 2.01x), `render` rendered it; with its
    draft layer declared it is blocked at 1.93x, as it should be."""
    from kvguard.cli import main

    body = {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": "sneak"},
            "spec": with_args("sglang", "engine", EAGLE) | {"contextLength": 220_000}}  # fmt: skip
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(body))
    for command in ("plan", "render"):
        assert main([command, "-f", str(manifest)]) == 2, command
        err = capsys.readouterr().err
        assert f"kvguard {command}: spec.engine.extraArgs: --speculative-algorithm, " in err and "extraDraftLayers" in err, err
    body["spec"]["model"]["extraDraftLayers"] = 1
    manifest.write_text(yaml.safe_dump(body))
    assert main(["plan", "-f", str(manifest)]) == 3  # blocked: the draft layer's KV counted
    assert "1.93x contextLength 220,000, below minKVRatio 2" in capsys.readouterr().out
