"""Test-only fault injection, enabled solely by the ``KVGUARD_FAULTS`` environment variable.

Never on by default. Tests and the canary suite turn switches on to prove that each safety
mechanism catches the failure it exists for. The value is a comma-separated list::

    KVGUARD_FAULTS="corrupt_chunk=0.1,delay_chunk_ms=50,seed=7"

| switch                          | consumer        | effect                                                |
| ------------------------------- | --------------- | ----------------------------------------------------- |
| ``corrupt_chunk=P``             | transfer sender | flip one payload byte after checksumming, prob. P     |
| ``drop_chunk=P``                | transfer sender | skip sending a chunk (still listed in the manifest)   |
| ``delay_chunk_ms=N``            | transfer sender | sleep N ms before every chunk                         |
| ``delay_prefill_ms=N``          | prefill server  | sleep N ms before computing each prompt (a long prefill)|
| ``delay_prefill_reply_ms=N``    | prefill server  | sleep N ms before answering, once the KV was sent      |
| ``delay_step_ms=N``             | engine thread   | sleep N ms after every engine step (a paced generation)|
| ``crash_prefill_after_chunks=N``| transfer sender | the prefill process dies after sending N chunks       |
| ``cut_decode_calls=N``          | decode server   | drop the connection of the first N decode legs unanswered|
| ``no_abort_propagation``        | sender, servers | aborts are not propagated to the peer (no ABORT frame)|
| ``no_checksum``                 | transfer recv.  | decode skips payload checksum verification            |
| ``no_tags``                     | engine          | page generation tags are not checked at read time     |
| ``unsafe_reject_path``          | servers         | the incident: over-length becomes a placeholder token |
| ``ignore_manifest``             | transfer recv.  | decode reports completion without checking the plan   |
| ``fail_proxied_requests``       | router          | 500 to requests with X-Forwarded-For (live traffic)   |
| ``seed=N``                      | all random ones | seed of the RNG behind ``corrupt_chunk``/``drop_chunk``|

Probabilistic switches draw from ``Faults.rng()`` (a ``random.Random`` seeded with ``seed``), so a
given sequence of chunks sees the same faults on every run.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_VAR = "KVGUARD_FAULTS"

log = logging.getLogger("kvguard.faults")


class FaultSpecError(ValueError):
    """The ``KVGUARD_FAULTS`` value names an unknown switch or carries a bad value."""


class Faults(BaseModel):
    """The parsed fault switches. The default instance has every fault off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    corrupt_chunk: float = Field(0.0, ge=0.0, le=1.0, description="probability per chunk")
    drop_chunk: float = Field(0.0, ge=0.0, le=1.0, description="probability per chunk")
    delay_chunk_ms: int = Field(0, ge=0, le=600_000)
    delay_prefill_ms: int = Field(0, ge=0, le=600_000)
    delay_prefill_reply_ms: int = Field(0, ge=0, le=600_000)
    delay_step_ms: int = Field(0, ge=0, le=60_000)
    crash_prefill_after_chunks: int | None = Field(None, ge=0)
    cut_decode_calls: int = Field(0, ge=0, le=1_000_000)
    no_abort_propagation: bool = False
    no_checksum: bool = False
    no_tags: bool = False
    unsafe_reject_path: bool = False
    ignore_manifest: bool = False
    fail_proxied_requests: bool = False
    seed: int = 0

    def enabled(self) -> list[str]:
        """The switches that differ from the safe default, in ``KVGUARD_FAULTS`` syntax."""
        default = Faults()
        out: list[str] = []
        for name in _SWITCHES:
            value = getattr(self, name)
            if value == getattr(default, name):
                continue
            out.append(name if isinstance(value, bool) else f"{name}={value}")
        return out

    @property
    def any_enabled(self) -> bool:
        return any(not switch.startswith("seed=") for switch in self.enabled())

    def rng(self) -> random.Random:
        """A fresh RNG for the probabilistic switches; each consumer owns one."""
        return random.Random(self.seed)

    def to_spec(self) -> str:
        """The ``KVGUARD_FAULTS`` string that parses back to this value (for child processes)."""
        return ",".join(self.enabled())


NO_FAULTS = Faults()

_FLAGS = frozenset(
    name for name, field in Faults.model_fields.items() if field.annotation is bool
)
_SWITCHES = tuple(Faults.model_fields)


def parse_faults(spec: str) -> Faults:
    """Parse a ``KVGUARD_FAULTS`` value. Raises ``FaultSpecError`` naming the offending switch."""
    values: dict[str, object] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if name not in Faults.model_fields:
            known = ", ".join(_SWITCHES)
            raise FaultSpecError(f"{ENV_VAR}: unknown fault switch {name!r} (known: {known})")
        if name in values:
            raise FaultSpecError(f"{ENV_VAR}: switch {name!r} given twice")
        if name in _FLAGS:
            if sep:
                raise FaultSpecError(f"{ENV_VAR}: switch {name!r} takes no value (got {item!r})")
            values[name] = True
            continue
        if not sep or not value:
            raise FaultSpecError(f"{ENV_VAR}: switch {name!r} needs a value, e.g. {name}=N")
        values[name] = value
    try:
        return Faults.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise FaultSpecError(f"{ENV_VAR}: {problems}") from None


def faults_from_env(environ: Mapping[str, str] | None = None) -> Faults:
    """Parse the faults from ``environ`` (default ``os.environ``); unset or empty means none."""
    env = os.environ if environ is None else environ
    return parse_faults(env.get(ENV_VAR, ""))


def log_enabled_faults(faults: Faults, logger: logging.Logger = log) -> None:
    """Log every enabled fault at WARNING so nobody mistakes a faulty process for a healthy one."""
    for switch in faults.enabled():
        logger.warning("FAULT INJECTION ENABLED: %s (from %s; test use only)", switch, ENV_VAR)


@functools.cache
def active_faults() -> Faults:
    """The process-wide faults: parsed once from the environment and logged loudly."""
    faults = faults_from_env()
    log_enabled_faults(faults)
    return faults
