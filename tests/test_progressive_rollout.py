"""Traffic in steps (rollout.py, state Shifting): the weight of each step, analysis between steps,
S8 on a failed analysis, inconclusive holds, the bake at 100% and the delayed scale-down that makes
kvguard.io/rollback-to instant. Driven on test_rollout's in-memory platform, the clock moved by hand
(no sleeps)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import yaml
from test_rollout import EXAMPLES, READY, S, Sim, assert_stable_untouched, conditions, events

from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.rollout import (
    PAUSE_ANNOTATION,
    RETRY_ANNOTATION,
    ROLLBACK_ANNOTATION,
    AnalysisOutcome,
    AnalysisResult,
    Decision,
    DeployRevision,
    MeasureAnalysis,
    RecordEvent,
    RolloutStatus,
    RouteTraffic,
    ScaleRevision,
    SetCondition,
    SetTrafficWeight,
    step,
)

TINY = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]
GATEWAY = {"parentRefs": [{"name": "gw"}]}


def spec(**rollout: Any) -> InferenceModelSpec:
    base = {"trafficRouter": "gatewayAPI", "gateway": GATEWAY, "steps": [{"weight": 10, "pause": 60}, {"weight": 50, "pause": 60}, {"weight": 100}],
            "analysis": {"intervalSeconds": 30}, "bakeSeconds": 120, "scaleDownDelaySeconds": 300}  # fmt: skip
    return InferenceModelSpec.model_validate({**TINY, "rollout": {**base, **rollout}})


def outcome(verdict: str, message: str = "") -> AnalysisOutcome:
    phase = {"pass": "Successful", "fail": "Failed", "inconclusive": "Inconclusive"}[verdict]
    return AnalysisOutcome(verdict, (AnalysisResult(name="errorRatio", phase=phase, value=0.0, threshold=0.05, message=message or verdict),), message or verdict)  # type: ignore[arg-type]


@dataclasses.dataclass
class StepSim(Sim):
    """Sim plus the HTTPRoute's weight and an analysis that answers from a script."""

    route: dict[str, int] = dataclasses.field(default_factory=dict)
    verdicts: list[str] = dataclasses.field(default_factory=list)
    measured: int = 0

    def decide(self, **overrides: Any) -> Decision:
        decision = super().decide(**overrides)
        if decision.of_type(MeasureAnalysis):  # the driver measures, then steps again at once
            verdict = self.verdicts.pop(0) if self.verdicts else "pass"
            self.measured += 1
            decision = step(self.spec, self.rollout, self.stable, self.world(analysis=outcome(verdict), **overrides))
        return decision

    def apply(self, decision: Decision) -> None:
        for action in decision.actions:  # the HTTPRoute's backends, as the driver would apply them
            if isinstance(action, SetTrafficWeight):
                self.route = {action.stable: 100 - action.weight, action.candidate: action.weight}
            elif isinstance(action, RouteTraffic):
                self.route = {action.revision: 100}
        super().apply(decision)

    def later(self, seconds: float) -> Decision:
        self.now += dt.timedelta(seconds=seconds)
        return self.tick()


def shifting_sim(**rollout: Any) -> StepSim:
    """r1 serving; r2 has passed its canary and is about to take traffic in steps."""
    sim = StepSim(spec=spec(**rollout))
    sim.run_until(S.STABLE)
    sim.canary = None
    sim.target = "r2"
    return sim


def weights_over_time(sim: StepSim, seconds: int = 2000) -> list[tuple[int, int | None, str]]:
    """(elapsed, weight, state) after every pass, moving the clock by what each decision asked."""
    seen, elapsed = [], 0
    for _ in range(200):
        d = sim.tick()
        seen.append((elapsed, d.rollout.weight, d.state.value))
        if d.state in (S.STABLE, S.ROLLED_BACK) and d.rollout.revision == "r2":
            break
        wait = d.requeue_after if d.requeue_after is not None else 60.0
        sim.now += dt.timedelta(seconds=wait)
        elapsed += int(wait)
        if elapsed > seconds:
            break
    return seen


def test_each_step_holds_its_weight_for_its_pause_with_a_passing_analysis() -> None:
    sim = shifting_sim()
    d = sim.run_until(S.SHIFTING)
    assert d.of_type(SetTrafficWeight) == [SetTrafficWeight("r1", "r2", 10)] and d.stable == "r1"
    assert d.rollout.step == 0 and d.rollout.weight == 10 and sim.serving == "r1" and sim.route == {"r1": 90, "r2": 10}
    history = weights_over_time(sim)
    shifting = [(t, w) for t, w, state in history if state == "Shifting"]
    first_at = {w: min(t for t, ww in shifting if ww == w) for w in (10, 50, 100)}
    assert first_at[50] - first_at[10] >= 60 and first_at[100] - first_at[50] >= 60  # each pause held
    stable_at = min(t for t, _, state in history if state == "Stable")
    assert stable_at - first_at[100] >= 120  # bakeSeconds at 100% before r2 becomes stable
    assert sim.stable == "r2" and sim.serving == "r2" and sim.measured >= 4


def test_a_failed_analysis_sends_all_traffic_back_to_stable_at_once_S8() -> None:
    sim = shifting_sim()
    sim.verdicts = ["fail"]
    sim.run_until(S.SHIFTING)
    d = sim.later(30)
    assert d.state in (S.FAILED, S.ROLLED_BACK) and d.stable == "r1" and d.rollout.weight == 0
    assert d.of_type(SetTrafficWeight) == [SetTrafficWeight("r1", "r2", 0)]
    assert ScaleRevision("r2", 0) in d.actions and RouteTraffic("r1") in d.actions
    order = [type(a).__name__ for a in d.actions if isinstance(a, SetTrafficWeight | ScaleRevision)]
    assert order[0] == "SetTrafficWeight", "the weight goes to 0 before the candidate is stopped"
    assert "AnalysisFailed" in events(d) and conditions(d)["Degraded"] == ("True", "AnalysisFailed")
    assert sim.revisions["r1"] == READY and sim.serving == "r1" and sim.route == {"r1": 100}


def test_inconclusive_holds_the_step_and_says_so() -> None:
    sim = shifting_sim()
    sim.verdicts = ["inconclusive"] * 5
    sim.run_until(S.SHIFTING)
    for _ in range(5):
        d = sim.later(30)
        assert d.state == S.SHIFTING and d.rollout.weight == 10, "no data: the step holds"
    assert conditions(d)["Progressing"] == ("True", "AnalysisInconclusive")
    d = sim.later(30)  # data arrives and passes: the step completes (its pause is long over)
    assert d.rollout.weight == 50


def test_the_old_revision_is_scaled_down_only_after_the_delay() -> None:
    sim = shifting_sim(steps=[{"weight": 50}, {"weight": 100}], bakeSeconds=0)
    weights_over_time(sim, seconds=400)
    d = sim.decisions[-1]
    assert sim.stable == "r2" and d.rollout.scale_down_revision == "r1"
    promoted = next(x for x in sim.decisions if x.promoted_from == "r1")
    assert not [a for a in promoted.actions if isinstance(a, ScaleRevision) and a.revision == "r1"], "kept warm"
    assert promoted.rollout.scale_down_at is not None and promoted.requeue_after == 300
    assert sim.revisions["r1"] == READY
    d = sim.later(299)
    assert not [a for a in d.actions if isinstance(a, ScaleRevision) and a.revision == "r1"]
    d = sim.later(1)
    assert ScaleRevision("r1", 0) in d.actions and d.rollout.scale_down_revision is None
    assert "PreviousRevisionScaledDown" in events(d)


def test_rollback_within_the_window_starts_no_pods() -> None:
    sim = shifting_sim(steps=[{"weight": 50}, {"weight": 100}], bakeSeconds=0)
    weights_over_time(sim, seconds=400)
    assert sim.stable == "r2" and sim.revisions["r1"] == READY
    sim.annotations[ROLLBACK_ANNOTATION] = "r1"
    before = len(sim.decisions)
    d = sim.run_until(S.STABLE)
    assert d.stable == "r1" and sim.serving == "r1" and sim.route == {"r1": 100}
    rollback = [a for x in sim.decisions[before:] for a in x.actions]
    assert DeployRevision("r1") not in rollback and ScaleRevision("r1", 0) not in rollback, "no new workloads for r1"
    assert sim.revisions["r1"] == READY and len(sim.decisions) - before <= 3  # ready at once: verify pools, promote
    assert d.rollout.scale_down_revision == "r2", "the revision rolled back from is kept warm in turn"


def test_a_spec_change_mid_shift_returns_traffic_to_stable_before_retiring() -> None:
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    sim.target = "r3"
    d = sim.tick()
    assert_stable_untouched(d, "r1")
    kinds = [type(a).__name__ for a in d.actions if isinstance(a, RouteTraffic | ScaleRevision) or type(a).__name__ == "DeleteRevision"]
    assert kinds[0] == "RouteTraffic" and RouteTraffic("r1") in d.actions
    # Announced as any superseded candidate is (outside probe: only those not yet serving were),
    # in the words of its history entry (another probe: the Event said it never served).
    superseded = [a.message for a in d.actions if isinstance(a, RecordEvent) and a.reason == "RolloutSuperseded"]
    assert superseded == ["revision r2 superseded by r3 after serving a share of traffic, before it was promoted"]


def test_resume_from_status_alone_mid_shift_S8() -> None:
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    saved = RolloutStatus.model_validate(sim.rollout.model_dump(by_alias=True))  # what status.rollout holds
    first = step(sim.spec, saved, "r1", sim.world())
    assert first == step(sim.spec, saved, "r1", sim.world())
    assert first.of_type(SetTrafficWeight) == [SetTrafficWeight("r1", "r2", 10)] and first.stable == "r1"


def test_one_step_of_100_through_a_service_is_todays_switch() -> None:
    sim = StepSim(spec=InferenceModelSpec.model_validate({**TINY, "rollout": {"scaleDownDelaySeconds": 0}}))
    sim.run_until(S.STABLE)
    sim.canary, sim.target = None, "r2"
    d = sim.run_until(S.STABLE)
    assert not d.of_type(SetTrafficWeight) and RouteTraffic("r2") in d.actions and ScaleRevision("r1", 0) in d.actions
    assert all(x.state != S.SHIFTING for x in sim.decisions)


def test_a_retry_after_a_failed_analysis_starts_its_failure_counts_from_zero() -> None:
    sim = shifting_sim()
    sim.verdicts = ["fail"]
    sim.run_until(S.SHIFTING)
    sim.later(30)
    sim.run_until(S.ROLLED_BACK)
    sim.annotations[RETRY_ANNOTATION] = "1"
    d = sim.run_until(S.SHIFTING)
    assert d.rollout.analysis == [] and d.rollout.weight == 10
    d = sim.later(30)  # a passing measurement: the earlier failure does not count against this attempt
    assert d.state == S.SHIFTING and d.rollout.analysis_verdict == "pass"


def test_a_measurement_that_could_not_judge_keeps_each_checks_failure_count() -> None:
    """Outside probe: a failed scrape (or an operator restart's first scrape) replaced
    status.rollout.analysis with its one entry, so every failure count -- what failureLimit reads
    -- went back to 0; alternating, a candidate failing half its requests kept its share for ever."""
    from kvguard.operator.rollout import carried_results

    failed = AnalysisResult(name="errorRatio", phase="Failed", value=0.5, threshold=0.02, failures=1, message="25 of 50 failed")
    safe = AnalysisResult(name="safety", phase="Successful", value=0, threshold=0, message="no safety counter rose")
    scrape = AnalysisResult(name="scrape", phase="Error", message="candidate metrics incomplete")
    window = AnalysisResult(name="window", phase="Inconclusive", message="first scrape of these revisions by this operator process")
    kept = carried_results([safe, failed], [scrape])
    assert kept == [safe, failed, scrape]
    assert carried_results(kept, [window]) == [safe, failed, window]  # one such entry at a time
    judged = AnalysisResult(name="errorRatio", phase="Failed", value=0.5, threshold=0.02, failures=2, message="again")
    assert carried_results(kept, [safe, judged]) == [safe, judged]  # a measurement that judged replaces them all
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    sim.rollout.analysis = [safe, failed]
    d = step(sim.spec, sim.rollout, sim.stable, sim.world(analysis=AnalysisOutcome("inconclusive", (scrape,), "scrape failed")))
    assert d.rollout.analysis == [safe, failed, scrape]


def test_progressing_says_why_the_last_measurement_could_not_judge_not_an_older_failure() -> None:
    """Outside probe: after a judged measurement with a failure, scrape errors for 15 minutes
    showed that old failure in Progressing as if it were why the step held."""
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    failed = AnalysisResult(name="errorRatio", phase="Failed", value=0.5, threshold=0.02, failures=1, message="25 of 50 failed")
    scrape = AnalysisResult(name="scrape", phase="Error", message="candidate metrics incomplete: r2-router-0: HTTP 500")
    sim.rollout.analysis = [failed]
    d = step(sim.spec, sim.rollout, sim.stable, sim.world(analysis=AnalysisOutcome("inconclusive", (scrape,), scrape.message)))
    progressing = [a for a in d.actions if isinstance(a, SetCondition) and a.type == "Progressing"][-1]
    assert progressing.message.endswith("holds at 10%: candidate metrics incomplete: r2-router-0: HTTP 500")


def test_a_candidate_that_cannot_be_measured_is_rolled_back_after_the_error_limit_s8() -> None:
    """Outside probe: with its metrics unreadable (or Prometheus down) every measurement held the
    step, and the candidate kept its share, up to 100% while baking, for ever. Past
    consecutiveErrorLimit errors in a row the analysis fails and traffic goes back (S8)."""
    from kvguard.operator.analysis import unmeasured

    sim = shifting_sim(analysis={"intervalSeconds": 30, "consecutiveErrorLimit": 2})
    d = sim.run_until(S.SHIFTING)
    analysis = sim.spec.rollout.analysis
    weights = []
    for _ in range(3):
        sim.now += dt.timedelta(seconds=30)
        unreadable = unmeasured(analysis, sim.rollout.analysis, "candidate metrics incomplete: r2-router-0: timed out", "t")
        d = step(sim.spec, sim.rollout, sim.stable, sim.world(analysis=unreadable))
        sim.apply(d)
        weights.append(d.rollout.weight)
    assert weights == [10, 10, 0] and sim.route == {"r1": 100}
    assert conditions(d)["Degraded"] == ("True", "AnalysisFailed")
    assert "3 measurements in a row could not be made, limit 2" in d.rollout.message


def _at_last_step(sim: StepSim) -> Decision:
    """Shift until the candidate holds the last step (100%), baking."""
    sim.run_until(S.SHIFTING)
    for _ in range(50):
        d = sim.later(30)
        if d.rollout.step == 2:
            return d
    raise AssertionError("never reached the last step")


def test_steps_shortened_under_the_step_in_progress_start_again_at_the_first_step() -> None:
    # Outside probe: [10, 50, 100] cut to [50, 100] while at step 3 (100%) raised IndexError on every
    # pass; the route stayed at 100% to the candidate, never promoted, and nothing said why.
    sim = shifting_sim()
    assert _at_last_step(sim).rollout.weight == 100
    sim.spec = spec(steps=[{"weight": 50, "pause": 60}, {"weight": 100}])
    d = sim.tick()
    assert d.state == S.SHIFTING and (d.rollout.step, d.rollout.weight) == (0, 50)
    assert d.of_type(SetTrafficWeight) == [SetTrafficWeight("r1", "r2", 50)] and sim.route == {"r1": 50, "r2": 50}
    assert "StepsChanged" in events(d)
    history = weights_over_time(sim)
    assert [w for _, w, state in history if state == "Shifting"][-1] == 100 and sim.stable == "r2"


def test_a_new_weight_for_the_step_in_progress_is_applied_from_the_first_step() -> None:
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    assert sim.route == {"r1": 90, "r2": 10}
    sim.spec = spec(steps=[{"weight": 20, "pause": 60}, {"weight": 50, "pause": 60}, {"weight": 100}])
    d = sim.tick()
    assert (d.rollout.step, d.rollout.weight) == (0, 20) and sim.route == {"r1": 80, "r2": 20}
    # A change that keeps this step's weight (here: its pause) updates in place, without a restart.
    sim.spec = spec(steps=[{"weight": 20, "pause": 90}, {"weight": 50, "pause": 60}, {"weight": 100}])
    d = sim.tick()
    assert "StepsChanged" not in events(d) and (d.rollout.step, d.rollout.weight) == (0, 20)


def test_switching_to_trafficrouter_service_mid_shift_promotes_as_service_mode_does() -> None:
    # Service mode cannot carry a share: the candidate takes all of it at once (RouteTraffic), so
    # the traffic objects of the old router can be swept (backends/kubernetes.py) and none points
    # at the old revision once it is scaled down.
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    sim.spec = InferenceModelSpec.model_validate({**TINY, "rollout": {"trafficRouter": "service", "scaleDownDelaySeconds": 300}})
    d = sim.tick()
    assert d.state == S.STABLE and sim.stable == "r2" and RouteTraffic("r2") in d.actions
    assert "TrafficRouterChanged" in events(d)


def test_switching_to_service_as_the_candidate_loses_readiness_fails_the_rollout_rather_than_promoting() -> None:
    # Audit: the router switch was taken before the readiness check of the same pass, and a
    # candidate that had just lost readiness was promoted and the stable scaled down.
    sim = shifting_sim(scaleDownDelaySeconds=0)
    sim.run_until(S.SHIFTING)
    sim.spec = InferenceModelSpec.model_validate({**TINY, "rollout": {"trafficRouter": "service", "scaleDownDelaySeconds": 0}})
    sim.revisions["r2"] = dataclasses.replace(sim.revisions["r2"], ready=False)
    d = sim.tick()
    assert d.state in (S.FAILED, S.ROLLED_BACK) and d.stable == "r1" and sim.serving == "r1"
    assert ScaleRevision("r1", 0) not in d.actions and "CandidateNotReady" in events(d)


def test_a_pause_mid_shift_keeps_the_split_in_force_applied() -> None:
    # Outside probe: while paused, no action at all was taken, so an HTTPRoute deleted during a
    # pause stayed gone (the gateway had no route for the model) until the pause was lifted.
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    sim.annotations[PAUSE_ANNOTATION] = "true"
    d = sim.tick()
    assert d.state == S.PAUSED and d.of_type(SetTrafficWeight) == [SetTrafficWeight("r1", "r2", 10)]
    sim.route = {}  # deleted by hand
    d = sim.later(3600)
    assert d.state == S.PAUSED and (d.rollout.step, d.rollout.weight) == (0, 10) and sim.route == {"r1": 90, "r2": 10}


def test_policy_compliance_is_said_again_on_every_pass_of_a_shift() -> None:
    # Outside probe: a pass halted by a foreign object set PolicyCompliant Unknown ("not judged
    # while the rollout is halted"), and nothing in Shifting said it again until the promotion.
    sim = shifting_sim()
    sim.run_until(S.SHIFTING)
    d = sim.later(30)
    assert conditions(d)["PolicyCompliant"] == ("True", "Compliant")


def test_a_resumed_step_holds_again_and_ends_on_a_measurement_taken_after_the_resume() -> None:
    """An outside probe: the step's clock ran through a pause, so a resume ended the step (or, in
    the bake, promoted) at once on a passing verdict from before the pause, judging nothing since."""
    sim = shifting_sim(steps=[{"weight": 10, "pause": 600}, {"weight": 50, "pause": 600}, {"weight": 100}])
    sim.run_until(S.SHIFTING)
    assert sim.later(30).rollout.analysis_verdict == "pass"
    sim.annotations[PAUSE_ANNOTATION] = "true"
    sim.later(1)
    sim.later(3600)
    del sim.annotations[PAUSE_ANNOTATION]
    resumed = sim.later(1)
    assert resumed.state == S.SHIFTING and resumed.rollout.step == 0 and sim.route == {"r1": 90, "r2": 10}
    assert resumed.rollout.analysis_verdict is None
    d = sim.later(30)  # a fresh pass, but the step's pause holds again from the resume
    assert d.rollout.step == 0 and d.rollout.analysis_verdict == "pass"
    assert sim.later(600).rollout.step == 1


def test_a_resume_in_the_bake_does_not_promote_on_a_verdict_from_before_the_pause() -> None:
    sim = shifting_sim(steps=[{"weight": 50}, {"weight": 100}], bakeSeconds=300)
    sim.run_until(S.SHIFTING)
    while sim.later(30).rollout.step != 1:
        pass
    sim.later(30)
    sim.annotations[PAUSE_ANNOTATION] = "true"
    sim.later(1)
    sim.later(3600)
    del sim.annotations[PAUSE_ANNOTATION]
    measured = sim.measured
    resumed = sim.later(1)
    assert resumed.state == S.SHIFTING and resumed.stable == "r1" and sim.measured == measured
    assert not [e for e in events(resumed) if "RevisionPromoted" in e]


def test_a_paused_step_is_still_watched_and_a_failing_candidate_loses_its_share_at_once() -> None:
    """An outside probe: paused at 10%, a candidate whose routers were no longer ready, or whose
    analysis failed, kept its share of traffic until someone resumed it (S8)."""
    for cause in ("not ready", "analysis", "gate"):
        sim = shifting_sim(analysis={"intervalSeconds": 30})
        sim.run_until(S.SHIFTING)
        sim.annotations[PAUSE_ANNOTATION] = "true"
        sim.later(1)
        overrides: dict[str, Any] = {}
        if cause == "not ready":
            sim.revisions["r2"] = dataclasses.replace(sim.revisions["r2"], ready=False)
        elif cause == "analysis":
            sim.verdicts = ["fail"]
        else:
            overrides["gate_refusals"] = {"r2": ("pod r2-decode-0: KV pool too small",)}
        sim.now += dt.timedelta(seconds=60)
        d = sim.tick(**overrides)
        assert d.state == S.PAUSED and sim.route.get("r2", 0) == 0 and sim.route["r1"] == 100, (cause, sim.route)
        assert conditions(d)["Degraded"][0] == "True" and conditions(d)["CanaryPassed"][0] == "False", cause
        progressing = [a.message for a in d.actions if isinstance(a, SetCondition) and a.type == "Progressing"]
        assert progressing and "rollback follows the resume" in progressing[-1], "said in the pass that failed it"
        again = sim.tick(**overrides)
        assert again.of_type(RecordEvent) == [], "said once"
        assert "nothing changes" not in (again.rollout.message or "") and "rollback follows the resume" in (again.rollout.message or "")
        del sim.annotations[PAUSE_ANNOTATION]
        for _ in range(5):
            d = sim.later(30)
        assert d.state in (S.FAILED, S.ROLLED_BACK) and sim.serving == "r1", cause


def test_a_measurement_asked_for_while_paused_does_not_end_the_resumed_step() -> None:
    """A review: a paused pass asks for a measurement at once; resumed before the next pass, that
    measurement (of the paused time) ended the step with none taken after the resume."""
    sim = shifting_sim(steps=[{"weight": 10, "pause": 60}, {"weight": 50, "pause": 60}, {"weight": 100}],
                       analysis={"intervalSeconds": 300})
    sim.run_until(S.SHIFTING)
    sim.annotations[PAUSE_ANNOTATION] = "true"
    sim.later(1)
    sim.now += dt.timedelta(seconds=3600)
    asked = step(sim.spec, sim.rollout, sim.stable, sim.world())
    assert asked.of_type(MeasureAnalysis)
    sim.rollout = asked.rollout
    del sim.annotations[PAUSE_ANNOTATION]  # resumed before the pass that reads the measurement
    sim.now += dt.timedelta(seconds=1)
    resumed = step(sim.spec, sim.rollout, sim.stable, sim.world(analysis=outcome("pass")))
    sim.apply(resumed)
    assert resumed.rollout.analysis_verdict is None
    before = sim.measured
    d = sim.later(resumed.requeue_after or 60)
    assert d.rollout.step == 0 or sim.measured > before, "the step ended on the paused window's measurement"
    failing = shifting_sim(analysis={"intervalSeconds": 300})  # a failure in that measurement still counts
    failing.run_until(S.SHIFTING)
    failing.annotations[PAUSE_ANNOTATION] = "true"
    failing.later(1)
    del failing.annotations[PAUSE_ANNOTATION]
    failing.now += dt.timedelta(seconds=1)
    assert step(failing.spec, failing.rollout, failing.stable, failing.world(analysis=outcome("fail"))).state == S.FAILED
