"""What the target says about itself, over HTTP only: its context length and engine.

The suite sizes isolation's long requests and the over-length cases from the context length, so
it must know it. It uses the smallest value any of these sources gives (the first of equals, in
this order; the report names the one used, and every value found, so a mismatch is visible):

1. configured: `kvguard canary --context-length N`, else `spec.canary.contextLength` (the operator
   fills it from the InferenceModel's contextLength) - for servers that advertise nothing
   (`transformers serve`);
2. `GET /v1/models` `data[].max_model_len` (vLLM `ModelCard`; SGLang `ModelCard`, set from
   `model_config.context_len`: sglang 0.5.22/0.5.23 `srt/entrypoints/http_server.py`
   `available_models`; vLLM 0.33.0 `entrypoints/openai/models/protocol.py`);
3. SGLang `GET /server_info` (older name `/get_server_info`) `context_length`: the resolved server
   arguments (sglang 0.5.23 `srt/utils/common.py` `build_server_info`); `GET /model_info`
   (`/get_model_info`) is read too, but 0.5.22/0.5.23 put no context length there;
4. metrics: `kvguard_context_length_tokens`, or SGLang's `/server_info` behind a metrics URL.

Pure except `discover_from_target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvguard.operator.canary.client import get_text
from kvguard.operator.canary.responses import parse_json_text
from kvguard.operator.canary.spec import MAX_CONTEXT_TOKENS, MIN_CONTEXT_TOKENS

# (current name, deprecated name): both served by sglang 0.5.22/0.5.23 (`http_server.py`).
SGLANG_INFO_PATHS: tuple[tuple[str, str], ...] = (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info"))


@dataclass(frozen=True)
class ContextReading:
    source: str  # e.g. "/v1/models max_model_len"
    tokens: int


@dataclass
class TargetFacts:
    """Everything found about the target before the probes run."""

    readings: list[ContextReading] = field(default_factory=list)
    engine: str | None = None  # from /server_info: "sglang"
    engine_version: str | None = None


def choose_context_length(configured: ContextReading | None, readings: list[ContextReading]) -> ContextReading | None:
    """The smallest of the configured and advertised values (the first of equals, in the order of
    the module doc). The smallest is the one that binds: a server whose /v1/models says more than
    its engines hold (the incident's shape) answered the requests in between with 200 and junk,
    and the suite, sized from the larger value, never sent one (an outside probe's false PASS)."""
    candidates = ([configured] if configured is not None else []) + readings
    return min(candidates, key=lambda r: r.tokens) if candidates else None


def bounded_readings(readings: list[ContextReading]) -> tuple[list[ContextReading], list[str]]:
    """(plausible readings, a note per dropped one). A server's number is not trusted blindly: the
    probes build prompts of that size in memory, so one outside the bounds of
    spec.contextLength is ignored."""
    kept = [r for r in readings if MIN_CONTEXT_TOKENS <= r.tokens <= MAX_CONTEXT_TOKENS]
    notes = [
        f"{r.source} says {r.tokens} tokens: ignored, outside {MIN_CONTEXT_TOKENS}..{MAX_CONTEXT_TOKENS:,}"
        for r in readings
        if r not in kept
    ]
    return kept, notes


def context_notes(chosen: ContextReading | None, readings: list[ContextReading]) -> list[str]:
    """Human-readable disagreements between the value used and what the servers advertise."""
    if chosen is None:
        return []
    return [
        f"{r.source} says {r.tokens} tokens; the suite uses {chosen.tokens} from {chosen.source}"
        for r in readings
        if r.tokens != chosen.tokens
    ]


def readings_from_sglang_info(path: str, payload: Any) -> tuple[list[ContextReading], str | None]:
    """(context readings, engine version) from one SGLang info body (pure)."""
    if not isinstance(payload, dict):
        return [], None
    readings = []
    value = payload.get("context_length")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        readings.append(ContextReading(f"{path} context_length", value))
    version = payload.get("version")
    return readings, version if isinstance(version, str) else None


async def discover_from_target(session: aiohttp.ClientSession, root: str, timeout: float) -> TargetFacts:
    """Ask the SGLang info endpoints (current name, then the deprecated one); a server without them
    (404: vLLM, ours, transformers serve) simply has nothing to say."""
    facts = TargetFacts()
    for names in SGLANG_INFO_PATHS:
        for path in names:
            payload = await _get_json(session, root + path, timeout)
            if payload is None:
                continue
            readings, version = readings_from_sglang_info(path, payload)
            facts.readings += readings
            if "server_info" in path and "internal_states" in payload:
                facts.engine, facts.engine_version = "sglang", version
            break
    return facts


async def _get_json(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, Any] | None:
    status, body, error = await get_text(session, url, timeout)
    if error is not None or status != 200:
        return None
    payload, bad = parse_json_text(body)
    return payload if bad is None and isinstance(payload, dict) else None
