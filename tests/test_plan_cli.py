"""`kvguard plan`: table and JSON output, exit codes 0/3/2, what-if flags, --hf-config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.cli import main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CONFIGS = REPO / "tests" / "data" / "hf_configs"


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    status = main(["plan", *args, "-o", "json"])
    return status, json.loads(capsys.readouterr().out)


def test_s7_llama_example_passes_with_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    status, body = plan_json(capsys, "-f", str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml"))
    assert status == 0
    assert body["verdict"] == "pass" and body["contextLength"] == 131072 and body["minRatio"] == 2.0
    for role in ("prefill", "decode"):
        assert {"poolTokens", "bytesPerToken", "ratio", "sufficient"} <= set(body["roles"][role])
    assert abs(body["roles"]["decode"]["poolTokens"] - 444_500) / 444_500 < 0.01


@pytest.mark.parametrize(
    ("example", "status", "verdict"),
    [("incident.yaml", 3, "blocked"), ("incident-fixed.yaml", 0, "pass"), ("sglang-30233.yaml", 3, "blocked"),
     ("tiny-cpu.yaml", 0, "pass")],
)  # fmt: skip
def test_s7_examples_exit_with_their_verdict(capsys: pytest.CaptureFixture[str], example: str, status: int, verdict: str) -> None:
    got_status, body = plan_json(capsys, "-f", str(EXAMPLES / example))
    assert (got_status, body["verdict"]) == (status, verdict)


def test_table_output_shows_roles_verdict_and_suggestions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(EXAMPLES / "incident.yaml")]) == 3
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "681,280 (cap)" in out
    assert "verdict: BLOCKED" in out and "decode: pool 1,361,728 tokens = 1.29x" in out
    assert "spec.kvCacheDtype=fp8_e4m3, spec.roles.prefill.kvPoolTokens=2097152" in out  # the whole change
    assert "(and raise kvPoolTokens: prefill to 2,097,152)" in out
    assert "note: estimated weight memory per GPU" in out


def test_what_if_flags_override_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    llama = str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml")
    status, body = plan_json(capsys, "-f", llama, "--context-length", "262144")
    assert status == 3 and body["contextLength"] == 262144
    status, body = plan_json(capsys, "-f", llama, "--context-length", "262144", "--kv-cache-dtype", "fp8_e4m3")
    assert status == 0 and body["roles"]["decode"]["bytesPerToken"] == 65536
    status, body = plan_json(capsys, "-f", llama, "--context-length", "262144", "--tp", "2")
    assert status == 0 and body["roles"]["prefill"]["bytesPerToken"] == 65536
    status, body = plan_json(capsys, "-f", llama, "--mem-fraction", "0.5")
    assert body["roles"]["decode"]["memoryFraction"] == 0.5
    assert body["roles"]["decode"]["poolTokens"] < 444_500


def test_incident_fix_by_flags_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-pool-tokens is the cap of every role: it replaces the file's per-role 681,280 too."""
    status, body = plan_json(
        capsys, "-f", str(EXAMPLES / "incident.yaml"), "--kv-cache-dtype", "fp8_e4m3", "--kv-pool-tokens", "2139136",
    )  # fmt: skip
    assert status == 0 and body["roles"]["prefill"]["poolTokens"] == 2_139_136
    assert body["roles"]["prefill"]["cappedBy"] == "kvPoolTokens"


def test_mem_fraction_flag_replaces_per_role_fractions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text().replace(
        "decode: {replicas: 1, tensorParallel: 1}", "decode: {replicas: 1, tensorParallel: 1, memoryFraction: 0.7}"))  # fmt: skip
    _, body = plan_json(capsys, "-f", str(manifest))
    assert body["roles"]["decode"]["memoryFraction"] == 0.7
    _, body = plan_json(capsys, "-f", str(manifest), "--mem-fraction", "0.8")
    assert body["roles"]["decode"]["memoryFraction"] == body["roles"]["prefill"]["memoryFraction"] == 0.8


def test_mla_pipeline_what_if_scales_the_measured_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """--pp 2 on examples/sglang-30233.yaml halves the measured 89.82 GiB per GPU (the figure is for
    the manifest's 8 GPUs) as well as the layers' KV, and passes; held fixed it would not."""
    status = main(["plan", "-f", str(EXAMPLES / "sglang-30233.yaml"), "--pp", "2", "-o", "json"])
    captured = capsys.readouterr()
    body = json.loads(captured.out)
    assert status == 0 and body["roles"]["decode"]["bytesPerToken"] == 39 * (576 + 132)
    assert body["roles"]["decode"]["weightsBytesPerGpu"] < 50 * 1024**3
    assert "measured over 8 GPUs" in captured.err


def test_tp_what_if_with_measured_weights_and_unequal_roles_asks_for_measured_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text((EXAMPLES / "sglang-30233.yaml").read_text().replace(
        "decode: {replicas: 1, tensorParallel: 8}", "decode: {replicas: 1, tensorParallel: 16}"))  # fmt: skip
    assert main(["plan", "-f", str(manifest), "--tp", "16"]) == 2
    assert "spec.weights.measuredShards" in capsys.readouterr().err


def test_a_split_what_if_that_changes_no_shape_keeps_the_measured_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A figure measured at PP4 with `--pp 4` (nothing changes) was recorded as measured over 4 GPUs
    with TP alone, and the stage re-planned from it: 4.23 -> 4.72 GiB for a no-op (a review)."""
    manifest = tmp_path / "pp4.yaml"
    text = (EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text().replace("  weights: {}", "  weights: {measuredBytesPerDevice: 4Gi}", 1)
    for role in ("prefill", "decode"):
        text = text.replace(f"{role}: {{replicas: 1, tensorParallel: 1}}", f"{role}: {{replicas: 1, tensorParallel: 1, pipelineParallel: 4}}")
    manifest.write_text(text)
    _, as_given = plan_json(capsys, "-f", str(manifest))
    _, same = plan_json(capsys, "-f", str(manifest), "--pp", "4", "--tp", "1")
    assert as_given["roles"]["decode"]["weightsBytesPerGpu"] == same["roles"]["decode"]["weightsBytesPerGpu"] == 4 * 1024**3
    _, moved = plan_json(capsys, "-f", str(manifest), "--pp", "2")  # a new shape: taken as 4 GPUs of TP, scaled
    assert moved["roles"]["decode"]["weightsBytesPerGpu"] > 2 * 4 * 1024**3 // 2
    # One GPU count in two shapes: recorded as that count (TP alone), as the planner takes it (a
    # review: refused as "split differently", where it planned before).
    manifest.write_text(text.replace("prefill: {replicas: 1, tensorParallel: 1, pipelineParallel: 4}",
                                     "prefill: {replicas: 1, tensorParallel: 4}"))  # fmt: skip
    status, mixed = plan_json(capsys, "-f", str(manifest), "--pp", "2")
    assert status in (0, 3) and mixed["roles"]["decode"]["weightsBytesPerGpu"] > 2 * 1024**3


def test_quantization_what_if_drops_the_measured_weights(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", "-f", str(EXAMPLES / "sglang-30233.yaml"), "--quantization", "nvfp4", "-o", "json"])
    captured = capsys.readouterr()
    assert status in (0, 3) and "counted from parameters" in captured.err
    assert json.loads(captured.out)["roles"]["decode"]["weightsBytesPerGpu"] < 60 * 1024**3


def test_dp_what_if_under_dp_attention_drops_the_measured_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: with dataParallelAttention, --dp changes the attention split (attention TP =
    tensorParallel / dataParallel), so every rank holds more attention weights; the measured figure
    for the manifest's dp was held fixed and a pool 69% too large planned PASS. It is now dropped
    and the weights counted from parameters, as for another --quantization."""
    manifest = tmp_path / "dpa.yaml"
    text = (EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text()
    text = text.replace("prefill: {replicas: 1, tensorParallel: 1}", "prefill: {replicas: 1, tensorParallel: 8, dataParallelAttention: true}")
    text = text.replace("decode: {replicas: 1, tensorParallel: 1}", "decode: {replicas: 1, tensorParallel: 8, dataParallelAttention: true}")
    manifest.write_text(text.replace("  weights: {}", "  weights: {measuredBytesPerDevice: 2Gi}", 1))
    _, measured = plan_json(capsys, "-f", str(manifest))
    assert measured["roles"]["decode"]["weightsBytesPerGpu"] == 2 * 1024**3
    status = main(["plan", "-f", str(manifest), "--dp", "8", "-o", "json"])
    captured = capsys.readouterr()
    assert status in (0, 3) and "--dp 8" in captured.err and "counted from parameters" in captured.err
    counted = json.loads(captured.out)["roles"]["decode"]["weightsBytesPerGpu"]
    assert counted > 2 * 1024**3  # the attention weights whole on every rank, not the figure for tp 8


def test_a_split_what_if_lists_the_measured_shards_it_implies_in_every_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: --pp 2 recorded spec.weights.measuredShards (so the measured figure scales),
    but the changes that pass left it out: applied to the manifest as printed, the first one was
    still BLOCKED at 0.34x. Each change now lists it, and applied with the what-if it passes."""
    glm = EXAMPLES / "sglang-30233.yaml"
    status, body = plan_json(capsys, "-f", str(glm), "--pp", "2", "--context-length", "4000000")
    assert status == 3 and body["suggestions"]
    for suggestion in body["suggestions"]:
        assert {"field": "spec.weights.measuredShards", "value": 8} in suggestion["changes"]
    split = next(s for s in body["suggestions"] if s["field"].endswith("pipelineParallel"))
    manifest = yaml.safe_load(glm.read_text())
    manifest["spec"]["contextLength"] = 4_000_000
    for change in split["changes"]:
        node = manifest
        *parents, leaf = change["field"].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = change["value"]
    applied = tmp_path / "applied.yaml"
    applied.write_text(yaml.safe_dump(manifest))
    status, body = plan_json(capsys, "-f", str(applied))
    assert status == 0 and body["verdict"] == "pass"


@pytest.mark.parametrize("flag", [["--page-size", "99999999999999999999999999"], ["--kv-pool-tokens", "99999999999999999999999999"]])
def test_a_page_or_pool_beyond_what_the_api_server_stores_is_bad_input(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: a page of 10^26 tokens was "blocked" (exit 3) as if the pool were too small,
    and a pool cap of 10^26 planned PASS; neither fits the CRD's integers."""
    assert main(["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), *flag]) == 2
    assert f"{flag[0]} {flag[1]}: Input should be less than or equal to" in capsys.readouterr().err


def test_hf_config_fills_the_architecture(capsys: pytest.CaptureFixture[str]) -> None:
    status, body = plan_json(
        capsys, "-f", str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml"), "--hf-config", str(CONFIGS / "qwen3-8b.json"),
    )  # fmt: skip
    assert status == 0 and body["roles"]["decode"]["bytesPerToken"] == 36 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--context-length", "-5"], "spec.contextLength"),
        (["--tp", "3"], "spec.roles.prefill.tensorParallel"),
        (["--kv-cache-dtype", "fp7"], "spec.kvCacheDtype"),
        (["--mem-fraction", "1.2"], "spec.memoryFraction"),
        (["--gpu-memory", "eighty"], "spec.hardware.memoryPerDevice"),
        (["--gpu-memory", "1e400Gi"], "spec.hardware.memoryPerDevice"),
        (["--reserve", "inf"], "spec.reserve"),
        (["--min-ratio", "inf"], "spec.minKVRatio"),
        (["--mem-fraction", "nan"], "spec.memoryFraction"),
        (["--engine", "tgi"], "spec.engine.kind"),
    ],
)
def test_bad_input_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str], args: list[str], field: str) -> None:
    assert main(["plan", "-f", str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml"), *args]) == 2
    captured = capsys.readouterr()
    assert field in captured.err and captured.out == ""


def test_a_bad_flag_value_is_named_by_its_flag_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--kv-pool-tokens", "0", "--page-size", "-3"]) == 2
    assert sorted(capsys.readouterr().err.splitlines()) == [
        "kvguard plan: --kv-pool-tokens 0: Input should be greater than 0 (sets spec.kvPoolTokens, "
        "spec.roles.prefill.kvPoolTokens, spec.roles.decode.kvPoolTokens)",
        "kvguard plan: --page-size -3: Input should be greater than 0 (sets spec.pageSize)",
    ]


def _manifest(tmp_path: Path, edit: Any) -> str:
    """tiny-cpu.yaml with `edit` applied to its parsed body, written to a file."""
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    edit(body)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


@pytest.mark.parametrize(("edit", "flags", "said"), [
    (lambda b: b["metadata"].update(name="Bad_Name!!"), [],
     "kvguard plan: metadata.name: 'Bad_Name!!' must be lowercase letters, digits and '-', start with a letter"),
    (lambda b: None, ["--context-length", "99999999999999999999"],
     "kvguard plan: --context-length 99999999999999999999: must be at most 16,777,216 tokens (sets spec.contextLength)"),
    (lambda b: b.update(metadata=None), [], "kvguard plan: metadata: must be a mapping\n"),
    (lambda b: b.update(spec=None), [], "kvguard plan: spec: must be a mapping\n"),
    (lambda b: b["spec"].update(model=[1]), [], "kvguard plan: spec.model: must be a mapping\n"),
])  # fmt: skip
def test_refusals_carry_neither_pydantics_prefix_nor_class_names(tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any,
                                                                 flags: list[str], said: str) -> None:  # fmt: skip
    """Outside probe: "(manifest): Value error, metadata.name: ...", "--context-length ...: Value
    error, must be at most ..." and "Input should be a valid dictionary or instance of ObjectMeta"."""
    assert main(["plan", "-f", _manifest(tmp_path, edit), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err
    assert "Value error" not in err and "instance of" not in err and "(manifest)" not in err


@pytest.mark.parametrize("flag", ["--reserve", "--gpu-memory"])
@pytest.mark.parametrize("form", ["separate", "joined"])
def test_a_negative_byte_size_is_refused_by_its_flag(capsys: pytest.CaptureFixture[str], flag: str, form: str) -> None:
    """Outside probe: `--reserve -4Gi` was "expected one argument" (argparse took -4Gi for an option)."""
    args = [flag, "-4Gi"] if form == "separate" else [f"{flag}=-4Gi"]
    with pytest.raises(SystemExit) as exited:
        main(["plan", "-f", str(EXAMPLES / "incident.yaml"), *args])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvguard plan: error: argument {flag}: must not be negative, got -4Gi"


def test_help_lists_the_values_validation_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: --help listed --quantization without fp32, which the refusal then offered."""
    from kvguard.operator.api import EngineKind, KVCacheDtype, Quantization

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for flag, values in (("--quantization Q", Quantization), ("--kv-cache-dtype D", KVCacheDtype), ("--engine KIND", EngineKind)):
        assert f"{flag} {', '.join(v.value for v in values)}" in flat


def test_yaml_mistakes_are_one_line_naming_file_line_and_column(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently and words errors over several lines naming
    "<unicode string>": here a repeated key is refused and every error is one line."""
    tiny = (EXAMPLES / "tiny-cpu.yaml").read_text()
    twice = tmp_path / "twice.yaml"
    twice.write_text(tiny.replace("  contextLength: 1024\n", "  contextLength: 1024\n  contextLength: 4096\n"))
    line = tiny.splitlines().index("  contextLength: 1024") + 2
    cases = (
        (twice, f"kvguard plan: {twice} is not valid YAML (line {line}, column 3): key 'contextLength' repeats the one on line {line - 1}\n"),
        (tmp_path / "open.yaml", f"kvguard plan: {tmp_path / 'open.yaml'} is not valid YAML (line 2, column 1): while parsing a flow "
                                 "node expected the node content, but found '<stream end>'\n"),
        (tmp_path / "list.yaml", f"kvguard plan: {tmp_path / 'list.yaml'}: the document is a list, expected an InferenceModel mapping\n"),
    )  # fmt: skip
    (tmp_path / "open.yaml").write_text("spec: [1,\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    for path, says in cases:
        assert main(["plan", "-f", str(path)]) == 2
        assert capsys.readouterr().err == says


def test_plan_reads_the_manifest_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO((EXAMPLES / "tiny-cpu.yaml").read_text()))
    assert main(["plan", "-f", "-"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out


def test_bad_files_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", "-f", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert main(["plan", "-f", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    typo = tmp_path / "typo.yaml"
    typo.write_text((EXAMPLES / "tiny-cpu.yaml").read_text().replace("contextLength:", "contextLenght:"))
    assert main(["plan", "-f", str(typo)]) == 2
    err = capsys.readouterr().err
    assert "spec.contextLenght" in err and "spec.contextLength" in err  # unknown field and missing one
    for name, content, says in (
        ("deep.yaml", "a: " + "[" * 2000 + "]" * 2000, "nested too deeply"),
        ("latin1.yaml", b"spec: caf\xe9\n", "is not UTF-8 text"),
        ("pod.yaml", "apiVersion: v1\nkind: Pod\nspec: {}\n", "kind: 'Pod', expected InferenceModel"),
    ):
        odd = tmp_path / name
        odd.write_bytes(content if isinstance(content, bytes) else content.encode())
        for command in ("plan", "render"):
            assert main([command, "-f", str(odd)]) == 2
            assert says in capsys.readouterr().err, (command, name)
    bad_config = tmp_path / "config.json"
    bad_config.write_text('{"hidden_size": 64}')
    assert main(["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--hf-config", str(bad_config)]) == 2
    assert "--hf-config" in (err := capsys.readouterr().err) and "num_attention_heads" in err
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 0, "hidden_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 4096, "intermediate_size": 1024}  # fmt: skip
    bad_config.write_text(json.dumps(config))
    assert main(["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--hf-config", str(bad_config)]) == 2
    assert capsys.readouterr().err == (f"kvguard plan: --hf-config {bad_config}: "
                                       "spec.model.architecture.numKVHeads: Input should be greater than 0\n")  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "field", "says"),
    [
        ("memoryPerDevice: 256Mi", "memoryPerDevice: .inf", "spec.hardware.memoryPerDevice", "not a finite number"),
        ("memoryPerDevice: 256Mi", "memoryPerDevice: '1e400Gi'", "spec.hardware.memoryPerDevice", "not a finite number"),
        ("memoryFraction: 0.9", "memoryFraction: 0.9\n  reserve: .inf", "spec.reserve", "not a finite number"),
        ("minKVRatio: 2.0", "minKVRatio: .inf", "spec.minKVRatio", "finite number"),
        ("memoryFraction: 0.9", "memoryFraction: .nan", "spec.memoryFraction", "finite number"),
    ],
)  # fmt: skip
def test_non_finite_numbers_in_the_file_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, field: str, says: str
) -> None:
    manifest = tmp_path / "m.yaml"
    text = (EXAMPLES / "tiny-cpu.yaml").read_text()
    assert old in text
    manifest.write_text(text.replace(old, new))
    assert main(["plan", "-f", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert field in err and says in err and "Traceback" not in err


def test_console_script_reports_infinite_memory_without_a_traceback(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text((EXAMPLES / "tiny-cpu.yaml").read_text().replace("memoryPerDevice: 256Mi", "memoryPerDevice: .inf"))
    result = subprocess.run(
        [sys.executable, "-P", "-m", "kvguard", "plan", "-f", str(manifest)], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr and "spec.hardware.memoryPerDevice" in result.stderr


def test_console_script_exit_status_is_real() -> None:
    """The installed `kvguard` entry point, as a user runs it (one process, ~1 s)."""
    result = subprocess.run(
        [sys.executable, "-P", "-m", "kvguard", "plan", "-f", str(EXAMPLES / "incident.yaml"), "-o", "json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert json.loads(result.stdout)["verdict"] == "blocked"


def test_tiny_cpu_example_matches_the_engines_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tiny-cpu.yaml describes exactly what `kvguard model tiny` writes (read via --hf-config)."""
    written = subprocess.run(
        [sys.executable, "-P", "-m", "kvguard", "model", "tiny", str(tmp_path / "tiny")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if written.returncode != 0 and "No module named" in written.stderr:
        pytest.skip(f"engine not installed here: {written.stderr.strip().splitlines()[-1]}")
    assert written.returncode == 0, written.stderr
    example = EXAMPLES / "tiny-cpu.yaml"
    _, from_file = plan_json(capsys, "-f", str(example))
    status, from_config = plan_json(capsys, "-f", str(example), "--hf-config", str(tmp_path / "tiny"))
    assert status == 0
    assert from_config["roles"] == from_file["roles"]


def test_a_pool_exactly_at_a_decimal_ratio_passes(capsys: pytest.CaptureFixture[str]) -> None:
    # 1.1 x 50 is 55.000000000000001 in floats: a 55-token pool was judged below 1.1x (an outside probe).
    args = ["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--context-length", "50", "--page-size", "1"]
    assert main([*args, "--min-ratio", "1.1", "--kv-pool-tokens", "55"]) == 0
    assert main([*args, "--min-ratio", "1.1", "--kv-pool-tokens", "54"]) == 3
    assert main([*args, "--min-ratio", "1.12", "--context-length", "25", "--kv-pool-tokens", "28"]) == 0
    capsys.readouterr()


def test_an_exact_ratio_never_reads_as_the_one_below_it(capsys: pytest.CaptureFixture[str]) -> None:
    # 1130 / 1000 is 1.12999... in floats: rounded down it read 1.1299, and 2300 / 1000 read 2.29x,
    # beside a pool judged sufficient at 1.13 and 2.3 (a review of the rounding-down fix).
    from kvguard.workers.pool_ratio import ratio_down, ratio_text

    assert (ratio_down(1130, 1000), ratio_text(2300, 1000), ratio_text(1150, 1000)) == (1.13, "2.30x", "1.15x")
    assert (ratio_down(2_097_140, 1_048_576), ratio_text(2_097_140, 1_048_576)) == (1.9999, "1.99x")
    args = ["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--context-length", "1000", "--page-size", "1", "-o", "json"]
    assert main([*args, "--min-ratio", "1.13", "--kv-pool-tokens", "1130"]) == 0
    decode = json.loads(capsys.readouterr().out)["roles"]["decode"]
    assert (decode["ratio"], decode["sufficient"]) == (1.13, True)


def test_a_shortfall_never_reads_as_the_ratio_it_misses(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--kv-cache-dtype", "fp8", "--kv-pool-tokens", "2097088"]  # 1.99994x of 1 Mi
    assert main(["plan", "-f", str(EXAMPLES / "incident.yaml"), *flags]) == 3
    out = capsys.readouterr().out
    assert "prefill: pool 2,097,088 tokens = 1.99x contextLength 1,048,576, below minKVRatio 2" in out
    row = next(line for line in out.splitlines() if line.startswith("prefill "))
    assert row.split()[-2:] == ["1.99", "NO"]
    assert main(["plan", "-f", str(EXAMPLES / "incident.yaml"), *flags, "-o", "json"]) == 3
    prefill = json.loads(capsys.readouterr().out)["roles"]["prefill"]
    assert (prefill["ratio"], prefill["sufficient"]) == (1.9999, False)  # rounded down, never 2.0


# --- the field checks admission runs, `kvguard plan` runs too (spec_checks.py) ------------------------
# An outside probe: plan exited 0 (PASS) for specs the webhook refused with 422 and `kvguard render`
# with exit 2 -- it ran the planner's checks and not the renderer's.

SGLANG_SPEC = {"image": "lmsysorg/sglang:v0.5.23", "version": "0.5.23"}
ADMISSION_CASES = [
    # (where in the manifest, value, the field the message names)
    (("spec", "kvCacheDtype"), "fp4_e2m1", "spec.kvCacheDtype: sglang does not take 'fp4_e2m1'"),
    (("spec", "roles", "decode", "resources"), {"limits": {"nvidia.com/gpu": "2"}},
     "spec.roles.decode.resources.limits: nvidia.com/gpu: 2 differs from the role's GPUs (1,"),
    (("spec", "engine", "kvCanary"), {"mode": "log"}, None),  # admitted on sglang: so is the plan
    (("spec", "kvTransfer", "encryption"), "aes-gcm", "spec.kvTransfer.encryption: sglang has no KV encryption"),
    (("spec", "roles", "decode", "extraArgs"), ["--disaggregation-enable-kv-checksum"],
     "prefill and decode must agree on what their KV exchange depends on (sglang#19398): KV checksum"),
    (("metadata", "annotations"), {"kvguard.io/pause": "yes"}, "metadata.annotations[kvguard.io/pause]: 'yes' is not"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "says"), ADMISSION_CASES, ids=[".".join(p) for p, _, _ in ADMISSION_CASES])
def test_plan_refuses_by_field_what_admission_refuses_and_passes_what_it_admits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: Any, says: str | None) -> None:  # fmt: skip
    from kvguard.operator.webhook import AdmissionDenied, check_admission

    manifest = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())
    manifest["spec"]["engine"].update(SGLANG_SPEC)
    manifest["spec"]["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    node = manifest
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    written = tmp_path / "m.yaml"
    written.write_text(yaml.safe_dump(manifest))
    try:
        check_admission(manifest, None, "CREATE", [])
        denied = None
    except AdmissionDenied as exc:
        denied = str(exc)
    status = main(["plan", "-f", str(written)])
    err = capsys.readouterr().err
    if says is None:
        assert denied is None and status == 0, (denied, err)
        return
    assert denied is not None and says in denied
    assert status == 2 and err == f"kvguard plan: {denied}\n"  # the same words as the webhook's
    assert main(["render", "-f", str(written)]) == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_plan_needs_no_image_though_admission_and_render_do(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan deploys nothing: the examples carry no image and still plan (render, which prints what
    would be deployed, refuses them naming the image)."""
    status, body = plan_json(capsys, "-f", str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml"), "--engine", engine)
    assert status == 0 and body["verdict"] == "pass"
    assert main(["render", "-f", str(EXAMPLES / "llama-3.1-8b-sglang-h100.yaml")]) == 2
    assert "spec.engine.image: required for engine sglang" in capsys.readouterr().err


def test_a_minimum_just_above_the_pool_is_written_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: a minKVRatio of 4.0000001 was written "4" (`:g`) beside a 4.00x pool refused
    as below it; the pods' min-kv-ratio annotation was written the same way and read back as 4."""
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.planner import plan
    from kvguard.operator.pool_gate import RATIO_ANNOTATION
    from kvguard.operator.render import Owner, render_revision
    from kvguard.workers.pool_ratio import ratio_number

    assert [ratio_number(x) for x in (2.0, 2.5, 4.0000001, 1.9999999999999998)] == ["2", "2.5", "4.0000001", "1.9999999999999998"]
    assert main(["plan", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--min-ratio", "4.0000001"]) == 3
    out = capsys.readouterr().out
    assert "min ratio 4.0000001," in out and "below minKVRatio 4.0000001 " in out
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["spec"] |= {"minKVRatio": 2.0000001, "model": {**body["spec"]["model"], "source": {"pvc": {"claimName": "m", "path": "t"}}}}
    spec = InferenceModel.model_validate(body).spec
    pods = [o["spec"]["template"]["metadata"] for o in render_revision(spec, plan(spec), Owner("m", "ns", "u"), "r1")
            if o["kind"] == "Deployment" and RATIO_ANNOTATION in o["spec"]["template"]["metadata"].get("annotations", {})]
    assert pods and all(float(p["annotations"][RATIO_ANNOTATION]) == 2.0000001 for p in pods)


def test_a_block_with_no_change_that_passes_says_so_in_the_units_of_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: a blocked plan with no suggestion printed nothing after its reasons, and the
    reasons of a tiny model read "weights (0.00 GiB per GPU) ... by 0.00 GiB"."""
    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["spec"]["hardware"]["memoryPerDevice"] = "300Ki"
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(body))
    assert main(["plan", "-f", str(manifest)]) == 3
    out = capsys.readouterr().out
    assert "weights (449.25 KiB per GPU)" in out and "by 179.25 KiB" in out and "0.00 GiB" not in out
    assert "changes that pass" not in out and "no change found that passes" in out
