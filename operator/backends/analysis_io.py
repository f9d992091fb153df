"""The I/O half of the analysis (operator/analysis.py is the pure half): scrape a revision's routers
and workers, ask Prometheus the spec's PromQL queries, and keep the previous scrape per model so
each measurement covers only the traffic since the last one.

Memory is per process. The first measurement of a candidate/stable pair in a process only takes
the baseline (inconclusive, "the window starts now"): counters since each process began would
include the canary's own probes (its deliberate aborts) and the stable's whole history. After an
operator restart the rollout therefore holds one interval longer; it never passes on old data.
A window with too few candidate requests stays open (its start is kept), and the stable's latest
window with traffic is kept as the latency reference for steps where it gets none.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvguard.operator.analysis import (
    QueryValue,
    Series,
    Window,
    measure,
    merge,
    needs_more_traffic,
    parse_exposition,
    served_traffic,
    source_name,
    unmeasured,
)
from kvguard.operator.api import AnalysisSpec, PrometheusQuery
from kvguard.operator.canary.client import RedirectRefused, UnreadableAnswer, get_text, read_text, session_without_redirects
from kvguard.operator.canary.metrics import MAX_METRICS_BYTES
from kvguard.operator.canary.report import clip
from kvguard.operator.rollout import AnalysisOutcome, AnalysisResult, rfc3339

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_SECONDS = 10.0
QUERY_TIMEOUT_SECONDS = 10.0


async def scrape_series(urls: Sequence[tuple[str, str, str]], timeout: float = SCRAPE_TIMEOUT_SECONDS) -> tuple[Series, list[str]]:
    """Every sample of (role, name, /metrics URL) triples; and the scrapes that failed, named."""
    async with session_without_redirects() as session:
        answers = await asyncio.gather(*(get_text(session, url, timeout, limit=MAX_METRICS_BYTES) for _, _, url in urls))
    scrapes, errors = [], []
    for (role, name, _), (status, body, error) in zip(urls, answers, strict=True):
        if error or status != 200:
            errors.append(f"{name}: {error or f'HTTP {status}'}")
            continue
        try:
            # Pure Python (~0.4 s per MB): on a thread, every other model's reconciles keep their turns.
            scrapes.append(await asyncio.to_thread(parse_exposition, source_name(role, name), body))
        except ValueError as exc:
            errors.append(f"{name}: unparseable metrics ({clip(' '.join(str(exc).split()), 200)})")
    return merge(scrapes), errors


def substitute(query: str, values: Mapping[str, str]) -> str:
    """`$revision`, `$stable`, `$model`, `$namespace` -> their values (longest names first)."""
    for name in sorted(values, key=len, reverse=True):
        query = query.replace(f"${name}", values[name])
    return query


def scalar_of(answer: object) -> float | None:
    """The one number of a Prometheus /api/v1/query answer (scalar, or a one-sample vector)."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        return None
    data = answer.get("data") or {}
    result = data.get("result")
    if data.get("resultType") == "scalar" and isinstance(result, list) and len(result) == 2:
        value = result[1]
    elif data.get("resultType") == "vector" and isinstance(result, list) and len(result) == 1:
        value = (result[0].get("value") or [None, None])[1]
    else:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


async def query_values(base_url: str, queries: Sequence[PrometheusQuery], values: Mapping[str, str]) -> list[tuple[str, float | None, str]]:
    """(name, value, error) of each query against `base_url`/api/v1/query."""
    found: list[tuple[str, float | None, str]] = []
    async with session_without_redirects() as session:
        for query in queries:
            url = f"{base_url.rstrip('/')}/api/v1/query"
            try:
                async with session.get(url, params={"query": substitute(query.query, values)},
                                       timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT_SECONDS)) as resp:  # fmt: skip
                    body = await read_text(resp)
                    status = resp.status
            except UnreadableAnswer as exc:
                found.append((query.name, None, f"Prometheus answered what cannot be read: {exc}"))
                continue
            except RedirectRefused as exc:
                found.append((query.name, None, f"Prometheus {exc}"))
                continue
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                found.append((query.name, None, f"Prometheus unreachable: {type(exc).__name__}"))
                continue
            found.append((query.name, *answer_of(status, body)))
    return found


def answer_of(status: int, body: str) -> tuple[float | None, str]:
    """(value, error) of a Prometheus answer. An answer that is no Prometheus success (another
    status, a body that is not its JSON -- a proxy's HTML page -- or `"status": "error"`) is an
    error, which consecutiveErrorLimit counts; only a success without one finite number is "no
    data" (an outside review: a proxy's page held the step for ever as no data)."""
    if status != 200:
        return None, f"Prometheus answered HTTP {status}"
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        return None, f"Prometheus answered what is not JSON: {clip(' '.join(body.split()), 80)!r}"
    if not isinstance(answer, dict) or answer.get("status") != "success":
        return None, "Prometheus answered without success: " + clip(str(answer.get("error") if isinstance(answer, dict) else answer), 120)
    return scalar_of(answer), ""


@dataclass
class AnalysisMemory:
    """The last scrape of each model's candidate and stable, so the next window starts there."""

    last: dict[tuple[str, str], tuple[str, str, Series, Series]] = field(default_factory=dict)
    stable_reference: dict[tuple[str, str], tuple[str, Series]] = field(default_factory=dict)
    """(stable revision, its latest window with router traffic), per model."""
    stable_lifetime: dict[tuple[str, str], tuple[str, Series]] = field(default_factory=dict)
    """(stable revision, its counters at this process's first scrape): `Window.stable_lifetime`."""

    def before(self, key: tuple[str, str], candidate: str, stable: str) -> tuple[Series | None, Series | None]:
        kept = self.last.get(key)
        if kept is None or kept[:2] != (candidate, stable):
            return None, None
        return kept[2], kept[3]

    def reference(self, key: tuple[str, str], stable: str) -> Series | None:
        kept = self.stable_reference.get(key)
        return kept[1] if kept is not None and kept[0] == stable else None

    def lifetime(self, key: tuple[str, str], stable: str) -> Series | None:
        kept = self.stable_lifetime.get(key)
        return kept[1] if kept is not None and kept[0] == stable else None

    def forget(self, key: tuple[str, str]) -> None:
        self.last.pop(key, None)
        self.stable_reference.pop(key, None)
        self.stable_lifetime.pop(key, None)


async def measure_live_traffic(
    key: tuple[str, str], spec: AnalysisSpec, candidate: tuple[str, Sequence[tuple[str, str, str]]],
    stable: tuple[str, Sequence[tuple[str, str, str]]], previous: Sequence[AnalysisResult], memory: AnalysisMemory,
    now_text: str | None = None, model: str = "", namespace: str = "",
) -> AnalysisOutcome:  # fmt: skip
    """One measurement: scrape both revisions (their routers' and workers' /metrics), query
    Prometheus, judge. An unreachable candidate is an error result (inconclusive), not a pass."""
    (cand_rev, cand_urls), (stable_rev, stable_urls) = candidate, stable
    cand_now, cand_errors = await scrape_series(cand_urls)
    stable_now, stable_errors = await scrape_series(stable_urls)
    at = now_text or rfc3339(dt.datetime.now(dt.UTC))
    if cand_errors:  # part of the candidate unseen: no evidence either way, and the window keeps its start
        return unmeasured(spec, previous, "candidate metrics incomplete: " + "; ".join(cand_errors), at)
    cand_before, stable_before = memory.before(key, cand_rev, stable_rev)
    if stable_errors:
        why = "stable metrics incomplete: " + "; ".join(stable_errors)
        if cand_before is None or stable_before is None:  # no window starts half-seen
            # Not counted toward consecutiveErrorLimit: failing the analysis would send all
            # traffic back to the revision that cannot be read (an outside review).
            return unmeasured(spec, previous, why, at, counted=False)
        # The stable's part of this window unseen: its start is kept (the next window covers both
        # intervals), and this one is compared with its last window that had traffic. Taken as
        # the window's end, an empty scrape made the next window the stable's whole life, whose
        # long-gone latencies failed a candidate as fast as it (an outside probe).
        log.warning("analysis of %s/%s: %s; compared with the stable's last window", *key, why)
        stable_now = stable_before
    if cand_before is None:  # counters since each process began would count the canary's own probes (its aborts...)
        memory.last[key] = (cand_rev, stable_rev, cand_now, stable_now)
        if served_traffic(stable_now, spec.min_requests):  # the stable's life so far: the last resort of a reference (Window)
            memory.stable_lifetime[key] = (stable_rev, stable_now)
        why = "first scrape of these revisions by this operator process: the analysis window starts now"
        return AnalysisOutcome("inconclusive", (AnalysisResult(name="window", phase="Inconclusive", message=why, measured_at=at),), why)
    queries: list[QueryValue] = []
    if spec.queries and spec.prometheus_url:
        values = {"revision": cand_rev, "stable": stable_rev, "model": model, "namespace": namespace}
        queries = [QueryValue(n, v, e) for n, v, e in await query_values(spec.prometheus_url, spec.queries, values)]
    window = Window.between(cand_before, cand_now, stable_before, stable_now, memory.reference(key, stable_rev),
                            memory.lifetime(key, stable_rev))  # fmt: skip
    if served_traffic(window.stable, spec.min_requests):  # a smaller one is no reference for a whole bake
        memory.stable_reference[key] = (stable_rev, window.stable)  # type: ignore[assignment]
    if not needs_more_traffic(spec, window):  # else the window stays open: its start is kept
        memory.last[key] = (cand_rev, stable_rev, cand_now, stable_now)
    return measure(spec, window, queries, previous, at)
