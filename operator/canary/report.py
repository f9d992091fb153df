"""The canary report: per probe a status, a reason and evidence an engineer can act on.

Evidence is a discriminated union (`kind`), so that JSON consumers (the operator's status, a
dashboard) can render each piece without guessing: two differing outputs, one HTTP exchange, a
leaked nonce, counter deltas, pool usage over time, one worker's capacity, or a plain note.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from kvguard.operator.canary.spec import ProbeName

# Long bodies and outputs are cut so a report stays readable and fits in a CRD status.
EVIDENCE_TEXT_LIMIT = 2000


def clip(text: str, limit: int = EVIDENCE_TEXT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


# A reason is one table row and one stderr line; server text inside it must not break either.
REASON_LIMIT = 1000
_ANSI_SEQUENCE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def one_line(text: str, limit: int = REASON_LIMIT) -> str:
    """`text` as one printable line: whitespace runs (newlines included) become one space, control
    and format characters (ANSI escapes, bidi overrides) are dropped, and it is cut at `limit`.
    Servers supply part of what reasons quote (error messages, HTML bodies, model ids), and a
    crafted one must not fake a verdict line or recolour the terminal."""
    kept = "".join(c for c in _ANSI_SEQUENCE.sub("", text) if c.isspace() or unicodedata.category(c) not in ("Cc", "Cf"))
    flat = " ".join(kept.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class _ReportModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class ProbeStatus(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


class Verdict(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    CANNOT_RUN = "cannot_run"


class OutputMismatch(_ReportModel):
    kind: Literal["output_mismatch"] = "output_mismatch"
    request: str = Field(description="Which request, e.g. 'B after A (0.7 of admissible)'.")
    expected_from: str = Field(description="Where the expected output came from.")
    expected: str
    actual: str


class HttpExchange(_ReportModel):
    kind: Literal["http"] = "http"
    request: str = Field(description="What was sent (endpoint, stream, size).")
    status: int | None = Field(None, description="HTTP status; null when none was received.")
    body: str = Field("", description="Response body or stream text (clipped).")
    error: str | None = Field(None, description="Transport, timeout or protocol error.")
    tokens_received: int = Field(0, description="Content chunks/characters of generated text seen.")
    finish_reason: str | None = Field(None, description="The finish reason the server sent, if any.")


class NonceLeak(_ReportModel):
    kind: Literal["nonce_leak"] = "nonce_leak"
    nonce: str
    owner: str = Field(description="The request the nonce belongs to.")
    found_in: str = Field(description="The request whose output contained it.")
    output: str


class CounterDeltas(_ReportModel):
    kind: Literal["counters"] = "counters"
    deltas: dict[str, float]
    before: dict[str, float]
    after: dict[str, float]
    note: str = ""


class PoolUsage(_ReportModel):
    kind: Literal["pool_usage"] = "pool_usage"
    # Whole tokens: a usage read as a fraction x capacity (vLLM) is rounded, not shown as 0.0.
    baseline_tokens: int
    final_tokens: int
    waited_seconds: float
    samples: list[tuple[float, int]] = Field(
        default_factory=list, description="(seconds since the aborts, used tokens) pairs."
    )
    generated_tokens: int | None = Field(
        None, description="Tokens the workers counted as generated while the pages were held (None: no worker "
        "exposes a generation counter).",
    )


class CapacityReading(_ReportModel):
    kind: Literal["capacity"] = "capacity"
    worker: str
    source: str = Field(description="Metric or endpoint the capacity was read from.")
    capacity_tokens: int | None
    context_length: int | None
    ratio: float | None
    required_ratio: float


class Note(_ReportModel):
    kind: Literal["note"] = "note"
    message: str


Evidence = Annotated[
    OutputMismatch | HttpExchange | NonceLeak | CounterDeltas | PoolUsage | CapacityReading | Note,
    Field(discriminator="kind"),
]


class ProbeResult(_ReportModel):
    name: ProbeName
    status: ProbeStatus
    reason: str = Field("", description="One line: why it failed or was skipped, or what passed.")
    duration_seconds: float = 0.0
    evidence: list[Evidence] = Field(default_factory=list)

    @field_validator("reason")
    @classmethod
    def _one_line(cls, value: str) -> str:
        return one_line(value)


class TargetInfo(_ReportModel):
    url: str
    baseline_url: str | None = None
    metrics_urls: list[str] = Field(default_factory=list)
    model: str | None = None
    context_length: int | None = Field(None, description="The context length the probes were sized from.")
    context_length_source: str | None = Field(
        None, description="Where it came from: --context-length, spec.canary.contextLength, /v1/models max_model_len, "
        "/server_info context_length or a metric."
    )
    context_notes: list[str] = Field(
        default_factory=list, description="Other context lengths the servers advertised, when they differ."
    )
    min_pool_tokens: int | None = Field(None, description="Smallest KV pool reported by a worker.")
    engines: list[str] = Field(
        default_factory=list, description="Engines recognised from metrics or /server_info (kvguard, sglang, vllm)."
    )
    engine_version: str | None = Field(None, description="The version /server_info reports (SGLang).")
    metrics_without_engine: list[str] = Field(
        default_factory=list, description="Metrics URLs that answered without any engine's metrics (a router?)."
    )
    seed_refused_by: list[str] = Field(
        default_factory=list, description="The servers (target, baseline URL) that refused the `seed` field: each was "
        "asked once more without it, and sent none from then on."
    )
    notes: list[str] = Field(
        default_factory=list, description="Notes on the run as a whole: what was sent differently to suit a server "
        "(a refused `seed`), and what that leaves unchecked."
    )


class CanaryReport(_ReportModel):
    verdict: Verdict
    reason: str = ""
    target: TargetInfo
    started_at: str = Field(description="UTC ISO-8601 time the suite started.")
    duration_seconds: float = 0.0
    time_to_verdict_seconds: float = Field(
        0.0, description="Seconds until the verdict was known: the first failure, else the end."
    )
    probes: list[ProbeResult] = Field(default_factory=list)

    @field_validator("reason")
    @classmethod
    def _one_line(cls, value: str) -> str:
        return one_line(value)

    def probe(self, name: ProbeName) -> ProbeResult | None:
        return next((p for p in self.probes if p.name == name), None)

    def failed_probes(self) -> list[ProbeName]:
        return [p.name for p in self.probes if p.status == ProbeStatus.FAIL]

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)
