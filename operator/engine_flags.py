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
  underscores are read as hyphens (for every engine: refusing more is the safe side), and
  `--kv-transfer-config.kv_role=x` as a JSON value of `--kv-transfer-config` that replaces the
  rendered one, so a dotted name is read as the name before the dot;
- a single-dash prefix (`-t` for `-tp`) as argparse resolves it.

Flags that only add a safety feature (SGLang's KV checksum and KV canary) are not owned: adding
them is how a spec meets a policy, and InferencePolicy checks them (policy.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvguard.operator.api import EngineKind
from kvguard.workers.args import WorkerArgs

_OPERATOR = "the operator (it wires each role)"
_SOURCE = "spec.model.source"
_ARGUMENT_FILE = "a file of arguments"  # vLLM's --config YAML: anything, where no check can read it
# Not on the rendered command line, but what the plan sizes KV per token from (the model's shape and
# dtype, with kvCacheDtype auto): the engine would otherwise read them from the checkpoint.
_PLAN_ONLY = {"--dtype", "--hf-overrides", "--hf-config-path", "--json-model-override-args"}

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
    "--dtype": "spec.model.architecture.dtype", "--json-model-override-args": "spec.model.architecture",
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
    # KV bytes per token follow the model's shape and dtype (kvCacheDtype auto): the plan's, from the spec
    "--dtype": "spec.model.architecture.dtype", "--hf-overrides": "spec.model.architecture",
    "--hf-config-path": "spec.model.architecture", "--config": _ARGUMENT_FILE,
}  # fmt: skip

# Owned flags the renderer writes on both the prefill and the decode command line, for some spec,
# spelled as it writes them (each with its value as the next argument). An InferencePolicy may
# require these (requiredEngineFlags reads the rendered lines); any other owned flag, or another
# spelling of one, is on neither line or on one only, and extraArgs may not add it: a requirement
# no model of that engine could meet (policy.required_flag_problem). The renderer's command lines
# are checked against these sets (tests/test_policy.py).
RENDERED_ON_WORKERS: Mapping[EngineKind, frozenset[str]] = {
    EngineKind.SGLANG: frozenset({
        "--model-path", "--revision", "--host", "--port", "--disaggregation-mode", "--disaggregation-transfer-backend",
        "--context-length", "--mem-fraction-static", "--tp-size", "--pp-size", "--dp-size", "--attn-dp-size",
        "--enable-dp-attention", "--ep-size", "--page-size", "--kv-cache-dtype", "--max-total-tokens",
    }),
    EngineKind.VLLM: frozenset({
        "--revision", "--host", "--port", "--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size",
        "--pipeline-parallel-size", "--data-parallel-size", "--block-size", "--kv-cache-dtype", "--kv-transfer-config",
        "--enable-expert-parallel",
    }),
    EngineKind.KVGUARD: frozenset({
        "--role", "--model", "--model-name", "--host", "--port", "--metrics-port", "--context-length", "--kv-pool-tokens",
        "--page-size", "--device", "--dtype", "--max-transfer-batch", "--transfer-timeout", "--transfer-encryption",
        "--bootstrap-timeout",
    }),
}  # fmt: skip

# Flags the plan itself reads from spec.engine.extraArgs (vLLM's profile run sizes the activation
# reserve from them: estimates.vllm_batch_limits). In a role's extraArgs they would change one
# role's reserve behind the plan's back, so they belong to the engine's list.
PLANNER_READ: Mapping[EngineKind, tuple[str, ...]] = {
    EngineKind.VLLM: ("--max-num-batched-tokens", "--max-num-seqs", "--enforce-eager", "--enable-chunked-prefill",
                      "--no-enable-chunked-prefill"),
}  # fmt: skip

# `kvguard worker`: every flag but these few tunables is written by the renderer from the spec, or
# is a safety setting (`--min-kv-ratio` is S7's own bar; `--transfer-encryption` the spec's choice).
_KVGUARD_TUNABLE = {"header_timeout", "max_connections", "max_running_requests"}
KVGUARD_TUNABLE_FLAGS = tuple(sorted("--" + name.replace("_", "-") for name in _KVGUARD_TUNABLE))
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

# Speculative decoding: the draft model's layers keep their KV in the target's pool, one slot per
# target token (planner.kv_bytes_per_token adds spec.model.extraDraftLayers). These flags turn it on
# or configure it, so in extraArgs they need the draft layers declared, or the plan sizes a pool
# the engine then shares with layers it never counted (S7; an outside probe passed at 2.01x what
# was 1.93x with its one EAGLE layer). Names from SGLang 0.5.22/0.5.23's `srt/arg_groups/fields/
# spec.py` (read as tests/engine_sources.py reads it) and vLLM's `--speculative-config` (JSON, also
# dotted); vLLM before 0.8 spelled it `--speculative-model` / `--num-speculative-tokens`, refused
# too (a newer vLLM does not start with them anyway). Any other `--speculative-*` flag counts as well.
SPECULATIVE_PREFIX = "--speculative-"
SPECULATIVE: Mapping[EngineKind, tuple[str, ...]] = {
    EngineKind.SGLANG: ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
                        "--speculative-draft-model-revision", "--speculative-num-steps", "--speculative-eagle-topk",
                        "--speculative-num-draft-tokens", "--speculative-token-map", "--speculative-draft-load-format",
                        "--speculative-dflash-block-size", "--speculative-dspark-block-size"),
    EngineKind.VLLM: ("--speculative-config", "--speculative-model", "--num-speculative-tokens"),
    EngineKind.KVGUARD: (),  # no speculative decoding; its parser refuses the flags anyway
}  # fmt: skip


def flag_name(token: str) -> str | None:
    """The option a command-line token names (`--x_y=1` -> `--x-y`), or None for a value."""
    if not token.startswith("-") or token == "-" or _is_number(token):
        return None
    name = token.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    return "--" + name[2:].split(".", 1)[0].replace("_", "-")


def owned_flag(name: str, owned: Mapping[str, str] | Sequence[str]) -> str | None:
    """The owned flag `name` stands for: itself, or the first owned flag of its kind (long or
    single-dash) it abbreviates."""
    if name in owned:
        return name
    long = name.startswith("--")
    if len(name) > (2 if long else 1):  # the first in sorted order, without sorting per token
        return min((flag for flag in owned if flag.startswith(name) and flag.startswith("--") == long), default=None)
    return None


def canonical(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`args` with each token that names one of `flags` spelled as that flag (`--max_num_seqs=8`
    -> `--max-num-seqs=8`), so a reader of the arguments sees what the engine's parser sees."""
    spelled = []
    for token in args:
        name = flag_name(token)
        flag = owned_flag(name, flags) if name is not None else None
        spelled.append(token if flag is None else flag + (token[token.index("="):] if "=" in token else ""))
    return spelled


def overrides(args: Sequence[str], owned: Mapping[str, str]) -> Iterator[tuple[str, str, str]]:
    """(token, owned flag, what owns it) for each token of `args` that names an owned flag."""
    for token in args:
        name = flag_name(token)
        if name is not None and (flag := owned_flag(name, owned)) is not None:
            yield token, flag, owned[flag]


def speculative(args: Sequence[str], kind: EngineKind) -> list[tuple[str, str]]:
    """(token, flag) for each token of `args` that names a speculative-decoding flag of `kind`'s
    engine, read as its parser reads it (`=` values, `_` for `-`, dotted JSON names, prefixes)."""
    known = SPECULATIVE[kind]
    if not known:
        return []
    found = []
    for token in args:
        name = flag_name(token)
        if name is None:
            continue
        flag = name if name.startswith(SPECULATIVE_PREFIX) else owned_flag(name, known)
        if flag is not None:
            found.append((token, flag))
    return found


def override_message(token: str, flag: str, owner: str) -> str:
    spelled = "" if token.split("=", 1)[0] == flag else f" (read as {flag})"
    if flag in _PLAN_ONLY:
        return f"{token}{spelled} changes {owner}, which the plan sizes the KV pool from: set {owner}"
    if owner == _ARGUMENT_FILE:
        return f"{token}{spelled} passes {owner} that no admission check can read: put them in extraArgs"
    if owner.startswith("spec."):
        return f"{token}{spelled} overrides {owner}, which the plan and the rendered command already use: set {owner}"
    return f"{token}{spelled} is set by {owner}: it cannot be overridden"


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True
