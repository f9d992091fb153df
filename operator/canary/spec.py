"""`CanarySpec`: the canary suite's configuration, one pydantic model.

It becomes part of the InferenceModel CRD, so every field has a camelCase alias, a description and
a default that makes a bare `kvguard canary --url URL` useful, and unknown keys are rejected (a typo
in a manifest must not silently disable a probe). Defaults are lean on purpose: a few tokens per
request and small repetition counts keep the whole suite within ~30 s on a tiny CPU model.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvguard.operator.json_numbers import numbers_only
from kvguard.workers.pool_ratio import DEFAULT_MIN_KV_RATIO, MAX_KV_RATIO


class ProbeName(str, enum.Enum):
    """The probes, in the order the suite runs them (cheap ones first)."""

    CAPACITY = "capacity"
    GOLDEN = "golden"
    DETERMINISM = "determinism"
    OVER_LENGTH = "over_length"
    ISOLATION = "isolation"
    ABORT = "abort"
    SAFETY_COUNTERS = "safety_counters"

    @classmethod
    def parse(cls, text: str) -> ProbeName:
        """Accept `over_length`, `over-length` and `overLength` alike."""
        key = re.sub(r"(?<!^)(?=[A-Z])", "_", text.strip()).replace("-", "_").lower()
        try:
            return cls(key)
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown probe {text!r} (known: {known})") from None


ApiKind = Literal["completions", "chat"]


# Larger than any served model's context (2025: 10M at most), small enough that prompts sized from
# it fit in memory: a typo or a server advertising 99999999999 must be bad input, not a MemoryError.
MAX_CONTEXT_TOKENS = 16 * 1024 * 1024
MIN_CONTEXT_TOKENS = 16


MAX_PROMPT_BYTES = MAX_CONTEXT_TOKENS * 4 * 5
"""Bound of overLength.maxPromptBytes: the longest prompt the canary can build at all, 320 MiB
(prompts.MAX_FILLER_WORDS, 16Mi tokens x 4 words per token, x BYTES_PER_WORD, 5; spelled out here,
where prompts.py cannot be imported). Every honest value is at most it: the default is 16 MiB, and a
10M-token context's over-length prompt (contextFactor 1.25) is ~63 MB, ~295 MB at the densest count
of words per token the estimate believes. Above the bound the limit no longer keeps a
case from being built: a case over the filler cap (a 16Mi context at contextFactor 4 and more, or a
large reported pool) went to `filler_words`, which refuses it, and the probe failed with a probe
error, failing a healthy revision, where it should have skipped the case with a note. As `le=` it is
in the CRD's schema too (`maximum`): an API server without the webhook refuses a larger value too."""


CONTEXT_BOUND: dict[str, Any] = {"maximum": MAX_CONTEXT_TOKENS}
"""The bound of `context_within_bound` in the CRD's schema (json_schema_extra), so that an API
server without the webhook refuses the value too. A stored value above it has not parsed since the
bound came (reconcile: InvalidSpec, the rollout halted), so the schema's copy stops nothing that ran."""


def context_within_bound(value: int) -> int:
    """A context length the canary can size its requests from (this model's and the
    InferenceModel's contextLength). A validator, not `le=`, for this message; the schema holds the
    same bound (`CONTEXT_BOUND`)."""
    if value > MAX_CONTEXT_TOKENS:
        raise ValueError(f"must be at most {MAX_CONTEXT_TOKENS:,} tokens")
    return value


# A timeout beyond a day is a typo; aiohttp and asyncio overflow on huge or infinite ones.
MAX_TIMEOUT_SECONDS = 86400.0
TIMEOUT_BOUND: dict[str, Any] = {"maximum": MAX_TIMEOUT_SECONDS}
"""The validators' bound of a timeout, in the CRD's schema too (as `CONTEXT_BOUND`)."""
Delay = Annotated[float, Field(json_schema_extra={"minimum": 0.0, **TIMEOUT_BOUND})]
"""A delay in seconds, 0 .. MAX_TIMEOUT_SECONDS: the validator refuses the list with its message, the
schema each item."""

MAX_GENERATED_TOKENS = 4096
"""The most tokens a probe request asks for by default (`maxTokens`). The probes judge text
equality and leaks, never length. A golden prompt's maxTokens and longRequestMaxTokens are bounded
by the model's contextLength instead (spec_checks.canary_problems): a cap here would make specs
stored before it fail to parse in reconcile."""

LONG_PROMPT_MIN_TOKENS = 16
"""The shortest prompt of a long request A (`admissible_prompt_tokens` never sizes one below 16
tokens), so longRequestMaxTokens may take at most contextLength - 16: more, and A is longer than
the context, which a healthy engine rightly refuses."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""The seeds every engine takes: vLLM's `seed` is a signed 64-bit integer (torch.long), the kvguard
engine's -2^63 .. 2^64-1 (workers/openai_requests.py). The canary sends the seed as it is written,
so one outside both answered 400 on every request and failed a healthy revision."""

LongRequestFraction = Annotated[float, Field(gt=0.0, le=1.0)]
"""A long request's share of the admissible prompt length: above 1 it is longer than the context
(a healthy engine refuses it), at 0 or below it is a 16-token prompt that tests nothing."""


class _SpecModel(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` in YAML is bad input (it crashed the timers, or made
    # every comparison false) rather than a value; it leaves the JSON schema (the CRD) unchanged.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return numbers_only(cls, value, info)  # `true` or "32" where a number belongs is refused


class _ProbeSpec(_SpecModel):
    """A probe's section: each one can be turned off (each says what it runs in its own description)."""

    enabled: bool = True


class GoldenPrompt(_SpecModel):
    prompt: str = Field(min_length=1, description="Prompt text (the user message for chat).")
    expect_substring: str | None = Field(
        None, description="The output must contain this text (greedy decoding)."
    )
    expect_regex: str | None = Field(None, description="The output must match this regex (search).")
    max_tokens: int | None = Field(
        None, ge=1,
        description="Tokens to generate; defaults to the suite's maxTokens. Below the InferenceModel's contextLength "
        "(the prompt needs room too).",
    )

    @field_validator("expect_regex")
    @classmethod
    def _regex_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


def _default_golden_prompts() -> list[GoldenPrompt]:
    return [
        GoldenPrompt(prompt="The capital of France is"),
        GoldenPrompt(prompt="1, 2, 3, 4, 5,"),
    ]


BaselineMatch = Literal["exact", "tolerant"]


class LogprobTolerance(_SpecModel):
    """How far a candidate may drift from the baseline when numerics legitimately differ (other
    weights file, quantization, KV dtype, GPU, a non-batch-invariant kernel). Both are judged per
    prompt over the greedy tokens, position by position, on the servers' own logprobs."""

    top_logprobs: int = Field(
        5, ge=1, le=20, description="Alternatives requested per token (OpenAI top_logprobs / logprobs=N)."
    )
    min_token_agreement: float = Field(
        0.75, ge=0.0, le=1.0,
        description="Share of positions, up to the first divergence, where candidate and baseline chose the same "
        "token; plus, after a divergence, the candidate's token must be among the baseline's top alternatives.",
    )
    max_logprob_divergence: float = Field(
        1.0, gt=0.0,
        description="Largest mean |logprob difference| (nats) over the positions both chose the same token.",
    )


class GoldenSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the golden-output probe.")
    prompts: list[GoldenPrompt] = Field(
        default_factory=_default_golden_prompts,
        description="Prompts with expected text; without expectations they are only compared "
        "with the baseline.",
    )
    compare_baseline: bool = Field(
        True,
        description="When a baseline URL is given, outputs must equal the baseline's. The operator "
        "compares only when the candidate serves the same weights, quantization, KV dtype, device, sharding and "
        "engine as the baseline (other numerics give other text).",
    )
    baseline_match: BaselineMatch = Field(
        "exact",
        description="exact: the text must equal the baseline's (same numerics). tolerant: request logprobs from "
        "both and judge per-token agreement and logprob divergence (logprobTolerance); a server that returns no "
        "logprobs makes the baseline comparison skip with a note. The operator uses tolerant when a revision "
        "changes numerics.",
    )
    logprob_tolerance: LogprobTolerance = Field(
        default_factory=LogprobTolerance, description="Thresholds of the tolerant comparison."
    )


GATE_REPETITIONS = 30
"""The determinism probe's repeats in a rollout's gate, whatever a model stores (an older CRD stored
2 into every model: InferenceModelSpec.canary_to_run)."""


class DeterminismSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the determinism probe.")
    prompt: str = Field(
        "Once upon a time, in a small village by the sea,",
        min_length=1,
        description="The prompt sent repeatedly.",
    )
    repetitions: int = Field(
        GATE_REPETITIONS, ge=2, le=100,
        description="How many times the request is sent, one after another (never batched together: a batch's "
        f"numerics may differ). {GATE_REPETITIONS} catch a fault that changes 1 request in 10 with 95% probability "
        f"(0.9^29 = 4.7%); a rollout's gate runs at least {GATE_REPETITIONS} (kvguard canary runs what is written).",
    )  # 2 let a build whose transfers corrupted 1 chunk in 10, unchecked, pass and ship (an outside probe)
    compare_streaming: bool = Field(
        True, description="A streamed run must give the same text as the non-streamed runs."
    )


class IsolationSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the isolation probe.")
    probe_prompt: str = Field(
        "Tell me about the weather today.",
        min_length=1,
        description="Request B: run alone, then after each long request A; outputs must be identical.",
    )
    long_request_fractions: list[LongRequestFraction] = Field(
        default_factory=lambda: [0.3, 0.7],
        min_length=1,
        description="Sizes of the long requests A, as fractions of the admissible prompt length "
        "(context length, or the KV pool when smaller), each in (0, 1]; varied to force page reuse.",
    )
    long_request_max_tokens: int = Field(
        2, ge=1,
        description="Tokens generated for each long request A; below the InferenceModel's contextLength (A's prompt "
        "needs room).",
    )
    nonce_length: int = Field(
        16, ge=8, le=128, description="Length (hex characters) of the secret nonce in each A."
    )
    nonce_every_words: int = Field(
        48, ge=1, description="Repeat the nonce every N filler words, so every page of A holds it."
    )
    tenants: int = Field(
        4, ge=0, le=64, description="Concurrent tenants with distinct nonces (0 disables this part). 4: a batch of "
        "four, where engines' batch-size buckets (CUDA graphs) change kernels; 3 never tried one."
    )
    tenant_prompt_words: int = Field(64, ge=1, description="Filler words in each tenant's prompt.")


class OverLengthSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the over-length probe.")
    context_factor: float = Field(
        1.25,
        gt=1.0,
        le=8.0,
        description="The over-length prompt has at least this many times the context length in tokens.",
    )
    check_pool: bool = Field(
        True, description="Also send a prompt longer than the smallest reported KV pool."
    )
    check_max_tokens: bool = Field(
        True, description="Also send a short prompt with max_tokens above the context length."
    )
    apis: list[ApiKind] = Field(
        default_factory=lambda: list(get_args(ApiKind)),
        min_length=1,
        description="Endpoints to test (/v1/completions, /v1/chat/completions).",
    )
    streaming: list[bool] = Field(
        default_factory=lambda: [False, True], min_length=1, description="Test with stream=false/true."
    )
    max_prompt_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=MAX_PROMPT_BYTES,
        description="Cases whose prompt would be larger than this are skipped (with a note). At most 320 MiB, the "
        "longest filler prompt the canary builds.",
    )


class AbortSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the abort probe.")
    stream_disconnect_after_tokens: list[int] = Field(
        default_factory=lambda: [4],
        description="Disconnect a streaming request after this many content chunks (one run each).",
    )
    prefill_disconnect_after_seconds: list[Delay] = Field(
        default_factory=lambda: [0.01, 0.05],
        description="Disconnect a long-prompt request this long after sending it (queued, prefill or "
        "transfer phase; one run each).",
    )
    prefill_prompt_fraction: float = Field(
        0.8, gt=0.0, le=1.0, description="Size of the mid-prefill prompt (fraction of admissible)."
    )
    pool_recovery_timeout_seconds: float = Field(
        5.0,
        gt=0.0,
        json_schema_extra=TIMEOUT_BOUND,
        description="KV pool usage must return to its baseline within this time after an abort (S4).",
    )
    pool_recovery_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="...and within this fraction of the time the aborted request would have needed "
        "to finish on its own (estimated from its streamed chunks), never less than 1 s; an "
        "engine that ignores the abort frees the pages only when the generation ends. A cut whose "
        "pages come back only after this deadline (but within the timeout), or in time but after "
        "1 s, is made once more, and fails the probe if that one is late too. Where the workers count generated "
        "tokens, a cut request that generated half or more of the tokens it had left before its pages came back "
        "ran on, whatever the timing: it is cut once more, and fails the probe if that one runs on too.",
    )
    pool_usage_tolerance_tokens: int = Field(
        0, ge=0, description="Used tokens above the baseline still counted as recovered."
    )
    check_isolation_after: bool = Field(
        True, description="After the aborts, request B must still give its solo output."
    )

    @field_validator("pool_recovery_timeout_seconds")
    @classmethod
    def _recovery_bounded(cls, value: float) -> float:
        if value > MAX_TIMEOUT_SECONDS:
            raise ValueError(f"must be at most {MAX_TIMEOUT_SECONDS:g} seconds")
        return value

    @field_validator("prefill_disconnect_after_seconds")
    @classmethod
    def _delays_bounded(cls, value: list[float]) -> list[float]:
        if any(not 0 <= d <= MAX_TIMEOUT_SECONDS for d in value):
            raise ValueError(f"each delay must be between 0 and {MAX_TIMEOUT_SECONDS:g} seconds")
        return value


class CapacitySpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the capacity probe (needs metrics).")
    # No default in the schema: unset, the operator uses the model's own minKVRatio (a default of 2
    # failed, in the canary, every pool the planner had passed at minKVRatio 1.5: outside probe).
    # The bounds are written into the schema by hand so that the validator below gives the reason.
    min_ratio: float | None = Field(
        None,
        json_schema_extra={"minimum": 1.0, "maximum": MAX_KV_RATIO},
        description="Every worker's reported KV pool must be >= this x context length (S7). Unset: the "
        f"InferenceModel's minKVRatio ({DEFAULT_MIN_KV_RATIO:g} for `kvguard canary` without one); set, between 1 "
        "and the model's minKVRatio.",
    )

    @field_validator("min_ratio")
    @classmethod
    def _ratio_bounded(cls, value: float | None) -> float | None:
        if value is not None and value < 1.0:
            raise ValueError("must be at least 1: a pool below one context length cannot hold a full-length request")
        if value is not None and value > MAX_KV_RATIO:
            raise ValueError(f"must be at most {MAX_KV_RATIO:g}, as minKVRatio")
        return value

    def required_ratio(self) -> float:
        """The ratio the probe judges by: minRatio, or S7's default where nothing filled it in (a
        bare `kvguard canary`; the operator fills in the model's minKVRatio)."""
        return DEFAULT_MIN_KV_RATIO if self.min_ratio is None else self.min_ratio


DEFAULT_SAFETY_COUNTERS: tuple[str, ...] = (
    "kvguard_tag_violations_total",
    "kvguard_checksum_failures_total",
    "kvguard_hmac_failures_total",
    "kvguard_stale_writes_dropped_total",
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
)

# A client disconnect during prefill can legitimately leave a late chunk in flight: dropping it is
# S5 working, so increases of these inside the abort probe's window are reported, not failed.
DEFAULT_ABORT_TOLERANT_COUNTERS: tuple[str, ...] = (
    "kvguard_stale_writes_dropped_total",
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
)


class SafetyCountersSpec(_ProbeSpec):
    enabled: bool = Field(True, description="Run the safety-counter probe (needs metrics).")
    counters: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SAFETY_COUNTERS),
        description="Prometheus sample names that must not increase during the run (summed over "
        "labels and workers); names a worker does not expose are ignored.",
    )
    abort_tolerant_counters: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ABORT_TOLERANT_COUNTERS),
        description="Counters whose increase during the abort probe is expected and not a failure.",
    )


CONTINUOUS_PROBES: tuple[ProbeName, ...] = (
    ProbeName.CAPACITY, ProbeName.OVER_LENGTH, ProbeName.ISOLATION, ProbeName.SAFETY_COUNTERS,
)  # fmt: skip
"""The light probe set run periodically against the serving revision (no golden text, no aborts)."""


class ContinuousSpec(_SpecModel):
    """A periodic light canary against the serving revision, so that a stable revision that starts
    leaking (a node, a driver, an engine bug hit by new traffic) is caught without a rollout."""

    interval_seconds: int | None = Field(
        None, ge=10, le=86400,
        description="Seconds between runs against the serving revision; unset (the default): off.",
    )
    action: Literal["alert", "rollback"] = Field(
        "alert",
        description="On a failed run: alert (Degraded condition, Warning Event, the operator's "
        "kvguard_operator_continuous_canary_failures_total counter) or rollback (the same, then a rollback to the "
        "newest kept previous revision, when one is kept, as with kvguard.io/rollback-to; recorded in "
        "status.continuous.rollback and held until the spec's revision changes).",
    )


ANY_PROBE_ENABLED = {
    # `_something_enabled` for the API server. A section left out is enabled (its default), as is one
    # without `enabled`; a stored canary with every probe off has not parsed since that check came.
    "rule": " || ".join(f"!has(self.{to_camel(p.value)}) || !has(self.{to_camel(p.value)}.enabled) || "
                        f"self.{to_camel(p.value)}.enabled" for p in ProbeName),
    "message": "every probe is disabled; enable at least one",
}  # fmt: skip


class CanarySpec(_SpecModel):
    """Configuration of the canary coherence suite (part of the InferenceModel CRD)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{**ANY_PROBE_ENABLED}]})

    model: str | None = Field(
        None, description="Model name sent in requests; default: the first of /v1/models."
    )
    api: ApiKind = Field(
        "completions", description="Endpoint the generation probes use (over-length tests its own list)."
    )
    max_tokens: int = Field(8, ge=1, le=MAX_GENERATED_TOKENS, description="Tokens generated per probe request.")
    context_length: int | None = Field(
        None, ge=16, json_schema_extra=CONTEXT_BOUND,
        description="Context length of the target, for servers that do not advertise one (no max_model_len in "
        "/v1/models, no /server_info); it sizes isolation's long requests and the over-length cases. When unset, "
        "the operator uses the InferenceModel's contextLength.",
    )
    seed: int = Field(
        1234, ge=SEED_MIN, le=SEED_MAX,
        description="Sampling seed sent with every request (decoding is greedy); a signed 64-bit integer, the range "
        "every engine accepts. A server that refuses the field is sent none from then on (the report notes it).",
    )
    request_timeout_seconds: float = Field(
        20.0, gt=0.0, json_schema_extra=TIMEOUT_BOUND, description="A request that takes longer fails (hangs are failures)."
    )
    suite_timeout_seconds: float | None = Field(
        300.0, gt=0.0, json_schema_extra=TIMEOUT_BOUND, description="Time limit for the whole suite; probes not finished by then fail."
    )
    stop_on_failure: bool = Field(
        False, description="Stop at the first failing probe (faster verdict, less evidence)."
    )
    golden: GoldenSpec = Field(default_factory=GoldenSpec, description="Golden-output probe.")
    determinism: DeterminismSpec = Field(
        default_factory=DeterminismSpec, description="Determinism probe."
    )
    isolation: IsolationSpec = Field(default_factory=IsolationSpec, description="Isolation probe.")
    over_length: OverLengthSpec = Field(
        default_factory=OverLengthSpec, description="Over-length rejection probe (S2)."
    )
    abort: AbortSpec = Field(default_factory=AbortSpec, description="Abort/disconnect probe (S4).")
    capacity: CapacitySpec = Field(default_factory=CapacitySpec, description="KV capacity probe (S7).")
    safety_counters: SafetyCountersSpec = Field(
        default_factory=SafetyCountersSpec, description="Safety-counter probe (S1, S3, S5)."
    )
    continuous: ContinuousSpec = Field(
        default_factory=ContinuousSpec,
        description="Periodic light canary (capacity, over-length, isolation, safety counters) against the serving "
        "revision; off by default.",
    )

    @field_validator("context_length")
    @classmethod
    def _context_bounded(cls, value: int | None) -> int | None:
        return None if value is None else context_within_bound(value)

    @field_validator("request_timeout_seconds", "suite_timeout_seconds")
    @classmethod
    def _timeout_bounded(cls, value: float | None) -> float | None:
        if value is not None and value > MAX_TIMEOUT_SECONDS:
            raise ValueError(f"must be at most {MAX_TIMEOUT_SECONDS:g} seconds")
        return value

    @model_validator(mode="after")
    def _something_enabled(self) -> CanarySpec:
        if not self.enabled_probes():
            raise ValueError("every probe is disabled; enable at least one")
        return self

    def probe_enabled(self, name: ProbeName) -> bool:
        section: _ProbeSpec = getattr(self, name.value)
        return bool(section.enabled)

    def enabled_probes(self) -> list[ProbeName]:
        return [name for name in ProbeName if self.probe_enabled(name)]

    def for_changed_numerics(self) -> CanarySpec:
        """The spec for a candidate whose numerics differ from the baseline's (`RunCanary.compare_outputs`
        False): the golden probe compares by logprobs instead of exact text."""
        golden = self.golden.model_copy(update={"baseline_match": "tolerant"})
        return self.model_copy(update={"golden": golden})

    def for_continuous(self) -> CanarySpec:
        """The periodic run's spec: the light probes this spec enables (all four if it enables none)."""
        light = [p for p in CONTINUOUS_PROBES if self.probe_enabled(p)] or list(CONTINUOUS_PROBES)
        return self.only(light)

    def only(self, names: list[ProbeName]) -> CanarySpec:
        """A copy with exactly `names` enabled (the CLI's --probes)."""
        data = self.model_dump()
        for name in ProbeName:
            data[name.value]["enabled"] = name in names
        return CanarySpec.model_validate(data)
