"""The continuous canary: a light probe set against the serving revision, every intervalSeconds (pure).

`spec.canary.continuous.intervalSeconds` (off by default) runs capacity, over-length, isolation
and safety counters (`CanarySpec.for_continuous`) against the stable revision while the rollout
rests (Stable), so a revision that starts leaking without any spec change is caught. Each pass of
reconcile calls `step` (level-based: it looks only at the status and the runner's last result):

- not configured, or no resting stable revision: nothing (status.continuous cleared, but for a pin
  that still holds and the revisions that failed, which a rollout after a spec change keeps);
- a finished run of the current schedule: recorded in status.continuous.lastRun, the next one
  scheduled; a failure raises `Degraded` (ContinuousCanaryFailed) and a Warning Event, and with
  `action: rollback` pins the newest kept previous revision in status.continuous.rollback: reconcile
  then rolls back to it exactly as for kvguard.io/rollback-to (the operator writes only status,
  never the user's object). The pin holds while the spec's revision is the one that failed, so
  the failed revision is not rolled out again until the spec changes (or the user names another
  revision with kvguard.io/rollback-to);
- otherwise: start the run once its time has come, else wake up then.

The Degraded condition follows the last recorded run (set while it failed, cleared by a pass), so
it survives passes and operator restarts without any memory.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kvguard.operator.canary.spec import ContinuousSpec
from kvguard.operator.rollout import CanaryResult

FAILED_REASON = "ContinuousCanaryFailed"
CANNOT_RUN_REASON = "ContinuousCanaryCannotRun"


class _StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", use_attribute_docstrings=True)


class ContinuousRun(_StatusModel):
    """One finished run of the continuous canary."""

    revision: str
    """The serving revision it ran against."""
    attempt: str
    """The scheduled time it ran for (RFC 3339): the run's id."""
    verdict: Literal["pass", "fail", "cannot_run"]
    """pass, fail or cannot_run."""
    finished_at: str
    """RFC 3339 time the result was recorded."""
    reason: str = ""
    """One line from the report."""
    failed_probes: list[str] = Field(default_factory=list)
    """Probes that failed."""
    duration_seconds: float = 0.0


class ContinuousRollback(_StatusModel):
    """A rollback the continuous canary decided (action: rollback)."""

    to_revision: str
    """The kept previous revision rolled back to."""
    from_revision: str
    """The serving revision that failed: the pin holds while the spec's revision is this one."""
    at: str
    """RFC 3339 time of the decision."""


MAX_FAILED_REMEMBERED = 16  # far more than revisionHistoryLimit keeps


class ContinuousStatus(_StatusModel):
    """status.continuous: the schedule and the last run of the continuous canary."""

    interval_seconds: int
    action: Literal["alert", "rollback"]
    revision: str
    """The serving revision the schedule is for (a promotion starts a new schedule)."""
    next_run_at: str
    """RFC 3339 time of the next run (also the id of that run)."""
    last_run: ContinuousRun | None = None
    consecutive_failures: int = 0
    rollback: ContinuousRollback | None = None
    """Set by a failure with action rollback; reconcile pins the rollout to `toRevision`."""
    failed_revisions: list[str] = Field(default_factory=list, max_length=MAX_FAILED_REMEMBERED)
    """Revisions whose last continuous run failed, newest first: a rollback never goes to one (a
    third failure went back to the first failed revision, and on, between them)."""


@dataclass(frozen=True)
class ContinuousEvent:
    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class ContinuousDecision:
    status: ContinuousStatus | None
    start: tuple[str, str] | None = None
    """(revision, attempt) of a run to start now."""
    requeue_after: float | None = None
    degraded: tuple[str, str] | None = None
    """(reason, message) of the Degraded condition while the last run did not pass."""
    recorded: str | None = None
    """The verdict of a run recorded in this pass (the operator counts failures)."""
    rollback_to: str | None = None
    """The revision a failure recorded in this pass rolls back to (the next pass acts on the pin)."""
    stop: bool = False
    """A run is in flight that nobody will read: stop it (the rollout left rest, or the continuous
    canary was turned off)."""
    events: list[ContinuousEvent] = field(default_factory=list)


def rollback_pin(previous: ContinuousStatus | None, target: str) -> str | None:
    """The revision the rollout is pinned to by an earlier failure, while the spec's revision is
    still the one that failed."""
    pin = previous.rollback if previous is not None else None
    return pin.to_revision if pin is not None and pin.from_revision == target else None


def rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def step(
    spec: ContinuousSpec, previous: ContinuousStatus | None, stable: str | None, resting: bool,
    result: CanaryResult | None, running: bool, kept: Sequence[str], now: dt.datetime, target: str,
) -> ContinuousDecision:  # fmt: skip
    """`resting`: the rollout is Stable on `stable`; `result`: the runner's last continuous result;
    `kept`: previous stable revisions still kept (newest first); `target`: the spec's revision."""
    pinned = previous is not None and rollback_pin(previous, target) is not None
    if spec.interval_seconds is None or stable is None or not resting:
        # Mid-rollout the rollout's own canary runs, and a periodic run still in flight is stopped
        # (its result would be thrown away; an outside probe saw it probe the stable through the
        # rollout). The pin outlives the rollback's rollout, and the failed revisions outlive a spec
        # change: the next stable's rollback must not go to one.
        if spec.interval_seconds is None or previous is None or not (pinned or previous.failed_revisions):
            return ContinuousDecision(None, stop=running)
        return ContinuousDecision(previous if pinned else previous.model_copy(update={"rollback": None}), stop=running)  # a void pin goes
    interval = spec.interval_seconds
    current = previous
    if current is None or current.revision != stable or current.interval_seconds != interval or current.action != spec.action:
        current = ContinuousStatus(interval_seconds=interval, action=spec.action, revision=stable,
                                   next_run_at=rfc3339(now + dt.timedelta(seconds=interval)),
                                   rollback=previous.rollback if pinned and previous is not None else None,
                                   failed_revisions=previous.failed_revisions if previous is not None else [])  # fmt: skip
    elif not pinned and current.rollback is not None:
        current = current.model_copy(update={"rollback": None})  # the spec moved on: the pin is void
    if result is not None and result.revision == stable and result.attempt == current.next_run_at:
        return _record(spec, current, result, kept, now)
    decision = _degraded(current)
    if running:
        return ContinuousDecision(current, degraded=decision)
    due = _parse(current.next_run_at)
    if now >= due:
        return ContinuousDecision(current, start=(stable, current.next_run_at), degraded=decision)
    return ContinuousDecision(current, requeue_after=(due - now).total_seconds(), degraded=decision)


def _record(spec: ContinuousSpec, current: ContinuousStatus, result: CanaryResult, kept: Sequence[str], now: dt.datetime) -> ContinuousDecision:
    run = ContinuousRun(revision=result.revision, attempt=result.attempt, verdict=result.verdict, finished_at=rfc3339(now),
                        reason=result.reason, failed_probes=list(result.failed_probes), duration_seconds=result.duration_seconds)  # fmt: skip
    failures = 0 if run.verdict == "pass" else current.consecutive_failures + 1
    # The spec's revision that failed: the run's own, or, while an earlier failure's pin holds
    # (`step` voids it once the spec moves on), the one that failure was of.
    pinned = current.rollback
    spec_failed = pinned.from_revision if pinned is not None else run.revision
    others = [r for r in current.failed_revisions if r != run.revision]
    failed = {"fail": [run.revision, *others], "pass": others}.get(run.verdict, current.failed_revisions)[:MAX_FAILED_REMEMBERED]
    usable = [r for r in kept if r not in (*failed, spec_failed)]  # never back to a revision that failed
    rollback_to = usable[0] if run.verdict == "fail" and spec.action == "rollback" and usable else None
    pin = ContinuousRollback(to_revision=rollback_to, from_revision=spec_failed, at=rfc3339(now)) if rollback_to else current.rollback
    status = current.model_copy(update={
        "last_run": run, "consecutive_failures": failures, "rollback": pin, "failed_revisions": failed,
        "next_run_at": rfc3339(now + dt.timedelta(seconds=current.interval_seconds)),
    })  # fmt: skip
    events = []
    if run.verdict == "pass":
        if current.last_run is not None and current.last_run.verdict != "pass":
            events.append(ContinuousEvent("Normal", "ContinuousCanaryPassed", f"revision {run.revision} passes the continuous canary again"))
    else:
        events.append(ContinuousEvent("Warning", FAILED_REASON if run.verdict == "fail" else CANNOT_RUN_REASON, _message(run)))
        if run.verdict == "fail" and spec.action == "rollback":
            events.append(ContinuousEvent("Warning", "ContinuousCanaryRollback", f"rolling back to {rollback_to}" if rollback_to
                                          else "action rollback, but no kept previous revision that has not failed: "
                                          "alerting only"))  # fmt: skip
    requeue = 0.0 if rollback_to else float(current.interval_seconds)  # a rollback is acted on at once
    return ContinuousDecision(status, requeue_after=requeue, degraded=_degraded(status),
                              recorded=run.verdict, rollback_to=rollback_to, events=events)  # fmt: skip


def _message(run: ContinuousRun) -> str:
    probes = f" (failed: {', '.join(run.failed_probes)})" if run.failed_probes else ""
    return f"continuous canary of serving revision {run.revision}: {run.verdict}{probes}: {run.reason}"


def _degraded(status: ContinuousStatus) -> tuple[str, str] | None:
    run = status.last_run
    if run is None or run.verdict == "pass" or run.revision != status.revision:
        return None
    return (FAILED_REASON if run.verdict == "fail" else CANNOT_RUN_REASON), _message(run)


__all__ = ["CANNOT_RUN_REASON", "FAILED_REASON", "ContinuousDecision", "ContinuousEvent", "ContinuousRollback", "ContinuousRun",
           "ContinuousStatus", "rollback_pin", "step"]  # fmt: skip
