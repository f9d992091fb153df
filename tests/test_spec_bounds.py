"""What an outside probe of the offline CLI found (2026-12-04): values the API server or the rollout's
clock cannot hold, specs `plan` passed that render, apply and admission refuse, and inputs that
ended in a traceback. Each is now refused by field with exit 2, or read as the API server reads it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvguard.cli import main
from kvguard.operator.api import MAX_INT32, InferenceModel
from kvguard.yaml_files import load_all

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY: dict[str, Any] = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
SGLANG: dict[str, Any] = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())


def with_spec(base: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    manifest = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = manifest
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return manifest


def refused_at(manifest: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        InferenceModel.model_validate(manifest)
    return [".".join(map(str, e["loc"])) for e in caught.value.errors()]


@pytest.mark.parametrize(("path", "value", "sane"), [
    ("spec.rollout.scaleDownDelaySeconds", 400_000_000_000, MAX_INT32),  # promotion overflowed its date arithmetic
    ("spec.rollout.bakeSeconds", MAX_INT32 + 1, 0),
    ("spec.rollout.progressDeadlineSeconds", 10**12, MAX_INT32),  # an int32 in every Deployment
    ("spec.roles.decode.dataParallel", 10**11, 3),
    ("spec.roles.decode.tensorParallel", 10**6, 2),
    ("spec.roles.decode.gpuCount", 2**70, 8),  # rendered as nvidia.com/gpu: 1180591620717411303424, a pod never scheduled
])  # fmt: skip
def test_numbers_beyond_what_the_api_server_and_the_clock_hold_are_refused_by_field(path: str, value: int, sane: int) -> None:
    base = with_spec(SGLANG, "spec.rollout", {}) if path.startswith("spec.rollout") else SGLANG
    assert any(loc.startswith(path) for loc in refused_at(with_spec(base, path, value)))
    assert InferenceModel.model_validate(with_spec(base, path, sane))


def test_pods_per_deployment_and_gpus_per_pod_are_checked_per_role() -> None:
    many = with_spec(SGLANG, "spec.roles.decode", {"replicas": 2_000_000, "dataParallel": 3000})
    assert refused_at(many) == ["spec.roles.decode"]
    short = with_spec(SGLANG, "spec.roles.decode", {"tensorParallel": 4, "gpuCount": 1})  # --tp-size 4 on 1 GPU: never starts
    assert refused_at(short) == ["spec.roles.decode"]
    assert InferenceModel.model_validate(with_spec(SGLANG, "spec.roles.decode", {"tensorParallel": 4, "gpuCount": 4}))


def test_a_toleration_second_count_is_an_int64() -> None:
    toleration = {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 10**30}
    assert any("tolerations" in loc for loc in refused_at(with_spec(SGLANG, "spec.roles.decode.tolerations", [toleration])))


@pytest.mark.parametrize("name", ["--context-length=999999", "has space", "x" * 300])
def test_a_served_model_name_is_one_flag_value(name: str) -> None:
    """Rendered as `--model-name NAME`: a leading `-` made the worker read a flag and crash-loop."""
    assert refused_at(with_spec(TINY, "spec.model.name", name)) == ["spec.model.name"]


def test_a_namespace_is_a_dns_label(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused_at(with_spec(TINY, "metadata.namespace", "Bad_NS")) == ["metadata.namespace"]
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(with_spec(TINY, "spec.model.source", {"pvc": {"claimName": "tiny"}})))
    assert main(["render", "-f", str(manifest), "-n", "Bad_NS"]) == 2
    assert "--namespace: must be a DNS-1123 label" in capsys.readouterr().err
    # As kubectl: the flag may repeat the manifest's namespace, never replace it (it rendered team-b's objects).
    manifest.write_text(yaml.safe_dump(with_spec(with_spec(TINY, "spec.model.source", {"pvc": {"claimName": "tiny"}}),
                                                 "metadata.namespace", "team-a")))  # fmt: skip
    assert main(["render", "-f", str(manifest), "-n", "team-b"]) == 2
    assert "metadata.namespace is 'team-a', not 'team-b' (--namespace)" in capsys.readouterr().err
    assert main(["render", "-f", str(manifest), "-n", "team-a"]) == 0
    assert "namespace: team-a" in capsys.readouterr().out


@pytest.mark.parametrize(("path", "value", "field"), [
    ("spec.roles.decode.tensorParallel", 2, "spec.roles.decode.tensorParallel"),
    ("spec.weights", {"quantization": "awq"}, "spec.weights.quantization"),
    ("spec.kvTransfer", {"backend": "nixl"}, "spec.kvTransfer.backend"),  # SGLang's: the kvguard engine has its own
    ("spec.hardware.gpuProduct", "NVIDIA-H100-80GB-HBM3", "spec.hardware.gpuProduct"),  # a cpu spec
])  # fmt: skip
def test_plan_refuses_what_render_apply_and_admission_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             path: str, value: object, field: str) -> None:  # fmt: skip
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(with_spec(TINY, path, value)))
    assert main(["plan", "-f", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvguard plan: {field}: ") and len(err.splitlines()) == 1, err


def test_a_deeply_nested_hf_config_is_bad_input_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "config.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(with_spec(TINY, "spec.model.architecture", None)))
    assert main(["plan", "-f", str(manifest), "--hf-config", str(deep)]) == 2
    err = capsys.readouterr().err
    assert "nests JSON too deeply" in err and "Traceback" not in err
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"hidden_size": 1}).replace("1", "9" * 5000))
    assert main(["plan", "-f", str(manifest), "--hf-config", str(huge)]) == 2
    err = capsys.readouterr().err
    assert f"--hf-config {huge}" in err and "set_int_max_str_digits" not in err, err


@pytest.mark.parametrize("flag", ["-f", "--hf-config"])
def test_a_file_that_never_ends_is_refused_after_16_mib(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """`kvguard plan -f /dev/zero` read 4.3 GB, `--hf-config /dev/zero` 5 GB, before they failed (outside probe)."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(with_spec(TINY, "spec.model.architecture", None)))
    args = ["-f", "/dev/zero"] if flag == "-f" else ["-f", str(manifest), "--hf-config", "/dev/zero"]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero is larger than 16 MiB" in err and len(err.splitlines()) == 1, err


def test_yaml_merge_keys_work_and_base_60_numbers_are_text(tmp_path: Path) -> None:
    """`<<: *defaults` is YAML kubectl reads (the mapping's own keys override the merged ones, and
    are no repeats); `17:04` is the string the API server reads, not YAML 1.1's 1024."""
    file = tmp_path / "m.yaml"
    file.write_text("base: &w {replicas: 1, gpuCount: 2}\nrole: {<<: *w, replicas: 3}\nctx: 17:04\nn: 42\n")
    assert load_all(file) == [{"base": {"replicas": 1, "gpuCount": 2}, "role": {"replicas": 3, "gpuCount": 2}, "ctx": "17:04", "n": 42}]
    file.write_text("role: {replicas: 1, replicas: 2}\n")
    with pytest.raises(ValueError, match="repeats"):
        load_all(file)


def test_model_tiny_takes_a_seed_torch_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["model", "tiny", str(tmp_path / "m"), "--seed", "9" * 23])
    assert caught.value.code == 2 and "must be in 0..2**63-1" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_render_prints_nothing_for_a_spec_the_planner_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """S7: the operator deploys nothing for a blocked spec, so `render` (which a user may pipe into
    kubectl) prints nothing either: exit 3 as `plan`, the reasons on stderr. It printed the
    Deployments with a pool of 1x the context, exit 0."""
    blocked = with_spec(with_spec(TINY, "spec.model.source", {"pvc": {"claimName": "tiny"}}), "spec.kvPoolTokens", 1024)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(blocked))
    assert main(["render", "-f", str(manifest)]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "blocked (S7): decode: pool 1,024 tokens = 1.00x contextLength 1,024" in captured.err
    manifest.write_text(yaml.safe_dump(with_spec(blocked, "spec.kvPoolTokens", 4096)))
    assert main(["render", "-f", str(manifest)]) == 0 and "kind: Deployment" in capsys.readouterr().out
    # No pool at all (the weights fill the device): blocked too, 3, not a render error's 2 (outside probe).
    manifest.write_text(yaml.safe_dump(with_spec(blocked, "spec.hardware.memoryPerDevice", "64Ki")))
    assert main(["render", "-f", str(manifest)]) == 3 and "blocked (S7)" in capsys.readouterr().err


@pytest.mark.parametrize(("policy", "message"), [
    ("", "holds no InferencePolicy"),  # an empty file was no policy at all, silently
    ("spec: {minEngineVersions: {sglang: banana}}", "spec.minEngineVersions.sglang: "),
    ("spec: {minEngineVersions: {tgi: '1.0'}}", "spec.minEngineVersions.tgi: not an engine kind"),
    ("spec: {requiredCanaryProbes: [isolation, foo]}", "spec.requiredCanaryProbes[1]: unknown probe 'foo'"),
])  # fmt: skip
def test_apply_refuses_a_policy_it_cannot_read_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                      policy: str, message: str) -> None:  # fmt: skip
    """Unreadable rules failed closed only when a model was judged; now the file is bad input."""
    file = tmp_path / "policy.yaml"
    file.write_text(f"apiVersion: kvguard.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: p}}\n{policy}\n" if policy else "")
    state = tmp_path / "state"
    assert main(["apply", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--local", "--policy", str(file), "--state-dir", str(state)]) == 2
    assert message in capsys.readouterr().err
    assert not state.exists()


@pytest.mark.parametrize("command", ["plan", "render"])
def test_heads_narrower_than_one_unit_are_refused_by_field_not_divided_by(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Outside probe: hiddenSize 3 over 4 heads (no headDim) made each head 0 wide, each token's KV
    0 bytes, and the pool size a ZeroDivisionError: a traceback here, a 500 from the webhook,
    an exception out of reconcile. The model refuses it (and the CRD's CEL rule with it)."""
    manifest = with_spec(TINY, "spec.model.architecture.hiddenSize", 3)
    manifest["spec"]["model"]["architecture"].pop("headDim", None)
    manifest["spec"]["model"]["architecture"]["numAttentionHeads"] = 4
    assert refused_at(manifest) == ["spec.model.architecture"]
    file = tmp_path / "m.yaml"
    file.write_text(yaml.safe_dump(manifest))
    assert main([command, "-f", str(file)]) == 2
    err = capsys.readouterr().err
    assert "hiddenSize must be at least numAttentionHeads when headDim is not set" in err and "Traceback" not in err, err


@pytest.mark.parametrize("path", ["spec.engine.extraArgs", "spec.roles.decode.extraArgs"])
def test_an_extra_args_list_is_bounded(path: str) -> None:
    """170,000 `-z` arguments were admitted in 3.4 s, all of it holding the operator's event loop
    (each token sorted the engine's owned flags), and again on every reconcile pass (outside probe)."""
    from kvguard.operator.api import MAX_EXTRA_ARGS

    assert refused_at(with_spec(SGLANG, path, ["-z"] * (MAX_EXTRA_ARGS + 1))) == [path]
    assert InferenceModel.model_validate(with_spec(SGLANG, path, ["-z"] * MAX_EXTRA_ARGS))


def test_an_abbreviated_flag_stands_for_the_first_owned_flag_it_begins() -> None:
    """Found without sorting the owned flags for every argument (`owned_flag`)."""
    from kvguard.operator.engine_flags import owned_flag

    owned = {"--tp-size": "", "--tp": "", "--trust-remote-code": "", "-t": ""}
    assert owned_flag("--tp", owned) == "--tp" and owned_flag("--t", owned) == "--tp"
    assert owned_flag("--tr", owned) == "--trust-remote-code" and owned_flag("-t", owned) == "-t"
    assert owned_flag("-z", owned) is None and owned_flag("--x", owned) is None
