"""The canary against an engine we did not write: `transformers serve` on the tiny model folder.

The healthy peer (behind the fault proxy's admission check, see `peer_harness`) passes every probe
that applies, with no false alarm; the bare peer passes everything except over-length, which it
really does answer with HTTP 200 and tokens; each fault-proxy mode fails, and the failure names
the bug. Its greedy outputs agree with `kvguard serve` token for token (golden with a baseline).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from peer_harness import FaultProxy, PeerServer, proxied, transformers_serve_available

from kvguard.cli import main as cli_main
from kvguard.operator.canary import CanaryReport, CanarySpec, ProbeName, ProbeStatus, Verdict, run_suite

CONTEXT = 1024
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_unavailable = transformers_serve_available()
if _unavailable:
    pytest.skip(f"no peer: {_unavailable}", allow_module_level=True)


@pytest.fixture(scope="module")
def peer(tiny_model_dir: Path) -> Iterator[PeerServer]:
    with PeerServer(tiny_model_dir) as server:
        yield server


def suite(url: str, metrics: list[str], **kwargs: object) -> CanaryReport:
    return asyncio.run(run_suite(url, CanarySpec(), metrics_urls=metrics, context_length=CONTEXT, **kwargs))  # type: ignore[arg-type]


def statuses(report: CanaryReport) -> dict[str, str]:
    return {p.name.value: p.status.value for p in report.probes}


def reason(report: CanaryReport, probe: ProbeName) -> str:
    result = report.probe(probe)
    assert result is not None
    return result.reason


def test_healthy_peer_passes_every_probe_that_applies(peer: PeerServer, tiny_model_dir: Path) -> None:
    with proxied(peer, tiny_model_dir, CONTEXT, "healthy") as proxy:
        report = suite(proxy.url, [proxy.metrics_url])
    assert report.verdict == Verdict.PASS, report.to_json()
    assert statuses(report) == {
        "capacity": "pass", "golden": "skipped", "determinism": "pass", "over_length": "pass",
        "isolation": "pass", "abort": "pass", "safety_counters": "skipped",
    }  # fmt: skip
    assert report.target.context_length == CONTEXT and report.target.context_length_source == "--context-length"
    # 3 cases and the 2 sized from the peer's usage, on both endpoints, streamed and not
    assert "20 over-length requests rejected" in reason(report, ProbeName.OVER_LENGTH)
    assert "prompt just over the context length" in reason(report, ProbeName.OVER_LENGTH)
    assert f"context {CONTEXT:,} (--context-length)" in reason(report, ProbeName.ISOLATION)
    assert "no baseline URL" in reason(report, ProbeName.GOLDEN)  # says why, claims nothing
    assert "none of the configured counters is exposed" in reason(report, ProbeName.SAFETY_COUNTERS)
    assert "pool usage not checked" in reason(report, ProbeName.ABORT)


def test_bare_peer_streams_without_done_pass_and_its_missing_admission_is_caught(peer: PeerServer) -> None:
    """transformers serve ends streams with a finish chunk and no [DONE] (the old client called that
    'closed early'); it also answers over-length prompts with 200 and tokens, which is a real finding."""
    raw = requests.post(f"{peer.url}/v1/completions", json={"model": peer.model, "prompt": "hi", "max_tokens": 3, "stream": True}, timeout=30)
    assert "[DONE]" not in raw.text and '"finish_reason":"length"' in raw.text.replace(" ", "")
    report = suite(peer.url, [])
    assert statuses(report)["determinism"] == "pass" and statuses(report)["isolation"] == "pass", report.to_json()
    assert statuses(report)["over_length"] == "fail"
    assert "accepted with HTTP 200" in reason(report, ProbeName.OVER_LENGTH)
    assert report.failed_probes() == [ProbeName.OVER_LENGTH]


FAULTS = [
    ("over_length_accepted", ProbeName.OVER_LENGTH, "accepted with HTTP 200"),
    ("spliced_content", ProbeName.ISOLATION, "secret nonce"),
    ("stream_no_finish", ProbeName.DETERMINISM, "stream cut short"),
    ("abort_as_length", ProbeName.DETERMINISM, "sglang#33507"),
    ("nondeterministic", ProbeName.DETERMINISM, "differ from run 1"),
    ("pool_below_ratio", ProbeName.CAPACITY, "1.50 x context length 1024"),
]


@pytest.mark.parametrize(("mode", "probe", "named"), FAULTS, ids=[f[0] for f in FAULTS])
def test_every_fault_mode_fails_naming_the_bug(peer: PeerServer, tiny_model_dir: Path, mode: str, probe: ProbeName, named: str) -> None:
    with proxied(peer, tiny_model_dir, CONTEXT, mode) as proxy:
        report = suite(proxy.url, [proxy.metrics_url])
    assert report.verdict == Verdict.FAIL
    result = report.probe(probe)
    assert result is not None and result.status == ProbeStatus.FAIL, report.to_json()
    assert named in result.reason, result.reason


def test_cli_with_context_length_runs_every_probe_that_needs_no_metrics(peer: PeerServer, tiny_model_dir: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with FaultProxy(peer.url, tiny_model_dir, CONTEXT) as proxy:
        code = cli_main(["canary", "--url", proxy.url, "--context-length", str(CONTEXT)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[:1] and line.split()[0] in {p.value for p in ProbeName}}
    assert {rows[p] for p in ("determinism", "over_length", "isolation", "abort")} == {"pass"}, out
    assert rows["capacity"] == rows["safety_counters"] == "skipped"
    assert f"context {CONTEXT:,} tokens (--context-length)" in out
    assert "engine not recognised (no engine metrics)" in out and "unknown" not in out


@pytest.fixture(scope="module")
def kvguard_serve(tiny_model_dir: Path) -> Iterator[str]:
    from pd_harness import deployment

    with deployment(tiny_model_dir, context_length=CONTEXT) as running:
        yield running.api_base


PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def fibonacci(n):"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_peer_agrees_with_kvguard_serve_token_for_token(peer: PeerServer, kvguard_serve: str, api: str) -> None:
    ours = requests.get(f"{kvguard_serve}/models", timeout=10).json()["data"][0]["id"]
    for prompt in PROMPTS:
        texts = []
        for base, model in ((f"{peer.url}/v1", peer.model), (kvguard_serve, ours)):
            body: dict[str, object] = {"model": model, "max_tokens": 32, "temperature": 0}
            body.update({"messages": [{"role": "user", "content": prompt}]} if api == "chat" else {"prompt": prompt})
            answer = requests.post(f"{base}/{'chat/completions' if api == 'chat' else 'completions'}", json=body, timeout=60).json()
            choice = answer["choices"][0]
            texts.append(choice["message"]["content"] if api == "chat" else choice["text"])
            assert answer["usage"]["completion_tokens"] == 32
        assert texts[0] == texts[1], (prompt, texts)


def test_golden_probe_with_kvguard_serve_as_baseline_passes(peer: PeerServer, tiny_model_dir: Path, kvguard_serve: str) -> None:
    with FaultProxy(peer.url, tiny_model_dir, CONTEXT) as proxy:
        report = asyncio.run(run_suite(proxy.url, CanarySpec().only([ProbeName.GOLDEN]), baseline_url=kvguard_serve, context_length=CONTEXT))
    assert report.verdict == Verdict.PASS, report.to_json()
    assert reason(report, ProbeName.GOLDEN) == "2 prompt(s): 2 output(s) equal to the baseline's"


def test_tolerant_golden_falls_back_when_a_server_rejects_logprobs(peer: PeerServer, tiny_model_dir: Path, kvguard_serve: str) -> None:
    """kvguard serve answers `logprobs` with a 400 today (the parameter is being added); the probe
    asks again without it, and equal texts need no logprobs."""
    spec = CanarySpec.model_validate({"golden": {"baselineMatch": "tolerant"}}).only([ProbeName.GOLDEN])
    with FaultProxy(peer.url, tiny_model_dir, CONTEXT) as proxy:
        report = asyncio.run(run_suite(kvguard_serve, spec, baseline_url=proxy.url, context_length=CONTEXT))
    assert report.verdict == Verdict.PASS, report.to_json()
    assert reason(report, ProbeName.GOLDEN) == "2 prompt(s): 2 output(s) equal to the baseline's"
