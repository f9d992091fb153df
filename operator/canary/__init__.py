"""kvguard.operator.canary: the canary coherence suite.

Judges the *content* of a deployment's outputs, against any OpenAI-compatible base URL (ours,
SGLang, vLLM), optionally a baseline URL (the stable revision) and the workers' `/metrics`.
Probes (one module each): golden, determinism, isolation, over_length, abort, capacity,
safety_counters. `run_suite` runs them and returns a `CanaryReport`; `CanarySpec` configures them.
How each engine's capacity and counters are read is documented in `kvguard.operator.canary.metrics`.
Pure and HTTP only: no torch, kopf or kubernetes imports.

`spec` and `report` are pydantic only (the API models embed them); the suite, which needs aiohttp,
is imported on first use, so `kvguard plan` and the other pure layers run on the base install.
"""

from typing import TYPE_CHECKING, Any

from kvguard.operator.canary.report import (
    CanaryReport,
    ProbeResult,
    ProbeStatus,
    TargetInfo,
    Verdict,
)
from kvguard.operator.canary.spec import CanarySpec, ProbeName

if TYPE_CHECKING:
    from kvguard.operator.canary.suite import ProgressCallback, ProgressEvent, run_suite

_SUITE_NAMES = ("ProgressCallback", "ProgressEvent", "run_suite")


def __getattr__(name: str) -> Any:
    if name in _SUITE_NAMES:
        from kvguard.operator.canary import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CanaryReport",
    "CanarySpec",
    "ProbeName",
    "ProbeResult",
    "ProbeStatus",
    "ProgressCallback",
    "ProgressEvent",
    "TargetInfo",
    "Verdict",
    "run_suite",
]
