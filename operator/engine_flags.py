"""Engine flags the spec owns, and which of a spec's extraArgs would override them (S7).

The renderer writes every number the KV plan rests on (context length, pool, memory fraction,
page size, parallelism, KV dtype) and every piece of wiring (model, ports, role, transfer) onto the
engine's command line, then appends `spec.engine.extraArgs` and the role's `extraArgs`. A flag
there that names one of those again wins (argparse keeps the last value), so the engine would run
a configuration the planner never saw: the incident's context/pool mismatch, typed by hand.

A token names an owned flag the way the engine's parser would read it:
- `--flag`, `--flag=value`, and for short aliases `-tp`, `-tp=2`;
- any unambiguous-looking prefix of a long flag (`--context-len`): argparse's `allow_abbrev`,
  on by default in SGLang's and vLLM's parsers, resolves it to the flag when unique, and refuses
  to start when not, so a prefix is refused either way;
- vLLM also reads `--max_model_len` as `--max-model-len` (its FlexibleArgumentParser), so
  underscores are read as hyphens (for every engine: refusing more is the safe side).

Flags that only add a safety feature (SGLang's KV checksum and KV canary) are not owned: adding
them is how a spec meets a policy, and InferencePolicy checks them (policy.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvguard.operator.api import EngineKind
from kvguard.workers.args import WorkerArgs

_OPERATOR = "the operator (it wires each role)"
_SOURCE = "spec.model.source"

SGLANG_OWNED: Mapping[str, str] = {
    "--model-path": _SOURCE, "--model": _SOURCE, "--revision": "spec.model.source.revision",
    "--host": _OPERATOR, "--port": _OPERATOR, "--disaggregation-mode": _OPERATOR,
    "--disaggregation-bootstrap-port": _OPERATOR,
    "--disaggregation-transfer-backend": "spec.kvTransfer.backend",
    "--context-length": "spec.contextLength", "--mem-fraction-static": "spec.memoryFraction",
    "--max-total-tokens": "spec.kvPoolTokens", "--page-size": "spec.pageSize", "--kv-cache-dtype": "spec.kvCacheDtype",
    "--tp-size": "spec.roles.*.tensorParallel", "--tp": "spec.roles.*.tensorParallel",
    "--tensor-parallel-size": "spec.roles.*.tensorParallel",
    "--pp-size": "spec.roles.*.pipelineParallel", "--pipeline-parallel-size": "spec.roles.*.pipelineParallel",
    "--dp-size": "spec.roles.*.dataParallel", "--dp": "spec.roles.*.dataParallel",
    "--data-parallel-size": "spec.roles.*.dataParallel", "--attn-dp-size": "spec.roles.*.dataParallel",
    "--enable-dp-attention": "spec.roles.*.dataParallelAttention",
    "--ep-size": "spec.roles.*.expertParallel", "--expert-parallel-size": "spec.roles.*.expertParallel",
    "--stream-interval": "spec.engine.streamInterval",
}  # fmt: skip

VLLM_OWNED: Mapping[str, str] = {
    "--model": _SOURCE, "--revision": "spec.model.source.revision",
    "--host": _OPERATOR, "--port": _OPERATOR, "--kv-transfer-config": "spec.kvTransfer",
    "--max-model-len": "spec.contextLength", "--gpu-memory-utilization": "spec.memoryFraction",
    "--kv-cache-memory-bytes": "spec.kvPoolTokens", "--num-gpu-blocks-override": "spec.kvPoolTokens",
    "--block-size": "spec.pageSize", "--kv-cache-dtype": "spec.kvCacheDtype",
    "--tensor-parallel-size": "spec.roles.*.tensorParallel", "-tp": "spec.roles.*.tensorParallel",
    "--pipeline-parallel-size": "spec.roles.*.pipelineParallel", "-pp": "spec.roles.*.pipelineParallel",
    "--data-parallel-size": "spec.roles.*.dataParallel", "-dp": "spec.roles.*.dataParallel",
    "--enable-expert-parallel": "spec.roles.*.expertParallel",
    "--stream-interval": "spec.engine.streamInterval",
}  # fmt: skip

# `kvguard worker`: every flag but these few tunables is written by the renderer from the spec, or
# is a safety setting (`--min-kv-ratio` is S7's own bar; `--transfer-encryption` the spec's choice).
_KVGUARD_TUNABLE = {"header_timeout", "max_running_requests"}
_KVGUARD_FIELDS = {
    "context_length": "spec.contextLength", "kv_pool_tokens": "spec.kvPoolTokens", "page_size": "spec.pageSize",
    "kv_memory_fraction": "spec.memoryFraction", "device": "spec.hardware.device", "dtype": "spec.weights.quantization",
    "model": _SOURCE, "stream_interval": "spec.engine.streamInterval",
    "max_transfer_batch": "spec.kvTransfer.maxBatch", "transfer_timeout": "spec.kvTransfer.timeoutSeconds",
    "bootstrap_timeout": "spec.kvTransfer.bootstrapTimeoutSeconds", "transfer_encryption": "spec.kvTransfer.encryption",
    "min_kv_ratio": "InferencePolicy minKVRatio (S7)",
}  # fmt: skip
KVGUARD_OWNED: Mapping[str, str] = {
    "--" + name.replace("_", "-"): _KVGUARD_FIELDS.get(name, _OPERATOR)
    for name in WorkerArgs.model_fields
    if name not in _KVGUARD_TUNABLE
}

OWNED: Mapping[EngineKind, Mapping[str, str]] = {
    EngineKind.SGLANG: SGLANG_OWNED, EngineKind.VLLM: VLLM_OWNED, EngineKind.KVGUARD: KVGUARD_OWNED,
}  # fmt: skip


def flag_name(token: str) -> str | None:
    """The option a command-line token names (`--x_y=1` -> `--x-y`), or None for a value."""
    if not token.startswith("-") or token == "-" or _is_number(token):
        return None
    name = token.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def owned_flag(name: str, owned: Mapping[str, str]) -> str | None:
    """The owned flag `name` stands for: itself, or the first owned long flag it abbreviates."""
    if name in owned:
        return name
    if name.startswith("--") and len(name) > 2:
        return next((flag for flag in sorted(owned) if flag.startswith(name)), None)
    return None


def overrides(args: Sequence[str], owned: Mapping[str, str]) -> Iterator[tuple[str, str, str]]:
    """(token, owned flag, what owns it) for each token of `args` that names an owned flag."""
    for token in args:
        name = flag_name(token)
        if name is not None and (flag := owned_flag(name, owned)) is not None:
            yield token, flag, owned[flag]


def override_message(token: str, flag: str, owner: str) -> str:
    spelled = "" if token.split("=", 1)[0] == flag else f" (read as {flag})"
    if owner.startswith("spec."):
        return f"{token}{spelled} overrides {owner}, which the plan and the rendered command already use: set {owner}"
    return f"{token}{spelled} is set by {owner}: it cannot be overridden"


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True
