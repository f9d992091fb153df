"""The continuous canary's schedule and verdicts (operator/continuous.py, pure)."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from kvguard.operator.canary.spec import CanarySpec, ContinuousSpec, ProbeName
from kvguard.operator.continuous import FAILED_REASON, rollback_pin, step
from kvguard.operator.rollout import CanaryResult

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
ALERT = ContinuousSpec(interval_seconds=60)
ROLLBACK = ContinuousSpec(interval_seconds=60, action="rollback")


def test_off_by_default_and_only_while_the_rollout_rests() -> None:
    assert CanarySpec().continuous.interval_seconds is None
    assert step(CanarySpec().continuous, None, "r1", True, None, False, [], T0, "r1").status is None
    assert step(ALERT, None, "r1", False, None, False, [], T0, "r1").status is None  # mid-rollout: the rollout's canary runs
    assert step(ALERT, None, None, True, None, False, [], T0, "r1").status is None
    with pytest.raises(ValidationError):
        ContinuousSpec(interval_seconds=1)  # bounded work: at most one run per 10 s per model


def test_the_light_probe_set() -> None:
    assert CanarySpec().for_continuous().enabled_probes() == [ProbeName.CAPACITY, ProbeName.OVER_LENGTH, ProbeName.ISOLATION,
                                                              ProbeName.SAFETY_COUNTERS]  # fmt: skip
    lean = CanarySpec.model_validate({"isolation": {"enabled": False}})
    assert ProbeName.ISOLATION not in lean.for_continuous().enabled_probes()


def test_schedule_run_record_and_wake_up() -> None:
    first = step(ALERT, None, "r1", True, None, False, [], T0, "r1")
    assert first.status is not None and first.status.next_run_at == "2026-01-01T00:01:00Z" and first.requeue_after == 60
    assert first.start is None
    due = step(ALERT, first.status, "r1", True, None, False, [], T0 + dt.timedelta(seconds=61), "r1")
    assert due.start == ("r1", "2026-01-01T00:01:00Z")
    assert step(ALERT, first.status, "r1", True, None, True, [], T0 + dt.timedelta(seconds=62), "r1").start is None  # running
    ok = CanaryResult("r1", "2026-01-01T00:01:00Z", "pass", "all passed")
    recorded = step(ALERT, first.status, "r1", True, ok, False, [], T0 + dt.timedelta(seconds=70), "r1")
    assert recorded.recorded == "pass" and recorded.degraded is None and recorded.status is not None
    assert recorded.status.last_run is not None and recorded.status.next_run_at == "2026-01-01T00:02:10Z"
    # The same result again is not recorded twice (level-based: a pass that sees it again does nothing).
    again = step(ALERT, recorded.status, "r1", True, ok, False, [], T0 + dt.timedelta(seconds=71), "r1")
    assert again.recorded is None and again.status == recorded.status


def test_a_failure_degrades_and_rolls_back_only_when_asked_and_kept() -> None:
    schedule = step(ROLLBACK, None, "r2", True, None, False, [], T0, "r2").status
    assert schedule is not None
    bad = CanaryResult("r2", schedule.next_run_at, "fail", "failed: over_length", ("over_length",))
    later = T0 + dt.timedelta(seconds=90)
    failed = step(ROLLBACK, schedule, "r2", True, bad, False, ["r1"], later, "r2")
    assert failed.degraded is not None and failed.degraded[0] == FAILED_REASON and "over_length" in failed.degraded[1]
    assert failed.rollback_to == "r1" and [e.reason for e in failed.events] == [FAILED_REASON, "ContinuousCanaryRollback"]
    assert failed.requeue_after == 0.0  # acted on at once
    assert failed.status is not None and failed.status.rollback is not None
    assert rollback_pin(failed.status, "r2") == "r1" and rollback_pin(failed.status, "r3") is None  # until the spec moves on
    assert step(ROLLBACK, schedule, "r2", True, bad, False, [], later, "r2").rollback_to is None  # nothing kept: alert only
    alert_schedule = schedule.model_copy(update={"action": "alert"})
    assert step(ALERT, alert_schedule, "r2", True, bad, False, ["r1"], later, "r2").rollback_to is None
    # Degraded holds on later passes (from status, not memory) until a run passes.
    assert failed.status is not None
    held = step(ROLLBACK, failed.status, "r2", True, bad, False, ["r1"], later + dt.timedelta(seconds=1), "r2")
    assert held.degraded == failed.degraded and held.rollback_to is None
    # The pin outlives the rollback's own rollout and the new schedule on the revision rolled back to.
    rolling = step(ROLLBACK, failed.status, "r2", False, None, False, [], later, "r2")
    assert rolling.status == failed.status
    back = step(ROLLBACK, failed.status, "r1", True, None, False, [], later, "r2")
    assert back.status is not None and back.status.revision == "r1" and rollback_pin(back.status, "r2") == "r1"
    assert back.degraded is None  # r1 has not failed
    moved_on = step(ROLLBACK, back.status, "r1", True, None, False, [], later, "r3")
    assert moved_on.status is not None and moved_on.status.rollback is None


def test_a_second_failure_never_rolls_back_to_the_revision_that_failed_first() -> None:
    """Outside probe: the spec's r2 failed and the rollout was pinned to r1; when r1 failed too,
    the pin moved to r2 -- the revision that had just failed -- and, the pin naming r2 now, the
    spec's failed revision was rolled out again. The pin now goes to a kept revision that has not
    failed (still "from" the spec's r2), or stays where it is with an alert."""
    schedule = step(ROLLBACK, None, "r2", True, None, False, [], T0, "r2").status
    assert schedule is not None
    first = step(ROLLBACK, schedule, "r2", True, CanaryResult("r2", schedule.next_run_at, "fail", "x", ("over_length",)), False,
                 ["r1", "r0"], T0 + dt.timedelta(seconds=90), "r2")  # fmt: skip
    assert first.rollback_to == "r1" and first.status is not None
    serving_r1 = step(ROLLBACK, first.status, "r1", True, None, False, ["r2", "r0"], T0 + dt.timedelta(seconds=91), "r2").status
    assert serving_r1 is not None
    bad_r1 = CanaryResult("r1", serving_r1.next_run_at, "fail", "x", ("isolation",))
    later = T0 + dt.timedelta(seconds=300)
    second = step(ROLLBACK, serving_r1, "r1", True, bad_r1, False, ["r2", "r0"], later, "r2")
    assert second.rollback_to == "r0" and second.status is not None
    assert rollback_pin(second.status, "r2") == "r0"  # the spec still names r2, which failed: pinned on
    none_left = step(ROLLBACK, serving_r1, "r1", True, bad_r1, False, ["r2"], later, "r2")
    assert none_left.rollback_to is None and none_left.status is not None
    assert rollback_pin(none_left.status, "r2") == "r1"  # nothing else kept: the pin stays, and an alert says so
    assert "not failed" in none_left.events[-1].message


def test_a_third_failure_never_goes_back_to_a_revision_that_failed() -> None:
    """Outside probe (after the fix above): r3 fails -> r2; r2 fails -> r1; r1 fails -> back to r2,
    which had failed one run earlier, and on between failed revisions. Failed revisions are now
    remembered (status.continuous.failedRevisions) until one passes again."""
    status = step(ROLLBACK, None, "r3", True, None, False, [], T0, "r3").status
    now = T0
    for serving, kept, expected in (("r3", ["r2", "r1"], "r2"), ("r2", ["r3", "r1"], "r1"), ("r1", ["r2", "r3"], None)):
        assert status is not None
        status = step(ROLLBACK, status, serving, True, None, False, kept, now, "r3").status  # its own schedule
        assert status is not None
        now += dt.timedelta(seconds=200)
        failed = step(ROLLBACK, status, serving, True, CanaryResult(serving, status.next_run_at, "fail", "x", ("isolation",)),
                      False, kept, now, "r3")  # fmt: skip
        assert failed.rollback_to == expected, (serving, failed.rollback_to)
        status = failed.status
    assert status is not None and status.failed_revisions == ["r1", "r2", "r3"]
    assert rollback_pin(status, "r3") == "r1"  # nothing that has not failed is kept: the pin stays, alerting


def test_failed_revisions_outlive_a_spec_change_and_its_rollout() -> None:
    """Outside-probe follow-up: a rollout after a spec change dropped status.continuous (no pin held
    it), and with it the failed revisions: the next stable's failure rolled back to one of them."""
    schedule = step(ROLLBACK, None, "r2", True, None, False, [], T0, "r2").status
    assert schedule is not None
    now = T0 + dt.timedelta(seconds=90)
    failed = step(ROLLBACK, schedule, "r2", True, CanaryResult("r2", schedule.next_run_at, "fail", "x", ("isolation",)), False,
                  ["r1"], now, "r2").status  # fmt: skip
    assert failed is not None and failed.failed_revisions == ["r2"]
    rolling = step(ROLLBACK, failed, "r1", False, None, False, ["r2"], now, "r3")  # the spec moved on to r3: no pin
    assert rolling.status is not None and rolling.status.failed_revisions == ["r2"]
    assert rolling.status.rollback is None  # void once the spec moved on: not shown as holding
    r3 = step(ROLLBACK, rolling.status, "r3", True, None, False, ["r2", "r1"], now, "r3").status
    assert r3 is not None and r3.revision == "r3" and r3.rollback is None and r3.failed_revisions == ["r2"]
    bad = step(ROLLBACK, r3, "r3", True, CanaryResult("r3", r3.next_run_at, "fail", "x", ("isolation",)), False, ["r2", "r1"],
               now + dt.timedelta(seconds=120), "r3")  # fmt: skip
    assert bad.rollback_to == "r1"  # not r2, newer but failed
    off = ContinuousSpec()
    assert step(off, failed, "r1", False, None, False, [], now, "r3").status is None  # switched off: nothing is kept


def test_a_run_in_flight_is_stopped_once_nobody_will_read_it() -> None:
    """Outside probe: a periodic run in flight when a rollout began (or the continuous canary was
    turned off) kept probing the stable through the rollout, and its result was thrown away."""
    schedule = step(ALERT, None, "r1", True, None, False, [], T0, "r1").status
    later = T0 + dt.timedelta(seconds=61)
    assert step(ALERT, schedule, "r1", True, None, True, [], later, "r1").stop is False  # resting: it runs on
    assert step(ALERT, schedule, "r1", False, None, True, [], later, "r2").stop is True  # a rollout began
    assert step(CanarySpec().continuous, schedule, "r1", True, None, True, [], later, "r1").stop is True  # turned off
    assert step(ALERT, schedule, "r1", False, None, False, [], later, "r2").stop is False  # nothing in flight
