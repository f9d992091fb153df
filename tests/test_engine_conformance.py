"""What kvguard assumes about SGLang and vLLM, checked against those releases' own code.

For each supported release (`engine_sources.SUPPORTED`): every flag and enumerated value the
renderer emits exists, every metric the canary reads is exported under that name with the labels
the canary pairs pools on, the /server_info and /v1/models fields it reads are built by the
server, the health and info routes exist, and SGLang's KV canary reports its violations where
docs/sglang-kv-canary.md says. Where a release renamed something, the test names which spelling
that release has and the code supports both.

SGLang's wheels (~35 MB each) are fetched into ~/.cache/kvguard-engines when missing; vLLM's
(336 MB) only by `make verify-engines` (KVGUARD_VERIFY_ENGINES=1), else a cached one is used.
Offline, or without the wheel, the tests skip and say why.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import pytest
from engine_sources import (
    HEAVY,
    SUPPORTED,
    EngineSource,
    cached_wheel,
    dict_keys_returned,
    fetch_wheel,
    sglang_choices,
    sglang_field,
    sglang_metric_labels,
)

from kvguard.operator import engine_flags
from kvguard.operator.api import EngineKind, InferenceModelSpec, KVTransferSpec, SGLangKVCanary
from kvguard.operator.canary import metrics as canary_metrics
from kvguard.operator.canary.discovery import SGLANG_INFO_PATHS
from kvguard.operator.canary.spec import DEFAULT_SAFETY_COUNTERS
from kvguard.operator.planner import plan
from kvguard.operator.render import (
    _SGLANG_KV_DTYPES,
    _VLLM_KV_DTYPES,
    ADAPTERS,
    Owner,
    RoleContext,
)

SGLANG = [pytest.param(v, id=f"sglang-{v}") for v in SUPPORTED["sglang"]]
VLLM = [pytest.param(v, id=f"vllm-{v}") for v in SUPPORTED["vllm"]]
pytestmark = pytest.mark.timeout(900)


@cache
def _source(engine: str, version: str) -> EngineSource | str:
    wheel = cached_wheel(engine, version)
    if wheel is None:
        if engine in HEAVY and not os.environ.get("KVGUARD_VERIFY_ENGINES"):
            return f"{engine} {version}'s wheel is large and not cached: run `make verify-engines`"
        wheel, why = fetch_wheel(engine, version)
        if wheel is None:
            return why
    return EngineSource(engine, version, wheel)


def source(engine: str, version: str) -> EngineSource:
    found = _source(engine, version)
    if isinstance(found, str):
        pytest.skip(found)
    return found


# --- the command lines the renderer emits ------------------------------------------------------

def _spec(kind: str, version: str, **changes: Any) -> InferenceModelSpec:
    data: dict[str, Any] = {
        "model": {"name": "m", "source": {"huggingFace": "org/m", "revision": "r1"},
                  "architecture": {"numLayers": 32, "numAttentionHeads": 32, "numKVHeads": 8, "headDim": 128,
                                   "totalParameters": 30_000_000_000, "expertParameters": 28_000_000_000, "numExperts": 64}},
        "contextLength": 8192, "kvPoolTokens": 65536, "hardware": {"memoryPerDevice": "80Gi"},
        "engine": {"kind": kind, "image": "img", "version": version},
    }  # fmt: skip
    data.update(changes)
    return InferenceModelSpec.model_validate(data)


def rendered_commands(kind: str, version: str) -> list[list[str]]:
    """Prefill and decode command lines for specs that switch on every option the adapter knows."""
    dp_attention = {"tensorParallel": 8, "dataParallel": 8, "dataParallelAttention": True, "expertParallel": 8}
    variants = [_spec(kind, version), _spec(kind, version, roles={"prefill": dp_attention, "decode": dp_attention}),
                _spec(kind, version, engine={"kind": kind, "image": "img", "version": version, "streamInterval": 4})]
    if kind == "sglang":
        variants.append(_spec(kind, version, kvTransfer={"checksum": True, "backend": "nixl"},
                              engine={"kind": kind, "image": "i", "version": version,
                                      "kvCanary": {"mode": "log", "realData": "partial", "sweepInterval": 10}}))  # fmt: skip
    owner = Owner("m", "ns", "u")
    return [
        ADAPTERS[s.engine.kind].command(RoleContext(s, plan(s), owner, "r", role))  # type: ignore[arg-type]
        for s in variants for role in ("prefill", "decode")
    ]  # fmt: skip


def flags_in(command: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in command if arg.startswith("-")}


def value_after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_every_rendered_flag_exists(version: str) -> None:
    src = source("sglang", version)
    commands = rendered_commands("sglang", version)
    assert all(c[:3] == ["python3", "-m", "sglang.launch_server"] for c in commands) and src.has("sglang/launch_server.py")
    emitted = set().union(*(flags_in(c[3:]) for c in commands))
    missing = sorted(emitted - set(src.flags))
    assert not missing, f"sglang {version} has no {missing}"
    assert "--kv-canary" in emitted and "--attn-dp-size" in emitted and "--disaggregation-enable-kv-checksum" in emitted
    assert "--stream-interval" in emitted
    # The deprecated spelling still parses in these releases (the renderer uses it below 0.5.22 only).
    assert "--enable-dp-attention" in src.flags and src.flags["--enable-dp-attention"].where.startswith("sglang/srt/server_args.py")


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_every_rendered_value_is_a_choice(version: str) -> None:
    src = source("sglang", version)
    assert set(_SGLANG_KV_DTYPES.values()) <= set(sglang_choices(src, "kv_cache_dtype"))
    assert set(KVTransferSpec.model_fields["backend"].annotation.__args__) <= set(sglang_choices(src, "disaggregation_transfer_backend"))  # type: ignore[union-attr]
    assert {"prefill", "decode"} <= set(sglang_choices(src, "disaggregation_mode"))
    assert set(SGLangKVCanary.model_fields["mode"].annotation.__args__) == set(sglang_choices(src, "kv_canary"))  # type: ignore[union-attr]
    real_kv = src.class_fields_enum("sglang/kernels/ops/kv_canary/consts.py", "RealKvHashMode")
    assert {m.lower() for m in real_kv} == set(SGLangKVCanary.model_fields["real_data"].annotation.__args__)  # type: ignore[union-attr]
    for command in rendered_commands("sglang", version):
        assert value_after(command, "--kv-cache-dtype") in sglang_choices(src, "kv_cache_dtype")


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_metrics_the_canary_reads_are_exported_with_the_labels_assumed(version: str) -> None:
    src = source("sglang", version)
    exported = src.metric_names("sglang:")
    read = {canary_metrics.SGLANG_CAPACITY, canary_metrics.SGLANG_USED, canary_metrics.SGLANG_USAGE}
    read |= {c for c in DEFAULT_SAFETY_COUNTERS + canary_metrics.GENERATION_COUNTERS if c.startswith("sglang:")}
    assert read <= set(exported), f"sglang {version} exports none of {sorted(read - set(exported))}"
    labels = sglang_metric_labels(src)
    rank_labels = {"tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"}
    assert rank_labels <= labels and rank_labels <= set(canary_metrics._POOL_KEY_LABELS)
    # Every other label is constant within one server process, so pools pair up by rank alone.
    assert labels - set(canary_metrics._POOL_KEY_LABELS) <= {"model_name", "engine_type", "priority"}
    # No KV-checksum or KV-canary counter exists: those report through aborts and logs only.
    assert not [m for m in exported if "checksum" in m or "canary" in m]


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_routes_and_server_info_fields_exist(version: str) -> None:
    src = source("sglang", version)
    routes = src.routes("sglang/srt/entrypoints/", "sglang/srt/utils/common.py")
    needed = {"/health", "/health_generate", "/v1/models", "/metrics", *(p for pair in SGLANG_INFO_PATHS for p in pair)}
    needed |= {ADAPTERS[EngineKind.SGLANG].health_path(role) for role in ("prefill", "decode")}
    assert needed <= set(routes), f"sglang {version} serves none of {sorted(needed - set(routes))}"
    http = "sglang/srt/entrypoints/http_server.py"
    assert {"internal_states", "version"} <= dict_keys_returned(src, http, "server_info")
    assert "token_capacity" in dict_keys_returned(src, "sglang/srt/managers/scheduler_components/memory_usage.py", "build_memory_usage")
    assert {"max_total_num_tokens", "max_req_input_len"} <= src.dict_keys("sglang/srt/managers/scheduler.py")  # scheduler_info
    sglang_field(src, "context_length")  # /server_info is the resolved server arguments: context_length among them
    assert "max_model_len" in src.class_fields("sglang/srt/entrypoints/openai/protocol.py", "ModelCard")
    # /model_info carries no context length in these releases (the canary reads it anyway, for others).
    assert "context_length" not in dict_keys_returned(src, http, "model_info")


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_kv_canary_reports_violations_in_the_log_only(version: str) -> None:
    """docs/sglang-kv-canary.md: `log` writes a structured WARNING line per violation; `raise`
    raises RuntimeError in the scheduler (the server stops). No metric, no endpoint."""
    src = source("sglang", version)
    reporter = src.text("sglang/srt/kv_canary/runner/violation_reporter.py")
    assert 'f"kv_canary violation: "' in reporter and "logger.warning(message)" in reporter
    assert "raise RuntimeError(" in reporter
    assert "[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d" in src.text("sglang/srt/kv_canary/runner/stats_logger.py")
    from kvguard.operator.canary.engine_logs import SGLANG_VIOLATION_PREFIX

    assert f'f"{SGLANG_VIOLATION_PREFIX} "' in reporter


@pytest.mark.parametrize("kind, version", [*(("sglang", v) for v in SUPPORTED["sglang"]), *(("vllm", v) for v in SUPPORTED["vllm"])])
def test_every_speculative_flag_of_the_release_needs_declared_draft_layers(kind: str, version: str) -> None:
    """engine_flags.SPECULATIVE: each speculative-decoding flag the release has is read as one (so it
    needs spec.model.extraDraftLayers, S7), and no other flag of the release is."""
    src = source(kind, version)
    speculative = {flag for flag in src.flags if "speculative" in flag}
    assert speculative, f"{kind} {version} has no speculative flag"
    caught = {flag for flag in src.flags if engine_flags.speculative([flag], EngineKind(kind))}
    assert caught == speculative, (sorted(speculative - caught), sorted(caught - speculative))
    listed = {flag for flag in engine_flags.SPECULATIVE[EngineKind(kind)] if flag in src.flags}
    assert listed, f"none of engine_flags.SPECULATIVE[{kind}] exists in {version}"


# --- vLLM --------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VLLM)
def test_vllm_every_rendered_flag_and_value_exists(version: str) -> None:
    src = source("vllm", version)
    commands = rendered_commands("vllm", version)
    emitted = set().union(*(flags_in(c) for c in commands))
    missing = sorted(emitted - set(src.flags))
    assert not missing, f"vllm {version} has no {missing}"
    assert all(c[:2] == ["vllm", "serve"] for c in commands)
    assert "--stream-interval" in emitted
    assert 'name = "serve"' in src.text("vllm/entrypoints/cli/serve.py")
    dtypes = src.module_list("vllm/config/cache.py", "CacheDType")
    assert set(_VLLM_KV_DTYPES.values()) <= set(dtypes)
    transfer = src.class_fields("vllm/config/kv_transfer.py", "KVTransferConfig")
    assert {"kv_connector", "kv_role", "kv_load_failure_policy"} <= set(transfer)
    assert '"NixlConnector"' in src.text("vllm/distributed/kv_transfer/kv_connector/factory.py")
    roles = set(src.module_list("vllm/config/kv_transfer.py", "KVProducer")) | set(src.module_list("vllm/config/kv_transfer.py", "KVConsumer"))
    assert {"kv_producer", "kv_consumer"} <= roles


@pytest.mark.parametrize("version", VLLM)
def test_vllm_metrics_and_routes_the_canary_reads(version: str) -> None:
    src = source("vllm", version)
    exported = src.metric_names("vllm:")
    assert canary_metrics.VLLM_CACHE_INFO in exported
    usage = [n for n in canary_metrics.VLLM_USAGE_NAMES if n in exported]
    assert usage, f"vllm {version} exports neither of {canary_metrics.VLLM_USAGE_NAMES}"
    counters = {c for c in DEFAULT_SAFETY_COUNTERS + canary_metrics.GENERATION_COUNTERS if c.startswith("vllm:")}
    assert counters <= set(exported)
    loggers = src.text("vllm/v1/metrics/loggers.py")
    assert 'labelnames = ["model_name", "engine"]' in loggers and "engine" in canary_metrics._POOL_KEY_LABELS
    cache_config = src.class_fields("vllm/config/cache.py", "CacheConfig")
    assert {"num_gpu_blocks", "block_size", "kv_cache_size_tokens"} <= set(cache_config)  # the info gauge's labels
    routes = src.routes("vllm/entrypoints/serve/", "vllm/entrypoints/openai/")
    assert {"/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"} <= set(routes)
    assert "max_model_len" in src.class_fields("vllm/entrypoints/serve/engine/protocol.py", "ModelCard")
