"""The rollout state machine of one InferenceModel (pure: no I/O, no clock, no randomness).

    Planning ──gates fail──> Blocked ──gates pass──> Planning
       │
       └─> CanaryDeploying ──ready──> CanaryVerifying ──pools + canary + policy ok──> Promoting ──> Stable
                 │                          │                                          │
                 └──── not ready in time ───┴── reported pool too small | canary fail ─┴──> Failed ──> RolledBack
    any state ──`kvguard.io/pause: "true"`──> Paused ──annotation removed──> the state it paused in
    Failed | RolledBack ──`kvguard.io/retry: <new value>`──> Planning
    a new spec revision (or `kvguard.io/rollback-to`) supersedes an unfinished rollout ──> Planning

Gates (S7), all re-checked at every step until traffic moves: the planned KV pool of every role is
>= minKVRatio x contextLength; every running prefill/decode worker of the candidate *reports* (on
its /metrics) a pool at least that large; the canary suite passed against the candidate's router
with the stable revision as baseline; the InferencePolicy verdict is compliant.
Scale: the candidate is verified at canary replicas (spec.rollout.canaryReplicas). Promoting scales
it to full replicas, waits for them and measures every worker's reported pool again (a new node is
a new pool), and only then moves traffic; a worker too small at full scale fails the rollout.
S8: nothing here ever scales, patches or deletes the stable revision before the candidate serves;
a failure scales the candidate to zero, says why (CanaryPassed=False, Degraded=True) and keeps the
stable revision serving, unchanged.

How to drive it (`driver.run_pass`, shared by the Kubernetes controller and the local backend):
read the world, call `step(...)` once, persist `Decision.rollout` in `status.rollout` (and
`Decision.stable` in `status.revision`) BEFORE acting, execute the returned actions in order, and
look again after `Decision.requeue_after` (0: at once; the drivers back off exponentially, with
jitter, while nothing changes, but never past `Decision.deadline_in`). Two actions ask for
observations that a later `step` consumes: `ScrapeMetrics` (scrape the revision's workers before
the next step and pass the reports as `World.worker_reports`) and `RunCanary` (start the suite off
the reconcile path; pass its result as `World.canary` once finished, `canary_running=True`
meanwhile). Every other action is idempotent, and the whole rollout is recorded in
`status.rollout`, so a restarted operator calling `step` with the persisted status continues where
it stopped: no double promotion (promotion is one idempotent step), no orphaned canary (Failed
keeps scaling it to zero until it is observed at zero), and a canary interrupted by the restart
simply runs again.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from kvguard.operator.numerics import numerics_change
from kvguard.workers.pool_ratio import ratio_down, ratio_number, ratio_text, required_pool_tokens

if TYPE_CHECKING:  # api.py embeds RolloutStatus, so importing it here at runtime would be a cycle
    from kvguard.operator.api import InferenceModelSpec
    from kvguard.operator.canary.report import CanaryReport

AnalysisVerdict = Literal["pass", "fail", "inconclusive"]


class RolloutState(str, enum.Enum):
    """Where the rollout of `status.rollout.revision` is. See the module docstring for the graph."""

    PLANNING = "Planning"
    """A revision to roll out was seen; plan and policy are about to be checked."""
    BLOCKED = "Blocked"
    """The planner or the policy said no; nothing of the candidate runs."""
    CANARY_DEPLOYING = "CanaryDeploying"
    """The candidate's workloads run beside the stable ones; waiting for them to be ready."""
    CANARY_VERIFYING = "CanaryVerifying"
    """Scraping every candidate worker's reported pool, then running the canary suite."""
    PROMOTING = "Promoting"
    """Every gate passed: scaling the candidate to full replicas and measuring it again, then
    routing traffic to it (at once, or in spec.rollout.steps)."""
    SHIFTING = "Shifting"
    """Traffic moves to the candidate in spec.rollout.steps while its live traffic is analysed,
    then bakes at 100%; the stable revision still serves the rest (S8)."""
    STABLE = "Stable"
    """The candidate serves all traffic; nothing to do."""
    FAILED = "Failed"
    """A gate failed after deploying: the candidate is being scaled to zero."""
    ROLLED_BACK = "RolledBack"
    """The failed candidate is at zero and the stable revision serves; waiting for retry or a new spec."""
    PAUSED = "Paused"
    """Held by the pause annotation; no action until it is removed."""


PAUSE_ANNOTATION = "kvguard.io/pause"
"""`"true"` holds the rollout where it is (nothing deployed, promoted or deleted); `"false"` (or no
annotation) does not. Any other value is refused at admission (`annotation_problems`)."""
PAUSE_VALUES = ("true", "false")
RETRY_ANNOTATION = "kvguard.io/retry"
"""Any value different from the one the failed attempt ran under retries the rollout."""
ROLLBACK_ANNOTATION = "kvguard.io/rollback-to"
"""A previous stable revision to serve instead of the spec's; remove it to roll the spec out again."""


def annotation_problems(annotations: Mapping[str, object] | None) -> list[str]:
    """What is wrong with the model's control annotations, one message per field (pure).

    Why: a pause written `"True"`, `"yes"` or `"1"` was read as no pause at all, so a user who
    meant to hold a rollout watched it go on. The admission webhook and `kvguard apply --local`
    refuse such a value, naming the field; the reconciler still reads only `"true"` as a pause."""
    problems = []
    value = (annotations or {}).get(PAUSE_ANNOTATION)
    if not (value is None or (isinstance(value, str) and value.strip() in PAUSE_VALUES)):
        problems.append(f"metadata.annotations[{PAUSE_ANNOTATION}]: {str(value)[:40]!r} is not \"true\" (hold the "
                        "rollout) or \"false\"")  # fmt: skip
    # A rollback to something no revision can be named was applied as "not a kept revision": the
    # spec rolled out instead, silently for `kvguard apply --local` (an outside probe).
    from kvguard.operator.revision import REVISION_LENGTH  # (revision imports api, which imports this module)

    rollback = (annotations or {}).get(ROLLBACK_ANNOTATION)
    # Read as the reconciler reads it: stripped, and "" is no rollback (a YAML block adds a newline).
    if rollback is not None and not (isinstance(rollback, str) and re.fullmatch(f"([0-9a-f]{{{REVISION_LENGTH}}})?", rollback.strip())):
        problems.append(f"metadata.annotations[{ROLLBACK_ANNOTATION}]: {str(rollback)[:40]!r} is not a revision "
                        f"({REVISION_LENGTH} lowercase hex digits, as `kvguard status` lists them)")  # fmt: skip
    return problems


NOT_A_CHECK = frozenset({"scrape", "window"})
"""Entries of a measurement that could not judge (a scrape failed, a window only started)."""


def carried_results(previous: Sequence[AnalysisResult], new: Sequence[AnalysisResult]) -> list[AnalysisResult]:
    """status.rollout.analysis after a measurement (pure). One that judged the checks replaces
    every entry; one that could not (`NOT_A_CHECK`) keeps each check's last entry beside its own,
    with the failure count `failureLimit` reads: replaced, a scrape error or an operator restart
    every other measurement reset the counts, and a candidate failing half its requests kept its
    share for ever (an outside probe)."""
    if not {r.name for r in new} <= NOT_A_CHECK:
        return list(new)
    return [r for r in previous if r.name not in NOT_A_CHECK] + list(new)


MAX_SCRAPE_ATTEMPTS = 5
"""Scrapes in which some candidate worker did not report before the rollout fails (S7)."""
REQUEUE_SECONDS = 5.0
"""How soon to look again while waiting for workloads, metrics or the canary."""

IN_FLIGHT = (RolloutState.PLANNING, RolloutState.CANARY_DEPLOYING, RolloutState.CANARY_VERIFYING)

Scale = Literal["canary", "full"]
"""Replicas a revision runs at: canary while verified, full once it is (or is about to be) serving."""
BaselineMatch = Literal["exact", "tolerant", "none", "unknown"]
"""How the canary may use the stable's outputs (RunCanary.baseline_match)."""


# --- the record kept in status.rollout ----------------------------------------------------------


class _StatusModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", use_attribute_docstrings=True
    )


class WorkerPool(_StatusModel):
    """One candidate worker's KV pool as the worker itself reported it (S7)."""

    worker: str
    """Pod name or metrics URL."""
    role: str
    """prefill or decode."""
    pool_tokens: float | None = None
    """Smallest KV pool the worker reports (over its DP ranks / engines), in tokens."""
    context_length: int
    """Context length the pool was judged against."""
    ratio: float | None = None
    """poolTokens / contextLength."""
    sufficient: bool
    """poolTokens holds the required ratio x contextLength, in whole tokens (ratio is rounded
    down, for reading)."""


class CanarySummary(_StatusModel):
    """The canary suite's verdict on one attempt of a revision (the full report is in the events/logs)."""

    revision: str
    """Revision the suite ran against."""
    attempt: str = ""
    """The retry annotation value of the attempt."""
    verdict: Literal["pass", "fail", "cannot_run"]
    """pass, fail or cannot_run."""
    reason: str = ""
    """One line from the report, e.g. `failed: isolation, over_length`."""
    failed_probes: list[str] = Field(default_factory=list)
    """Probes that failed."""
    duration_seconds: float = 0.0
    """How long the suite ran."""


AnalysisPhase = Literal["Successful", "Failed", "Inconclusive", "Error"]


class AnalysisResult(_StatusModel):
    """The latest measurement of one analysis check (status.rollout.analysis)."""

    name: str
    """safety, errorRatio, ttft, itl or the name of a PromQL query."""
    phase: AnalysisPhase
    """Successful, Failed, Inconclusive (not enough data) or Error (could not be measured)."""
    value: float | None = None
    """The measured number (a ratio, or seconds for a query in seconds)."""
    threshold: float | None = None
    """The bound the value was judged against."""
    failures: int = 0
    """Failed measurements so far in this rollout (the analysis fails past the check's failureLimit)."""
    errors: int = 0
    """Measurements in a row whose phase was Error (the analysis fails past
    spec.rollout.analysis.consecutiveErrorLimit)."""
    message: str = ""
    """The numbers, for humans: e.g. `p95 TTFT 0.41 s vs stable 0.20 s = 2.05x > 1.5x`."""
    measured_at: str | None = None
    """RFC 3339 time of the measurement."""
    reference: float | None = None
    """ttft/itl: the stable's percentile (seconds) from its last window with traffic, kept so that
    an operator restarted at 100% (where the stable gets no traffic) compares with it."""

    @field_validator("value", "threshold", "reference")
    @classmethod
    def _finite(cls, number: float | None) -> float | None:
        # NaN and Inf are not JSON: a status patch holding one is refused, and the actions it
        # asks for (an abort) wait for that write. The message keeps what was seen.
        return number if number is None or math.isfinite(number) else None


class RolloutStatus(_StatusModel):
    """Every step of the current rollout, so that a restarted operator resumes it exactly (S8)."""

    state: RolloutState = RolloutState.PLANNING
    """Planning, Blocked, CanaryDeploying, CanaryVerifying, Promoting, Stable, Failed, RolledBack, Paused."""
    revision: str | None = None
    """The candidate: the spec's revision, or the one named by kvguard.io/rollback-to."""
    baseline: str | None = None
    """The stable revision when this rollout started (the canary's baseline)."""
    numerics: str | None = None
    """The candidate's output fingerprint (`revision.numerics_of`)."""
    baseline_numerics: str | None = None
    """The baseline's fingerprint, carried from its own rollout record (None: unknown)."""
    attempt: str = ""
    """Value of kvguard.io/retry this attempt runs under."""
    canary_run: str | None = None
    """RFC 3339 time this rollout deployed its candidate for a canary: with `attempt`, the key its
    canary run and verdict go by (`canary_run_key`)."""
    rollback: bool = False
    """True when the candidate is a previous revision named by kvguard.io/rollback-to."""
    since: str | None = None
    """RFC 3339 time the rollout entered this state."""
    reason: str | None = None
    """CamelCase reason of the last transition."""
    message: str | None = None
    """What happened last, for humans."""
    paused_from: RolloutState | None = None
    """The state to resume when the pause annotation is removed."""
    paused_reason: str | None = None
    """The reason of the state paused in, given back on resume (with `pausedMessage`): a failed
    rollout's cause became "Paused", then "Resumed", for good (a review)."""
    paused_message: str | None = None
    scrape_attempts: int = 0
    """Scrapes in which some worker did not report (fails at MAX_SCRAPE_ATTEMPTS)."""
    workers: list[WorkerPool] = Field(default_factory=list)
    """Reported pools of the candidate's workers, once all were measured."""
    measured_scale: Scale | None = None
    """The scale `workers` were measured at; traffic moves only after a full-scale measurement."""
    canary: CanarySummary | None = None
    """The canary verdict for this attempt, once finished."""
    step: int | None = None
    """Index (from 0) of the traffic step of spec.rollout.steps the candidate is at; None before
    traffic moves."""
    weight: int | None = None
    """Percent of user traffic the candidate gets now (0 after a failed analysis)."""
    step_since: str | None = None
    """RFC 3339 time the current step's weight was set (its pause counts from here)."""
    analysis: list[AnalysisResult] = Field(default_factory=list)
    """The latest measurement of each analysis check on the candidate's live traffic."""
    scale_down_revision: str | None = None
    """The previous stable revision, kept running after promotion for an instant rollback."""
    scale_down_at: str | None = None
    """RFC 3339 time `scaleDownRevision` is scaled to zero (spec.rollout.scaleDownDelaySeconds)."""
    analysis_verdict: Literal["pass", "fail", "inconclusive"] | None = None
    """The verdict of the latest measurement at the current step (None: none yet at this step)."""
    analysis_at: str | None = None
    """RFC 3339 time of the latest measurement (or of the step's start, before the first)."""


# --- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RevisionView:
    """What the backend sees of one revision's workloads."""

    ready: bool = False
    """Every role's workload has all its (non-zero) desired replicas ready."""
    scaled_to_zero: bool = False
    """Every workload of the revision wants 0 replicas and none runs."""
    worker_replicas: int = 0
    """Desired prefill + decode replicas: how many workers must report a pool."""
    scale: Scale = "full"
    """The scale the revision's workloads were last deployed at."""
    waiting: tuple[str, ...] = ()
    """Human-readable `role ready/desired` of what is not ready."""


@dataclass(frozen=True)
class WorkerReport:
    """One scraped worker: what it reports about its KV pool, or why it could not be read."""

    worker: str
    role: str
    pool_tokens: float | None = None
    context_length: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class PolicyGate:
    """The InferencePolicy verdict reduced to what the machine needs."""

    compliant: bool = True
    message: str = "no InferencePolicy applies"

    @classmethod
    def from_verdict(cls, verdict: Any) -> PolicyGate:
        """From `kvguard.operator.policy.PolicyVerdict` (compliant, violations[policy, rule, field, message])."""
        if verdict.compliant:
            return cls(True, "compliant with every applicable InferencePolicy")
        parts = [f"{v.field}: {v.message} (policy {v.policy}, rule {v.rule})" for v in verdict.violations]
        return cls(False, "; ".join(parts) or "not compliant")


@dataclass(frozen=True)
class CanaryResult:
    """A finished canary run, as the driver hands it back."""

    revision: str
    attempt: str
    verdict: Literal["pass", "fail", "cannot_run"]
    reason: str = ""
    failed_probes: tuple[str, ...] = ()
    duration_seconds: float = 0.0

    @classmethod
    def from_report(cls, report: CanaryReport, revision: str, attempt: str) -> CanaryResult:
        return cls(
            revision=revision, attempt=attempt, verdict=report.verdict.value,
            reason=report.reason, failed_probes=tuple(p.value for p in report.failed_probes()),
            duration_seconds=report.duration_seconds,
        )  # fmt: skip


@dataclass(frozen=True)
class World:
    """Everything `step` looks at besides spec and status, read just before the step."""

    target: str
    """The spec's revision (hash of its KV-relevant fields)."""
    now: dt.datetime
    numerics: str | None = None
    """The spec's output fingerprint (`revision.numerics_of`); None: unknown."""
    plan_ok: bool = True
    """The plan passes: every role's planned pool >= minKVRatio x contextLength (S7)."""
    plan_message: str = ""
    policy: PolicyGate = PolicyGate()
    revisions: Mapping[str, RevisionView] = field(default_factory=dict)
    """Every revision that has workloads, by revision."""
    serving: str | None = None
    """The revision user traffic is routed to right now, as observed (None: nothing routed)."""
    previous_stables: tuple[str, ...] = ()
    """Earlier stable revisions, newest first (from status.history): rollback targets."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    worker_reports: tuple[WorkerReport, ...] | None = None
    """A fresh scrape of the candidate's workers (after ScrapeMetrics); None when not scraped."""
    canary: CanaryResult | None = None
    """The latest finished canary run of this model, if the driver has one."""
    canary_running: bool = False
    """A canary run for the candidate's current attempt is in progress."""
    analysis: AnalysisOutcome | None = None
    """A fresh measurement of the candidate's live traffic (after MeasureAnalysis); None: not measured."""
    gate_refusals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """revision -> why the readiness gate keeps its pods out of rotation (pool_gate.py, S7): such a
    pod never becomes Ready, so the candidate fails now rather than at the progress deadline."""


@dataclass(frozen=True)
class AnalysisOutcome:
    """One measurement of the analysis (`analysis.measure`): the verdict and every check's numbers."""

    verdict: AnalysisVerdict
    results: tuple[AnalysisResult, ...]
    message: str


# --- outputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeployRevision:
    """Create or update the spec's revision's workloads at canary or full replicas (idempotent)."""

    revision: str
    scale: Scale = "full"


@dataclass(frozen=True)
class ScaleRevision:
    """Scale every workload of a revision: 0 stops it; None restores the replicas it had before."""

    revision: str
    replicas: int | None


@dataclass(frozen=True)
class DeleteRevision:
    """Delete every object of a revision."""

    revision: str


@dataclass(frozen=True)
class ScrapeMetrics:
    """Scrape every prefill/decode worker of the revision before the next step, and pass the
    reports to it in World.worker_reports."""

    revision: str


@dataclass(frozen=True)
class RunCanary:
    """Start the canary suite against the revision's router (baseline: that revision's router)."""

    revision: str
    baseline: str | None
    attempt: str
    baseline_match: BaselineMatch = "exact"
    """How the golden probe compares the candidate's outputs with the baseline's
    (`revision.numerics_change`): `exact` text when the numerics match; `tolerant` (per-token
    logprobs) when the same model runs with other numerics (quantization, KV dtype, device, engine,
    sharding); `none` when the model itself changed -- the stable's outputs are no reference, and
    the canary runs with no baseline at all (backends.base._start_canary); `unknown` when an older
    operator recorded the stable's fingerprint, so the model may be the same: golden does not
    compare text (it could be another model), but the isolation probe still judges two tenants'
    identical answers alone by the stable's (a leak shipped costs more than a revision rolled
    back, and retried once the stable is fingerprinted anew)."""


@dataclass(frozen=True)
class CancelCanary:
    """Stop any canary run of the revision (superseded)."""

    revision: str


@dataclass(frozen=True)
class RouteTraffic:
    """Point the user-facing route (the model's Service / the local proxy) at the revision."""

    revision: str


@dataclass(frozen=True)
class SetTrafficWeight:
    """Split user traffic: `candidate` gets `weight` percent, `stable` the rest (the HTTPRoute)."""

    stable: str
    candidate: str
    weight: int


@dataclass(frozen=True)
class MeasureAnalysis:
    """Measure the candidate's live traffic against the stable's before the next step, and pass
    the result to it in World.analysis."""

    candidate: str
    stable: str


@dataclass(frozen=True)
class RecordEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class SetCondition:
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


Action = (
    DeployRevision | ScaleRevision | DeleteRevision | ScrapeMetrics | RunCanary | CancelCanary
    | RouteTraffic | SetTrafficWeight | MeasureAnalysis | RecordEvent | SetCondition
)  # fmt: skip


@dataclass(frozen=True)
class Decision:
    """The outcome of one step: the new record, who serves, and what to do (in this order)."""

    rollout: RolloutStatus
    stable: str | None
    """The revision serving users once the actions are applied (status.revision)."""
    actions: tuple[Action, ...]
    requeue_after: float | None = None
    """Look again after this long (0: at once) because something is awaited; None: at rest."""
    promoted_from: str | None = None
    """Set when this step promoted: the previously stable revision (None on a first rollout)."""
    deadline_in: float | None = None
    """Seconds until the progress deadline of what is awaited: a driver backing off must look
    again by then, so a rollout fails on time."""

    @property
    def state(self) -> RolloutState:
        return self.rollout.state

    def of_type(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]


# --- the step -------------------------------------------------------------------------------------


def rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def step(
    spec: InferenceModelSpec, previous: RolloutStatus | None, stable: str | None, world: World
) -> Decision:
    """One transition (or a chain of immediate ones) of the rollout. Pure and idempotent: the same
    inputs give the same decision, so re-running it after a crash re-issues what may be missing."""
    run = _Step(spec, stable, world, previous.model_copy(deep=True) if previous else RolloutStatus())
    return run.go()


def canary_run_key(attempt: str, canary_run: str | None) -> str:
    """What a rollout's canary run is known by (RunCanary.attempt, CanaryResult.attempt): the retry
    value and the rollout's own `canary_run`, so a verdict from an earlier rollout of the same
    revision under the same retry value is not this one's (an outside probe: a revision rolled out
    again went by its old verdict, pass or fail). A status from before `canary_run`: the retry value."""
    return f"{attempt}@{canary_run}" if canary_run else attempt


@dataclass
class _Step:
    spec: InferenceModelSpec
    stable: str | None
    world: World
    r: RolloutStatus
    actions: list[Action] = field(default_factory=list)
    requeue: float | None = None
    promoted_from: str | None = None
    deadline_in: float | None = None
    resumed: bool = False
    """This pass resumed a paused traffic step (its measurement was asked for while paused)."""

    # --- plumbing ---------------------------------------------------------------------------------
    def go(self) -> Decision:
        if self.r.revision is None:
            self._enter_or_supersede()  # first sight of this model
        if self._paused():
            self._keep_traffic()
            return self._decision()  # a pause freezes everything else, supersedes included
        self._enter_or_supersede()
        self._retry()
        for _ in range(len(RolloutState)):  # a chain of immediate transitions, never a loop
            before = self.r.state
            getattr(self, f"_on_{self.r.state.name.lower()}")()
            if self.r.state == before:
                break
        self._clean_up()
        return self._decision()

    def _decision(self) -> Decision:
        return Decision(self.r, self.stable, _normalised(self.actions), self.requeue, self.promoted_from, self.deadline_in)

    def move(self, state: RolloutState, reason: str, message: str) -> None:
        self.r.state, self.r.reason, self.r.message = state, reason, message
        self.r.since = rfc3339(self.world.now)

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.actions.append(RecordEvent(type_, reason, message))

    def condition(self, type_: str, status: Literal["True", "False", "Unknown"], reason: str, message: str) -> None:
        self.actions.append(SetCondition(type_, status, reason, message))

    def wait(self, seconds: float = REQUEUE_SECONDS) -> None:
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def waited(self) -> float:
        """Seconds since the rollout entered its current state."""
        return (self.world.now - _parse_time(self.r.since, self.world.now)).total_seconds()

    def within_deadline(self) -> bool:
        """False once the candidate has waited longer than spec.rollout.progressDeadlineSeconds;
        while waiting, the driver is told when the deadline falls."""
        left = self.spec.rollout.progress_deadline_seconds - self.waited()
        if left < 0:
            return False
        self.deadline_in = left if self.deadline_in is None else min(self.deadline_in, left)
        return True

    @property
    def candidate(self) -> str:
        assert self.r.revision is not None
        return self.r.revision

    def view(self, revision: str | None) -> RevisionView | None:
        return self.world.revisions.get(revision) if revision else None

    def annotation(self, name: str) -> str | None:
        value = self.world.annotations.get(name)
        return value.strip() if isinstance(value, str) else None

    # --- which revision this rollout is about ---------------------------------------------------
    def _wanted(self) -> tuple[str, bool]:
        """The candidate revision and whether it is a rollback (to a kept previous stable)."""
        rollback_to = self.annotation(ROLLBACK_ANNOTATION)
        if rollback_to and rollback_to == self.stable:
            return rollback_to, True
        if rollback_to and rollback_to in self._kept_previous():
            return rollback_to, True
        return self.world.target, False

    def _enter_or_supersede(self) -> None:
        wanted, rollback = self._wanted()
        if self.r.revision == wanted and self.r.rollback == rollback:
            return
        old, old_state = self.r.revision, self.r.state
        if old_state == RolloutState.PROMOTING and old is not None and self.world.serving == old:
            return  # traffic already moved: finish the promotion, then supersede
        if old is not None and old != self.stable and old_state not in (RolloutState.STABLE,):
            served = old_state == RolloutState.SHIFTING or bool(self.r.weight)
            if self.stable and served:
                self.actions.append(RouteTraffic(self.stable))  # S8: its share goes back before it goes
            self._retire(old)
            if old_state in (*IN_FLIGHT, RolloutState.PROMOTING, RolloutState.SHIFTING):
                # The same words as its status.history entry (reconcile._supersede_replaced_candidate).
                how = f"after serving a share of traffic, {NEVER_PROMOTED}" if served else NEVER_SERVED
                self.event("Normal", "RolloutSuperseded", f"revision {old} superseded by {wanted} {how}")
        if old_state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):  # that failure is history now, not the target's
            self.condition("Degraded", "False", "RolloutStarted", f"rolling out revision {wanted}; revision {old} failed "
                           "before (status.history)")  # fmt: skip
        self.r = RolloutStatus(
            state=RolloutState.PLANNING, revision=wanted, baseline=self.stable, rollback=rollback,
            attempt=self.annotation(RETRY_ANNOTATION) or "", since=rfc3339(self.world.now),
            reason="RevisionChanged", message=f"rolling out revision {wanted}",
            numerics=None if rollback else self.world.numerics, baseline_numerics=self._stable_numerics(),
        )  # fmt: skip
        if (unusable := self._unusable_rollback()) is not None:
            self.event("Warning", "RollbackUnavailable", f"{unusable}; rolling out the spec")

    def _unusable_rollback(self) -> str | None:
        """What is wrong with a rollback-to annotation that names no kept previous revision."""
        rollback_to = self.annotation(ROLLBACK_ANNOTATION)
        if not rollback_to or self._wanted()[1]:
            return None
        kept = ", ".join(self._kept_previous()) or "none"
        return f"{ROLLBACK_ANNOTATION}={rollback_to}: not a kept previous revision (kept: {kept})"

    def _kept_previous(self) -> tuple[str, ...]:
        """Previous stables a rollback can go to: those whose workloads still exist (newest first);
        history outlives the revisions deleted past revisionHistoryLimit."""
        return tuple(r for r in self.world.previous_stables if r in self.world.revisions)

    def _stable_numerics(self) -> str | None:
        """The stable's fingerprint: its own record's, or what the last rollout against it carried."""
        if self.r.revision is not None and self.r.revision == self.stable:
            return self.r.numerics
        return self.r.baseline_numerics if self.r.baseline == self.stable else None

    def _retire(self, revision: str) -> None:
        """Stop a candidate that never served: cancel its canary, delete it (or park a kept one)."""
        self.actions.append(CancelCanary(revision))
        if revision not in self.world.revisions:
            return
        if revision in self.world.previous_stables[: self.spec.revision_history_limit]:
            self.actions.append(ScaleRevision(revision, 0))
        else:
            self.actions.append(DeleteRevision(revision))

    # --- annotations ------------------------------------------------------------------------------
    def _paused(self) -> bool:
        pause = self.annotation(PAUSE_ANNOTATION) == "true"
        if pause and self.r.state != RolloutState.PAUSED:
            self.r.paused_from, self.r.paused_reason, self.r.paused_message = self.r.state, self.r.reason, self.r.message
            self.move(RolloutState.PAUSED, "Paused", f"paused by {PAUSE_ANNOTATION}; nothing changes until it is removed "
                      "(the traffic in force stays applied)")
            self.event("Normal", "RolloutPaused", self.r.message or "")
        if pause:
            if self.r.paused_from == RolloutState.SHIFTING:
                self._watch_paused_step()
            self.condition("Progressing", "False", "Paused", self.r.message or "paused")
            wanted, _ = self._wanted()
            if wanted == self.stable and wanted != self.r.revision:  # the spec went back to the stable revision
                self._stable_passed(wanted)
            elif wanted != self.r.revision:  # the rollout paused is an earlier revision's
                # The conditions speak of the target revision: an earlier revision's pass must not
                # read as this one's (an outside probe: CanaryPassed=True for a target never started).
                self.condition("CanaryPassed", "Unknown", "CanaryNotRun",
                               f"revision {wanted} is paused before its rollout starts ({PAUSE_ANNOTATION})")  # fmt: skip
            else:  # the target is the paused rollout's again: an earlier pass may have spoken of another
                self._restate_canary_passed()
            return True
        if self.r.state == RolloutState.PAUSED:
            resume = self.r.paused_from or RolloutState.PLANNING
            reason, message = self.r.paused_reason or "Resumed", self.r.paused_message or f"resumed in {resume.value}"
            if self.r.paused_reason is None and resume in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
                # A status paused before pausedReason kept no cause: "Resumed" must not read as one
                # in CanaryPassed, Degraded and Progressing for good.
                reason, message = "RolloutFailed", f"revision {self.candidate} failed before it was paused (status.history)"
            self.r.paused_from = self.r.paused_reason = self.r.paused_message = None
            if resume == RolloutState.SHIFTING:
                # The step holds its pause (and bake) again and ends only on a measurement taken after
                # the resume: the paused time and the verdict from before it judged nothing since (an
                # outside probe: a resume promoted at once on a pass from an hour before).
                self.r.step_since = self.r.analysis_at = rfc3339(self.world.now)
                self.r.analysis_verdict = None
                self.resumed = True
            self.move(resume, reason, message)
            self.event("Normal", "RolloutResumed", f"revision {self.candidate}: resumed in {resume.value}")
            self._restate_canary_passed()  # a state that wrote it before the pause does not write it again
        return False

    def _watch_paused_step(self) -> None:
        """S8 while paused: a candidate keeps its share of traffic, so it is still watched (the
        readiness gate, readiness, the analysis at its interval), and one that fails loses the share
        at once; the rollout then resumes into its failure. The step itself does not move (an
        outside probe: paused, a candidate with no ready router kept 10% of the users)."""
        problem = self._unsafe_at_weight()
        if problem is None and self.world.analysis is not None:
            problem = self._take_measurement(self.world.analysis)
        if problem is not None:
            reason, message = problem
            self.r.weight = 0
            self.actions.append(SetTrafficWeight(self._stable_revision(), self.candidate, 0))
            self.r.paused_from, self.r.paused_reason, self.r.paused_message = RolloutState.FAILED, reason, message
            self.r.message = (f"paused by {PAUSE_ANNOTATION}: {message}; all traffic is back on revision {self.stable}, "
                              "and the rollback follows the resume")  # no longer "nothing changes" (a review)
            self.event("Warning", reason, f"{message}; revision {self.stable} keeps serving (paused: the rollback follows the resume)")
            self.condition("Degraded", "True", reason, message)
            return
        if due_in := self._measure_when_due():
            self.wait(max(1.0, due_in))

    def _stable_passed(self, revision: str) -> None:
        self.condition("CanaryPassed", "True", "StableRevision",
                       f"revision {revision} is the stable revision: it passed its canary before it served")  # fmt: skip

    def _restate_canary_passed(self) -> None:
        """CanaryPassed as the rollout in status stands: a pass while paused may have written it for
        another target (CanaryNotRun) since its state last wrote it, and a state past its canary
        (Promoting, Shifting, Stable) never writes it again (a review: a spec changed and changed
        back while paused left CanaryNotRun for a revision no longer wanted, for good)."""
        paused = self.r.state == RolloutState.PAUSED
        state = (self.r.paused_from or self.r.state) if paused else self.r.state
        reason, message = (self.r.paused_reason, self.r.paused_message) if paused else (self.r.reason, self.r.message)
        c, canary = self.candidate, self.r.canary
        if state in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
            self.condition("CanaryPassed", "False", reason or "RolloutFailed", message or f"revision {c} failed")
        elif state == RolloutState.BLOCKED:
            self.condition("CanaryPassed", "Unknown", "CanaryNotRun", f"revision {c} is blocked before its canary: {reason or 'a rollout gate'}")
        elif state in (RolloutState.PLANNING, RolloutState.CANARY_DEPLOYING):
            self.condition("CanaryPassed", "Unknown", "CanaryPending", f"revision {c} is being deployed")
        elif self.r.rollback:  # a kept revision: no canary runs again
            self.condition("CanaryPassed", "True", "RollbackToVerifiedRevision",
                           f"revision {c} passed its canary when it was first promoted")  # fmt: skip
        elif state == RolloutState.CANARY_VERIFYING and (canary is None or canary.revision != c):
            self.condition("CanaryPassed", "Unknown", "CanaryRunning", f"revision {c}: canary suite running")
        elif canary is not None and canary.revision == c and canary.verdict == "pass":
            self.condition("CanaryPassed", "True", "CanaryPassed", f"revision {c}: canary passed ({canary.reason})")
        elif state == RolloutState.STABLE and c == self.stable:
            self._stable_passed(c)

    def _keep_traffic(self) -> None:
        """While paused, the split in force is applied again as it stands (as Argo Rollouts keeps
        a paused step's weight): a pause changes nothing, but a route deleted during it must not
        leave the model's gateway clients without one until it is lifted."""
        if self.stable is None:
            return
        if self.r.paused_from == RolloutState.SHIFTING and self.r.weight is not None:
            self.actions.append(SetTrafficWeight(self.stable, self.candidate, self.r.weight))
        else:
            self.actions.append(RouteTraffic(self.stable))

    def _retry(self) -> None:
        retry = self.annotation(RETRY_ANNOTATION) or ""
        if self.r.state in (RolloutState.FAILED, RolloutState.ROLLED_BACK) and retry != self.r.attempt:
            self.r.attempt, self.r.canary = retry, None
            self._forget_pools()
            self.move(RolloutState.PLANNING, "Retry", f"retrying revision {self.candidate} ({RETRY_ANNOTATION}={retry})")
            self.event("Normal", "RolloutRetried", self.r.message or "")
            self.condition("Degraded", "False", "RolloutStarted", self.r.message or "")

    # --- gates ------------------------------------------------------------------------------------
    def _gate_problem(self) -> tuple[str, str] | None:
        """(reason, message) of the first pre-deploy gate that fails, None when all pass (S7)."""
        if self.r.rollback:
            return None  # a previous stable passed planner and policy when it was promoted
        if not self.world.plan_ok:
            return "KVPoolTooSmall", self.world.plan_message or "the planned KV pool is below minKVRatio x contextLength"
        if not self.world.policy.compliant:
            return "PolicyViolation", self.world.policy.message
        idle = [name for name, role in self.spec.roles.worker_roles().items() if role.replicas == 0]
        if idle:  # nothing to measure or canary: say so now instead of timing out in CanaryDeploying
            fields = ", ".join(f"spec.roles.{name}.replicas" for name in idle)
            return "NoWorkers", f"{fields}: 0, a revision without them cannot be verified or serve; scale it up to roll it out"
        return None

    def _policy_condition(self) -> None:
        gate = self.world.policy
        self.condition("PolicyCompliant", "True" if gate.compliant else "False",
                       "Compliant" if gate.compliant else "PolicyViolation", gate.message)  # fmt: skip

    def _block_if_gates_fail(self) -> bool:
        problem = self._gate_problem()
        if problem is None:
            return False
        reason, message = problem
        self.move(RolloutState.BLOCKED, reason, f"revision {self.candidate} blocked: {message}")
        self.event("Warning", reason, self.r.message or "")
        # The conditions speak of the target revision: an earlier revision's pass must not read as this one's.
        self.condition("CanaryPassed", "Unknown", "CanaryNotRun", f"revision {self.candidate} is blocked before its canary: {reason}")
        return True

    # --- states -----------------------------------------------------------------------------------
    def _on_planning(self) -> None:
        self._policy_condition()
        if self.candidate == self.stable:
            self._back_to_stable()
            return
        if self._block_if_gates_fail():
            return
        self.r.canary = None
        self._forget_pools()
        self.r.baseline = self.stable
        beside = f" beside stable {self.stable}" if self.stable else ""
        if self.r.rollback:  # no canary runs: it passed one when it was first promoted
            self.move(RolloutState.CANARY_DEPLOYING, "RollbackDeploying",
                      f"bringing back revision {self.candidate}{beside}: its pools are measured again, no canary")  # fmt: skip
            self.event("Normal", "RollbackDeploying", self.r.message or "")
        else:
            self.move(RolloutState.CANARY_DEPLOYING, "CanaryDeploying", f"deploying revision {self.candidate}{beside}")
            self.event("Normal", "CanaryDeploying", self.r.message or "")
            # A new rollout of the revision: its canary run has a key of its own, and an earlier
            # rollout's run of it stops (an outside probe: its verdict stood for this one's).
            self.r.canary_run = rfc3339(self.world.now)
            self.actions.append(CancelCanary(self.candidate))
        self.condition("CanaryPassed", "Unknown", "CanaryPending", f"revision {self.candidate} is being deployed")

    def _on_blocked(self) -> None:
        self._policy_condition()
        if self.candidate == self.stable:
            self._back_to_stable()
            return
        problem = self._gate_problem()
        if problem is None:
            self.move(RolloutState.PLANNING, "GatesPass", f"revision {self.candidate} is no longer blocked")
            return
        if (self.r.reason, self.r.message) != (problem[0], f"revision {self.candidate} blocked: {problem[1]}"):
            # The gate that blocks it now: another one than at first (a policy fixed, a plan now too
            # small), or a status resumed from a pause that kept no reason (before pausedReason).
            self._block_if_gates_fail()
        if self.candidate in self.world.revisions:
            # Parked, not deleted, when it is a revision kept for rollback (a spec back to an older
            # revision that a policy now refuses): `rollback-to` must still find it (a review).
            self._retire(self.candidate)
        self.condition("Progressing", "False", self.r.reason or "Blocked", self.r.message or "")

    def _back_to_stable(self) -> None:
        """The spec names the stable revision again (a candidate was superseded, or blocked): the
        conditions speak of it now, not of the candidate that was being deployed."""
        self.move(RolloutState.STABLE, "RolloutComplete", f"revision {self.candidate} is serving")
        self._stable_passed(self.candidate)

    def _deploy(self, scale: Scale) -> None:
        if self.r.rollback:  # a kept revision comes back at the replicas it served with
            self.actions.append(ScaleRevision(self.candidate, None))
        else:
            self.actions.append(DeployRevision(self.candidate, scale))

    def _verification_scale(self) -> Scale:
        """canary, unless canary replicas are the full replicas anyway (then nothing grows later)."""
        roles = ("prefill", "decode", "router")
        smaller = any(self.spec.replicas_at(r, "canary") != self.spec.replicas_at(r, "full") for r in roles)
        return "canary" if smaller else "full"

    def _forget_pools(self) -> None:
        self.r.workers, self.r.measured_scale, self.r.scrape_attempts = [], None, 0

    def _refused_by_the_gate(self) -> bool:
        """S7: a candidate pod the readiness gate keeps out (too small a pool) fails the rollout."""
        refused = self.world.gate_refusals.get(self.candidate)
        if refused:
            self._fail("ReportedPoolTooSmall", f"revision {self.candidate}: " + "; ".join(refused))
        return bool(refused)

    def _stopped_by_a_gate(self) -> bool:
        """Every check a deployed candidate passes again on each pass: policy and the gates (else
        BLOCKED), and the readiness gate's pool check (else failed, S7)."""
        self._policy_condition()
        return self._block_if_gates_fail() or self._refused_by_the_gate()

    def _on_canary_deploying(self) -> None:
        if self._stopped_by_a_gate():
            return
        self._deploy(self._verification_scale())
        view = self.view(self.candidate)
        if view is not None and view.ready:
            self.move(RolloutState.CANARY_VERIFYING, "CanaryReady", f"revision {self.candidate} is ready; verifying")
            return
        if not self.within_deadline():
            waiting = ", ".join(view.waiting) if view else "no workloads"
            deadline = self.spec.rollout.progress_deadline_seconds
            self._fail("CanaryNotReady", f"revision {self.candidate} not ready after {deadline:g} s "
                       f"(spec.rollout.progressDeadlineSeconds; {waiting})")  # fmt: skip
            return
        waiting = ", ".join(view.waiting) if view and view.waiting else "workloads to be created"
        self.condition("Progressing", "True", "CanaryDeploying", f"revision {self.candidate}: waiting for {waiting}")
        self.wait()

    def _on_canary_verifying(self) -> None:
        if self._stopped_by_a_gate():
            return
        self._deploy(self._verification_scale())
        view = self.view(self.candidate)
        if view is None or not view.ready:
            self.r.canary = None
            self._forget_pools()  # workers changed: measure again (S7)
            self.move(RolloutState.CANARY_DEPLOYING, "CanaryNotReady", f"revision {self.candidate} lost readiness")
            self.wait()
            return
        if not self.r.workers and not self._verify_pools(view):
            return
        if self.r.rollback:
            self.condition("CanaryPassed", "True", "RollbackToVerifiedRevision",
                           f"revision {self.candidate} passed its canary when it was first promoted")  # fmt: skip
            self._start_promoting("RollbackVerified", f"rolling back to revision {self.candidate}")
            return
        self._verify_canary()

    def _verify_pools(self, view: RevisionView) -> bool:
        """S7: every running worker reports a pool >= ratio x context. True once recorded."""
        reports = self.world.worker_reports
        if reports is None:
            self.actions.append(ScrapeMetrics(self.candidate))
            self.condition("Progressing", "True", "ScrapingMetrics", f"revision {self.candidate}: reading every worker's KV pool")
            self.wait(0.0)  # the scrape is the next observation: nothing to wait for
            return False
        missing = [f"{w.worker}: {w.error}" for w in reports if w.error or w.pool_tokens is None]
        if len(reports) < view.worker_replicas:
            missing.append(f"{len(reports)} of {view.worker_replicas} workers found")
        if missing:
            self.r.scrape_attempts += 1
            if self.r.scrape_attempts >= MAX_SCRAPE_ATTEMPTS:
                self._fail("MetricsUnavailable", f"revision {self.candidate}: not every worker reports its KV pool: " + "; ".join(missing))
            else:
                self.actions.append(ScrapeMetrics(self.candidate))  # scrape again before the next step
                self.condition("Progressing", "True", "WaitingForMetrics", "; ".join(missing))
                self.wait()
            return False
        pools = [self._judge(w) for w in reports]
        self.r.workers, self.r.measured_scale = pools, view.scale
        small = [p for p in pools if not p.sufficient]
        if small:
            detail = "; ".join(f"{p.worker} ({p.role}) reports {math.floor(p.pool_tokens)} tokens = "
                               f"{ratio_text(p.pool_tokens, p.context_length)} context {p.context_length}"
                               for p in small if p.pool_tokens is not None and p.context_length)  # fmt: skip
            self._fail("ReportedPoolTooSmall", f"revision {self.candidate}: {detail} < {ratio_number(self.spec.min_kv_ratio)}x required")
            return False
        self.event("Normal", "PoolsVerified", f"revision {self.candidate}: {len(pools)} worker(s) at {view.scale} "
                   f"scale report >= {ratio_number(self.spec.min_kv_ratio)}x context")  # fmt: skip
        return True

    def _judge(self, report: WorkerReport) -> WorkerPool:
        # The larger of the spec's and the worker's own context: a worker that admits longer
        # requests than the spec says needs the pool for them (for a rollback, the spec may be newer).
        spec_context = 0 if self.r.rollback else self.spec.context_length
        context = max(spec_context, report.context_length or 0) or self.spec.context_length
        pool = report.pool_tokens or 0.0
        # S7 on exact integers: judging a rounded ratio passed a pool 12 tokens short of 2x a 1M
        # context. The ratio shown is rounded down, so a shortfall never reads as the ratio it misses.
        ratio = ratio_down(pool, context)
        return WorkerPool(
            worker=report.worker, role=report.role, pool_tokens=pool, context_length=context,
            ratio=ratio, sufficient=pool >= required_pool_tokens(self.spec.min_kv_ratio, context, self.spec.page_size),
        )  # fmt: skip

    def _verify_canary(self) -> None:
        result = self.world.canary
        if result is not None and result.revision == self.candidate and result.attempt == self._canary_key():
            self.r.canary = CanarySummary(
                revision=result.revision, attempt=result.attempt, verdict=result.verdict, reason=result.reason,
                failed_probes=list(result.failed_probes), duration_seconds=result.duration_seconds,
            )  # fmt: skip
        if self.r.canary is None:
            if not self.world.canary_running:
                self._run_canary()
            self.condition("CanaryPassed", "Unknown", "CanaryRunning", f"revision {self.candidate}: canary suite running")
            self.condition("Progressing", "True", "CanaryRunning", f"revision {self.candidate}: canary suite running")
            self.wait()
            return
        summary = self.r.canary
        if summary.verdict != "pass":
            self._fail("CanaryFailed", f"revision {self.candidate}: canary {summary.verdict}: {summary.reason}")
            return
        message = f"revision {self.candidate}: canary passed ({summary.reason})"
        self.condition("CanaryPassed", "True", "CanaryPassed", message)
        self.event("Normal", "CanaryPassed", message)
        self._start_promoting("CanaryPassed", f"promoting revision {self.candidate}")

    def _canary_key(self) -> str:
        return canary_run_key(self.r.attempt, self.r.canary_run)

    def _start_promoting(self, reason: str, message: str) -> None:
        self.r.scrape_attempts = 0
        self.move(RolloutState.PROMOTING, reason, message)

    def _run_canary(self) -> None:
        baseline = self._baseline()
        change = numerics_change(self.r.numerics, self.r.baseline_numerics)
        match: BaselineMatch = "exact"
        if baseline is not None and change is not None:
            fields = "; ".join(change.fields)
            if change.other_model:
                match = "unknown" if change.opaque else "none"  # unknown: the model may be the same (RunCanary)
                serves, still = ("may serve", "; isolation still reads them") if change.opaque else ("serves", "")
                self.event("Normal", "BaselineOutputsNotCompared",
                           f"revision {self.candidate} {serves} another model than {baseline} ({fields}): the golden "
                           f"probe checks expected text, not {baseline}'s outputs{still}")  # fmt: skip
            else:
                match = "tolerant"
                self.event("Normal", "BaselineComparedByLogprobs",
                           f"revision {self.candidate} runs the same model as {baseline} with other numerics ({fields}): "
                           f"the golden probe compares per-token logprobs with {baseline}'s, not exact text")  # fmt: skip
        self.actions.append(RunCanary(self.candidate, baseline, self._canary_key(), baseline_match=match))

    def _baseline(self) -> str | None:
        stable = self.stable
        view = self.view(stable)
        return stable if stable and stable != self.candidate and view is not None and view.ready else None

    def _all_gates_pass(self) -> bool:
        """S7, checked once more right before traffic moves."""
        if self._gate_problem() is not None:
            return False
        pools_ok = bool(self.r.workers) and all(w.sufficient for w in self.r.workers)
        canary_ok = self.r.rollback or (self.r.canary is not None and self.r.canary.verdict == "pass")
        return pools_ok and canary_ok

    def _on_promoting(self) -> None:
        already_routed = self.world.serving == self.candidate
        if not already_routed and not self._all_gates_pass():
            if not self._block_if_gates_fail():
                self.move(RolloutState.CANARY_VERIFYING, "Reverify", f"revision {self.candidate}: evidence incomplete")
            return
        if not already_routed and not self._at_full_scale():
            return
        if not already_routed and self._in_steps():
            self._enter_step(0)
            return
        self._complete()

    def _in_steps(self) -> bool:
        """Traffic moves in steps (with analysis) only from a serving stable revision to a new one."""
        stable_view = self.view(self.stable)
        return (self.spec.rollout.progressive and not self.r.rollback and self.stable is not None
                and self.stable != self.candidate and stable_view is not None and stable_view.ready)  # fmt: skip

    def _complete(self) -> None:
        """The candidate becomes stable; the old revision keeps running for scaleDownDelaySeconds so
        that kvguard.io/rollback-to it is instant, then is scaled to zero (`_scale_down_when_due`)."""
        self.actions.append(RouteTraffic(self.candidate))
        old, delay = self.stable, self.spec.rollout.scale_down_delay_seconds
        if old and old != self.candidate:
            self.promoted_from = old
            if delay > 0:
                self.r.scale_down_revision = old
                self.r.scale_down_at = rfc3339(self.world.now + dt.timedelta(seconds=delay))
                self.event("Normal", "RevisionPromoted", f"revision {self.candidate} is serving; {old} keeps running until "
                           f"{self.r.scale_down_at} (spec.rollout.scaleDownDelaySeconds) for an instant {ROLLBACK_ANNOTATION}")  # fmt: skip
            else:
                self.actions.append(ScaleRevision(old, 0))
                self.event("Normal", "RevisionPromoted", f"revision {self.candidate} is serving; {old} scaled to zero")
        elif old != self.candidate:
            self.event("Normal", "RevisionPromoted", f"revision {self.candidate} is serving")
        self.stable = self.candidate
        self.r.weight = 100 if self.r.step is not None else self.r.weight
        self.move(RolloutState.STABLE, "RolloutComplete", f"revision {self.candidate} is serving")

    # --- traffic in steps -------------------------------------------------------------------------
    def _enter_step(self, index: int) -> None:
        steps = self.spec.rollout.steps
        self.r.step, self.r.weight = index, steps[index].weight
        self.r.step_since = self.r.analysis_at = rfc3339(self.world.now)
        self.r.analysis_verdict = None
        if index == 0:
            self.r.analysis = []  # failure limits count per attempt: a retry starts from zero
        message = f"revision {self.candidate} gets {self.r.weight}% of traffic (step {index + 1} of {len(steps)})"
        self.move(RolloutState.SHIFTING, "TrafficStep", message)
        self.event("Normal", "TrafficStep", message)
        self.actions.append(SetTrafficWeight(self._stable_revision(), self.candidate, self.r.weight))
        self.condition("Progressing", "True", "TrafficStep", message)
        self.wait(float(self.spec.rollout.analysis.interval_seconds))

    def _stable_revision(self) -> str:
        assert self.stable is not None
        return self.stable

    def _unsafe_at_weight(self) -> tuple[str, str] | None:
        """(reason, message) when the candidate must lose its share of traffic now (S7/S8), else None."""
        weight = self.r.weight or 0
        refused = self.world.gate_refusals.get(self.candidate)
        if refused:  # S7: a candidate pod the readiness gate keeps out, found while it takes traffic
            return "ReportedPoolTooSmall", f"revision {self.candidate} at {weight}% of traffic: " + "; ".join(refused)
        view = self.view(self.candidate)
        if view is None or not view.ready:
            return "CandidateNotReady", f"revision {self.candidate} lost readiness at {weight}% of traffic"
        return None

    def _on_shifting(self) -> None:
        stable, weight = self._stable_revision(), self.r.weight or 0
        if (problem := self._unsafe_at_weight()) is not None:
            self._abort(*problem)
            return
        if self._steps_changed():  # after the checks above: a switch to service promotes only a sound candidate
            return
        self._policy_condition()  # said again: a pass halted by a foreign object or a bad spec set it Unknown
        if self._record_measurement():
            return
        if not self._advance():
            self.actions.append(SetTrafficWeight(stable, self.candidate, weight))  # idempotent: re-applied each pass
            self._wait_for_analysis()

    def _steps_changed(self) -> bool:
        """The rollout settings changed under the step in progress (they update in place): with
        trafficRouter service nothing can carry a share, so the candidate takes all traffic at once,
        as service mode promotes; a step list that no longer holds this step (gone, or another
        weight) starts again at its first step, as Argo Rollouts does with a new step list."""
        steps, index = self.spec.rollout.steps, self.r.step or 0
        if self.spec.rollout.traffic_router == "service":
            self.event("Normal", "TrafficRouterChanged", f"spec.rollout.trafficRouter is service: revision {self.candidate} "
                       f"takes all traffic at once (it had {self.r.weight}%)")  # fmt: skip
            self._complete()
            return True
        if index < len(steps) and steps[index].weight == self.r.weight:
            return False
        self.event("Normal", "StepsChanged", f"spec.rollout.steps changed during step {index + 1} ({self.r.weight}%): "
                   f"revision {self.candidate} starts again at step 1 of {len(steps)}")  # fmt: skip
        self._enter_step(0)
        return True

    def _record_measurement(self) -> bool:
        """Take in a fresh measurement; True when it failed the rollout. On the pass that resumes,
        one was asked for while paused: a failure counts, a pass does not end the step (a review)."""
        measured = self.world.analysis
        if measured is None or (self.resumed and measured.verdict != "fail"):
            return False
        if (failed := self._take_measurement(measured)) is not None:
            self._abort(*failed)
            return True
        return False

    def _take_measurement(self, measured: AnalysisOutcome) -> tuple[str, str] | None:
        """Record a measurement in status; (reason, message) when it failed the candidate."""
        self.r.analysis = carried_results(self.r.analysis or [], measured.results)
        self.r.analysis_verdict, self.r.analysis_at = measured.verdict, rfc3339(self.world.now)
        if measured.verdict != "fail":
            return None
        return "AnalysisFailed", f"revision {self.candidate} failed its analysis at {self.r.weight}% of traffic: {measured.message}"

    def _measure_when_due(self) -> float:
        """Ask for a measurement once the analysis interval has passed since the last one (0.0: asked,
        and it is the next observation); else the seconds until it is due."""
        since_measured = (self.world.now - _parse_time(self.r.analysis_at, self.world.now)).total_seconds()
        due_in = float(self.spec.rollout.analysis.interval_seconds) - since_measured
        if due_in > 0:
            return due_in
        self.actions.append(MeasureAnalysis(self.candidate, self._stable_revision()))
        self.wait(0.0)
        return 0.0

    def _hold(self) -> tuple[float, float]:
        """(seconds the current step must hold, seconds it has held): its pause, plus bakeSeconds at the last."""
        steps, index = self.spec.rollout.steps, self.r.step or 0
        hold = steps[index].pause + (self.spec.rollout.bake_seconds if index == len(steps) - 1 else 0)
        return float(hold), (self.world.now - _parse_time(self.r.step_since, self.world.now)).total_seconds()

    def _advance(self) -> bool:
        """To the next step (or promotion after the last) once this one held with a passing analysis."""
        hold, held = self._hold()
        if self.r.analysis_verdict != "pass" or held < hold:
            return False
        index = self.r.step or 0
        if index + 1 < len(self.spec.rollout.steps):
            self._enter_step(index + 1)
        else:
            self.event("Normal", "AnalysisPassed", f"revision {self.candidate}: analysis passed at every step")
            self._complete()
        return True

    def _wait_for_analysis(self) -> None:
        if self.r.analysis_verdict == "inconclusive":
            # Why the last measurement could not judge: its own entry when it judged nothing (the
            # checks' kept entries are older: `carried_results`), else its open checks, each once.
            latest = [r for r in self.r.analysis if r.name in NOT_A_CHECK] or self.r.analysis
            open_ = "; ".join(dict.fromkeys(r.message for r in latest if r.phase != "Successful"))
            self.condition("Progressing", "True", "AnalysisInconclusive", f"revision {self.candidate} holds at {self.r.weight}%: {open_}")
        else:
            self.condition("Progressing", "True", "TrafficStep", self.r.message or "")
        if due_in := self._measure_when_due():
            hold, held = self._hold()
            self.wait(max(1.0, min(due_in, hold - held if held < hold else float(self.spec.rollout.analysis.interval_seconds))))

    def _abort(self, reason: str, message: str) -> None:
        """S8: all traffic back to the stable revision at once, then the usual failure path."""
        self.r.weight = 0
        self.actions.append(SetTrafficWeight(self._stable_revision(), self.candidate, 0))
        self._fail(reason, message)

    def _at_full_scale(self) -> bool:
        """S7 at the size that will serve: full replicas, all ready, every worker measured again."""
        self._deploy("full")
        if self.r.measured_scale == "full":
            return True
        view = self.view(self.candidate)
        if view is None or not view.ready or view.scale != "full":
            waiting = ", ".join(view.waiting) if view and view.waiting else "the scale-up to be observed"
            if not self.within_deadline():
                self._fail("ScaleUpNotReady", f"revision {self.candidate} not ready at full scale after "
                           f"{self.spec.rollout.progress_deadline_seconds:g} s (spec.rollout.progressDeadlineSeconds; {waiting})")  # fmt: skip
            else:
                self.condition("Progressing", "True", "ScalingUp", f"revision {self.candidate}: waiting for {waiting}")
                self.wait()
            return False
        return self._verify_pools(view)

    def _on_stable(self) -> None:
        self._policy_condition()
        if not self.r.rollback and self.candidate == self.world.target and self.world.plan_ok:
            self.actions.append(DeployRevision(self.candidate))  # in-place changes (replicas...)
        elif self.r.rollback:
            self.actions.append(ScaleRevision(self.candidate, None))
        self.actions.append(RouteTraffic(self.candidate))
        self._scale_down_when_due()
        pinned = f"; pinned by {ROLLBACK_ANNOTATION}, spec revision {self.world.target} waits" if self.r.rollback else ""
        if (unusable := self._unusable_rollback()) is not None:  # said on every pass: the annotation is still there
            pinned = f"; {unusable}, ignored"
        self.condition("Progressing", "False", "RolloutComplete", f"revision {self.candidate} is serving{pinned}")
        self.condition("Degraded", "False", "AsExpected", "")

    def _scale_down_when_due(self) -> None:
        """The previous stable stays up until scaleDownAt (an instant rollback), then goes to zero."""
        old = self.r.scale_down_revision
        if old is None:
            return
        due = _parse_time(self.r.scale_down_at, self.world.now)
        if old == self.candidate or self.world.now >= due:
            if old != self.candidate and old in self.world.revisions:
                self.actions.append(ScaleRevision(old, 0))
                self.event("Normal", "PreviousRevisionScaledDown", f"revision {old} scaled to zero after "
                           f"spec.rollout.scaleDownDelaySeconds ({self.spec.rollout.scale_down_delay_seconds} s)")  # fmt: skip
            self.r.scale_down_revision = self.r.scale_down_at = None
            return
        self.wait((due - self.world.now).total_seconds())

    def _fail(self, reason: str, message: str) -> None:
        """S8: stop the candidate, say why, keep the stable revision exactly as it is."""
        self.move(RolloutState.FAILED, reason, message)
        self.event("Warning", reason, message + ("" if not self.stable else f"; revision {self.stable} keeps serving"))
        self.condition("CanaryPassed", "False", reason, message)

    def _on_failed(self) -> None:
        self._stop_candidate()
        view = self.view(self.candidate)
        if view is None or view.scaled_to_zero:
            self.move(RolloutState.ROLLED_BACK, self.r.reason or "RolledBack", self.r.message or "")
            serving = f"; revision {self.stable} keeps serving" if self.stable else ""
            self.event("Normal", "RolledBack", f"revision {self.candidate} scaled to zero{serving}")
        else:
            self.wait()

    def _on_rolled_back(self) -> None:
        self._stop_candidate()

    def _stop_candidate(self) -> None:
        if self.candidate != self.stable:
            view = self.view(self.candidate)
            self.actions.append(CancelCanary(self.candidate))
            if view is not None and not view.scaled_to_zero:
                self.actions.append(ScaleRevision(self.candidate, 0))
        if self.stable:
            self.actions.append(RouteTraffic(self.stable))
        retry = f"; set {RETRY_ANNOTATION} to a new value to retry" if self.r.state == RolloutState.ROLLED_BACK else ""
        self.condition("Degraded", "True", self.r.reason or "RolloutFailed", (self.r.message or "") + retry)
        self.condition("Progressing", "False", self.r.reason or "RolloutFailed", self.r.message or "")

    def _on_paused(self) -> None:  # reached only through _paused(); kept for the dispatch table
        return

    # --- retention --------------------------------------------------------------------------------
    def _clean_up(self) -> None:
        """Delete revisions nobody needs; park kept previous stables at zero (not while in flight)."""
        kept = [r for r in self.world.previous_stables if r != self.stable][: self.spec.revision_history_limit]
        warm = self.r.scale_down_revision if self.r.state == RolloutState.STABLE else None
        needed = {self.stable, self.r.revision, warm, *kept} - {None}
        touched = {a.revision for a in self.actions if isinstance(a, DeleteRevision | ScaleRevision)}
        for revision in sorted(set(self.world.revisions) - needed - touched):
            self.actions.append(DeleteRevision(revision))
        if self.r.state not in (RolloutState.STABLE, RolloutState.ROLLED_BACK, RolloutState.BLOCKED):
            return
        for revision in kept:
            view = self.view(revision)
            if view is not None and not view.scaled_to_zero and revision not in touched and revision not in (self.r.revision, warm):
                self.actions.append(ScaleRevision(revision, 0))


def _normalised(actions: list[Action]) -> tuple[Action, ...]:
    """Chained transitions may repeat an action: keep the first of each, and the last condition per type."""
    last_condition = {a.type: i for i, a in enumerate(actions) if isinstance(a, SetCondition)}
    seen: set[Action] = set()
    result: list[Action] = []
    for i, action in enumerate(actions):
        if isinstance(action, SetCondition):
            if last_condition[action.type] == i:
                result.append(action)
        elif action not in seen:
            seen.add(action)
            result.append(action)
    return tuple(result)


def _parse_time(text: str | None, default: dt.datetime) -> dt.datetime:
    if not text:
        return default
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return default


# --- helpers for drivers --------------------------------------------------------------------------


NEVER_SERVED = "before it served"
"""The end of a Superseded record's message when the revision was a candidate replaced mid-canary
(reconcile._supersede_replaced_candidate): it never served, so it is no rollback target and nothing of it is kept."""
NEVER_PROMOTED = "before it was promoted"
"""The end of one replaced while shifting traffic: it served a share, but was never the stable
revision, so it is no rollback target either."""


def previous_stables(history: Sequence[Any], stable: str | None) -> tuple[str, ...]:
    """Revisions that served before `stable`, newest first (status.history records, newest first).
    A candidate superseded before it served is not one: an operator restarted mid-change kept its
    Deployments for ever as if it were a rollback target."""
    seen: list[str] = []
    for record in history:
        revision, state = record.revision, record.state
        never_served = state == "Superseded" and (record.message or "").endswith((NEVER_SERVED, NEVER_PROMOTED))
        if state in ("Stable", "Superseded") and not never_served and revision != stable and revision not in seen:
            seen.append(revision)
    return tuple(seen)


def with_reports(world: World, reports: Sequence[WorkerReport]) -> World:
    """The same world with a fresh scrape (call `step` again with it after ScrapeMetrics)."""
    return replace(world, worker_reports=tuple(reports))
