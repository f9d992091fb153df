"""What a hostile candidate engine may do to the operator, which runs the canary suite and scrapes
every engine pod's /metrics in its own process and event loop: nothing but fail its own checks.
(And an InferenceModel's prometheusURL, named by whoever deploys the model, no more.)

An outside probe's hostile OpenAI-compatible server (a third-party image a user can name)
redirected the operator's requests to a fake cloud metadata service and had its answer copied into
the verdict, the report and a pod's condition; held the operator's loop 27 s with 10 KB answers
(a quadratic comparison) and 6.7 s per scrape with a 16 MB metrics page; and took it to 5.4 GB
with 16 MB answers kept for the leak search. Every server here is a real aiohttp server on
loopback; the clients are the operator's own.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest
from aiohttp import web
from test_canary_hostile_bodies import serving

from kvguard.operator.api import PrometheusQuery
from kvguard.operator.backends.analysis_io import query_values, scrape_series
from kvguard.operator.canary import isolation
from kvguard.operator.canary import metrics as canary_metrics
from kvguard.operator.canary.base import Heard
from kvguard.operator.canary.client import MAX_TOKEN_CHARS, Completion, EngineClient, get_text, session_without_redirects
from kvguard.operator.canary.metrics import MAX_METRICS_BYTES, WorkerSnapshot, fetch_all

SECRET = "AKIA_SECRET_FROM_METADATA"


def completion_of(text: str, completion_tokens: int = 8) -> dict:
    return {"id": "x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": completion_tokens, "total_tokens": 4 + completion_tokens}}  # fmt: skip


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_the_operator_follows_no_redirect_and_repeats_nothing_from_where_it_points(status: int) -> None:
    metadata_hits: list[str] = []

    async def metadata(request: web.Request) -> web.Response:
        metadata_hits.append(request.path)
        return web.Response(text=f'{{"AccessKeyId": "{SECRET}"}}\n', content_type="application/json")

    async with serving(metadata) as secret_url:

        async def redirecting(request: web.Request) -> web.Response:
            return web.Response(status=status, headers={"Location": f"{secret_url}{request.path}"})

        async with serving(redirecting) as engine, session_without_redirects() as session:
            answer = await EngineClient(session, engine, model="m").complete("p", max_tokens=8)
            models, models_error, _ = await EngineClient(session, engine).list_models()
            (scrape,) = await fetch_all(session, [f"{engine}/metrics"], 5)
    assert metadata_hits == []
    for error in (answer.error, models_error, scrape.error):
        assert error is not None and f"answered HTTP {status}, a redirect; the operator follows none" in error, error
        assert SECRET not in error and secret_url not in error
    assert models is None and not answer.ok


async def test_analysis_scrapes_and_prometheus_queries_follow_no_redirect_either() -> None:
    """The rollout analysis scrapes the revisions' routers and asks the InferenceModel's
    prometheusURL (named by whoever deploys the model): neither follows a redirect."""
    hits: list[str] = []

    async def target(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="kvguard_requests_total 1\n")

    async with serving(target) as elsewhere:

        async def redirecting(request: web.Request) -> web.Response:
            return web.Response(status=307, headers={"Location": f"{elsewhere}{request.path}"})

        async with serving(redirecting) as url:
            _, errors = await scrape_series([("router", "r0", f"{url}/metrics")])
            (found,) = await query_values(url, [PrometheusQuery(name="q", query="up", max=1)], {})
    assert hits == []
    assert errors == ["r0: RedirectRefused: answered HTTP 307, a redirect; the operator follows none"]
    assert found == ("q", None, "Prometheus answered HTTP 307, a redirect; the operator follows none")


async def test_answers_longer_than_their_tokens_can_make_fail_and_are_clipped_before_anything_compares_them() -> None:
    """10 KB of text for max_tokens 8: text that is not its tokens'. The answer is that request's
    error, and its text is clipped to the budget, so the isolation checks' comparison (quadratic
    in the answers' lengths) never sees it whole."""
    async def verbose(_request: web.Request) -> web.Response:
        return web.json_response(completion_of("ab c" * 2500))

    async with serving(verbose) as engine, session_without_redirects() as session:
        answer = await EngineClient(session, engine, model="m").complete("p", max_tokens=8)
        listed, _ = await EngineClient(session, engine, model="m").complete_list(["p", "q"], max_tokens=8, label="batch")
    assert answer.error == (f"the answer's text is 10,000 characters for max_tokens=8: more than that many tokens make "
                            f"(at most {MAX_TOKEN_CHARS} characters each)")  # fmt: skip
    assert len(answer.text) == 8 * MAX_TOKEN_CHARS
    assert listed.error is not None and "more than that many tokens make" in listed.error
    assert len(listed.text) <= 16 * MAX_TOKEN_CHARS


def test_likeness_of_long_answers_is_bounded_in_time_and_still_tells_whose_an_answer_is() -> None:
    """One comparison of two different 10 KB texts took 5.8 s (difflib's ratio is quadratic)."""
    import random

    rng = random.Random(7)
    texts = ["".join(rng.choices("abcdefgh ", k=10_000)) for _ in range(3)]
    started = time.process_time()
    scores = [isolation.likeness(texts[0], other) for other in texts]
    assert time.process_time() - started < 2.0  # ~0.05 s per comparison of 1,000 characters here
    assert scores[0] == 1.0 and max(scores[1:]) < 1.0
    assert isolation.whose_answer(texts[1][:900] + "zz", texts) == 1
    assert isolation.likeness("a" * 10, "a" * 40) <= 0.5  # from the lengths alone: too unlike to be anyone's


def test_the_leak_search_reads_each_whole_response_once_and_keeps_only_what_it_found() -> None:
    raw = json.dumps(completion_of("hello")) + " " * (4 << 20) + '{"reasoning": "0123456789abcdef"}'
    tracemalloc.start()
    try:
        heard = Heard.of("tenant 2", "hello", raw, frozenset({"fedcba9876543210"}), ["0123456789abcdef", "fedcba9876543210"])
        del raw
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert heard.carries("0123456789abcdef") and heard.carries("fedcba9876543210") is False
    assert "in the response) ..." in heard.showing("0123456789abcdef") and "0123456789abcdef" in heard.showing("0123456789abcdef")
    assert size < 64 * 1024, size  # the 4 MB response is not kept


async def test_a_metrics_page_is_read_to_a_bound_and_parsed_without_holding_the_operators_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MB page held the operator's loop 6.7 s per scrape, on every reconcile pass."""
    line = b"kvguard_kv_pool_capacity_tokens 4096\n"
    big = line * (MAX_METRICS_BYTES // len(line) + 1)
    fair = b"# TYPE kvguard_kv_pool_capacity_tokens gauge\n" + line * 80_000  # ~3 MB: parsed, on a thread

    async def pages(request: web.Request) -> web.Response:
        return web.Response(body=big if request.path == "/big/metrics" else fair, content_type="text/plain")

    async with serving(pages) as engine, session_without_redirects() as session:
        status, _, error = await get_text(session, f"{engine}/big/metrics", 10, limit=MAX_METRICS_BYTES)
        assert status is None and error == f"the answer is over {MAX_METRICS_BYTES:,} bytes: read that far, then stopped"
        (too_big,) = await fetch_all(session, [f"{engine}/big/metrics"], 10)
        assert too_big.error is not None and "over" in too_big.error

        parsed_on: list[threading.Thread] = []
        parse = canary_metrics.snapshot_from_text

        def recording(url: str, text: str) -> WorkerSnapshot:
            parsed_on.append(threading.current_thread())
            return parse(url, text)

        monkeypatch.setattr(canary_metrics, "snapshot_from_text", recording)
        (parsed,) = await fetch_all(session, [f"{engine}/fair/metrics"], 30)
    assert parsed.error is None and parsed.engine == "kvguard"
    assert parsed_on and threading.main_thread() not in parsed_on  # off the loop: it kept its turns meanwhile


def test_an_answer_crossed_past_the_compared_opening_is_still_another_tenants() -> None:
    """`likeness` reads the first 1,000 characters: a 300-token answer that left its own for
    tenant 2's after token 120 (character ~650) scored as its own and passed (a review). Rows
    that crossed go on with the other's tokens to the end, so the end is judged too."""
    import random

    words = ["the", "a", "model", "of", "and", "inference", "cache", "to", "is", "request", "kernel", "batch",
             "server", "token", "page", "it", "on", "which", "attention", "decode"]  # fmt: skip
    tokens = [[" " + rng.choice(words) for _ in range(300)] for rng in (random.Random(seed) for seed in range(3))]
    solos: list[str | None] = ["".join(t) for t in tokens]
    crossed = "".join(tokens[0][:120] + tokens[1][120:])
    problems: list[str] = []
    isolation.check_own_answer(0, Completion(label="tenant 1", status=200, text=crossed), solos, problems, [])
    assert problems == ["tenant 1: the answer is tenant 2's, not its own (outputs crossed between requests)"]
    near_tie = "".join(tokens[0][:-1] + [" zebra"])  # its own but for the last token: noted, not failed
    problems = []
    isolation.check_own_answer(0, Completion(label="tenant 1", status=200, text=near_tie), solos, problems, [])
    assert problems == []


async def test_a_redirect_on_the_same_server_is_followed_and_a_refused_one_is_not_retried() -> None:
    """Starlette's mounted /metrics answers 307 to /metrics/ (older vLLM): the same server, followed.
    A redirect elsewhere is refused once, not asked again as if the connection had failed."""
    paths: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        paths.append(request.path)
        if request.path == "/metrics":
            return web.Response(status=307, headers={"Location": "/metrics/"})
        if request.path == "/v1/completions":
            return web.Response(status=307, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
        return web.Response(text="# TYPE kvguard_kv_pool_capacity_tokens gauge\nkvguard_kv_pool_capacity_tokens 4096\n")

    async with serving(metrics) as engine, session_without_redirects() as session:
        (scraped,) = await fetch_all(session, [f"{engine}/metrics"], 10)
        answer = await EngineClient(session, engine, model="m").complete("p", max_tokens=8)
    assert scraped.error is None and scraped.engine == "kvguard"
    assert answer.error is not None and "RedirectRefused" in answer.error and answer.retried == []
    assert paths == ["/metrics", "/metrics/", "/v1/completions"]
