"""The analysis of a candidate's live traffic (operator/analysis.py) on real Prometheus text: the
router's and workers' own registries, exposed by prometheus_client and parsed back."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from test_canary_hostile_bodies import serving

from kvguard.operator.analysis import (
    ITL,
    TTFT,
    QueryValue,
    Window,
    histogram_buckets,
    increase,
    measure,
    merge,
    parse_exposition,
    quantile,
    source_name,
)
from kvguard.operator.api import AnalysisSpec, PrometheusQuery
from kvguard.workers.metrics import EngineMetrics
from kvguard.workers.router import RouterMetrics
from kvguard.workers.transfer.metrics import TransferMetrics

AT = "2026-01-01T00:00:00Z"
SPEC = AnalysisSpec(min_requests=10)


class Revision:
    """One revision's router and its prefill and decode workers' metrics, as they would be scraped.

    The engines count `kvguard_requests_total` too (their halves of each request that reached
    them): the analysis must count a request once, at the router."""

    def __init__(self) -> None:
        self.router = RouterMetrics()
        self.worker = TransferMetrics.create(worker := CollectorRegistry())
        self.worker_registry = worker
        self.decode_engine = EngineMetrics(worker)
        self.prefill_engine = EngineMetrics()

    def serve(self, finished: int, failed: int = 0, ttft: float = 0.05, itl: float = 0.01, tokens: int = 4) -> None:
        for _ in range(finished):
            self.router.requests.labels("finished").inc()
            for engine in (self.prefill_engine, self.decode_engine):
                engine.requests.labels("finished").inc()
            self.router.time_to_first_token.observe(ttft)
            for _ in range(tokens):
                self.router.inter_token_latency.observe(itl)
        for _ in range(failed):
            self.router.requests.labels("failed").inc()  # failed at the router: no engine saw it

    def scrape(self) -> dict:
        return merge([parse_exposition(source_name("router", "router-0"), generate_latest(self.router.registry).decode()),
                      parse_exposition(source_name("prefill", "prefill-0"), generate_latest(self.prefill_engine.registry).decode()),
                      parse_exposition(source_name("decode", "decode-0"), generate_latest(self.worker_registry).decode())])  # fmt: skip


def measured(candidate: Revision, stable: Revision | None, spec: AnalysisSpec = SPEC, previous=(), before=None, queries=()):
    window = Window.between(before[0] if before else None, candidate.scrape(),
                            before[1] if before else None, stable.scrape() if stable else None)  # fmt: skip
    return measure(spec, window, queries, previous, AT)


def by_name(measurement) -> dict:
    return {r.name: r for r in measurement.results}


def test_a_healthy_candidate_passes_with_its_numbers() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(20, ttft=0.05, itl=0.01)
    stable.serve(200, ttft=0.05, itl=0.01)
    m = measured(candidate, stable)
    assert m.verdict == "pass", m.message
    results = by_name(m)
    assert set(results) == {"safety", "errorRatio", "ttft", "itl"}
    assert results["errorRatio"].value == 0 and results["ttft"].value == pytest.approx(1.0)
    assert "p95 TTFT" in results["ttft"].message and results["ttft"].measured_at == AT


def test_errors_above_the_ratio_fail_at_the_first_measurement() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(18, failed=2)  # 10% > 5%
    stable.serve(100)
    m = measured(candidate, stable)
    assert m.verdict == "fail"
    assert by_name(m)["errorRatio"].value == pytest.approx(0.1) and by_name(m)["errorRatio"].failures == 1
    assert "2 of 20 candidate requests failed" in m.message


def test_a_safety_counter_fails_at_once() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(50)
    stable.serve(50)
    candidate.worker.checksum_failures.inc()
    m = measured(candidate, stable)
    assert m.verdict == "fail" and "kvguard_checksum_failures_total +1" in m.message


def test_dropped_stale_writes_are_not_a_live_traffic_failure() -> None:
    """S5 working: a client that hangs up mid-prefill leaves a late write that is dropped."""
    candidate, stable = Revision(), Revision()
    candidate.serve(50)
    stable.serve(50)
    candidate.worker.stale_writes_dropped.inc()
    assert measured(candidate, stable).verdict == "pass"


def test_latency_is_relative_to_stable_and_has_a_failure_limit() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(20, ttft=2.0)
    stable.serve(200, ttft=0.2)
    first = measured(candidate, stable)
    ttft = by_name(first)["ttft"]
    assert ttft.phase == "Failed" and ttft.value > 1.5 and ttft.failures == 1
    assert first.verdict == "inconclusive"  # failureLimit 1: one failed measurement is tolerated
    before = (candidate.scrape(), stable.scrape())
    candidate.serve(20, ttft=2.0)
    stable.serve(200, ttft=0.2)
    second = measured(candidate, stable, previous=first.results, before=before)
    assert second.verdict == "fail" and by_name(second)["ttft"].failures == 2


def test_too_few_requests_are_inconclusive() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(3)
    stable.serve(100)
    m = measured(candidate, stable)
    assert m.verdict == "inconclusive" and by_name(m)["errorRatio"].phase == "Inconclusive"
    assert m.message == ("3 candidate requests ended, 10 needed (spec.rollout.analysis.minRequests): "
                         "the step is judged on live traffic and waits for it")  # said once, not per check


def test_a_request_counts_once_though_router_and_engines_all_count_it() -> None:
    """Engines count the requests that reached them too: summing every source would count a
    success three times and a router failure once, diluting the error ratio."""
    candidate, stable = Revision(), Revision()
    candidate.serve(18, failed=2)
    stable.serve(100)
    assert "2 of 20 candidate requests failed = 0.100" in measured(candidate, stable).message


def test_requests_the_clients_abandoned_are_not_judged() -> None:
    """A client that disconnects (a user pressing stop, a tenant hanging up on purpose) ends its
    request `aborted`: not the revision's error, and not a request it served either -- so a wave
    of hang-ups can neither fail a candidate nor dilute its real failures."""
    candidate, stable = Revision(), Revision()
    candidate.serve(19, failed=1)
    for _ in range(30):
        candidate.router.requests.labels("aborted").inc()
    stable.serve(100)
    m = measured(candidate, stable)
    result = by_name(m)["errorRatio"]
    assert m.verdict == "pass" and result.value == pytest.approx(0.05)
    assert "1 of 20 candidate requests failed = 0.050" in result.message and "30 abandoned by their clients, not counted" in result.message

    only_abandoned = Revision()
    for _ in range(30):
        only_abandoned.router.requests.labels("aborted").inc()
    assert measured(only_abandoned, stable).verdict == "inconclusive"  # a hung candidate is not passed either


def test_a_window_counts_only_what_happened_since_the_last_measurement() -> None:
    candidate, stable = Revision(), Revision()
    candidate.serve(0, failed=20)  # a bad start ...
    stable.serve(100)
    before = (candidate.scrape(), stable.scrape())
    candidate.serve(30)  # ... then healthy
    stable.serve(100)
    assert measured(candidate, stable, before=before).verdict == "pass"


def test_a_reset_counter_counts_from_zero() -> None:
    before = parse_exposition("router/r", "# TYPE kvguard_requests_total counter\nkvguard_requests_total{outcome=\"failed\"} 50\n")
    after = parse_exposition("router/r", "# TYPE kvguard_requests_total counter\nkvguard_requests_total{outcome=\"failed\"} 3\n")
    assert list(increase(before, after).values()) == [3.0]


def test_a_restarted_router_counts_all_its_series_from_zero() -> None:
    """Outside probe: judged per series, a restarted router that had failed 5 and now failed 6
    counted +1 failure, and its 20 earlier slow first tokens hid 4 new ones: a pass for a window of
    6 failures in 46 and an 8 s p95. Any series of a process that went down means it restarted."""
    old, new = Revision(), Revision()
    old.serve(20, failed=5, ttft=8.0)
    new.serve(36, ttft=0.005)
    new.serve(4, failed=6, ttft=8.0)
    gained = increase(old.scrape(), new.scrape())
    assert total_of(gained, "kvguard_requests_total", "router", outcome="failed") == 6
    assert total_of(gained, "kvguard_requests_total", "router", outcome="finished") == 40
    stable = Revision()
    stable.serve(100, ttft=0.005)
    result = measure(SPEC, Window(candidate=gained, stable=stable.scrape()), (), (), AT)
    assert by_name(result)["errorRatio"].phase == "Failed" and by_name(result)["ttft"].phase == "Failed"


def test_a_gauge_going_down_is_no_restart() -> None:
    """Outside probe: the router's body-memory gauge fell (a large body ended) between two
    scrapes, the router read as restarted, and a window of 20 failures in 20 requests was judged
    as 20 in the router's lifetime of 1,020: a pass. Only counters and histograms are read."""
    candidate = Revision()
    candidate.serve(1000)
    candidate.router.body_memory.set(70_000)
    candidate.router.waiting_choices.set(3)
    before = candidate.scrape()
    candidate.serve(0, failed=20)
    candidate.router.body_memory.set(0)
    candidate.router.waiting_choices.set(0)
    result = by_name(measured(candidate, None, before=(before, None)))["errorRatio"]
    assert result.phase == "Failed" and "20 of 20" in result.message
    assert not any("body_memory" in name or name.endswith("_created") for _, name, _ in before)


def total_of(series: dict, name: str, role: str, **labels: str) -> float:
    from kvguard.operator.analysis import total

    return total(series, name, role=role, **labels)


@pytest.mark.parametrize(("stable_ttft", "candidate_ttft", "phase"),
                         [(0.051, 0.099, "Failed"), (0.110, 0.240, "Failed"), (1.05, 2.4, "Failed"),
                          (0.098, 0.102, "Successful"), (0.0049, 0.0051, "Successful")])  # fmt: skip
def test_the_routers_buckets_resolve_a_ratio_to_stable(stable_ttft: float, candidate_ttft: float, phase: str) -> None:
    """Outside probe: buckets 2-2.5x apart put 0.051 s and 0.099 s in one bucket (a 2x slower
    candidate read 1.00x and passed) and 0.098 s and 0.102 s on two sides of an edge (4% read
    2.49x and failed). The router's buckets are 1.25x apart now."""
    candidate, stable = Revision(), Revision()
    candidate.serve(20, ttft=candidate_ttft)
    stable.serve(180, ttft=stable_ttft)
    assert by_name(measured(candidate, stable))["ttft"].phase == phase


def test_a_stable_window_smaller_than_min_requests_is_not_what_latency_is_compared_with() -> None:
    """Outside probe: one stable request (at a 100% step's start) became the reference for the whole
    bake: an equal candidate then failed 2x against it. A window that served fewer than
    minRequests is passed over for the last one that served enough."""
    candidate, tiny, reference = Revision(), Revision(), Revision()
    candidate.serve(20, ttft=0.1)
    tiny.serve(1, ttft=0.045)
    reference.serve(40, ttft=0.1)
    window = Window(candidate=candidate.scrape(), stable=tiny.scrape(), stable_reference=reference.scrape())
    ttft = by_name(measure(SPEC, window, (), (), AT))["ttft"]
    assert ttft.phase == "Successful" and "its last window with traffic" in ttft.message


def test_first_rollout_compares_no_latency() -> None:
    candidate = Revision()
    candidate.serve(20, ttft=5.0)
    m = measured(candidate, None)
    assert m.verdict == "pass" and "no stable revision" in by_name(m)["ttft"].message


def test_quantile_matches_prometheus_interpolation() -> None:
    from prometheus_client import Histogram

    registry = CollectorRegistry()
    histogram = Histogram(TTFT.removesuffix("_seconds"), "ttft", unit="seconds", buckets=(0.0025, 0.005, 0.025, 0.05), registry=registry)
    for value in [0.003] * 50 + [0.04] * 50:
        histogram.observe(value)
    buckets = histogram_buckets(parse_exposition("router/r", generate_latest(registry).decode()), TTFT)
    # 50 in (0.0025, 0.005], 50 in (0.025, 0.05]: the median is the top of the first, p75 halfway up the second
    assert quantile(0.5, buckets) == pytest.approx(0.005)
    assert quantile(0.75, buckets) == pytest.approx(0.0375)
    assert quantile(0.5, histogram_buckets({}, ITL)) is None
    # A count that is not a number anywhere, even above the rank: no percentile (it never passes).
    assert math.isnan(quantile(0.5, [(0.01, 10.0), (0.1, float("nan")), (math.inf, math.inf)]) or 0.0)


def test_queries_are_judged_against_their_bounds() -> None:
    spec = AnalysisSpec.model_validate({"minRequests": 10, "prometheusURL": "http://prom:9090",
                                        "queries": [{"name": "gpu-util", "query": "x", "max": 0.9},
                                                    {"name": "tokens", "query": "y", "min": 1}]})  # fmt: skip
    candidate, stable = Revision(), Revision()
    candidate.serve(20)
    stable.serve(20)
    ok = measured(candidate, stable, spec, queries=[QueryValue("gpu-util", 0.5), QueryValue("tokens", 5)])
    assert ok.verdict == "pass"
    high = measured(candidate, stable, spec, queries=[QueryValue("gpu-util", 0.95), QueryValue("tokens", 5)])
    assert high.verdict == "fail" and "gpu-util = 0.95 (must be <= 0.9)" in high.message
    missing = measured(candidate, stable, spec, queries=[QueryValue("gpu-util", None, "HTTP 503"), QueryValue("tokens", 5)])
    assert missing.verdict == "inconclusive" and by_name(missing)["gpu-util"].phase == "Error"


def test_a_query_that_errors_more_than_the_limit_in_a_row_fails_the_analysis() -> None:
    """Outside probe: an unreachable Prometheus made every measurement inconclusive, so the
    candidate held its step (its whole bake at 100%) for ever. As Argo Rollouts'
    consecutiveErrorLimit: more errors in a row than the limit fail it; a good answer resets them."""
    spec = AnalysisSpec.model_validate({"minRequests": 10, "prometheusURL": "http://prom:9090", "consecutiveErrorLimit": 2,
                                        "queries": [{"name": "gpu-util", "query": "x", "max": 0.9}]})  # fmt: skip
    candidate, stable = Revision(), Revision()
    candidate.serve(20)
    stable.serve(20)
    down, up = [QueryValue("gpu-util", None, "Prometheus unreachable: ClientConnectorError")], [QueryValue("gpu-util", 0.5)]
    verdicts, previous = [], ()
    for answer in (down, down, up, down, down, down):
        result = measured(candidate, stable, spec, previous=previous, queries=answer)
        verdicts.append((result.verdict, by_name(result)["gpu-util"].errors))
        previous = result.results
    assert verdicts == [("inconclusive", 1), ("inconclusive", 2), ("pass", 0), ("inconclusive", 1), ("inconclusive", 2), ("fail", 3)]
    assert "3 measurements in a row could not be made, limit 2" in result.message and "consecutiveErrorLimit" in result.message
    no_data = measured(candidate, stable, spec, previous=previous, queries=[QueryValue("gpu-util", None)])
    assert no_data.verdict == "inconclusive" and by_name(no_data)["gpu-util"].errors == 0  # no data is no error: it holds


def test_metrics_that_cannot_be_read_more_than_the_limit_in_a_row_fail_the_analysis() -> None:
    from kvguard.operator.analysis import unmeasured
    from kvguard.operator.rollout import carried_results

    spec = AnalysisSpec()  # consecutiveErrorLimit 4, as Argo Rollouts
    previous: list = []
    for _ in range(4):
        held = unmeasured(spec, previous, "candidate metrics incomplete: r2-router-0: HTTP 500", AT)
        assert held.verdict == "inconclusive" and held.message == "candidate metrics incomplete: r2-router-0: HTTP 500"
        previous = carried_results(previous, held.results)
    failed = unmeasured(spec, previous, "candidate metrics incomplete: r2-router-0: HTTP 500", AT)
    assert failed.verdict == "fail" and "5 measurements in a row could not be made, limit 4" in failed.message


# --- the I/O half: real /metrics over loopback HTTP ---------------------------------------------


def test_prometheus_answers_and_substitution() -> None:
    from kvguard.operator.backends.analysis_io import scalar_of, substitute

    assert substitute('x{revision="$revision",stable="$stable"}', {"revision": "r2", "stable": "r1"}) == 'x{revision="r2",stable="r1"}'
    assert scalar_of({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "0.5"]}}) == 0.5
    assert scalar_of({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "3"]}]}}) == 3.0
    two = [{"metric": {}, "value": [1, "3"]}] * 2
    assert scalar_of({"status": "success", "data": {"resultType": "vector", "result": two}}) is None  # not one number
    assert scalar_of({"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "NaN"]}]}}) is None
    assert scalar_of({"status": "error"}) is None


async def test_measurements_scrape_real_metrics_and_start_with_a_baseline() -> None:
    from aiohttp import web

    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic

    candidate, stable = Revision(), Revision()
    candidate.serve(100, failed=50)  # before the window: e.g. the canary's own probes
    stable.serve(100)

    def exposition(registry: CollectorRegistry):  # noqa: ANN202
        async def handler(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), content_type="text/plain")
        return handler

    app = web.Application()
    app.router.add_get("/candidate/metrics", exposition(candidate.router.registry))
    app.router.add_get("/stable/metrics", exposition(stable.router.registry))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    memory, key = AnalysisMemory(), ("models", "m")
    try:
        urls = (("r2", [("router", "r2-router-0", f"{base}/candidate/metrics")]), ("r1", [("router", "r1-router-0", f"{base}/stable/metrics")]))
        first = await measure_live_traffic(key, SPEC, *urls, (), memory, now_text=AT)
        assert first.verdict == "inconclusive" and "window starts now" in first.message
        candidate.serve(30)
        stable.serve(30)
        second = await measure_live_traffic(key, SPEC, *urls, first.results, memory, now_text=AT)
        assert second.verdict == "pass", second.message  # the 50 failures before the window do not count
        gone = (("r2", [("router", "r2-router-0", f"{base}/nowhere/metrics")]), urls[1])
        candidate.serve(30)
        third = await measure_live_traffic(key, SPEC, *gone, second.results, memory, now_text=AT)
        assert third.verdict == "inconclusive" and "candidate metrics incomplete: r2-router-0: HTTP 404" in third.message
        candidate.serve(0, failed=30)  # back in sight: the window still starts at the last good scrape
        fourth = await measure_live_traffic(key, SPEC, *urls, second.results, memory, now_text=AT)
        assert fourth.verdict == "fail" and "30 of 60 candidate requests failed" in fourth.message
    finally:
        await runner.cleanup()


async def test_a_prometheus_answer_that_is_no_success_is_an_error_not_no_data() -> None:
    """Outside review: a proxy's HTML page (200) or Prometheus' own `"status": "error"` read as
    "no data", which holds the step for ever and resets consecutiveErrorLimit's count."""
    from aiohttp import web

    from kvguard.operator.backends.analysis_io import query_values

    answers = {"html": web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html"),
               "error": web.json_response({"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}),
               "empty": web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})}  # fmt: skip

    async def handler(request: web.Request) -> web.Response:
        return answers[request.query["query"]]

    async with serving(handler) as base:  # every path answers: /api/v1/query among them
        queries = [PrometheusQuery(name=n, query=n, max=1.0) for n in answers]
        found = {name: (value, error) for name, value, error in await query_values(base, queries, {})}
    assert found["html"][0] is None and "not JSON" in found["html"][1] and "502 Bad Gateway" in found["html"][1]
    assert found["error"] == (None, "Prometheus answered without success: parse error at char 3")
    assert found["empty"] == (None, "")  # a success without a number: no data, which only holds


async def test_the_stables_unreadable_metrics_never_fail_the_candidate() -> None:
    """Outside review: before a window started, the stable's unreadable /metrics counted toward
    consecutiveErrorLimit, so a healthy candidate failed, and S8 sent all traffic to the revision
    that could not be read."""
    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic

    candidate, stable = Revision(), Revision()
    runner, urls = await _serving(candidate, stable)
    stable_gone = (urls[0], ("r1", [("router", "r1-router-0", urls[1][1][0][2].replace("/stable/", "/nowhere/"))]))
    previous: tuple = ()
    try:
        for _ in range(SPEC.consecutive_error_limit + 2):
            outcome = await measure_live_traffic(("models", "m"), SPEC, *stable_gone, previous, AnalysisMemory(), now_text=AT)
            assert outcome.verdict == "inconclusive" and "stable metrics incomplete" in outcome.message
            previous = outcome.results
    finally:
        await runner.cleanup()


async def _serving(candidate: Revision, stable: Revision):  # noqa: ANN202
    """Both revisions' router /metrics on a loopback server; yields the (revision, sources) pairs."""
    from aiohttp import web

    app = web.Application()
    for name, revision in (("candidate", candidate), ("stable", stable)):
        async def handler(_: web.Request, registry: CollectorRegistry = revision.router.registry) -> web.Response:
            return web.Response(body=generate_latest(registry), content_type="text/plain")
        app.router.add_get(f"/{name}/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    urls = (("r2", [("router", "r2-router-0", f"{base}/candidate/metrics")]), ("r1", [("router", "r1-router-0", f"{base}/stable/metrics")]))
    return runner, urls


async def test_a_window_with_too_few_requests_stays_open_until_it_can_be_judged() -> None:
    """At low traffic no single window reaches minRequests: a candidate failing every request must
    still be aborted once enough of its requests have ended, not held at its first step forever."""
    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic

    candidate, stable = Revision(), Revision()
    runner, urls = await _serving(candidate, stable)
    memory, key, previous = AnalysisMemory(), ("models", "m"), ()
    try:
        first = await measure_live_traffic(key, SPEC, *urls, (), memory, now_text=AT)
        assert "window starts now" in first.message
        for ended in (4, 8):
            candidate.serve(0, failed=4)
            stable.serve(30)
            held = await measure_live_traffic(key, SPEC, *urls, previous, memory, now_text=AT)
            assert held.verdict == "inconclusive" and held.message.startswith(f"{ended} candidate requests ended, 10 needed")
            previous = held.results
        candidate.serve(0, failed=4)
        judged = await measure_live_traffic(key, SPEC, *urls, previous, memory, now_text=AT)
        assert judged.verdict == "fail" and "12 of 12 candidate requests failed" in judged.message
    finally:
        await runner.cleanup()


async def test_at_full_weight_latency_is_compared_with_the_stables_last_traffic() -> None:
    """At 100% the stable gets no requests: its latest window with traffic is the reference, or
    the last step would hold forever on "no observations from the stable"."""
    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic

    candidate, stable = Revision(), Revision()
    runner, urls = await _serving(candidate, stable)
    memory, key = AnalysisMemory(), ("models", "m")
    try:
        first = await measure_live_traffic(key, SPEC, *urls, (), memory, now_text=AT)
        candidate.serve(20, ttft=0.05)
        stable.serve(20, ttft=0.05)  # a step below 100%: both serve
        split = await measure_live_traffic(key, SPEC, *urls, first.results, memory, now_text=AT)
        assert split.verdict == "pass", split.message
        candidate.serve(40, ttft=0.05)  # 100%: only the candidate
        full = await measure_live_traffic(key, SPEC, *urls, split.results, memory, now_text=AT)
        assert full.verdict == "pass", full.message
        assert "vs stable (its last window with traffic)" in by_name(full)["ttft"].message
        candidate.serve(40, ttft=2.0)  # and a regression at 100% is still caught
        slow = await measure_live_traffic(key, SPEC, *urls, full.results, memory, now_text=AT)
        assert by_name(slow)["ttft"].phase == "Failed"
    finally:
        await runner.cleanup()


async def test_a_failed_scrape_of_the_stable_keeps_its_window_start() -> None:
    """Outside probe: the stable's scrape errors were ignored and its empty scrape taken as the
    window's end, so the next window measured the stable over its whole life and a candidate as
    fast as it failed its TTFT check (48x). Now that window is compared with the stable's last
    window with traffic, and the next one starts where the last good scrape was."""
    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic

    candidate, stable = Revision(), Revision()
    stable.serve(1000, ttft=0.005)  # a fast history, long before the rollout
    runner, urls = await _serving(candidate, stable)
    memory, key = AnalysisMemory(), ("models", "m")
    gone = (urls[0], ("r1", [("router", "r1-router-0", urls[1][1][0][2].replace("/stable/", "/nowhere/"))]))
    try:
        first = await measure_live_traffic(key, SPEC, *urls, (), memory, now_text=AT)
        results = first.results
        for window in range(3):
            candidate.serve(20, ttft=0.4)
            stable.serve(20, ttft=0.4)  # now both equally slow
            measured = await measure_live_traffic(key, SPEC, *(gone if window == 1 else urls), results, memory, now_text=AT)
            assert measured.verdict == "pass", (window, measured.message)
            results = measured.results
    finally:
        await runner.cleanup()


def test_non_finite_counters_never_pass() -> None:
    """Outside probe: a NaN (or Inf) request counter made the error ratio NaN, which no limit
    refuses, and a safety counter at NaN hid a rise: both passed."""
    nan = float("nan")
    before = {("router/router-0", "kvguard_requests_total", (("outcome", "finished"),)): 0.0,
              ("router/router-0", "kvguard_requests_total", (("outcome", "failed"),)): 0.0}  # fmt: skip
    after = {("router/router-0", "kvguard_requests_total", (("outcome", "finished"),)): 50.0,
             ("router/router-0", "kvguard_requests_total", (("outcome", "failed"),)): nan}  # fmt: skip
    window = Window(candidate=increase(before, after), stable=None)
    assert by_name(measure(SPEC, window, (), (), AT))["errorRatio"].phase == "Failed"
    unsafe = {**after, ("decode/decode-0", "kvguard_tag_violations_total", ()): nan}
    unsafe[("router/router-0", "kvguard_requests_total", (("outcome", "failed"),))] = 0.0
    result = measure(SPEC, Window(candidate=increase(before, unsafe), stable=None), (), (), AT)
    assert result.verdict == "fail" and by_name(result)["safety"].phase == "Failed"


def test_a_latency_histogram_that_is_not_finite_never_passes() -> None:
    """Outside probe: one NaN bucket made the candidate's p95 NaN, which no limit refuses, and a
    candidate 100x slower than the stable was promoted; an infinite stable made any candidate 0x."""
    candidate, stable = Revision(), Revision()
    candidate.serve(50, ttft=2.0)
    stable.serve(50, ttft=0.02)
    cand = candidate.scrape()
    bucket = next(k for k in cand if k[1] == "kvguard_router_time_to_first_token_seconds_bucket" and float(dict(k[2])["le"]) > 4)
    nan_candidate = {**cand, bucket: float("nan")}
    result = measure(SPEC, Window(candidate=nan_candidate, stable=stable.scrape()), (), (), AT)
    assert by_name(result)["ttft"].phase == "Failed" and result.verdict != "pass"
    stable_scrape = stable.scrape()
    top = next(k for k in stable_scrape if k[1] == "kvguard_router_time_to_first_token_seconds_bucket" and ("le", "+Inf") in k[2])
    result = measure(SPEC, Window(candidate=cand, stable={**stable_scrape, top: float("nan")}), (), (), AT)
    assert by_name(result)["ttft"].phase != "Successful" and result.verdict != "pass"


def test_a_status_entry_never_holds_a_number_json_cannot_carry() -> None:
    """Outside probe: a NaN safety counter put a bare NaN into the status patch, which a strict
    JSON parser (the API server's) refuses -- and the abort waits for that write."""
    from kvguard.operator.rollout import AnalysisResult

    entry = AnalysisResult(name="safety", phase="Failed", value=float("nan"), threshold=float("inf"), message="rose: +nan")
    assert entry.value is None and entry.threshold is None
    assert "NaN" not in entry.model_dump_json() and "Infinity" not in entry.model_dump_json()


async def test_an_operator_restarted_at_full_weight_compares_with_the_recorded_stable_latency() -> None:
    """Outside probe: restarted at 100% (the stable gets no traffic), the operator's first scrape
    made the stable's whole life the reference -- its long-gone fast latencies -- and a candidate
    as fast as the stable's last window failed 49x. Each latency result now records the stable
    percentile it compared with (status), and a restarted operator compares with that."""
    from kvguard.operator.backends.analysis_io import AnalysisMemory, measure_live_traffic
    from kvguard.operator.rollout import carried_results

    candidate, stable = Revision(), Revision()
    stable.serve(1000, ttft=0.005)  # a fast history
    runner, urls = await _serving(candidate, stable)
    key = ("models", "m")
    try:
        memory = AnalysisMemory()
        status = list((await measure_live_traffic(key, SPEC, *urls, (), memory, now_text=AT)).results)
        candidate.serve(20, ttft=0.4)
        stable.serve(20, ttft=0.4)  # a step below 100%: both serve, equally slow now
        split = await measure_live_traffic(key, SPEC, *urls, status, memory, now_text=AT)
        assert split.verdict == "pass", split.message
        status = carried_results(status, split.results)
        memory = AnalysisMemory()  # the operator restarts; status.rollout.analysis is what it keeps
        status = carried_results(status, (await measure_live_traffic(key, SPEC, *urls, status, memory, now_text=AT)).results)
        candidate.serve(40, ttft=0.4)  # 100%: only the candidate
        full = await measure_live_traffic(key, SPEC, *urls, status, memory, now_text=AT)
        assert full.verdict == "pass", full.message
        assert "as recorded" in by_name(full)["ttft"].message
    finally:
        await runner.cleanup()
