"""Analysis of a candidate's live traffic between traffic steps (pure: no I/O, no clock).

Inputs are Prometheus text already scraped from the candidate's and the stable revision's routers
and workers (parsed here with prometheus_client), at the start of the window and now; the
measurement covers the traffic in between. Each scrape is named `role/name` (`source_name`): the
routers and the engines both count `kvguard_requests_total`, and a request is the router's.
Output: pass, fail or inconclusive, with every check's numbers for status.rollout.analysis.

Checks (spec.rollout.analysis):
- safety: any increase of a safety counter on the candidate (tag violations S1, KV checksum and
  HMAC failures S3) fails the analysis at once, whatever the failure limits.
- errorRatio: failed / the candidate routers' ended requests (kvguard_requests_total{outcome}),
  at most maxRatio. Requests the client abandoned (`aborted`: it disconnected) are left out of
  both: a user pressing stop, or a tenant hanging up on purpose, says nothing about the revision.
  A revision that hangs is not hidden by this: its requests end `failed` at the router's request
  timeout, and while none end otherwise the window holds too few requests to pass.
- ttft, itl: a percentile of kvguard_router_time_to_first_token_seconds /
  kvguard_router_inter_token_latency_seconds of the candidate, at most maxRatioToStable times the
  stable's over the same window (no stable revision: not compared).
- queries: PromQL values fetched by the driver from prometheusURL, within [min, max].
A check that fails more than its failureLimit measurements in a rollout fails the analysis; one
that errors (could not be measured: an unreachable Prometheus, unreadable metrics) more than
consecutiveErrorLimit measurements in a row fails it too, as in Argo Rollouts. Fewer
than minRequests candidate requests in the window make the router checks inconclusive: the step
holds (a candidate nobody talks to is not evidence), and the window stays open
(`needs_more_traffic`) until it holds enough, so a candidate at low traffic that fails every
request is still judged. At 100% the stable gets no traffic: latencies are compared with its last
window that had some (`Window.stable_reference`).

Only counters and histograms are read. A process whose counters went down restarted (a restarted
pod): all of its series count from zero, not only those that went down (a restarted router's few
failures hid behind the old count).
A stable window with fewer than minRequests first tokens is too small to compare with (one slow
request made an equal candidate 2x): the last window that had enough is used instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvguard.operator.api import AnalysisSpec, LatencyCheck, PrometheusQuery
from kvguard.operator.canary.spec import DEFAULT_ABORT_TOLERANT_COUNTERS, DEFAULT_SAFETY_COUNTERS
from kvguard.operator.rollout import AnalysisOutcome, AnalysisPhase, AnalysisResult

REQUESTS = "kvguard_requests_total"
ERROR_OUTCOMES = ("failed",)
"""kvguard_requests_total outcomes that count as errors: 5xx answers and responses the revision
broke off (`rejected` is a 4xx the client caused, e.g. an over-length prompt)."""
ABANDONED = "aborted"
"""The outcome of a request whose client disconnected: not judged either way."""
TTFT = "kvguard_router_time_to_first_token_seconds"
ITL = "kvguard_router_inter_token_latency_seconds"
LIVE_SAFETY_COUNTERS = tuple(c for c in DEFAULT_SAFETY_COUNTERS if c not in DEFAULT_ABORT_TOLERANT_COUNTERS)
"""Counters that must never rise under live traffic: tag violations (S1), KV checksum and HMAC
failures (S3). Dropped stale writes and the engines' transfer failures also follow a client that
hangs up mid-prefill (S5 working), which live traffic does all the time, so they are left out."""
LATENCY_FLOOR_SECONDS = 0.001
"""The stable's percentile is taken as at least this when dividing: a sub-millisecond stable
would make any jitter look like a regression."""

ROUTER = "router"

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, str, Labels]
"""(source: `role/name` of the scraped process, sample name, labels)."""
Series = dict[SeriesKey, float]


def source_name(role: str, name: str) -> str:
    """The source of a scrape: its role first, so the analysis can tell a router's series."""
    return f"{role}/{name}"


MONOTONIC_TYPES = frozenset({"counter", "histogram"})
"""The families a window measures: counts that only grow while their process lives. Gauges are
left out: one that went down (the router's body memory as a large body ends, its waiting
choices as they get a slot) read as a restarted router, and the window counted its lifetime
(an outside probe: a window of 20 failures in 20 passed as 20 in 1,020)."""


def parse_exposition(source: str, text: str) -> Series:
    """The counter and histogram samples of one scrape (not their `_created` times), keyed by
    source, name and labels. ValueError on bad text."""
    series: Series = {}
    for family in text_string_to_metric_families(text):
        if family.type not in MONOTONIC_TYPES:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                series[(source, sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return series


def merge(scrapes: Iterable[Series]) -> Series:
    merged: Series = {}
    for scrape in scrapes:
        merged.update(scrape)
    return merged


def increase(before: Series | None, after: Series) -> Series:
    """What each series of `after` gained since `before` (None: since the process started). A
    source any of whose series went down restarted: all of its series gained their whole value.
    Judged per series, a restarted router whose `failed` count had not yet passed the old one
    showed a fraction of its failures, and its histogram's buckets came out non-monotonic."""
    before = before or {}
    restarted = {key[0] for key, value in after.items() if value < before.get(key, 0.0)}
    return {key: value if key[0] in restarted else value - before.get(key, 0.0) for key, value in after.items()}


def total(window: Series, name: str, *, role: str | None = None, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (from `role`'s sources only,
    when given)."""
    wanted = set(labels.items())
    prefix = None if role is None else f"{role}/"
    return sum(v for (source, n, ls), v in window.items()
               if n == name and wanted <= set(ls) and (prefix is None or source.startswith(prefix)))  # fmt: skip


def requests_ended(window: Series, **labels: str) -> float:
    """Requests the routers ended (the engines count their halves of the same requests too)."""
    return total(window, REQUESTS, role=ROUTER, **labels)


def requests_judged(window: Series) -> float:
    """Requests that ended by the revision's doing: all but those whose client hung up."""
    return requests_ended(window) - requests_ended(window, outcome=ABANDONED)


def histogram_buckets(window: Series, histogram: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram summed over sources, ascending."""
    counts: dict[float, float] = {}
    for (_, name, labels), value in window.items():
        if name == f"{histogram}_bucket":
            bound = float(dict(labels)["le"])
            counts[bound] = counts.get(bound, 0.0) + value
    return sorted(counts.items())


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation.
    None without observations; the largest finite bound when it falls in the +Inf bucket."""
    if not all(math.isfinite(count) for _, count in buckets):
        return math.nan  # a count that is not a number cannot be ranked: never a pass (docs/rollouts.md)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


@dataclass(frozen=True)
class Window:
    """The traffic one measurement covers: each revision's series gained since the last one."""

    candidate: Series
    stable: Series | None
    """None: no stable revision serves (a first rollout); latencies are not compared."""
    stable_reference: Series | None = None
    """The stable's latest window that had router traffic: what latencies are compared with when
    this window has none from the stable (at 100% it gets no traffic at all)."""
    stable_lifetime: Series | None = None
    """The stable's counters since its processes began, as an operator process first scraped them:
    the last resort, when no window of the stable had traffic and no measurement recorded the
    stable's latency (`AnalysisResult.reference`) -- a lifetime's latencies may be long gone."""

    @classmethod
    def between(cls, candidate_before: Series | None, candidate_now: Series,
                stable_before: Series | None, stable_now: Series | None,
                stable_reference: Series | None = None, stable_lifetime: Series | None = None) -> Window:  # fmt: skip
        stable = increase(stable_before, stable_now) if stable_now is not None else None
        return cls(increase(candidate_before, candidate_now), stable, stable_reference, stable_lifetime)


def first_tokens(series: Series | None) -> float:
    """The first tokens a revision's routers observed in a window: its requests that were served."""
    return 0.0 if series is None else total(series, f"{TTFT}_count")


def served_traffic(series: Series | None, min_requests: int = 1) -> bool:
    """Whether a revision's window served at least `min_requests` requests (first tokens)."""
    return first_tokens(series) >= max(min_requests, 1)


def needs_more_traffic(spec: AnalysisSpec, window: Window) -> bool:
    """Too few candidate requests to judge: the next measurement should cover this window too."""
    return requests_judged(window.candidate) < spec.min_requests


@dataclass(frozen=True)
class QueryValue:
    """A PromQL query's answer as the driver fetched it (value None: no data or an error)."""

    name: str
    value: float | None
    error: str = ""


Measurement = AnalysisOutcome
"""One measurement: the verdict, every check's result, and the failing or missing checks with
their numbers (a summary when all passed). Defined in rollout.py, which consumes it."""


def _result(name: str, phase: AnalysisPhase, value: float | None, threshold: float | None, message: str,
            failures: int, at: str, reference: float | None = None, errors: int = 0) -> AnalysisResult:  # fmt: skip
    return AnalysisResult(name=name, phase=phase, value=None if value is None else round(value, 6), threshold=threshold,
                          failures=failures, message=message, measured_at=at, reference=reference, errors=errors)  # fmt: skip


def errors_in_a_row(previous: Sequence[AnalysisResult], name: str) -> int:
    """How many measurements in a row `name` has errored, counting this one."""
    return next((r.errors for r in previous if r.name == name), 0) + 1


def unmeasured(spec: AnalysisSpec, previous: Sequence[AnalysisResult], why: str, at: str, counted: bool = True) -> Measurement:
    """A measurement that could not be made (the revisions' metrics could not all be read): it
    holds the step and, `counted` (the candidate's metrics), fails the analysis once it has
    errored more than consecutiveErrorLimit times in a row (a candidate nobody can measure is
    never promoted by waiting). The stable's alone are not counted: failing would send all the
    traffic to the revision that cannot be read."""
    errors = errors_in_a_row(previous, "scrape") if counted else 0
    return _verdict(spec, [_result("scrape", "Error", None, None, why, 0, at, errors=errors)])


def measure(
    spec: AnalysisSpec, window: Window, queries: Sequence[QueryValue], previous: Sequence[AnalysisResult], at: str
) -> Measurement:
    """One measurement of every enabled check; `previous` carries each check's failure count."""
    failures = {r.name: r.failures for r in previous}
    recorded = {r.name: r.reference for r in previous}  # the stable latencies earlier measurements compared with
    results = [_safety(window, failures.get("safety", 0), at)]
    requests = requests_judged(window.candidate)
    if spec.error_ratio.enabled:
        results.append(_error_ratio(spec, window, requests, failures.get("errorRatio", 0), at))
    for name, histogram, check in (("ttft", TTFT, spec.ttft), ("itl", ITL, spec.itl)):
        if check.enabled:
            results.append(_latency(name, histogram, check, spec.min_requests, window, requests, failures.get(name, 0), at,
                                    recorded.get(name)))  # fmt: skip
    by_name = {q.name: q for q in queries}
    for query in spec.queries:
        results.append(_query(query, by_name.get(query.name), failures.get(query.name, 0), at, previous))
    return _verdict(spec, results)


def _safety(window: Window, failures: int, at: str) -> AnalysisResult:
    rose = {name: total(window.candidate, name) for name in LIVE_SAFETY_COUNTERS}
    rose = {name: v for name, v in rose.items() if v > 0 or not math.isfinite(v)}  # a NaN counter hides nothing
    if rose:
        detail = ", ".join(f"{name} +{v:g}" for name, v in sorted(rose.items()))
        return _result("safety", "Failed", sum(rose.values()), 0, f"safety counters rose on the candidate: {detail}", failures + 1, at)
    return _result("safety", "Successful", 0, 0, "no safety counter rose", failures, at)


def _too_few(requests: float, min_requests: int) -> str:
    """One text for every router check short of requests (the hold message names it once)."""
    return (f"{requests:g} candidate requests ended, {min_requests} needed (spec.rollout.analysis.minRequests): "
            "the step is judged on live traffic and waits for it")  # a rollout with no clients holds here (outside probe)


def _error_ratio(spec: AnalysisSpec, window: Window, requests: float, failures: int, at: str) -> AnalysisResult:
    limit = spec.error_ratio.max_ratio
    if requests < spec.min_requests:
        return _result("errorRatio", "Inconclusive", None, limit, _too_few(requests, spec.min_requests), failures, at)
    errors = sum(requests_ended(window.candidate, outcome=o) for o in ERROR_OUTCOMES)
    if not (math.isfinite(requests) and math.isfinite(errors)):  # a NaN ratio compares False with any limit: never a pass
        return _result("errorRatio", "Failed", None, limit, f"the candidate's request counters are not finite ({errors:g} "
                       f"failed of {requests:g}): its metrics cannot be judged", failures + 1, at)  # fmt: skip
    ratio = errors / requests
    text = f"{errors:g} of {requests:g} candidate requests failed = {ratio:.3f} (max {limit:g})"
    if abandoned := requests_ended(window.candidate, outcome=ABANDONED):
        text += f"; {abandoned:g} abandoned by their clients, not counted"
    if ratio > limit:
        return _result("errorRatio", "Failed", ratio, limit, text, failures + 1, at)
    return _result("errorRatio", "Successful", ratio, limit, text, failures, at)


def _stable_latency(check: LatencyCheck, histogram: str, window: Window, recorded: float | None,
                    min_requests: int) -> tuple[float | None, str]:  # fmt: skip
    """The stable's percentile to compare with, and where it comes from: this window's, when it
    served minRequests; else its last window that did (this operator process saw it); else what
    the last measurement that had one recorded (status: it outlives an operator restart, which at
    100% no window replaces); else, last, its lifetime as first scraped."""
    if served_traffic(window.stable, min_requests):
        stable = quantile(check.percentile, histogram_buckets(window.stable or {}, histogram))
        if stable is not None:
            return stable, "stable"
    if window.stable_reference is not None:
        return quantile(check.percentile, histogram_buckets(window.stable_reference, histogram)), "stable (its last window with traffic)"
    if recorded is not None:
        return recorded, "stable (its last window with traffic, as recorded)"
    if window.stable_lifetime is not None:
        return quantile(check.percentile, histogram_buckets(window.stable_lifetime, histogram)), "stable (its lifetime)"
    return None, "stable"


def _latency(name: str, histogram: str, check: LatencyCheck, min_requests: int, window: Window, requests: float,
             failures: int, at: str, recorded: float | None = None) -> AnalysisResult:  # fmt: skip
    limit = check.max_ratio_to_stable
    label = f"p{check.percentile * 100:g} {name.upper()}"
    if window.stable is None:
        return _result(name, "Successful", None, limit, f"{label}: no stable revision to compare with", failures, at)
    if requests < min_requests:
        return _result(name, "Inconclusive", None, limit, _too_few(requests, min_requests), failures, at, recorded)
    candidate = quantile(check.percentile, histogram_buckets(window.candidate, histogram))
    stable, stable_from = _stable_latency(check, histogram, window, recorded, min_requests)
    if candidate is None or stable is None:
        missing = "candidate" if candidate is None else "stable"
        return _result(name, "Inconclusive", None, limit, f"{label}: no {histogram} observations from the {missing}", failures, at,
                       recorded)  # fmt: skip
    # A NaN compares False with any limit, and an infinite stable makes any candidate 0x: never a pass.
    if not math.isfinite(candidate):
        return _result(name, "Failed", None, limit, f"{label}: the candidate's {histogram} is not finite", failures + 1, at, recorded)
    if not math.isfinite(stable):
        return _result(name, "Inconclusive", None, limit, f"{label}: the stable's {histogram} is not finite", failures, at, recorded)
    ratio = candidate / max(stable, LATENCY_FLOOR_SECONDS)
    text = f"{label} {candidate:.4f} s vs {stable_from} {stable:.4f} s = {ratio:.2f}x (max {limit:g}x)"
    reference = recorded if stable_from == "stable (its lifetime)" else stable  # a lifetime is never recorded as a window
    if ratio > limit:
        return _result(name, "Failed", ratio, limit, text, failures + 1, at, reference)
    return _result(name, "Successful", ratio, limit, text, failures, at, reference)


def _query(query: PrometheusQuery, answer: QueryValue | None, failures: int, at: str,
           previous: Sequence[AnalysisResult] = ()) -> AnalysisResult:  # fmt: skip
    bound = query.max if query.max is not None else query.min
    if answer is not None and answer.error:  # Prometheus unreachable, or answering an error
        return _result(query.name, "Error", None, bound, f"{query.name}: {answer.error}", failures, at,
                       errors=errors_in_a_row(previous, query.name))  # fmt: skip
    if answer is None or answer.value is None:
        return _result(query.name, "Inconclusive", None, bound, f"{query.name}: no data", failures, at)
    value = answer.value
    too_high = query.max is not None and value > query.max
    too_low = query.min is not None and value < query.min
    bounds = " and ".join(part for part in (f">= {query.min:g}" if query.min is not None else "",
                                            f"<= {query.max:g}" if query.max is not None else "") if part)  # fmt: skip
    text = f"{query.name} = {value:g} (must be {bounds})"
    if too_high or too_low:
        return _result(query.name, "Failed", value, query.max if too_high else query.min, text, failures + 1, at)
    return _result(query.name, "Successful", value, bound, text, failures, at)


def _limit(spec: AnalysisSpec, name: str) -> int:
    if name in ("safety", "window", "scrape"):
        return 0
    checks: Mapping[str, int] = {"errorRatio": spec.error_ratio.failure_limit, "ttft": spec.ttft.failure_limit, "itl": spec.itl.failure_limit}
    if name in checks:
        return checks[name]
    return next((q.failure_limit for q in spec.queries if q.name == name), 0)


def _verdict(spec: AnalysisSpec, results: list[AnalysisResult]) -> Measurement:
    over = [f"{r.message} ({r.failures} failed measurement(s), limit {_limit(spec, r.name)})"
            for r in results if r.failures > _limit(spec, r.name)]  # fmt: skip
    over += [f"{r.message} ({r.errors} measurements in a row could not be made, limit {spec.consecutive_error_limit}: "
             "spec.rollout.analysis.consecutiveErrorLimit)" for r in results if r.errors > spec.consecutive_error_limit]  # fmt: skip
    if over:
        return Measurement("fail", tuple(results), "; ".join(over))
    open_ = [r for r in results if r.phase != "Successful"]
    if open_:
        return Measurement("inconclusive", tuple(results), "; ".join(dict.fromkeys(r.message for r in open_)))
    return Measurement("pass", tuple(results), "; ".join(r.message for r in results))
