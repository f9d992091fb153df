"""SGLang's own KV canary reports violations in its log, and nowhere else: reading them (pure).

sglang 0.5.22/0.5.23 `srt/kv_canary/runner/violation_reporter.py`: with `--kv-canary log` every
violation is logged as a WARNING whose first line is frozen by SGLang's own tests:

    kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_chain slot_idx=12 position=7 ...

With `--kv-canary raise` the same lines are the message of the RuntimeError that stops the
scheduler (and the server). No Prometheus metric or HTTP endpoint carries them (checked by
tests/test_engine_conformance.py), so the canary scans the engine logs it is given: files
(`kvguard canary --engine-log FILE`) or, in the operator, each SGLang pod's log through the
Kubernetes API (`operator/backends/kubernetes.py` PodLog). Lines written while the suite runs are
this run's: an `EngineLog` is marked when the suite starts and read when the safety probe runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SGLANG_VIOLATION_PREFIX = "kv_canary violation:"
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass(frozen=True)
class KVCanaryViolation:
    launch_tag: str
    fail_reason: str
    slot_idx: str
    position: str
    line: str

    def describe(self) -> str:
        return f"{self.launch_tag} {self.fail_reason} at slot {self.slot_idx}, position {self.position}"


def parse_violations(text: str) -> list[KVCanaryViolation]:
    """Every structured violation line in `text` (log noise and other lines are ignored)."""
    found = []
    for line in text.splitlines():
        at = line.find(SGLANG_VIOLATION_PREFIX)
        if at < 0:
            continue
        fields = dict(_FIELD.findall(line[at + len(SGLANG_VIOLATION_PREFIX):]))
        found.append(KVCanaryViolation(
            fields.get("launch_tag", "?"), fields.get("fail_reason", "?"), fields.get("slot_idx", "?"),
            fields.get("position", "?"), line[at:].strip(),
        ))  # fmt: skip
    return found


class EngineLog(Protocol):
    """One engine's log, read from a mark on (I/O: each source knows how to reach its log)."""

    @property
    def name(self) -> str: ...

    async def mark(self) -> None:
        """Remember where the log ends now: `appended` returns what comes after."""

    async def appended(self) -> str:
        """The text written since `mark` (may repeat a little before it, never miss any)."""


class FileLog:
    """A log file on this machine (`kvguard canary --engine-log FILE`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    @property
    def name(self) -> str:
        return str(self.path)

    async def mark(self) -> None:
        self._offset = log_offsets([self.path])[self.path]

    async def appended(self) -> str:
        return appended_text(self.path, self._offset)


def log_offsets(paths: list[Path]) -> dict[Path, int]:
    """Where each log ends now (a missing file counts as empty: it may appear later)."""
    return {p: p.stat().st_size if p.exists() else 0 for p in paths}


def appended_text(path: Path, offset: int) -> str:
    """What was written to `path` after `offset` (all of it when the log was rotated/truncated)."""
    if not path.exists():
        return ""
    with path.open("rb") as handle:
        size = path.stat().st_size
        handle.seek(offset if offset <= size else 0)
        return handle.read().decode("utf-8", errors="replace")
