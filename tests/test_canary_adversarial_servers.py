"""Findings of the second outside probe of `kvguard canary`, one test each.

Leaks only a stream or the chat endpoint shows, answers with no text, abort reasons that claimed
cuts that never happened, unbounded context lengths and timeouts, server text that broke the
table's lines, probes missing from the table, Ctrl-C.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from test_canary_fakes import Behaviour, FakeEngine, RunningServer

from kvguard.cli import main as cli_main
from kvguard.commands import canary as canary_command
from kvguard.operator.canary import CanaryReport, CanarySpec, ProbeName, ProbeStatus, Verdict, run_suite
from kvguard.operator.canary.report import PoolUsage, one_line

FAST = {"abort": {"poolRecoveryTimeoutSeconds": 1.0}, "requestTimeoutSeconds": 60}


def spec(**overrides: object) -> CanarySpec:
    return CanarySpec.model_validate({**FAST, **overrides})


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with RunningServer(getattr(request, "param", Behaviour())) as running:
        yield running


async def run(server: RunningServer, canary: CanarySpec | None = None, **kwargs: object) -> CanaryReport:
    return await run_suite(server.url, canary or spec(), metrics_urls=[server.metrics_url], **kwargs)  # type: ignore[arg-type]


def result(report: CanaryReport, name: ProbeName):  # type: ignore[no-untyped-def]
    found = report.probe(name)
    assert found is not None, f"{name} missing"
    return found


# 1. isolation covers streamed answers and the chat endpoint; every answer is searched -------------


@pytest.mark.parametrize(
    ("server", "path"),
    [(Behaviour(leak_nonce_on="stream"), "streamed"), (Behaviour(leak_nonce_on="chat"), "(chat)")],
    indirect=["server"],
)
async def test_a_leak_on_one_path_only_fails_isolation(server: RunningServer, path: str) -> None:
    report = await run(server, spec().only([ProbeName.ISOLATION]))
    isolation = result(report, ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "secret nonce" in isolation.reason and path in isolation.reason
    leaks = [e for e in isolation.evidence if e.kind == "nonce_leak"]
    assert leaks and all(leak.nonce in leak.output for leak in leaks)


async def test_a_clean_server_passes_isolation_on_every_path(server: RunningServer) -> None:
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    assert "completions; completions, streamed; chat" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(swap_concurrent=True)], indirect=True)
async def test_concurrent_tenants_given_each_others_answers_fail_isolation(server: RunningServer) -> None:
    """No nonce is echoed (the fake's answers only start with the prompt's first word): the crossing
    shows only as a tenant getting the answer another tenant gets alone."""
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "not its own (outputs crossed between requests)" in isolation.reason
    crossed = [e for e in isolation.evidence if e.kind == "output_mismatch" and e.expected_from.startswith("tenant ")]
    assert crossed and all(e.expected != e.actual for e in crossed)


@pytest.mark.parametrize("server", [Behaviour(crossed_list=True)], indirect=True)
async def test_a_prompt_list_whose_choices_are_crossed_fails_isolation(server: RunningServer) -> None:
    """Alone and concurrently every answer is right: only the one batch a prompt list makes shows it."""
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("prompt list, choice 0 (tenant 1's prompt): the answer is tenant 2's, not its own")


@pytest.mark.parametrize("server", [Behaviour(crossed_list=True)], indirect=True)
async def test_a_crossed_prompt_list_padded_past_its_tokens_still_fails(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer with more text than its tokens make is an error, and the prompt list's check
    took an errored batch as "not checked": padding a crossed list with spaces made it pass (a review)."""
    answer_list = FakeEngine._prompt_list

    def padded(engine: FakeEngine, prompts: list[str], max_tokens: int, n: int) -> web.Response:
        body = json.loads(answer_list(engine, prompts, max_tokens, n).body)  # type: ignore[arg-type]
        body["choices"][-1]["text"] += " " * 70_000
        return web.json_response(body)

    monkeypatch.setattr(FakeEngine, "_prompt_list", padded)
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("prompt list: the answer's text is 70,"), isolation.reason


@pytest.mark.parametrize("server", [Behaviour(crossed_forks=True)], indirect=True)
async def test_a_second_choice_forked_from_another_prompt_fails_isolation(server: RunningServer) -> None:
    """Every first choice is right: only a prompt's second choice (`n` = 2, its KV forked from the
    prompt's) goes on with the next prompt's answer -- the fork copied another sequence's pages."""
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("prompt list, choice 1 (tenant 1's prompt): the answer is tenant 2's, not its own")


@pytest.mark.parametrize("server", [Behaviour(refuse_n=True)], indirect=True)
async def test_a_server_that_refuses_n_is_checked_with_one_choice_per_prompt_and_noted(server: RunningServer) -> None:
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    notes = [getattr(e, "message", "") for e in isolation.evidence]
    assert any(m.startswith("n: 2 not checked: prompt list: HTTP 400") for m in notes), notes
    assert not any(m.startswith("prompt list not checked") for m in notes), notes


@pytest.mark.parametrize("server", [Behaviour(fail_forks=True)], indirect=True)
async def test_a_server_error_on_the_forked_prompt_list_fails_isolation(server: RunningServer) -> None:
    """Every prompt alone is answered; the batch whose choices fork each prompt's KV ends in a 500
    (ours: kv_tag_violation, a stale read caught). That was a note ("not checked"), and a PASS."""
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("prompt list: HTTP 500"), isolation.reason
    assert "kv_tag_violation" in isolation.reason or any("kv_tag_violation" in str(e) for e in isolation.evidence)


@pytest.mark.parametrize("server", [Behaviour(refuse_n=True, crossed_list=True)], indirect=True)
async def test_crossed_rows_fail_on_a_server_that_refuses_n(server: RunningServer) -> None:
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("prompt list, choice 0 (tenant 1's prompt): the answer is tenant 2's, not its own")


@pytest.mark.parametrize("server", [Behaviour(serves_completions=False)], indirect=True)
async def test_a_server_without_prompt_lists_is_noted_not_failed(server: RunningServer) -> None:
    isolation = result(await run(server, spec(api="chat").only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    assert any(getattr(e, "message", "").startswith("prompt list not checked: ") for e in isolation.evidence)


def test_a_concurrent_answer_is_attributed_to_the_solo_answer_it_is_most_like() -> None:
    from kvguard.operator.canary.isolation import whose_answer

    solos = ["own 1a2b3 4c5d6 7e8f9", "two 0f1e2 d3c4b a5968", "three 77777 88888 99999", None]
    assert whose_answer(solos[0], solos) == 0
    assert whose_answer("own 0f1e2 d3c4b a5968", solos) == 1  # its own first token, then tenant 2's rows
    assert whose_answer("own 1a2b3 4c5d6 7e8f0", solos) == 0  # diverged at the end: still its own
    assert whose_answer("nothing like any of them", solos) is None and whose_answer("", solos) is None


@pytest.mark.parametrize("server", [Behaviour(serves_chat=False)], indirect=True)
async def test_a_server_without_chat_is_noted_not_failed(server: RunningServer) -> None:
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    assert any("chat not checked: " in getattr(e, "message", "") for e in isolation.evidence)


@pytest.mark.parametrize("server", [Behaviour(leak_nonce_on="stream")], indirect=True)
async def test_the_abort_probe_searches_its_cut_streams_for_nonces(server: RunningServer) -> None:
    report = await run(server, spec(isolation={"tenants": 0}).only([ProbeName.ISOLATION, ProbeName.ABORT]))
    abort = result(report, ProbeName.ABORT)
    assert abort.status == ProbeStatus.FAIL and "stream cut after" in abort.reason and "secret nonce" in abort.reason
    assert abort.evidence[0].kind == "nonce_leak"  # the cause first: the table shows only a few rows


# 2. answers without text prove nothing ---------------------------------------------------------


@pytest.mark.parametrize("server", [Behaviour(empty_text=True)], indirect=True)
async def test_empty_answers_do_not_pass_determinism_or_isolation(server: RunningServer) -> None:
    report = await run(server, spec().only([ProbeName.DETERMINISM, ProbeName.ISOLATION]))
    for name in (ProbeName.DETERMINISM, ProbeName.ISOLATION):
        probe = result(report, name)
        assert probe.status == ProbeStatus.SKIPPED, probe.reason
        assert "no text" in probe.reason and "finish_reason length" in probe.reason
    assert report.verdict == Verdict.CANNOT_RUN  # nothing was proven


@pytest.mark.parametrize("server", [Behaviour(empty_text=True)], indirect=True)
async def test_the_whole_suite_does_not_pass_a_server_whose_answers_have_no_text(server: RunningServer) -> None:
    """Capacity, over-length, abort and the counters pass (they read statuses, pools and metrics):
    without a probe that read the output, the verdict is not PASS."""
    report = await run(server)
    assert report.verdict == Verdict.CANNOT_RUN, report.reason
    assert report.reason.startswith("no probe could check what the server outputs: golden: ")
    assert result(report, ProbeName.OVER_LENGTH).status == ProbeStatus.PASS


async def test_a_suite_without_content_probes_is_judged_on_what_it_ran(server: RunningServer) -> None:
    report = await run(server, spec().only([ProbeName.CAPACITY, ProbeName.OVER_LENGTH]))
    assert report.verdict == Verdict.PASS and report.reason == "2 probe(s) passed"


@pytest.mark.parametrize("server", [Behaviour(usage_extra_tokens=3)], indirect=True)
async def test_usage_above_max_tokens_fails(server: RunningServer) -> None:
    determinism = result(await run(server, spec().only([ProbeName.DETERMINISM])), ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL
    assert "usage says 11 completion tokens, more than max_tokens=8" in determinism.reason


@pytest.mark.parametrize("server", [Behaviour(prompt_tokens_drift=True)], indirect=True)
async def test_the_same_prompt_counted_differently_fails(server: RunningServer) -> None:
    determinism = result(await run(server, spec().only([ProbeName.DETERMINISM])), ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL
    assert determinism.reason.startswith("usage.prompt_tokens differs for the same prompt (run 1 ")


# 3. the abort reason says what happened --------------------------------------------------------


async def test_abort_counts_only_the_cuts_that_happened(server: RunningServer) -> None:
    # A cut after more chunks than the stream has, and a prefill cut long after the answer came.
    canary = spec(abort={"poolRecoveryTimeoutSeconds": 1.0, "streamDisconnectAfterTokens": [100000],
                         "prefillDisconnectAfterSeconds": [0.0, 30.0]}).only([ProbeName.ABORT])
    abort = result(await run(server, canary), ProbeName.ABORT)
    assert abort.status == ProbeStatus.PASS, abort.reason
    assert abort.reason.startswith("0 mid-decode and 1 mid-prefill disconnect(s) (2 planned cut(s) not exercised")


async def test_abort_with_no_cut_exercised_is_skipped(server: RunningServer) -> None:
    canary = spec(abort={"streamDisconnectAfterTokens": [100000], "prefillDisconnectAfterSeconds": [30.0]})
    abort = result(await run(server, canary.only([ProbeName.ABORT])), ProbeName.ABORT)
    assert abort.status == ProbeStatus.SKIPPED and abort.reason.startswith("no disconnect exercised: ")
    assert "stream finished before the cut" in abort.reason and "answered before the cut" in abort.reason


# 4 and 5. bounded context lengths, finite timeouts ---------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [{"contextLength": 99_999_999_999}, {"requestTimeoutSeconds": float("inf")}, {"suiteTimeoutSeconds": float("nan")},
     {"requestTimeoutSeconds": 1e300}, {"abort": {"prefillDisconnectAfterSeconds": [float("inf")]}}],
)
def test_unbounded_numbers_are_bad_specs(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CanarySpec.model_validate(bad)


@pytest.mark.parametrize(
    ("flag", "value"), [("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-1"), ("--context-length", "99999999999")]
)
def test_cli_rejects_unusable_numbers_in_one_line(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["canary", "--url", "http://127.0.0.1:1", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvguard canary: cannot run: {flag} must") and err.count("\n") == 1


@pytest.mark.parametrize("value", ["", " , "])
def test_probes_naming_no_probe_is_refused_not_every_probe(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--probes "$UNSET"` ran the whole suite (outside probe): a list that names nothing is a mistake."""
    assert cli_main(["canary", "--url", "http://127.0.0.1:1", "--probes", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard canary: cannot run: --probes names no probe; the probes are capacity") and err.count("\n") == 1


def test_a_yaml_infinity_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("requestTimeoutSeconds: .inf\n")
    assert cli_main(["canary", "--url", "http://127.0.0.1:1", "--spec", str(path)]) == 2
    assert "requestTimeoutSeconds: Input should be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("server", [Behaviour(advertised_context=99_999_999_999, metrics_style="none")], indirect=True)
async def test_a_huge_advertised_context_is_ignored_with_a_note(server: RunningServer) -> None:
    report = await run_suite(server.url, spec().only([ProbeName.DETERMINISM]))
    assert report.verdict == Verdict.PASS and report.target.context_length is None
    assert any("99999999999" in note and "ignored" in note for note in report.target.context_notes)


async def test_a_server_that_silently_cuts_prompts_below_its_advertised_context_fails_isolation() -> None:
    """An outside probe: a server that advertised 4096 tokens, kept 2048 of a longer prompt and
    answered 200 passed every probe (over-length tests just past 4096, which it refused; every
    answer was its own). Its usage said so: the longer long request's prompt_tokens stopped
    growing. An honest server, the same in all else, passes."""
    canary = spec().only([ProbeName.ISOLATION, ProbeName.OVER_LENGTH])
    with RunningServer(Behaviour(context_length=1024, truncate_prompts_at=400, metrics_style="none")) as cutting, \
            RunningServer(Behaviour(context_length=1024, metrics_style="none")) as honest:  # fmt: skip
        report = await run_suite(cutting.url, canary)
        isolation = result(report, ProbeName.ISOLATION)
        assert isolation.status == ProbeStatus.FAIL, isolation.reason
        assert "usage.prompt_tokens is 400" in isolation.reason and "the server cut the prompt" in isolation.reason
        assert result(report, ProbeName.OVER_LENGTH).status == ProbeStatus.PASS  # it refuses past what it advertises
        fair = await run_suite(honest.url, canary)
        assert fair.verdict == Verdict.PASS, fair.reason


async def test_run_suite_refuses_a_huge_configured_context(server: RunningServer) -> None:
    report = await run_suite(server.url, spec(), context_length=99_999_999_999)
    assert report.verdict == Verdict.CANNOT_RUN and "outside" in report.reason


# 6. server text never breaks a line ------------------------------------------------------------


def test_one_line_strips_controls_ansi_and_newlines() -> None:
    assert one_line("fake\nverdict: PASS\x1b[32m  x\u202ey\r\n") == "fake verdict: PASS xy"
    assert len(one_line("x" * 5000)) == 1000


@pytest.mark.parametrize(
    "server", [Behaviour(model_id="fake\nverdict: PASS (7 probe(s) passed)\x1b[32m", error_message="one\ntwo\nthree")],
    indirect=True,
)
def test_server_strings_cannot_add_lines_or_escapes(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["canary", "--url", server.url, "--probes", "determinism,isolation"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and sum(line.startswith("verdict:") for line in out.splitlines()) == 1
    assert "HTTP 500: one two three" in out
    rows = [line for line in out.splitlines() if line.startswith(("determinism", "isolation", " "))]
    assert all(line.strip() for line in rows)  # no continuation lines without a row


# 7. the table lists probes that were not run ---------------------------------------------------


@pytest.mark.parametrize("server", [Behaviour(error_message="boom")], indirect=True)
def test_table_shows_probes_not_run(server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stop.yaml"
    path.write_text("stopOnFailure: true\n")
    assert cli_main(["canary", "--url", server.url, "--spec", str(path), "--probes", "determinism,isolation,abort"]) == 1
    out = capsys.readouterr().out
    for name in ("isolation", "abort"):
        assert any(line.startswith(name) and "not run: determinism failed" in line for line in out.splitlines()), out


# 8. nits ----------------------------------------------------------------------------------------


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(make_coroutine: Any) -> None:
        make_coroutine().close()
        raise KeyboardInterrupt

    monkeypatch.setattr(canary_command, "run_interruptible", interrupted)
    assert cli_main(["canary", "--url", "http://127.0.0.1:1", "-o", "json"]) == 130
    assert capsys.readouterr().err.strip() == "kvguard canary: interrupted; no verdict"


def test_cannot_run_target_line_and_evidence_wording() -> None:
    target = CanaryReport.model_validate(
        {"verdict": "cannot_run", "target": {"url": "http://x"}, "startedAt": "now"}
    ).target
    assert canary_command.describe_target(target)[0].startswith("target: model not identified;")
    named = target.model_copy(update={"model": 'fake verdict: PASS\n(x)'})
    assert canary_command.describe_target(named)[0].startswith('target: model "fake verdict: PASS (x)"; context')
    http = canary_command.describe_evidence(
        CanaryReport.model_validate({"verdict": "fail", "target": {"url": "u"}, "startedAt": "t", "probes": [
            {"name": "determinism", "status": "fail", "evidence": [{"kind": "http", "request": "r", "error": "timed out"}]}
        ]}).probes[0].evidence[0]
    )
    assert http == ["- r: no HTTP response, 0 chunk(s): timed out"]
    assert PoolUsage(baseline_tokens=round(12.6), final_tokens=0, waited_seconds=0.1).model_dump()["baseline_tokens"] == 13


# 4. the third outside probe: wrong content that passed ------------------------------------------


@pytest.mark.parametrize("server", [Behaviour(constant_text="The quick brown fox jumps over the lazy dog"),
                                    Behaviour(constant_text="Error: CUDA out of memory. Tried to allocate")], indirect=True)  # fmt: skip
async def test_one_answer_for_every_prompt_fails_golden_without_a_baseline(server: RunningServer) -> None:
    golden = result(await run(server, spec().only([ProbeName.GOLDEN])), ProbeName.GOLDEN)
    assert golden.status == ProbeStatus.FAIL, golden.reason
    assert golden.reason.startswith("all 2 golden prompts got the same answer") and "does not answer its prompt" in golden.reason


async def test_a_healthy_server_without_a_baseline_still_skips_golden(server: RunningServer) -> None:
    golden = result(await run(server, spec().only([ProbeName.GOLDEN])), ProbeName.GOLDEN)
    assert golden.status == ProbeStatus.SKIPPED and "no baseline URL was given" in golden.reason


@pytest.mark.parametrize("server", [Behaviour(constant_text="d")], indirect=True)
async def test_a_short_answer_shared_by_every_golden_prompt_is_not_a_failure(server: RunningServer) -> None:
    """Outside probe (false positive): "The capital of France is" and "... of Italy is" both gave 'd'
    at maxTokens 1 on a healthy server; a short answer may honestly be every prompt's."""
    canary = spec(maxTokens=1, golden={"prompts": [{"prompt": "The capital of France is"}, {"prompt": "The capital of Italy is"}]})
    golden = result(await run(server, canary.only([ProbeName.GOLDEN])), ProbeName.GOLDEN)
    assert golden.status == ProbeStatus.SKIPPED, golden.reason


def test_a_diverged_answer_going_on_with_a_generic_run_is_not_crossed() -> None:
    """Outside probe (theoretical false positive): a near tie broken into a run of newlines that
    another tenant's answer also has at that place is no crossing."""
    from kvguard.operator.canary.isolation import crossed_after

    own, other = "The weather today is", "Some other text" + "\n" * 20
    assert crossed_after("The weather" + "\n" * 12, len("The weather"), own, [own, other]) is None
    worded = "Some other answer with words and more words"
    crossed = "The weather" + worded[len("The weather"):]
    assert crossed_after(crossed, len("The weather"), own, [own, worded]) == 1


async def test_tenants_served_each_others_cached_answer_fail_against_a_baseline() -> None:
    """A prefix-cache collision (answers keyed by the prompt's first 100 characters, which the
    tenants share): even "alone" every tenant gets the first one's answer, so only the baseline,
    which answers them differently, tells a leak from a model that answers alike."""
    with RunningServer(Behaviour(prefix_cache_chars=100)) as leaky, RunningServer(Behaviour()) as healthy:
        canary = spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])
        report = await run_suite(leaky.url, canary, baseline_url=healthy.url, metrics_urls=[leaky.metrics_url])
        isolation = result(report, ProbeName.ISOLATION)
        assert isolation.status == ProbeStatus.FAIL, isolation.reason
        assert "got the same answer alone to different prompts, which the baseline answers differently" in isolation.reason
        alone = result(await run_suite(leaky.url, canary, metrics_urls=[leaky.metrics_url]), ProbeName.ISOLATION)
        assert any("without a baseline this cannot tell" in getattr(e, "message", "") for e in alone.evidence)
        # Other numerics (baselineMatch tolerant) answer differently anyway: noted, not failed.
        tolerant = spec(isolation={"tenants": 3}, golden={"baselineMatch": "tolerant"}).only([ProbeName.ISOLATION])
        other = result(await run_suite(leaky.url, tolerant, baseline_url=healthy.url, metrics_urls=[leaky.metrics_url]),
                       ProbeName.ISOLATION)  # fmt: skip
        assert any("same numerics (baselineMatch exact)" in getattr(e, "message", "") for e in other.evidence), other.reason
        # compareBaseline is golden's: turned off (by a user, or by the operator for an older operator's
        # fingerprint), the leak still fails here (a review: judged it a note, this leak passed the canary).
        unused = spec(isolation={"tenants": 3}, golden={"compareBaseline": False}).only([ProbeName.ISOLATION])
        still = result(await run_suite(leaky.url, unused, baseline_url=healthy.url, metrics_urls=[leaky.metrics_url]),
                       ProbeName.ISOLATION)  # fmt: skip
        assert still.status == ProbeStatus.FAIL and "which the baseline answers differently" in still.reason, still.reason


async def test_a_collision_on_one_endpoint_only_fails_against_a_baseline() -> None:
    """Outside probe (a response cache keyed per endpoint on the prompt's first tokens, in front of
    a healthy server): the tenants take turns over the paths, so their answers alone never
    collided; only the prompt list's answers alone (all on completions) did, and each of its right
    choices then "differed from its answer alone" -- a note, and a PASS."""
    with RunningServer(Behaviour(prefix_cache_chars=100, cache_per_path=True)) as leaky, RunningServer(Behaviour()) as healthy:
        canary = spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])
        report = await run_suite(leaky.url, canary, baseline_url=healthy.url, metrics_urls=[leaky.metrics_url])
        isolation = result(report, ProbeName.ISOLATION)
        assert isolation.status == ProbeStatus.FAIL, isolation.reason
        assert "got the same answer alone to different prompts, which the baseline answers differently" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(swap_concurrent=True, swap_same_path=True)], indirect=True)
async def test_answers_swapped_within_one_endpoint_fail_isolation(server: RunningServer) -> None:
    """Outside probe: concurrent requests on the same path exchanging answers (a batch's rows, or a
    connection pool's responses, mixed up within one endpoint) passed: the only concurrent
    requests were the tenants', one per path. They also run all on the main path now."""
    isolation = result(await run(server, spec(isolation={"tenants": 3}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "not its own (outputs crossed between requests)" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(swap_concurrent=True, cross_after=0.5),
                                    Behaviour(swap_concurrent=True, cross_after=0.75)], indirect=True)  # fmt: skip
async def test_answers_crossed_part_way_fail_isolation(server: RunningServer) -> None:
    """Each concurrent answer keeps its own first half (or three quarters) and goes on with another
    tenant's: no longer "most like" the other's as a whole, it passed as a near tie ~40% of runs."""
    canary = spec(maxTokens=16, isolation={"tenants": 3}).only([ProbeName.ISOLATION])
    isolation = result(await run(server, canary), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "outputs crossed between requests" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(reverse_chat_stream=True)], indirect=True)
async def test_streamed_chat_that_differs_from_plain_chat_fails_determinism(server: RunningServer) -> None:
    determinism = result(await run(server, spec().only([ProbeName.DETERMINISM])), ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL, determinism.reason
    assert determinism.reason == "streamed chat output differs from the non-streamed chat output"


# 5. the fourth outside probe: short fixed answers, long-prompt leaks, budgets, lengths ---------


@pytest.mark.parametrize("server", [Behaviour(constant_text=" ".join("!" * 8)), Behaviour(constant_text=". " * 8)], indirect=True)
async def test_one_short_answer_to_every_prompt_fails_without_a_baseline(server: RunningServer) -> None:
    """NaN logits decode to '!' every step: 8 one-character tokens, under golden's 12-character
    threshold for two prompts, and every B and tenant equalled itself alone, so the suite passed.
    Four and more different prompts answered alone with one text that fills the budget fail,
    however short."""
    report = await run(server)
    assert report.verdict == Verdict.FAIL, report.reason
    isolation = result(report, ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "different prompts answered alone got the same answer" in isolation.reason, isolation.reason
    assert "does not answer its prompt" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(constant_text="safe")], indirect=True)
async def test_one_answer_that_ends_by_itself_for_every_prompt_is_a_models_own(server: RunningServer) -> None:
    """A guard or classifier model answers "safe" to every harmless prompt and stops there (an
    outside audit: it failed isolation, even against a baseline answering the same): an answer
    that ended by itself is the model's, however many prompts share it."""
    report = await run(server)
    isolation = result(report, ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason


@pytest.mark.parametrize("server", [Behaviour(constant_text="d")], indirect=True)
async def test_a_one_token_answer_shared_by_many_prompts_is_not_a_failure(server: RunningServer) -> None:
    """One greedy token may honestly be the next word of several prompts: at maxTokens 1 nothing is
    concluded from a shared answer."""
    report = await run(server, spec(maxTokens=1))
    assert result(report, ProbeName.ISOLATION).status == ProbeStatus.PASS, report.reason
    assert result(report, ProbeName.GOLDEN).status == ProbeStatus.SKIPPED


@pytest.mark.parametrize("server", [Behaviour(previous_answer_tokens=250)], indirect=True)
async def test_a_leak_only_the_longest_request_shows_fails_isolation(server: RunningServer) -> None:
    """Outside probe: a leak on prompts over ~0.6 of the context (the answer of the request before)
    hit only A #2; A #1 alone was asked again, so the suite passed. Every long request is asked again."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("A #2 ("), isolation.reason


@pytest.mark.parametrize("server", [Behaviour(long_leak_tokens=100), Behaviour(wrap_ring_tokens=750)], indirect=True)
async def test_a_leak_only_long_requests_show_fails_isolation(server: RunningServer) -> None:
    """A long prompt served the previous long prompt's KV (or a long request whose KV wrapped the
    pool's end reading stale slots): B, short, never sees it, and A's own answer was compared with
    nothing, so it passed. A #1 asked again after the others must give its first answer (S1)."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("A #1 (") and "a long request's answer depended on what ran before it" in isolation.reason
    again = [e for e in isolation.evidence if e.kind == "output_mismatch" and e.request.endswith("again after the others")]
    assert again and again[0].expected != again[0].actual


@pytest.mark.parametrize("server", [Behaviour(wrap_ring_tokens=3946)], indirect=True)
async def test_a_tenant_whose_answer_alone_was_the_leak_fails_isolation(server: RunningServer) -> None:
    """The request of a tenant's answer alone wrapped the KV ring and read stale slots: every later
    check of that tenant compared against the leak, and the concurrent answers that differed from
    it were noted as near ties. Asked alone once more, it must give its first answer alone.

    The ring is filled in arrival order, and the probe's concurrent requests arrive in any order,
    so the ring's size is chosen for the wrap to land on a request sent alone: the suite's
    requests before tenant 1's "alone again" fill 3,923 slots whatever their order, and that one
    ends at 3,995 (the streamed `n` = 2 requests added 144, and A #2 asked again 302). (At 1800 the wrap landed in a concurrent batch: in one run of eight under load
    the tenant that wrapped it was the one whose "alone again" wrapped next, read its own KV, and
    the probe honestly saw no leak; a loop under two busy loops found it.)"""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert isolation.reason.startswith("tenant 1 alone again: output differs from its first answer alone"), isolation.reason


@pytest.mark.parametrize("server", [Behaviour(cached_repeat_tokens=16)], indirect=True)
async def test_a_prefix_cache_that_breaks_a_near_tie_on_a_repeat_is_noted_not_failed(server: RunningServer) -> None:
    """vLLM and SGLang serve a long prompt asked again from its first request's KV, and their
    kernels may break a near tie differently from the cold prefill (an outside audit: the repeat
    checks failed such healthy servers). A repeat that differs is asked a third time: when the two
    repeats agree and neither is another request's answer, it is the server's numerics."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    notes = [e.message for e in isolation.evidence if e.kind == "note" and "repeats itself when asked once more" in e.message]
    assert any(n.startswith("A #1") for n in notes) and any(n.startswith("tenant 1 alone again") for n in notes), notes


@pytest.mark.parametrize("server", [Behaviour(tokens_at_least=24, usage_mode="none"),
                                    Behaviour(tokens_at_least=24, usage_mode="capped")], indirect=True)  # fmt: skip
async def test_max_tokens_ignored_fails_whatever_usage_says(server: RunningServer) -> None:
    """24 tokens for max_tokens 8, with usage left out or capped at 8: only usage was checked, so it
    passed. Each non-empty streamed chunk is at least one token: 24 of them are over budget."""
    determinism = result(await run(server, spec().only([ProbeName.DETERMINISM])), ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL, determinism.reason
    assert "the stream carried 24 text chunks, more than max_tokens=8" in determinism.reason, determinism.reason


def test_usage_below_the_streamed_chunk_count_is_an_error() -> None:
    from kvguard.operator.canary.client import Completion, streamed_over_budget

    lying = Completion(label="streamed run", status=200, text="a b c d", chunks=4, completion_tokens=2, max_tokens=8)
    assert "usage says 2 completion tokens, fewer than the 4 text chunks" in (streamed_over_budget(lying) or "")
    honest = Completion(label="streamed run", status=200, text="ab cd", chunks=2, completion_tokens=4, max_tokens=8)
    assert streamed_over_budget(honest) is None  # a chunk may carry several tokens (a stream interval)


@pytest.mark.parametrize(("server", "case"), [(Behaviour(prompt_limit=512), "prompt + max_tokens > context length"),
                                              (Behaviour(prompt_limit=600), "prompt just over the context length")],
                         indirect=["server"])  # fmt: skip
async def test_admission_short_of_the_context_fails_over_length(server: RunningServer, case: str) -> None:
    """Admission that never adds max_tokens to the prompt, or checks the prompt against more than
    the context it advertises: only a prompt of 1.25 x the context and a max_tokens above it were
    sent, each refused, so it passed (S2). Sized from the server's own usage, the cases between
    must be refused too."""
    over_length = result(await run(server, spec().only([ProbeName.OVER_LENGTH])), ProbeName.OVER_LENGTH)
    assert over_length.status == ProbeStatus.FAIL, over_length.reason
    accepted = [e for e in over_length.evidence if e.kind == "http" and e.status == 200]
    assert any(e.request.startswith(f"{case}: completions, stream=false") for e in accepted), over_length.reason
    assert not any(e.request.startswith(("prompt > context length", "max_tokens > context length")) for e in accepted)


@pytest.mark.parametrize("server", [Behaviour(usage_mode="none", context_length=2048, pool_tokens=8192)], indirect=True)
async def test_a_server_without_usage_leaves_the_calibrated_over_length_cases_out(server: RunningServer) -> None:
    over_length = result(await run(server, spec().only([ProbeName.OVER_LENGTH])), ProbeName.OVER_LENGTH)
    assert over_length.status == ProbeStatus.PASS, over_length.reason
    notes = [getattr(e, "message", "") for e in over_length.evidence]
    assert any("not checked on completions: the server reports no usage.prompt_tokens" in n for n in notes), notes


@pytest.mark.parametrize("server", [Behaviour(context_length=20_000, pool_tokens=80_000)], indirect=True)
async def test_the_calibrated_over_length_cases_respect_max_prompt_bytes_before_sending_anything(server: RunningServer) -> None:
    """maxPromptBytes bounds every prompt the probe sends: the calibration's prompts of up to half
    the context went out first, and only the cases built from them were skipped (outside audit)."""
    cap = 16_384
    canary = spec(overLength={"maxPromptBytes": cap}).only([ProbeName.OVER_LENGTH])
    over_length = result(await run(server, canary), ProbeName.OVER_LENGTH)
    notes = [getattr(e, "message", "") for e in over_length.evidence]
    assert any("are over maxPromptBytes" in n for n in notes), notes
    assert server.engine.largest_prompt_bytes <= cap


# Third outside probe (2026-12-06): paths and shapes the isolation probe never sent ---------------


@pytest.mark.parametrize("server", [Behaviour(leak_nonce_on="chat_stream")], indirect=True)
async def test_a_leak_only_streamed_chat_shows_fails_isolation(server: RunningServer) -> None:
    """Streamed chat, what chat UIs use, was sent once in the whole suite, before any nonce existed."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "(chat, streamed): output contains the secret nonce" in isolation.reason, isolation.reason


@pytest.mark.parametrize("server", [Behaviour(swap_concurrent=True, swap_same_path=True, swap_only_chat=True)], indirect=True)
async def test_chats_in_flight_together_given_each_others_answers_fail_isolation(server: RunningServer) -> None:
    """Tenants took turns over the paths, then ran together only on the main (completions) path:
    two chats were never in flight at once."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "(chat" in isolation.reason and "not its own (outputs crossed between requests)" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(usage_from_company=True)], indirect=True)
async def test_usage_counted_from_another_tenant_fails_isolation(server: RunningServer) -> None:
    """Every tenant's prompt had one length, so usage swapped between them could not show."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "usage.prompt_tokens is" in isolation.reason and "(usage counted from another request)" in isolation.reason


@pytest.mark.parametrize("server", [Behaviour(crossed_single_forks=True)], indirect=True)
async def test_a_single_prompts_second_choice_from_another_sequence_fails_isolation(server: RunningServer) -> None:
    """`n` went out only with a prompt list: a single prompt's forked choices were never checked."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "tenant 1, n: 2 (completions): its greedy choices differ" in isolation.reason, isolation.reason


@pytest.mark.parametrize("server", [Behaviour(crossed_stream_forks=True)], indirect=True)
async def test_a_streamed_second_choice_from_another_sequence_fails_isolation(server: RunningServer) -> None:
    """`n` > 1 was never streamed, where a server routes each choice's chunks by index: a server
    whose streamed forks read another sequence (plain ones right) passed."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "tenant 1, n: 2 (completions, streamed): its greedy choices differ" in isolation.reason, isolation.reason
    assert "tenant 1, n: 2 (completions):" not in isolation.reason  # the plain forks are right


@pytest.mark.parametrize("server", [Behaviour(unfinished_stream_forks=True)], indirect=True)
async def test_a_streamed_choice_that_never_finishes_is_a_stream_cut_short(server: RunningServer) -> None:
    """The stream of several choices took its finish reason from whichever choice ended first: one
    cut after another finished passed (a review)."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "choice(s) [1] never finished" in isolation.reason, isolation.reason


async def test_a_clean_server_passes_every_new_path_and_shape(server: RunningServer) -> None:
    """The fake honours `n` for a single prompt; four tenants, each path concurrently, chat streams."""
    isolation = result(await run(server, spec().only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.PASS, isolation.reason
    assert "4 concurrent tenants" in isolation.reason and "chat; chat, streamed" in isolation.reason
    assert not [e for e in isolation.evidence if "n: 2" in getattr(e, "message", "")]  # n was honoured: nothing to note


@pytest.mark.parametrize(("server", "says"), [
    (Behaviour(empty_when_busy=2), "answered no text (finish_reason length, usage"),
    (Behaviour(empty_when_busy=2, empty_finish="stop"), "answers of one concurrent round had no text where their prompts alone had text"),
], indirect=["server"])  # fmt: skip
async def test_answers_lost_under_concurrency_fail_isolation(server: RunningServer, says: str) -> None:
    """Outside probes: a proxy that emptied answers while others were in flight (HTTP 200, usage
    still counting the tokens, finish_reason length, or "stop" as if each ended at once) passed
    isolation as a dozen near-tie notes."""
    isolation = result(await run(server, spec(isolation={"tenants": 4}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert says in isolation.reason and "lost" in isolation.reason, isolation.reason


@pytest.mark.parametrize("server", [Behaviour(empty_plain_chat=True)], indirect=True)
async def test_plain_chat_with_no_text_where_streamed_chat_has_it_fails_determinism(server: RunningServer) -> None:
    """Outside probe: plain chat answered 200 with empty content while streamed chat had text;
    determinism dropped the chat comparison quietly and passed."""
    determinism = result(await run(server, spec().only([ProbeName.DETERMINISM])), ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL, determinism.reason
    assert determinism.reason.startswith("streamed chat output differs from the non-streamed chat output"), determinism.reason


@pytest.mark.parametrize("server", [Behaviour(empty_choices=True)], indirect=True)
async def test_choices_that_all_lost_their_text_fail_isolation(server: RunningServer) -> None:
    """Every choice of `n` > 1 empty (finish_reason length) where the prompt alone has text: the
    choices agree, so only each one's own finish reason tells a lost answer from a near tie
    (review: the choices were checked without theirs, and the rule never fired)."""
    isolation = result(await run(server, spec(isolation={"tenants": 2}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "choice 0: answered no text (finish_reason length)" in isolation.reason, isolation.reason


@pytest.mark.parametrize("server", [Behaviour(empty_list_choice=True)], indirect=True)
async def test_a_prompt_lists_lost_choice_fails_isolation(server: RunningServer) -> None:
    """The prompt list's choices carry their own finish reasons too (review: built without them,
    a lost choice there could never fail)."""
    isolation = result(await run(server, spec(isolation={"tenants": 2}).only([ProbeName.ISOLATION])), ProbeName.ISOLATION)
    assert isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "prompt list, choice 0 (tenant 1's prompt): answered no text (finish_reason length" in isolation.reason, isolation.reason
