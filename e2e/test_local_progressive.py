"""Progressive delivery on the local backend, with live traffic on one URL (#17).

Real worker processes, the real driver and canary, the local splitter (workers/splitter.py) in
front of the revisions' routers, and clients (the official openai client) that keep sending
requests to the model's one URL for the whole story. Each response says which revision served it
(`x-kvguard-revision`), so the scenarios check what users saw, not only what the status says:

1. the first rollout: the splitter's URL is the model's URL;
2. steps 10/50/100 with analysis passing: every request answered, the candidate served some at
   the steps before it took everything, the URL never moved;
3. `kvguard.io/rollback-to` the previous revision within the scale-down window is immediate: its
   processes still run (same PIDs), no canary, no new process;
4. the incident's build (`unsafe_reject_path,no_tags`) is caught before the second step (here by
   the canary, before the first: no user request ever reaches it);
5. a candidate that fails live traffic (`fail_proxied_requests`: it answers 500 to what arrives
   through the splitter, while the canary's direct probes pass) is aborted at 10% by the error
   ratio; all traffic is back on the stable revision, whose processes were never touched;
6. a stable decode worker restarted with a smaller pool is kept out of rotation by the router's
   pool check (S7 while it serves): every request is answered, none by that worker; the model's
   status (as the driver records it, and `kvguard status --local`) says Degraded naming it, and
   clears once it is back with its planned pool.

Local only: on a cluster the same steps are an HTTPRoute's weights, checked against the upstream
schema with the real operator in tests/test_progressive_kmock.py.
Durations: analysis every second, pauses of a second; a slow machine makes a step hold longer
(an inconclusive window holds), never makes a scenario fail.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import yaml
from harness import NAME
from harness_local import MAX_SECONDS, LocalHarness
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from kvguard.commands.status import measure_local
from kvguard.operator.api import InferenceModel
from kvguard.operator.backends.local import LocalBackend, StateStore
from kvguard.operator.backends.local_rollout import RolloutResult, roll_out
from kvguard.operator.rollout import ROLLBACK_ANNOTATION, RolloutState
from kvguard.workers.splitter import REVISION_HEADER

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
STEPS = [{"weight": 10, "pause": "1s"}, {"weight": 50, "pause": "1s"}, {"weight": 100}]
PROMPT = "The capital of France is"


def body_at(harness: LocalHarness, version: str, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": NAME}
    spec = body["spec"]
    spec["model"]["source"] = harness.model_source(0)
    spec["engine"]["version"] = version
    spec["rollout"] = {
        "trafficRouter": "gatewayAPI",
        "gateway": {"parentRefs": [{"name": "not-used-locally"}]},
        "steps": steps or [{"weight": 100}],
        # Latency against stable is measured, with a bound no honest candidate on a shared
        # 2-core machine can break; errors and safety counters keep their strict defaults.
        "analysis": {"intervalSeconds": 1, "minRequests": 3, "ttft": {"maxRatioToStable": 1000}, "itl": {"maxRatioToStable": 1000}},
        "scaleDownDelaySeconds": 3600,  # the old revision stays up: rollback-to it is instant (scenario 3)
    }
    return body


class Traffic:
    """Clients on the model's one URL while a rollout runs; who served each request, and how."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.answers: list[tuple[str | None, int]] = []
        """(revision that served it, HTTP status; 0 = no connection) per request, in order."""
        self.connection_errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)
        while not self._stop.is_set():
            try:
                raw = client.completions.with_raw_response.create(model="kvguard/tiny-random", prompt=PROMPT, max_tokens=4, temperature=0)
                raw.parse()
                answer = (raw.headers.get(REVISION_HEADER), raw.status_code)
            except openai.APIStatusError as exc:
                answer = (exc.response.headers.get(REVISION_HEADER), exc.status_code)
            except openai.APIConnectionError as exc:
                answer = (None, 0)
                self.connection_errors.append(repr(exc.__cause__ or exc))
            with self._lock:
                self.answers.append(answer)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        wait_for(lambda: len(self.answers) >= 3, "the first answers through the splitter", MAX_SECONDS)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)

    def by(self, revision: str | None) -> list[int]:
        with self._lock:
            return [status for served, status in self.answers if served == revision]


class Story:
    """One model rolled through the scenarios on one state folder (and one URL)."""

    def __init__(self, harness: LocalHarness) -> None:
        self.harness = harness

    def apply(self, body: dict[str, Any], faults: str = "") -> RolloutResult:
        model = InferenceModel.model_validate(body)
        with LocalBackend(self.harness.state_dir, models_root=self.harness.root) as backend:
            rolling = roll_out(backend, NAME, model.spec, faults=faults, annotations=model.metadata.annotations,
                               say=self.harness.log.append, max_seconds=MAX_SECONDS)  # fmt: skip
            return asyncio.run(rolling)

    def weights(self) -> dict[str, int]:
        return dict(self.harness.state()["weights"])

    def stable(self) -> Stable:
        state = self.harness.state()
        return Stable(state["status"]["revision"], f"http://127.0.0.1:{state['splitter']['port']}/v1")


@dataclass(frozen=True)
class Stable:
    revision: str
    url: str


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    harness = LocalHarness.with_tiny_models(tmp_path_factory.mktemp("e2e-progressive"))
    try:
        yield Story(harness)
    finally:
        harness.close()


@pytest.fixture(scope="module")
def first(story: Story) -> RolloutResult:
    result = story.apply(body_at(story.harness, "0.1.0"))
    assert result.promoted and result.serving_url, story.harness.log
    return result


@pytest.fixture(scope="module")
def stepped(story: Story, first: RolloutResult) -> tuple[RolloutResult, Traffic]:
    assert first.serving_url is not None
    with Traffic(first.serving_url) as traffic:
        result = story.apply(body_at(story.harness, "0.2.0", STEPS))
    return result, traffic


def test_steps_10_50_100_with_analysis_pass_on_one_url(story: Story, first: RolloutResult, stepped: tuple[RolloutResult, Traffic]) -> None:
    result, traffic = stepped
    assert result.promoted, story.harness.log
    assert result.serving_url == first.serving_url  # the client's URL never moved
    steps = [e.message for e in result.events if e.reason == "TrafficStep"]
    assert [s.split(" gets ")[1].split("%")[0] for s in steps] == ["10", "50", "100"], steps
    assert any(e.reason == "AnalysisPassed" for e in result.events)
    assert {r.name for r in result.status.rollout.analysis} >= {"safety", "errorRatio", "ttft", "itl"}  # type: ignore[union-attr]
    assert all(r.phase == "Successful" for r in result.status.rollout.analysis), result.status.rollout.analysis  # type: ignore[union-attr]
    # What the clients saw: every request answered, by one revision or the other, never refused.
    assert {status for _, status in traffic.answers} == {200}, traffic.connection_errors[:3]
    assert traffic.by(first.revision) and traffic.by(result.revision)
    assert story.weights() == {result.revision: 100}
    assert not story.harness.revision_stopped(first.revision)  # kept warm for scaleDownDelaySeconds


def test_rollback_to_within_the_scale_down_window_is_immediate(story: Story, first: RolloutResult, stepped: tuple[RolloutResult, Traffic]) -> None:
    stable = stepped[0]
    assert stable.serving_url is not None
    warm = story.harness.pids(first.revision)
    assert all(warm.values()), warm  # the previous revision still runs (scaleDownDelaySeconds)
    body = body_at(story.harness, "0.2.0", STEPS)
    body["metadata"]["annotations"] = {ROLLBACK_ANNOTATION: first.revision}
    with Traffic(stable.serving_url) as traffic:
        result = story.apply(copy.deepcopy(body))
        settled = len(traffic.answers) + 3  # (a request of each client may have been in flight at the switch)
        wait_for(lambda: len(traffic.answers) >= settled + 10, "10 more answers after the rollback", MAX_SECONDS)
    assert result.state == RolloutState.STABLE and result.stable == first.revision, story.harness.log
    assert story.harness.pids(first.revision) == warm  # no new process: the same ones serve again
    assert not result.canary_reports and not [e for e in result.events if e.reason == "TrafficStep"]
    assert all(a == (first.revision, 200) for a in traffic.answers[settled:])
    assert result.serving_url == first.serving_url and story.weights() == {first.revision: 100}


def test_the_incident_build_is_caught_before_the_second_step(story: Story, first: RolloutResult) -> None:
    stable = story.stable()
    before = story.harness.pids(stable.revision)
    with Traffic(stable.url) as traffic:
        result = story.apply(body_at(story.harness, "0.3.0-incident-build", STEPS), faults="unsafe_reject_path,no_tags")
    assert result.state == RolloutState.ROLLED_BACK and result.stable == stable.revision, story.harness.log
    assert result.serving_url == first.serving_url
    assert not [e for e in result.events if e.reason == "TrafficStep" and "step 2 of" in e.message]
    assert result.canary_reports[result.revision].verdict.value == "fail"
    assert traffic.by(result.revision) == []  # caught by the canary: no user request reached it
    assert set(traffic.by(stable.revision)) == {200} and len(traffic.by(None)) == 0
    assert story.harness.pids(stable.revision) == before and story.weights().get(stable.revision) == 100


def test_a_candidate_failing_live_traffic_is_aborted_at_10_percent(story: Story, first: RolloutResult) -> None:
    stable = story.stable()
    before = story.harness.pids(stable.revision)
    with Traffic(stable.url) as traffic:
        result = story.apply(body_at(story.harness, "0.4.0-fails-live", STEPS), faults="fail_proxied_requests")
        settled = len(traffic.answers) + 3  # (a request of each client may have been in flight at the abort)
        wait_for(lambda: len(traffic.answers) >= settled + 20, "20 more answers after the abort", MAX_SECONDS)
    assert result.state == RolloutState.ROLLED_BACK and result.stable == stable.revision, story.harness.log
    assert result.canary_reports[result.revision].verdict.value == "pass"  # the canary's direct probes passed
    steps = [e.message for e in result.events if e.reason == "TrafficStep"]
    assert len(steps) == 1 and "gets 10% of traffic" in steps[0], steps
    assert "failed its analysis at 10% of traffic" in (result.status.rollout.message or ""), result.status.rollout  # type: ignore[union-attr]
    error_ratio = next(r for r in result.status.rollout.analysis if r.name == "errorRatio")  # type: ignore[union-attr]
    assert error_ratio.phase == "Failed" and error_ratio.value == 1.0
    assert set(traffic.by(result.revision)) == {500}  # what the 10% saw
    after_abort = traffic.answers[settled:]
    assert after_abort and all(a == (stable.revision, 200) for a in after_abort)  # all back on stable
    assert story.harness.pids(stable.revision) == before and story.weights()[stable.revision] == 100
    assert result.serving_url == first.serving_url


def test_a_stable_worker_restarted_with_a_smaller_pool_is_kept_out_of_rotation_s7(story: Story, first: RolloutResult) -> None:
    """The incident's sizing bug arriving without a spec change: a serving decode worker restarts
    where it gets a smaller pool (here its recorded command line is edited, as a node with less
    memory would size it). The router's pool check keeps it out; users are served by the other."""
    body = body_at(story.harness, "0.1.0")
    body["spec"]["roles"]["decode"]["replicas"] = 2  # resized in place: two decode workers serve
    resized = story.apply(body)
    stable = story.stable()
    assert resized.stable == stable.revision and resized.resized, story.harness.log
    victim = next(w for w in story.harness.state()["revisions"][stable.revision]["workers"] if w["name"] == "decode-1")
    full_pool = _restart_with_pool(story, stable.revision, "decode-1", "1024")  # 1x the 1,024-token context: below 2x
    healed = story.apply(body)  # the next pass restarts the dead worker, as a Deployment would
    assert healed.state == RolloutState.STABLE and healed.stable == stable.revision, story.harness.log
    decode = {w["name"]: w for w in story.harness.state()["revisions"][stable.revision]["workers"] if w["role"] == "decode"}
    assert decode["decode-1"]["pid"] != victim["pid"] and decode["decode-1"]["restarts"] >= 1
    # The status the driver recorded says Degraded, naming the worker by role, port and PID, as the
    # operator's names the pod and node (the same rule: pool_gate.judge, reconcile.pool_gate_degraded).
    small = f"{NAME}-{stable.revision}-decode-1 (decode, revision {stable.revision}) on node local:{decode['decode-1']['port']} (pid {decode['decode-1']['pid']})"
    recorded = _degraded(healed.status.model_dump(by_alias=True))
    assert recorded["status"] == "True" and recorded["reason"] == "PodKVPoolTooSmall" and small in recorded["message"], recorded
    assert "kept out of rotation" in recorded["message"] and "decode-0" not in recorded["message"]
    wait_for(lambda: "Degraded=True" in _status_text(story) and small in _status_text(story),
             "`kvguard status --local` to show Degraded naming decode-1", MAX_SECONDS)  # fmt: skip
    router = next(w for w in story.harness.state()["revisions"][stable.revision]["workers"] if w["name"] == "router")
    wait_for(lambda: _sample(router["metrics_port"], "kvguard_router_workers_kept_out", role="decode") == 1,
             "the router to keep decode-1 out of rotation", MAX_SECONDS)  # fmt: skip
    served_before = {n: _sample(w["metrics_port"], "kvguard_requests_total") for n, w in decode.items()}
    with Traffic(stable.url) as traffic:
        wait_for(lambda: len(traffic.answers) >= 30, "30 answers", MAX_SECONDS)
    assert {status for _, status in traffic.answers} == {200}, traffic.connection_errors[:3]
    served = {n: _sample(w["metrics_port"], "kvguard_requests_total") - served_before[n] for n, w in decode.items()}
    assert served["decode-1"] == 0 and served["decode-0"] >= 30, served  # no request reached the small worker
    measured = asyncio.run(measure_local(StateStore(story.harness.state_dir).load()))
    pools = {p.pod.removeprefix(f"{NAME}-{stable.revision}-"): p for p in measured if p.revision == stable.revision}
    assert pools["decode-1"].reason == "KVPoolTooSmall" and pools["decode-0"].verified  # what `kvguard status --local` shows

    # Back with the planned pool (restarted where it fits again): Degraded clears, it serves again.
    _restart_with_pool(story, stable.revision, "decode-1", full_pool)
    back = story.apply(body)
    assert back.state == RolloutState.STABLE and back.stable == stable.revision, story.harness.log
    cleared = _degraded(back.status.model_dump(by_alias=True))
    assert cleared["status"] == "False" and cleared["reason"] == "AsExpected", cleared
    assert all(p.verified for p in back.status.pools if p.revision == stable.revision), back.status.pools
    wait_for(lambda: "Degraded=False" in _status_text(story), "`kvguard status --local` to show Degraded=False", MAX_SECONDS)
    wait_for(lambda: _sample(router["metrics_port"], "kvguard_router_workers_kept_out", role="decode") == 0,
             "the router to take decode-1 back into rotation", MAX_SECONDS)  # fmt: skip


def _restart_with_pool(story: Story, revision: str, name: str, pool: str) -> str:
    """Kill worker `name` and edit its recorded command line to `pool` KV tokens (as a node with
    another amount of memory would size it); the next pass restarts it. Returns the pool it had."""
    victim = next(w for w in story.harness.state()["revisions"][revision]["workers"] if w["name"] == name)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{victim['pid']}").exists() or _zombie(victim["pid"]), f"{name} to exit", MAX_SECONDS)
    state = story.harness.state()
    worker = next(w for w in state["revisions"][revision]["workers"] if w["name"] == name)
    at = worker["argv"].index("--kv-pool-tokens")
    before, worker["argv"][at + 1] = worker["argv"][at + 1], pool
    (story.harness.state_dir / "state.json").write_text(json.dumps(state))
    return str(before)


def _degraded(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c["type"] == "Degraded")


def _status_text(story: Story) -> str:
    """What `kvguard status --local` prints now (its view, run in-process)."""
    from kvguard.commands.status import _local_view

    return str(_local_view(story.harness.state_dir, NAME)())


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


def _sample(metrics_port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a worker's /metrics (those matching `labels`)."""
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip
