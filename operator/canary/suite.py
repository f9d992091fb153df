"""The suite runner: preflight, then the enabled probes in order, then the verdict.

Order: capacity (metrics only), golden, determinism (short prompts), over-length (rejections are
cheap), isolation, abort, and the safety counters last, so their before/after window spans every
other probe. A preflight that cannot reach the target, the baseline or any of the metrics URLs
yields `cannot_run`, as does a run in which every probe was skipped: nothing was proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvguard.operator.canary.abort import AbortProbe
from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext
from kvguard.operator.canary.capacity import CapacityProbe
from kvguard.operator.canary.client import API_PATHS, EngineClient, session_without_redirects
from kvguard.operator.canary.determinism import DeterminismProbe
from kvguard.operator.canary.discovery import (
    ContextReading,
    bounded_readings,
    choose_context_length,
    context_notes,
    discover_from_target,
)
from kvguard.operator.canary.engine_logs import EngineLog, FileLog
from kvguard.operator.canary.golden import GoldenProbe
from kvguard.operator.canary.isolation import IsolationProbe
from kvguard.operator.canary.metrics import WorkerSnapshot, fetch_all
from kvguard.operator.canary.over_length import OverLengthProbe
from kvguard.operator.canary.prompts import CALIBRATION_WORDS, TokenEstimate, filler_text
from kvguard.operator.canary.report import (
    CanaryReport,
    ProbeResult,
    ProbeStatus,
    TargetInfo,
    Verdict,
    one_line,
)
from kvguard.operator.canary.safety_counters import SafetyCountersProbe
from kvguard.operator.canary.spec import MAX_CONTEXT_TOKENS, MIN_CONTEXT_TOKENS, ApiKind, CanarySpec, ProbeName

PROBES: dict[ProbeName, type[Probe]] = {
    ProbeName.CAPACITY: CapacityProbe,
    ProbeName.GOLDEN: GoldenProbe,
    ProbeName.DETERMINISM: DeterminismProbe,
    ProbeName.OVER_LENGTH: OverLengthProbe,
    ProbeName.ISOLATION: IsolationProbe,
    ProbeName.ABORT: AbortProbe,
    ProbeName.SAFETY_COUNTERS: SafetyCountersProbe,
}


@dataclass(frozen=True)
class ProgressEvent:
    """`started` (result is None) or `finished` for one probe; `elapsed` since the suite began."""

    kind: str
    probe: ProbeName
    elapsed: float
    result: ProbeResult | None = None


ProgressCallback = Callable[[ProgressEvent], None]


class CannotRun(Exception):
    """The suite cannot judge this target at all (unreachable, no model); the message says why."""


async def run_suite(
    url: str,
    spec: CanarySpec | None = None,
    *,
    baseline_url: str | None = None,
    metrics_urls: Sequence[str] = (),
    progress: ProgressCallback | None = None,
    timeout_seconds: float | None = None,
    context_length: int | None = None,
    engine_logs: Sequence[Path | EngineLog] = (),
) -> CanaryReport:
    """Run every enabled probe against `url`; never raises for the target's misbehaviour.

    `timeout_seconds` overrides `spec.suiteTimeoutSeconds`; `context_length` overrides
    `spec.contextLength` (see `discovery` for where it is read otherwise); `engine_logs` are the
    engines' logs (files or `EngineLog`s) whose new SGLang KV-canary violations fail the
    safety-counter probe;
    `progress` is called as each probe starts and finishes.
    """
    spec = spec or CanarySpec()
    started = time.monotonic()
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    info = TargetInfo(url=url, baseline_url=baseline_url, metrics_urls=list(metrics_urls))
    limit = timeout_seconds or spec.suite_timeout_seconds
    deadline = started + limit if limit else None
    async with session_without_redirects() as session:
        logs = [FileLog(log) if isinstance(log, Path) else log for log in engine_logs]
        await asyncio.gather(*(log.mark() for log in logs))  # before any request: every line after is this run's
        try:
            configured = _configured_context(spec, context_length)
            ctx = await _prepare(session, spec, info, baseline_url, deadline, configured)
            ctx.engine_logs = logs
        except CannotRun as exc:
            took = round(time.monotonic() - started, 3)
            return CanaryReport(
                verdict=Verdict.CANNOT_RUN, reason=str(exc), target=info, started_at=started_at,
                duration_seconds=took, time_to_verdict_seconds=took,
            )
        results, first_failure = await _run_probes(ctx, started, deadline, progress)
        note_seed_refusals(ctx)
    duration = time.monotonic() - started
    verdict, reason = _verdict(results)
    return CanaryReport(
        verdict=verdict, reason=reason, target=ctx.info, started_at=started_at,
        duration_seconds=round(duration, 3),
        time_to_verdict_seconds=round(first_failure if first_failure is not None else duration, 3),
        probes=results,
    )


@contextlib.asynccontextmanager
async def _preflight_by(deadline: float | None) -> AsyncIterator[None]:
    """The preflight under the suite's time limit too: a server that accepts connections and never
    answers /v1/models would otherwise hold it for requestTimeoutSeconds per call."""
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    timer = asyncio.timeout(remaining)
    try:
        async with timer:
            yield
    except TimeoutError:
        if not timer.expired():
            raise
        raise CannotRun("the suite's time limit ran out before the target answered its preflight "
                        "(model list, context length, metrics)") from None


async def _prepare(
    session: aiohttp.ClientSession,
    spec: CanarySpec,
    info: TargetInfo,
    baseline_url: str | None,
    deadline: float | None,
    configured: ContextReading | None,
) -> RunContext:
    """Preflight: model and context length, the baseline, start-of-run metrics, token calibration."""
    timeout = spec.request_timeout_seconds
    target = EngineClient(session, info.url, model=spec.model, seed=spec.seed, timeout_seconds=timeout)
    baseline = None
    async with _preflight_by(deadline):
        info.model, max_model_len = await _identify(target, spec.model, "target")
        target.model = info.model
        if baseline_url:
            baseline = EngineClient(session, baseline_url, model=spec.model, seed=spec.seed, timeout_seconds=timeout)
            baseline.model, _ = await _identify(baseline, spec.model, "baseline")
        facts = await discover_from_target(session, target.base_url, timeout)
        snapshots = await fetch_all(session, info.metrics_urls, timeout)
    if snapshots and not any(s.reachable for s in snapshots):
        # Metrics were asked for (S7 on every worker, the safety counters) and none answer: a
        # wrong URL, as with an unreachable baseline, must not quietly drop those checks.
        raise CannotRun("no metrics URL answers: " + "; ".join(f"{s.url}: {s.error}" for s in snapshots))
    readings = [ContextReading("/v1/models max_model_len", max_model_len)] if max_model_len else []
    readings, implausible = bounded_readings(readings + facts.readings + _metric_contexts(snapshots))
    chosen = choose_context_length(configured, readings)
    info.context_length = chosen.tokens if chosen else None
    info.context_length_source = chosen.source if chosen else None
    info.context_notes = context_notes(chosen, readings) + implausible
    info.engine_version = facts.engine_version
    _absorb_metrics(info, snapshots, facts.engine)
    target.context_length = info.context_length
    if baseline is not None:
        baseline.context_length = info.context_length
    ctx = RunContext(
        spec=spec, session=session, target=target, baseline=baseline,
        metrics_urls=info.metrics_urls, info=info, start_snapshots=snapshots,
    )
    target.observer = ctx.observe  # every answer from here on is searched for foreign nonces
    ctx.estimate = await _calibrate(target, spec.api, deadline)
    return ctx


async def _identify(client: EngineClient, model: str | None, role: str) -> tuple[str, int | None]:
    models, error, answered = await client.list_models()
    if models is None:
        # A server without a usable /v1/models can still be judged when the model name is given;
        # one that does not answer at all cannot.
        if model is None or not answered:
            raise CannotRun(f"{role} {client.base_url}: {error}")
        return model, None
    if not models.data and model is None:
        raise CannotRun(f"{role} {client.base_url}: /v1/models lists no model")
    card = next((m for m in models.data if m.id == model), None) if model else models.data[0]
    if card is None:
        listed = ", ".join(m.id for m in models.data)
        raise CannotRun(f"{role} {client.base_url}: model {model!r} not served (serves: {listed})")
    return card.id, card.max_model_len


def _configured_context(spec: CanarySpec, override: int | None) -> ContextReading | None:
    if override is not None:
        if not MIN_CONTEXT_TOKENS <= override <= MAX_CONTEXT_TOKENS:  # prompts are sized (and built) from it
            raise CannotRun(f"context length {override} is outside {MIN_CONTEXT_TOKENS}..{MAX_CONTEXT_TOKENS:,} tokens")
        return ContextReading("--context-length", override)
    if spec.context_length is not None:
        return ContextReading("spec.canary.contextLength", spec.context_length)
    return None


def _metric_contexts(snapshots: list[WorkerSnapshot]) -> list[ContextReading]:
    """The smallest context length the workers' metrics report (one reading at most)."""
    found = [(s.context_length, s) for s in snapshots if s.reachable and s.context_length]
    if not found:
        return []
    tokens, snap = min(found, key=lambda pair: pair[0])
    source = "kvguard_context_length_tokens" if snap.engine == "kvguard" else "/server_info context_length (metrics URL)"
    return [ContextReading(f"{source} of {snap.url}", int(tokens))]


def _absorb_metrics(info: TargetInfo, snapshots: list[WorkerSnapshot], engine_from_http: str | None) -> None:
    reachable = [s for s in snapshots if s.reachable]
    engines = {s.engine for s in reachable if s.engine != "unknown"} | ({engine_from_http} if engine_from_http else set())
    info.engines = sorted(engines)
    info.metrics_without_engine = [s.url for s in reachable if s.engine == "unknown"]
    capacities = [p.capacity_tokens for s in reachable for p in s.pools]
    info.min_pool_tokens = int(min(capacities)) if capacities else None


def _names(text: str, model: str) -> bool:
    """`text` names `model` as a whole word (quoted or not): a short name such as "a" inside an
    unrelated 404's wording is not it (a review). A period or colon after it ends the word unless
    the name goes on (`my-lora.` ends a sentence; `my-lora.gguf`, `llama3:8b` are other names)."""
    return re.search(rf"(?<![\w./:-]){re.escape(model)}(?![\w/-]|[.:][\w/-])", text) is not None


async def _calibrate(target: EngineClient, api: ApiKind, deadline: float | None) -> TokenEstimate:
    """Tokens per filler word from usage.prompt_tokens, when the server reports usage.

    Best effort: a failure here only leaves the estimate unknown (worst-case bounds); the probes
    judge the target. One exception: an endpoint the server does not have (404/405) would fail
    every generation probe, which is a wrong spec.api, not a broken server, so it cannot run.
    It may use at most a quarter of the remaining suite budget.
    """
    budget = target.timeout_seconds
    if deadline is not None:
        budget = min(budget, max(0.1, (deadline - time.monotonic()) / 4))
    try:
        probe = await asyncio.wait_for(
            target.complete(filler_text(CALIBRATION_WORDS, seed=7), api=api, max_tokens=1, label="calibration"),
            timeout=budget,
        )
    except TimeoutError:
        return TokenEstimate()
    if probe.status in (404, 405):
        said = one_line(probe.error or "", 200)
        if target.model and _names(said, target.model):
            # vLLM's 404 for a model it does not serve ("The model `x` does not exist.", param
            # "model"): the API is there, the name is wrong (outside probe: the hint named the API).
            raise CannotRun(f"target {target.base_url}: POST {API_PATHS[api]} answers HTTP {probe.status} for model "
                            f"{target.model!r}: {said} (set spec.canary.model)")  # fmt: skip
        other = "chat" if api == "completions" else "completions"
        raise CannotRun(
            f"target {target.base_url}: POST {API_PATHS[api]} answers HTTP {probe.status}: the server does not serve "
            f"the {api} API the probes use (spec.canary.api: {other}?)"
        )
    return TokenEstimate.from_usage(probe.prompt_tokens if probe.ok else None)


async def _run_probes(
    ctx: RunContext, started: float, deadline: float | None, progress: ProgressCallback | None
) -> tuple[list[ProbeResult], float | None]:
    results: list[ProbeResult] = []
    first_failure: float | None = None
    stop_reason: str | None = None
    for name in ctx.spec.enabled_probes():
        if stop_reason is not None:
            results.append(ProbeResult(name=name, status=ProbeStatus.SKIPPED, reason=stop_reason))
            # A row for it too: a table that drops it would hide that it never ran.
            _notify(progress, ProgressEvent("finished", name, time.monotonic() - started, results[-1]))
            continue
        _notify(progress, ProgressEvent("started", name, time.monotonic() - started))
        result = await _run_one(PROBES[name](), ctx, deadline)
        results.append(result)
        _notify(progress, ProgressEvent("finished", name, time.monotonic() - started, result))
        if result.status == ProbeStatus.FAIL:
            if first_failure is None:
                first_failure = time.monotonic() - started
            if ctx.spec.stop_on_failure:
                stop_reason = f"not run: {name.value} failed and stopOnFailure is set"
        if deadline is not None and time.monotonic() >= deadline and stop_reason is None:
            stop_reason = "not run: suite timeout reached"
    return results, first_failure


async def _run_one(probe: Probe, ctx: RunContext, deadline: float | None) -> ProbeResult:
    began = time.monotonic()
    try:
        if deadline is None:
            outcome = await probe.run(ctx)
        else:
            outcome = await asyncio.wait_for(probe.run(ctx), timeout=max(0.0, deadline - began))
    except ProbeSkipped as exc:
        outcome = Outcome(ProbeStatus.SKIPPED, str(exc))
    except TimeoutError:
        outcome = Outcome(ProbeStatus.FAIL, "suite timeout reached while this probe was running (a hang?)")
    except Exception as exc:  # noqa: BLE001 - a bug in a probe must not crash the whole suite
        where = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = Outcome(
            ProbeStatus.FAIL, f"probe error {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"
        )
    return ProbeResult(
        name=probe.name, status=outcome.status, reason=outcome.reason,
        duration_seconds=round(time.monotonic() - began, 3), evidence=outcome.evidence,
    )


def _notify(progress: ProgressCallback | None, event: ProgressEvent) -> None:
    if progress is not None:
        progress(event)


SEED_LEAVES_NOTHING_UNCHECKED = (
    "nothing is left unchecked: every answer the probes compare is greedy (temperature 0), which a seed does not "
    "change, and the sampled requests carry none"
)
"""What sending no seed costs the probes. A probe that compares sampled answers across runs would
need the seed; none does (isolation judges its sampled answers by their nonces alone), and one
that comes to must say here what is then not checked."""


def note_seed_refusals(ctx: RunContext) -> None:
    """Into the report: each server that refused `seed` (target, baseline), and what that leaves."""
    for role, client in (("target", ctx.target), ("baseline", ctx.baseline)):
        if client is not None and client.seed_refused is not None:
            ctx.info.seed_refused_by.append(client.base_url)
            ctx.info.notes.append(f"the {role} {client.base_url} refuses `seed` ({client.seed_refused}): its requests "
                                  f"were sent without it; {SEED_LEAVES_NOTHING_UNCHECKED}")  # fmt: skip


CONTENT_PROBES = frozenset({ProbeName.GOLDEN, ProbeName.DETERMINISM, ProbeName.ISOLATION})
"""The probes that judge output text."""
TEXT_ALWAYS_CHECKED = frozenset({ProbeName.DETERMINISM, ProbeName.ISOLATION})
"""Content probes that need no configuration: when one of them ran and no content probe passed
(answers with no text; golden without expectations or a baseline), nothing about what the server
outputs was proven, and the verdict is not PASS. A suite that leaves both out (golden alone, or
none) is judged on what it chose to run."""


def _verdict(results: list[ProbeResult]) -> tuple[Verdict, str]:
    failed = [r.name.value for r in results if r.status == ProbeStatus.FAIL]
    if failed:
        return Verdict.FAIL, f"failed: {', '.join(failed)}"
    if not any(r.status == ProbeStatus.PASS for r in results):
        return Verdict.CANNOT_RUN, "every probe was skipped: " + "; ".join(
            f"{r.name.value}: {r.reason}" for r in results
        )
    content = [r for r in results if r.name in CONTENT_PROBES]
    needs_text = any(r.name in TEXT_ALWAYS_CHECKED for r in results)
    if needs_text and not any(r.status == ProbeStatus.PASS for r in content):
        # The incident passed every check of status and speed: a verdict that the outputs are
        # right needs at least one probe that read them.
        return Verdict.CANNOT_RUN, "no probe could check what the server outputs: " + "; ".join(
            f"{r.name.value}: {r.reason}" for r in content
        )
    passed_count = sum(r.status == ProbeStatus.PASS for r in results)
    return Verdict.PASS, f"{passed_count} probe(s) passed"
