"""A server that refuses the `seed` field (an OpenAI-compatible server without seed support).

The canary sends `seed` with every greedy request. A server that refuses it (a 400 or 422 about the
field) is asked once more without it, and the client remembers: its later requests carry no seed.
No probe compares sampled answers across runs, so nothing is left unchecked, and the report says
so. A real fault on such a server still fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import pytest
from test_canary_adversarial_servers import run, spec
from test_canary_fakes import Behaviour, RunningServer

from kvguard.cli import main as cli_main
from kvguard.operator.canary import CanaryReport, ProbeName, ProbeStatus, Verdict, responses, run_suite
from kvguard.operator.canary.client import EngineClient

SEED_NOTE = "refuses `seed`"
NOTHING_LEFT = "nothing is left unchecked"


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with RunningServer(getattr(request, "param", Behaviour())) as running:
        yield running


def probe(report: CanaryReport, name: ProbeName):  # type: ignore[no-untyped-def]
    found = report.probe(name)
    assert found is not None, f"{name} missing"
    return found


# Which answers refuse the seed -------------------------------------------------------------------


def _error(message: str, param: object = None) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}})


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, _error("Unsupported parameter: 'seed' is not supported with this model.", "seed")),
        (400, _error("whatever the words", "seed")),
        (400, _error("Unrecognized request argument supplied: seed")),
        (400, json.dumps({"object": "error", "message": "'seed' is not a supported parameter", "param": None, "code": 400})),
        (400, json.dumps({"error": "the seed parameter is not supported by this server"})),
        (400, _error("Failed to deserialize the JSON body: unknown field `seed`, expected one of `model`, `prompt`")),
        (400, _error("[{'type': 'extra_forbidden', 'loc': ('body', 'seed'), 'msg': 'Extra inputs are not permitted'}]")),
        (400, _error("seed must be between 0 and 4294967295")),
        (422, json.dumps({"detail": [{"type": "extra_forbidden", "loc": ["body", "seed"], "msg": "Extra inputs are not permitted",
                                      "input": 1234}]})),  # fmt: skip
        (422, json.dumps({"detail": "this server does not support seed"})),
    ],
)
def test_a_refusal_of_the_seed_is_recognised(status: int, body: str) -> None:
    words = responses.seed_refusal(status, body)
    assert words is not None and "\n" not in words


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # another field's refusal, whatever else its message says
        (400, _error("max_tokens must be at most 16; seed must be set too", "max_tokens")),
        (400, _error("n must be 1 when using greedy sampling")),
        (400, _error("The input (600 tokens) is longer than the model's context length (512 tokens).")),
        # the word in passing, not as the parameter refused
        (400, _error("prompt rejected: 'the seed grows into a tree'")),
        (400, _error("random_seed is not supported")),
        # a validation error about another field echoes the request, seed included
        (422, json.dumps({"detail": [{"type": "missing", "loc": ["body", "messages"], "msg": "Field required",
                                      "input": {"model": "m", "seed": 1234}}]})),  # fmt: skip
        (422, json.dumps({"detail": [{"type": "extra_forbidden", "loc": ["body", "seed"], "msg": "Extra inputs are not permitted"},
                                     {"type": "missing", "loc": ["body", "prompt"], "msg": "Field required"}]})),  # fmt: skip
        (400, _error("[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', 'input': {'seed': 1234}}]")),
        # not a refusal of the request's shape at all
        (500, _error("Unsupported parameter: 'seed'", "seed")),
        (503, _error("seed is not supported")),
        (200, json.dumps({"choices": [{"text": "seed is not supported", "finish_reason": "length"}]})),
        (400, "seed is not supported"),  # not JSON: no shape says what was refused
    ],
)
def test_other_refusals_are_not_read_as_the_seeds(status: int, body: str) -> None:
    assert responses.seed_refusal(status, body) is None


# A healthy server that refuses the seed passes, with the note --------------------------------------


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="param")], indirect=True)
async def test_a_seed_refusing_healthy_server_passes_the_whole_suite_with_a_note(server: RunningServer) -> None:
    report = await run(server, spec())
    assert report.verdict == Verdict.PASS, [(p.name.value, p.status.value, p.reason) for p in report.probes]
    assert probe(report, ProbeName.DETERMINISM).status == ProbeStatus.PASS  # greedy answers still compared
    assert probe(report, ProbeName.ISOLATION).status == ProbeStatus.PASS
    assert report.target.seed_refused_by == [server.url]
    [note] = report.target.notes
    assert SEED_NOTE in note and "is not supported with this model" in note and NOTHING_LEFT in note
    # Refused once (the first generation), asked again without it, and never sent again.
    assert server.engine.seeded_requests == 1
    assert server.engine.generation_requests > 20


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="message", flat_errors=True), Behaviour(refuse_seed="detail")],
                         indirect=True)  # fmt: skip
async def test_each_shape_of_refusal_is_retried_once_without_the_seed(server: RunningServer) -> None:
    report = await run(server, spec().only([ProbeName.DETERMINISM, ProbeName.ISOLATION]))
    assert report.verdict == Verdict.PASS, report.reason
    assert report.target.seed_refused_by == [server.url] and SEED_NOTE in report.target.notes[0]
    assert server.engine.seeded_requests == 1


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="param")], indirect=True)
def test_the_table_and_json_show_the_note(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["canary", "--url", server.url, "--probes", "determinism"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("  note:") and SEED_NOTE in line]
    assert len(notes) == 1 and NOTHING_LEFT in notes[0], out
    assert cli_main(["canary", "--url", server.url, "--probes", "determinism", "-o", "json"]) == 0
    target = json.loads(capsys.readouterr().out)["target"]
    assert target["seedRefusedBy"] == [server.url]
    assert len(target["notes"]) == 1 and SEED_NOTE in target["notes"][0]


async def test_a_baseline_that_refuses_the_seed_is_still_compared() -> None:
    """Per server: the baseline refusing the seed changes nothing the target is sent, and golden
    still compares the two's greedy text."""
    with RunningServer(Behaviour()) as target, RunningServer(Behaviour(refuse_seed="param")) as baseline:
        report = await run_suite(target.url, spec().only([ProbeName.GOLDEN]), baseline_url=baseline.url)
        golden = probe(report, ProbeName.GOLDEN)
        assert golden.status == ProbeStatus.PASS, golden.reason
        assert report.target.seed_refused_by == [baseline.url]
        assert "the baseline" in report.target.notes[0] and SEED_NOTE in report.target.notes[0]
        assert baseline.engine.seeded_requests == 1
        assert target.engine.seeded_requests == target.engine.generation_requests > 0


# A real fault on a seed-refusing server still fails -------------------------------------------------


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="param", leak_nonce_on="stream")], indirect=True)
async def test_a_seed_refusing_server_that_leaks_fails_isolation(server: RunningServer) -> None:
    report = await run(server, spec().only([ProbeName.DETERMINISM, ProbeName.ISOLATION]))
    isolation = probe(report, ProbeName.ISOLATION)
    assert report.verdict == Verdict.FAIL and isolation.status == ProbeStatus.FAIL, isolation.reason
    assert "secret nonce" in isolation.reason
    assert any(e.kind == "nonce_leak" for e in isolation.evidence)
    assert server.engine.seeded_requests == 1


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="leaky")], indirect=True)
async def test_the_answer_that_refused_seed_is_observed_too(server: RunningServer) -> None:
    """Every answer is searched for other tenants' nonces (the suite's observer), the refused
    attempt's too (a review: only the attempt sent again without `seed` was). Here a server that
    echoes another tenant's input in its refusal: a client still sending seeds meets it."""
    heard: list[str] = []
    tenant_a, tenant_b = "tenant a writes 0123456789abcdef", "tenant b writes fedcba9876543210"
    async with aiohttp.ClientSession() as session:
        first = EngineClient(session, server.url, model="fake-model")
        assert (await first.complete(tenant_a, max_tokens=4)).ok  # refused, then served without seed
        second = EngineClient(session, server.url, model="fake-model")
        second.observer = lambda prompt, result: heard.append(result.body)
        answer = await second.complete(tenant_b, max_tokens=4)
    assert answer.ok and second.seed_refused is not None
    assert any("0123456789abcdef" in body for body in heard), heard  # tenant A's nonce, in B's refusal


@pytest.mark.parametrize("server", [Behaviour(refuse_seed="message", nondeterministic=True)], indirect=True)
async def test_a_seed_refusing_server_whose_greedy_output_varies_fails_determinism(server: RunningServer) -> None:
    report = await run(server, spec().only([ProbeName.DETERMINISM]))
    determinism = probe(report, ProbeName.DETERMINISM)
    assert determinism.status == ProbeStatus.FAIL and "differ from run 1" in determinism.reason, determinism.reason
    assert report.target.seed_refused_by == [server.url]


# Other refusals are not retried ---------------------------------------------------------------------


@pytest.mark.parametrize("server", [Behaviour(refuse_n=True, refuse_n_message="param n must be 1 when seed is set")],
                         indirect=True)  # fmt: skip
async def test_a_refusal_that_names_seed_in_passing_is_not_taken_for_a_seed_refusal(server: RunningServer) -> None:
    """A review: words that name seed in passing read as a seed refusal, so the client dropped the
    seed for the run and the report said the server refused it. The answer without `seed` is the
    same refusal: that answer stands, and later requests still carry the seed."""
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, server.url, model="fake-model")
        answer, _ = await client.complete_list(["one", "two"], max_tokens=4, label="prompt list", n=2)
        assert answer.status == 400 and client.seed_refused is None and answer.seed_refused_by is None
        again = await client.complete("three", max_tokens=4)
        assert again.ok and server.engine.seeded_requests == 2  # the first request's and this one's


@pytest.mark.parametrize("server", [Behaviour(refuse_n=True)], indirect=True)
async def test_a_refusal_of_another_field_is_not_retried_without_the_seed(server: RunningServer) -> None:
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, server.url, model="fake-model")
        answer, _ = await client.complete_list(["one", "two"], max_tokens=4, label="prompt list", n=2)
        assert answer.status == 400 and answer.retried == []
        assert client.seed_refused is None
        assert server.engine.seeded_requests == server.engine.generation_requests == 1
        again = await client.complete("three", max_tokens=4)
        assert again.ok and server.engine.seeded_requests == 2  # the seed is still sent
