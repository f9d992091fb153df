"""Findings of the third outside probe of `kvguard canary`, one test each (S1).

Leaks in fields of a response the probes did not read (reasoning content, tool-call arguments,
logprob tokens, a chat message whose stray `text` was right), a leaked extra choice hidden behind a
repeated index, a leak only sampled requests show, and a healthy server failed for one "not now"
answer (429, 503, a connection closed before any response).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_canary_adversarial_servers import spec
from test_canary_fakes import Behaviour, RunningServer

from kvguard.operator.canary import CanaryReport, ProbeName, ProbeStatus, Verdict, run_suite
from kvguard.operator.canary.client import RETRY_AFTER_CAP_S, Completion
from kvguard.operator.canary.responses import choice_texts, parse_body


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with RunningServer(getattr(request, "param", Behaviour())) as running:
        yield running


async def isolation_of(server: RunningServer, **overrides: object) -> tuple[ProbeStatus, str, list[object]]:
    report: CanaryReport = await run_suite(server.url, spec(**overrides).only([ProbeName.ISOLATION]),
                                           metrics_urls=[server.metrics_url])  # fmt: skip
    found = report.probe(ProbeName.ISOLATION)
    assert found is not None
    return found.status, found.reason, list(found.evidence)


@pytest.mark.parametrize(
    ("server", "field"),
    [
        (Behaviour(leak_nonce_into="reasoning"), "reasoning_content"),
        (Behaviour(leak_nonce_into="tool_calls"), "tool_calls"),
        (Behaviour(leak_nonce_into="logprobs"), "logprobs"),
    ],
    indirect=["server"],
)
async def test_a_nonce_in_a_field_beside_the_text_fails_isolation(server: RunningServer, field: str) -> None:
    """The text every probe compares is right; the other tenant's secret is in a field the official
    client hands the user all the same. Only the text was searched: a PASS."""
    status, reason, evidence = await isolation_of(server)
    assert status == ProbeStatus.FAIL, reason
    assert "secret nonce" in reason
    leaks = [e for e in evidence if getattr(e, "kind", "") == "nonce_leak"]
    assert leaks and all(leak.nonce in leak.output for leak in leaks)  # type: ignore[attr-defined]
    assert any("outside the answer's text" in leak.output and field in leak.output for leak in leaks)  # type: ignore[attr-defined]


@pytest.mark.parametrize("server", [Behaviour(leak_nonce_into="decoy_text")], indirect=True)
async def test_chat_is_read_from_its_message_not_a_stray_text_field(server: RunningServer) -> None:
    status, reason, _ = await isolation_of(server)
    assert status == ProbeStatus.FAIL, reason
    assert "(chat" in reason and "secret nonce" in reason


def test_a_chat_choice_reads_as_the_openai_client_reads_it() -> None:
    decoy = {"choices": [{"index": 0, "text": "right", "message": {"content": "what the user sees"}, "finish_reason": "stop"}]}
    assert parse_body(decoy).text == "what the user sees"
    delta = {"choices": [{"index": 0, "text": "right", "delta": {"content": None}}]}
    assert parse_body(delta).text == ""  # a chunk with no content carries no text, whatever `text` says
    assert parse_body({"choices": [{"index": 0, "text": "plain"}]}).text == "plain"


@pytest.mark.parametrize("server", [Behaviour(duplicate_list_choice=True)], indirect=True)
async def test_an_extra_choice_with_a_repeated_index_fails_isolation(server: RunningServer) -> None:
    """The leaked choice came first, the right one with the same index after it: the dict of texts
    by index kept the right one, and the leak was never read."""
    status, reason, _ = await isolation_of(server, isolation={"tenants": 3})
    assert status == ProbeStatus.FAIL, reason
    assert "two choices carry index 0" in reason or "secret nonce" in reason


def test_choice_texts_refuses_a_repeated_index_and_the_prompt_list_an_index_not_asked_for() -> None:
    twice = {"choices": [{"index": 0, "text": "a"}, {"index": 0, "text": "b"}]}
    assert choice_texts(twice) == ({}, "two choices carry index 0")
    assert choice_texts({"choices": [{"text": "a"}, {"text": "b"}]}) == ({0: "a", 1: "b"}, None)


@pytest.mark.parametrize("server", [Behaviour(leak_when_sampled=True)], indirect=True)
async def test_a_leak_only_sampled_requests_show_fails_isolation(server: RunningServer) -> None:
    status, reason, _ = await isolation_of(server)
    assert status == ProbeStatus.FAIL, reason
    assert "sampled" in reason and "secret nonce" in reason


@pytest.mark.parametrize(
    "server",
    [Behaviour(transient_at=at, transient=kind) for kind in ("429", "503", "close") for at in (4, 20)],
    indirect=True,
    ids=[f"{kind}-at-{at}" for kind in ("429", "503", "close") for at in (4, 20)],
)
async def test_one_not_now_answer_does_not_fail_a_healthy_server(server: RunningServer) -> None:
    """A router starting or draining answers 503; a gateway 429; a proxy closes an idle keep-alive
    connection. Each failed the whole run of a healthy server once (determinism, over-length);
    the official clients ask again, and so does the suite now."""
    report = await run_suite(server.url, spec(), metrics_urls=[server.metrics_url])
    assert server.engine.generation_requests > 20  # the blip happened inside the run
    assert report.verdict == Verdict.PASS, [(p.name, p.reason) for p in report.probes if p.status == ProbeStatus.FAIL]


def test_what_is_asked_again_and_after_how_long() -> None:
    def outcome(status: int | None, error: str | None = None, retry_after: float | None = None) -> Completion:
        return Completion(label="x", status=status, error=error, retry_after_header=retry_after)

    assert outcome(503).retry_after(0) == 0.5 and outcome(429).retry_after(1) == 1.0
    assert outcome(503, retry_after=2).retry_after(0) == 2 and outcome(429, retry_after=3600).retry_after(0) == RETRY_AFTER_CAP_S
    assert outcome(None, "ServerDisconnectedError: Server disconnected").retry_after(0) == 0.5
    assert outcome(503).retry_after(2) is None  # twice at most, as the OpenAI clients
    # A caught stale read (500 kv_tag_violation), a failed transfer (502), a timeout: answers, not blips.
    for kept in (outcome(500), outcome(502), outcome(None, "timed out after 20 s"), outcome(400), outcome(200)):
        assert kept.retry_after(0) is None
