"""Pure pieces of the canary suite: body parsing, prompt sizing, metric mapping, the spec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_canary_fakes import sglang_metrics, sglang_server_info, vllm_metrics

from kvguard.operator.canary import CanarySpec, ProbeName
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.metrics import (
    counter_totals,
    pools_from_server_info,
    snapshot_from_text,
    total_used_tokens,
)
from kvguard.operator.canary.over_length import judge_rejection
from kvguard.operator.canary.prompts import TokenEstimate, filler_text, make_nonce
from kvguard.operator.canary.responses import error_message, parse_body, parse_json_text


def test_error_shapes_of_every_engine_are_errors() -> None:
    nested = {"error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"}}
    assert error_message(nested) == "too long (context_length_exceeded)"
    flat = {"object": "error", "message": "The input (9 tokens) is longer", "type": "BadRequestError", "param": None, "code": 400}
    assert error_message(flat) == "The input (9 tokens) is longer"
    assert error_message({"error": "plain"}) == "plain"
    assert error_message({"choices": []}) is None


def test_abort_finish_reason_is_an_error_even_with_http_200() -> None:
    sglang_abort = {"choices": [{"text": "partial", "finish_reason": {"type": "abort", "message": "checksum"}}]}
    assert parse_body(sglang_abort).error == "finish_reason is 'abort'"
    meta = {"choices": [{"text": "x", "finish_reason": None}], "meta_info": {"finish_reason": {"type": "abort"}}}
    assert parse_body(meta).error is not None
    ok = parse_body({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 7}})
    assert (ok.text, ok.error, ok.finish_reason, ok.prompt_tokens) == ("hi", None, "stop", 7)
    assert "malformed completion body" in (parse_body({"choices": "nope"}).error or "")


@pytest.mark.parametrize(
    ("status", "text", "chunks", "problem"),
    [
        (400, "", 0, None),
        (413, "", 0, None),
        (200, "", 0, "accepted with HTTP 200"),
        (200, "leaked text", 3, "accepted with HTTP 200 (3 chunk(s)"),
        (500, "", 0, "expected a 4xx"),
        (None, "", 0, "no HTTP response"),
        (400, "tok", 1, "text was generated"),
        (422, "", 0, None),
        (401, "", 0, "refuses the caller, not the length"),
        (429, "", 0, "refuses the caller, not the length"),
        (404, "", 0, None),  # not served: a note, and no proof (see the next test)
    ],
)
def test_s2_rejection_judgement(status: int | None, text: str, chunks: int, problem: str | None) -> None:
    result = Completion(label="case", status=status, text=text, chunks=chunks, error="x", body='{"error":{"code":"context_length_exceeded"}}')
    found, _ = judge_rejection(result)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_s2_an_endpoint_that_is_not_served_is_noted_not_counted_as_a_rejection() -> None:
    for status in (404, 405):
        problem, note = judge_rejection(Completion(label="case", status=status, error=f"HTTP {status}"))
        assert problem is None and "not served" in (note or "")


def test_prompt_sizing_bounds_hold_for_byte_level_and_bpe() -> None:
    unknown = TokenEstimate()
    words = unknown.words_at_most(1000)
    assert len(filler_text(words, 1).encode()) <= 1000  # one token per byte is the worst case
    assert unknown.words_at_least(1000) > 1000  # one token per word is the floor
    measured = TokenEstimate.from_usage(prompt_tokens=320)  # byte-level: 5 tokens per word
    assert measured.words_at_most(1000) * 5 <= 1000 and measured.words_at_least(1000) * 5 > 1000
    assert TokenEstimate.from_usage(None).tokens_per_word is None
    # Outside probe: a usage three times too high (or 1) sized the over-length probe wrong, and a
    # healthy server failed as the incident. A count no tokenizer makes is not believed.
    assert TokenEstimate.from_usage(prompt_tokens=3 * 320).tokens_per_word is None
    assert TokenEstimate.from_usage(prompt_tokens=1).tokens_per_word is None
    assert TokenEstimate.from_usage(prompt_tokens=83).tokens_per_word == 83 / 64  # a BPE model's ~1.3 a word


def test_nonce_is_on_every_page_of_the_long_prompt() -> None:
    nonce = make_nonce(16)
    assert len(nonce) == 16 and len({make_nonce(16) for _ in range(20)}) == 20
    words = filler_text(200, 3, nonce, nonce_every=48).split()
    assert [i for i, w in enumerate(words) if w == nonce] == [0, 48, 96, 144, 192]
    assert nonce not in filler_text(200, 3)


def test_kvguard_metrics_mapping() -> None:
    text = (
        "# TYPE kvguard_kv_pool_capacity_tokens gauge\n"
        'kvguard_kv_pool_capacity_tokens{role="prefill"} 4096\n'
        'kvguard_kv_pool_capacity_tokens{role="decode"} 8192\n'
        "# TYPE kvguard_kv_pool_used_tokens gauge\n"
        'kvguard_kv_pool_used_tokens{role="prefill"} 16\n'
        'kvguard_kv_pool_used_tokens{role="decode"} 32\n'
        "# TYPE kvguard_context_length_tokens gauge\nkvguard_context_length_tokens 2048\n"
        "# TYPE kvguard_tag_violations counter\nkvguard_tag_violations_total 2\n"
        "# TYPE kvguard_aborts counter\n"
        'kvguard_aborts_total{cause="client_disconnect"} 1\nkvguard_aborts_total{cause="transfer_timeout"} 2\n'
    )
    snap = snapshot_from_text("u", text)
    assert snap.engine == "kvguard" and snap.context_length == 2048
    assert sorted((p.pool, p.capacity_tokens, p.used_tokens) for p in snap.pools) == [
        ("role=decode", 8192, 32), ("role=prefill", 4096, 16)
    ]
    assert total_used_tokens([snap]) == 48
    assert counter_totals([snap, snap], ["kvguard_tag_violations_total", "kvguard_aborts_total", "absent_total"]) == {
        "kvguard_tag_violations_total": 4, "kvguard_aborts_total": 6
    }


def test_sglang_metrics_and_server_info_mapping() -> None:
    snap = snapshot_from_text("u", sglang_metrics(pool=284928, used=1000))
    assert snap.engine == "sglang"
    assert [(p.capacity_tokens, p.used_tokens) for p in snap.pools] == [(284928, 1000)]
    assert snap.counter("sglang:num_transfer_failed_reqs_total") == 0
    old = snapshot_from_text("u", sglang_metrics(pool=4096, used=2048, with_capacity=False))
    assert old.engine == "sglang" and old.pools == []  # falls back to /server_info
    pools, context = pools_from_server_info(sglang_server_info(pool=284928, context=1048576))
    assert [p.capacity_tokens for p in pools] == [284928] and context == 1048576
    pools, _ = pools_from_server_info({"max_total_num_tokens": 5000})
    assert pools[0].capacity_tokens == 5000 and "max_total_num_tokens" in pools[0].source


def test_vllm_metrics_mapping_one_pool_per_engine() -> None:
    snap = snapshot_from_text("u", vllm_metrics(pool=4096, used=1024, block_size=16, engines=2))
    assert snap.engine == "vllm"
    assert [(p.pool, p.capacity_tokens) for p in snap.pools] == [("engine=0", 4096), ("engine=1", 4096)]
    assert snap.pools[0].used_tokens == pytest.approx(512)
    sized = snapshot_from_text("u", 'vllm:cache_config_info{engine="0",kv_cache_size_tokens="123456",num_gpu_blocks="9",block_size="16"} 1.0\n')
    assert sized.pools[0].capacity_tokens == 123456
    assert snap.counter("vllm:num_preemptions") == 0  # with or without _total


def test_unparseable_metrics_are_an_error_not_a_crash() -> None:
    snap = snapshot_from_text("u", "this is { not prometheus\n")
    assert not snap.reachable and "unparseable" in (snap.error or "")


def test_spec_aliases_defaults_and_field_errors() -> None:
    spec = CanarySpec.model_validate({"overLength": {"contextFactor": 2}, "maxTokens": 4})
    assert spec.over_length.context_factor == 2 and spec.max_tokens == 4
    assert spec.model_dump(by_alias=True)["safetyCounters"]["counters"][0] == "kvguard_tag_violations_total"
    assert CanarySpec(max_tokens=4).max_tokens == 4  # populate_by_name
    with pytest.raises(ValidationError, match="goldn"):
        CanarySpec.model_validate({"goldn": {}})
    with pytest.raises(ValidationError, match="regular expression"):
        CanarySpec.model_validate({"golden": {"prompts": [{"prompt": "x", "expectRegex": "("}]}})
    with pytest.raises(ValidationError, match="every probe is disabled"):
        CanarySpec().only([])
    assert ProbeName.parse("overLength") == ProbeName.parse("over-length") == ProbeName.OVER_LENGTH
    schema = CanarySpec.model_json_schema(by_alias=True)
    assert schema["properties"]["maxTokens"]["description"]


def test_s4_recovery_deadline_tracks_the_aborted_requests_natural_duration() -> None:
    from kvguard.operator.canary.abort import MIN_RECOVERY_SECONDS, recovery_deadline

    assert recovery_deadline(5.0, 0.5, None) == 5.0  # no stream timing: the fixed timeout
    assert recovery_deadline(5.0, 0.5, 60.0) == 5.0  # a slow GPU generation: still the timeout
    assert recovery_deadline(5.0, 0.5, 3.0) == 1.5  # a fast CPU one: half its natural duration
    assert recovery_deadline(5.0, 0.5, 0.1) == MIN_RECOVERY_SECONDS


def test_s4_tokens_generated_after_a_cut_are_counted_by_worker() -> None:
    """A worker missing from one scrape must not read as a jump (its whole count) in the sum, and
    each engine's generation counter is read under its own name."""
    from kvguard.operator.canary.abort import Recovery, TokensGenerated
    from kvguard.operator.canary.metrics import WorkerSnapshot, snapshot_from_text
    from kvguard.operator.canary.report import PoolUsage

    def scrape(url: str, name: str, count: float) -> WorkerSnapshot:
        return snapshot_from_text(url, f"# TYPE {name} counter\n{name}_total {count}\n")

    prefill, decode = "http://p/metrics", "http://d/metrics"
    counted = TokensGenerated()
    assert counted.total() is None  # nothing read yet: no verdict from counters
    counted.read([scrape(decode, "kvguard_generation_tokens", 5000)])  # prefill's scrape failed
    counted.read([scrape(decode, "kvguard_generation_tokens", 5010), scrape(prefill, "kvguard_generation_tokens", 900)])
    assert counted.total() == 10  # prefill's 900 are its count at the cut, not tokens since
    counted.read([scrape(decode, "kvguard_generation_tokens", 5400), scrape(prefill, "kvguard_generation_tokens", 901)])
    counted.read([scrape(prefill, "kvguard_generation_tokens", 901)])  # decode missing: its 400 stand
    assert counted.total() == 401
    for name in ("sglang:generation_tokens", "vllm:generation_tokens"):
        other = TokensGenerated()
        other.read([scrape(decode, name, 1.0)])
        other.read([scrape(decode, name, 3.0)])
        assert other.total() == 2, name

    def recovery(generated: int | None) -> Recovery:
        usage = PoolUsage(baseline_tokens=0, final_tokens=0, waited_seconds=0.4, generated_tokens=generated)
        return Recovery(deadline=1.0, back=True, in_time=True, waited_seconds=0.4, held_tokens=0, usage=usage)

    assert "ran on: 500 tokens" in recovery(500).ran_on(1000) and "(it had 1000 left)" in recovery(500).ran_on(1000)
    assert recovery(499).ran_on(1000) == ""  # under half of what it had left: a correct engine's last steps
    assert recovery(None).ran_on(1000) == ""  # no counter: the timing rules judge it
    assert recovery(20).ran_on(20) == ""  # too few tokens left to tell a run-on from the steps in flight


def test_stream_chunk_timing() -> None:
    out = Completion(label="s", chunk_times=[0.5, 0.6, 0.7, 0.8])
    assert out.seconds_per_chunk() == pytest.approx(0.1)
    assert Completion(label="s", chunk_times=[0.5]).seconds_per_chunk() is None


def test_s4_decode_speed_is_the_median_gap_so_one_slow_gap_does_not_stretch_the_abort_deadline() -> None:
    # The first gap carries the KV hand-off (and here a descheduled moment): the mean, 0.034 s,
    # put a tiny model's natural time at twice its real one, and a non-propagated abort passed.
    out = Completion(label="s", chunk_times=[0.5, 0.6, 0.601, 0.602])
    assert out.seconds_per_chunk() == pytest.approx(0.001)


def test_a_body_that_is_no_json_is_named_by_its_first_characters() -> None:
    """An outside probe: a proxy's HTML error page read only "malformed JSON body (Expecting value
    at position 0)"; what came instead is now quoted, one clean line, ANSI escapes gone."""
    payload, error = parse_json_text("<html>\n<h1>\x1b[31m502 Bad Gateway</h1></html>")
    assert payload is None and error is not None
    assert error.startswith("malformed JSON body (Expecting value at position 0): it begins '<html> <h1>502 Bad Gateway")
    assert "\x1b" not in error and "\n" not in error
    assert parse_json_text("  ")[1] == "malformed JSON body (Expecting value at position 2): it is empty"
    assert parse_json_text('{"ok": 1}') == ({"ok": 1}, None)


def test_prompt_growth_is_judged_without_the_chat_template() -> None:
    """A review: the shorter long request's tokens per word held the chat template too, so an honest
    server with a 150-token template (a default system prompt) at 2.5 tokens per word, its long
    requests 150 and 350 words, was failed as one that cut its prompt. The calibration prompt's
    count (64 words, the same endpoint) takes the template out; a cut prompt still fails."""
    from kvguard.operator.canary.isolation import check_prompts_counted

    template, per_word = 150, 2.5
    calibration = TokenEstimate.from_usage(round(template + 64 * per_word))

    def answer(words: int, cut_at: int | None = None) -> Completion:
        tokens = round(template + words * per_word)
        return Completion(label=f"A ({words} words)", status=200, text="x", prompt_tokens=min(tokens, cut_at or tokens))

    problems: list[str] = []
    check_prompts_counted([(150, answer(150)), (350, answer(350))], problems, [], calibration)
    assert problems == []
    check_prompts_counted([(150, answer(150)), (350, answer(350, cut_at=800))], problems, [], calibration)
    assert len(problems) == 1 and "the server cut the prompt" in problems[0]


def test_the_table_shows_a_prefix_cache_collision_left_unjudged() -> None:
    """A review: the note that two tenants got one answer alone (no baseline to judge it: the README
    says it is only noted) was the one left-out case the table did not print under a passing row."""
    import asyncio
    from types import SimpleNamespace

    from kvguard.commands.canary import evidence_rows
    from kvguard.operator.canary.isolation import IsolationProbe
    from kvguard.operator.canary.report import ProbeResult, ProbeStatus

    solos = [Completion(label=f"tenant {i}", status=200, text="same") for i in (1, 2)]
    ctx = SimpleNamespace(baseline=None, spec=CanarySpec())
    evidence: list = []
    asyncio.run(IsolationProbe()._same_answers_alone(ctx, ["a", "b"], [("completions", False)] * 2, solos, [], evidence))  # type: ignore[arg-type]
    result = ProbeResult(name=ProbeName.ISOLATION, status=ProbeStatus.PASS, reason="ok", evidence=evidence)
    assert any("tenants 1 and 2 got the same answer alone" in row for row in evidence_rows(result))
