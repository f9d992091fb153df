"""Progressive delivery with live traffic on one URL (#17): on the local backend always, on a real
cluster when KUBECONFIG is set.

Real workers, the real driver (locally) or operator (on a cluster), the real canary, and clients
(the official openai client) that keep sending requests to the model's one URL for the whole story:
locally the splitter's (workers/splitter.py), on a cluster a Gateway's (Envoy Gateway; the
operator's HTTPRoute carries the steps' weights). Each response says which revision served it
(`x-kvguard-revision`, set by every router itself), so the scenarios check what users saw, not only
what the status says. The scenario bodies are shared (progressive.py `Story`):

1. the first rollout: the splitter's (Gateway's) URL is the model's URL;
2. steps 10/50/100 with analysis passing: every request answered, the candidate served some at
   the steps before it took everything, the URL never moved;
3. `kvguard.io/rollback-to` the previous revision within the scale-down window is immediate: its
   processes (pods) still run, the same ones, no canary, nothing new started;
4. the incident's build (`unsafe_reject_path,no_tags`) is caught before the second step (here by
   the canary, before the first: no user request ever reaches it);
5. a candidate that fails live traffic (`fail_proxied_requests`: it answers 500 to what arrives
   through a proxy, while the canary's direct probes pass) is aborted at 10% by the error ratio;
   all traffic is back on the stable revision, whose workloads were never touched;
6. S7 while a worker serves, one test per backend:
   - local: a stable decode worker restarted with a smaller pool is kept out of rotation by the
     router's pool check: every request is answered, none by that worker; the model's status (as
     the driver records it, and `kvguard status --local`) says Degraded naming it, and clears once
     it is back with its planned pool;
   - cluster: a bare Pod copying the stable decode Deployment's pod template (same labels: the
     Service selects it once Ready) but sized with a smaller pool, as a node with less memory
     would size it: the operator's readiness gate keeps `kvguard.io/kv-pool-verified` False, it
     never becomes a ready endpoint of the Service's EndpointSlices, no request reaches it,
     Degraded names the pod and its node, and clears once it is gone.

Run on a cluster (see docs/rollouts.md, "End-to-end scenarios on a cluster", and the docstrings of
harness_cluster.py and progressive_cluster.py for every variable):
    kubectl apply -k e2e/install
    kubectl apply --server-side -f https://github.com/envoyproxy/gateway/releases/download/v1.7.2/install.yaml
    kubectl apply -k e2e/install/gateway
    KUBECONFIG=... KVGUARD_E2E_WORKER_IMAGE=... .venv/bin/python -P -m pytest e2e/test_local_progressive.py -k cluster
Without KUBECONFIG or the image the cluster variant is skipped with the reason.
Durations: analysis every second, pauses of a second; a slow machine makes a step hold longer
(an inconclusive window holds), never makes a scenario fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import NAME
from harness_local import MAX_SECONDS, LocalHarness
from progressive import STEPS, LocalStory, Rolled, Story, Traffic
from progressive_cluster import ClusterStory, pod_condition, ready_endpoint_of, unavailable
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from kvguard.commands.status import measure_local
from kvguard.operator.backends.local import StateStore
from kvguard.operator.pool_gate import GATE_CONDITION
from kvguard.operator.render import METRICS_PORT
from kvguard.operator.rollout import ROLLBACK_ANNOTATION, RolloutState
from kvguard.workers.openai_api import REVISION_HEADER

pytestmark = pytest.mark.slow
CLUSTER = pytest.param("cluster", marks=[pytest.mark.cluster, pytest.mark.timeout(3600)])  # image pulls, pod starts


@pytest.fixture(scope="module", params=["local", CLUSTER])
def story(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    chosen: Story
    if request.param == "cluster":
        reason = unavailable()
        if reason:
            pytest.skip(reason)
        chosen = ClusterStory.from_env()
    else:
        chosen = LocalStory(LocalHarness.with_tiny_models(tmp_path_factory.mktemp("e2e-progressive")))
    try:
        yield chosen
    finally:
        chosen.close()


@pytest.fixture(scope="module")
def first(story: Story) -> Rolled:
    result = story.apply(story.body("0.1.0"))
    assert result.promoted and result.url, story.log
    return result


@pytest.fixture(scope="module")
def stepped(story: Story, first: Rolled) -> tuple[Rolled, Traffic]:
    assert first.url is not None
    with Traffic(first.url) as traffic:
        result = story.apply(story.body("0.2.0", STEPS))
    return result, traffic


def test_steps_10_50_100_with_analysis_pass_on_one_url(story: Story, first: Rolled, stepped: tuple[Rolled, Traffic]) -> None:
    result, traffic = stepped
    assert result.promoted, story.log
    assert result.url == first.url  # the client's URL never moved
    steps = result.reasons("TrafficStep")
    assert [s.split(" gets ")[1].split("%")[0] for s in steps] == ["10", "50", "100"], steps
    assert result.reasons("AnalysisPassed")
    assert {r.name for r in result.status.rollout.analysis} >= {"safety", "errorRatio", "ttft", "itl"}  # type: ignore[union-attr]
    assert all(r.phase == "Successful" for r in result.status.rollout.analysis), result.status.rollout.analysis  # type: ignore[union-attr]
    # What the clients saw: every request answered, by one revision or the other, never refused.
    assert {status for _, status in traffic.answers} == {200}, traffic.connection_errors[:3]
    assert traffic.by(first.revision) and traffic.by(result.revision), traffic.served()
    assert story.weights() == {result.revision: 100}
    assert not story.revision_stopped(first.revision)  # kept warm for scaleDownDelaySeconds


def test_rollback_to_within_the_scale_down_window_is_immediate(story: Story, first: Rolled, stepped: tuple[Rolled, Traffic]) -> None:
    stable = stepped[0]
    assert stable.url is not None
    warm = story.workload_ids(first.revision)
    assert warm, f"revision {first.revision} runs nothing"  # the previous revision still runs (scaleDownDelaySeconds)
    body = story.body("0.2.0", STEPS)
    body["metadata"]["annotations"] = {ROLLBACK_ANNOTATION: first.revision}
    with Traffic(stable.url) as traffic:
        result = story.apply(body)
        switched = time.monotonic()
        wait_for(lambda: len(traffic.sent_since(switched)) >= 10, "10 answers to requests sent after the rollback", MAX_SECONDS)
    assert result.state == RolloutState.STABLE and result.stable == first.revision, story.log
    assert story.workload_ids(first.revision) == warm  # nothing new started: the same ones serve again
    assert not result.canary_ran and not result.reasons("TrafficStep"), result.events
    # Every request sent once the rollback returned is the first revision's. (Counting answers
    # instead -- "3 past the switch" -- failed in CI: a request in flight at the switch can be
    # answered after several newer ones.)
    after = traffic.sent_since(switched)
    assert all(a == (first.revision, 200) for a in after), (traffic.served(), after, story.log[-8:])
    assert result.url == first.url and story.weights() == {first.revision: 100}


def test_the_incident_build_is_caught_before_the_second_step(story: Story, first: Rolled) -> None:
    stable = story.stable()
    before = story.workload_ids(stable)
    with Traffic(story.url()) as traffic:
        result = story.apply(story.body("0.3.0-incident-build", STEPS), faults="unsafe_reject_path,no_tags")
    assert result.state == RolloutState.ROLLED_BACK and result.stable == stable, story.log
    assert result.url == first.url
    assert not [m for m in result.reasons("TrafficStep") if "step 2 of" in m]
    assert result.canary_verdict == "fail", result.status.rollout
    assert traffic.by(result.revision) == []  # caught by the canary: no user request reached it
    assert set(traffic.by(stable)) == {200} and len(traffic.by(None)) == 0, traffic.served()
    assert story.workload_ids(stable) == before and story.weights().get(stable) == 100


def test_a_candidate_failing_live_traffic_is_aborted_at_10_percent(story: Story, first: Rolled) -> None:
    stable = story.stable()
    before = story.workload_ids(stable)
    with Traffic(story.url()) as traffic:
        result = story.apply(story.body("0.4.0-fails-live", STEPS), faults="fail_proxied_requests")
        aborted = time.monotonic()  # requests in flight at the abort may be answered by either side
        wait_for(lambda: len(traffic.sent_since(aborted)) >= 20, "20 answers to requests sent after the abort", MAX_SECONDS)
    assert result.state == RolloutState.ROLLED_BACK and result.stable == stable, story.log
    assert result.canary_verdict == "pass", result.status.rollout  # the canary's direct probes passed
    steps = result.reasons("TrafficStep")
    assert len(steps) == 1 and "gets 10% of traffic" in steps[0], steps
    assert "failed its analysis at 10% of traffic" in (result.status.rollout.message or ""), result.status.rollout  # type: ignore[union-attr]
    error_ratio = next(r for r in result.status.rollout.analysis if r.name == "errorRatio")  # type: ignore[union-attr]
    assert error_ratio.phase == "Failed" and error_ratio.value == 1.0
    assert set(traffic.by(result.revision)) == {500}  # what the 10% saw
    after_abort = traffic.sent_since(aborted)
    assert after_abort and all(a == (stable, 200) for a in after_abort), (traffic.served(), after_abort)  # all back on stable
    assert story.workload_ids(stable) == before and story.weights()[stable] == 100
    assert result.url == first.url


def test_a_stable_worker_restarted_with_a_smaller_pool_is_kept_out_of_rotation_s7(story: Story, first: Rolled) -> None:
    """The incident's sizing bug arriving without a spec change: a serving decode worker restarts
    where it gets a smaller pool (here its recorded command line is edited, as a node with less
    memory would size it). The router's pool check keeps it out; users are served by the other."""
    if not isinstance(story, LocalStory):
        pytest.skip("local backend: a worker process restarted with a smaller pool (the cluster variant is the next test)")
    body = story.body("0.1.0")
    body["spec"]["roles"]["decode"]["replicas"] = 2  # resized in place: two decode workers serve
    resized = story.apply(body)
    stable = Stable(story.stable(), story.url())
    assert resized.stable == stable.revision and resized.resized, story.log
    router = next(w for w in story.harness.state()["revisions"][stable.revision]["workers"] if w["name"] == "router")
    direct = requests.get(f"http://127.0.0.1:{router['port']}/v1/models", timeout=30)  # the router itself, not the splitter
    assert direct.status_code == 200 and direct.headers[REVISION_HEADER] == stable.revision
    victim = next(w for w in story.harness.state()["revisions"][stable.revision]["workers"] if w["name"] == "decode-1")
    full_pool = _restart_with_pool(story, stable.revision, "decode-1", "1024")  # 1x the 1,024-token context: below 2x
    healed = story.apply(body)  # the next pass restarts the dead worker, as a Deployment would
    assert healed.state == RolloutState.STABLE and healed.stable == stable.revision, story.log
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
    wait_for(lambda: _sample(router["metrics_port"], "kvguard_router_workers_kept_out", worker_role="decode") == 1,
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
    assert back.state == RolloutState.STABLE and back.stable == stable.revision, story.log
    cleared = _degraded(back.status.model_dump(by_alias=True))
    assert cleared["status"] == "False" and cleared["reason"] == "AsExpected", cleared
    assert all(p.verified for p in back.status.pools if p.revision == stable.revision), back.status.pools
    wait_for(lambda: "Degraded=False" in _status_text(story), "`kvguard status --local` to show Degraded=False", MAX_SECONDS)
    wait_for(lambda: _sample(router["metrics_port"], "kvguard_router_workers_kept_out", worker_role="decode") == 0,
             "the router to take decode-1 back into rotation", MAX_SECONDS)  # fmt: skip


def test_a_stable_pod_with_a_smaller_pool_is_kept_out_of_rotation_on_a_cluster_s7(story: Story, first: Rolled) -> None:
    """S7 while a pod serves, on a cluster: a pod of the stable decode revision that starts with a
    smaller pool (a bare Pod from the Deployment's own template, its `--kv-pool-tokens` at 1x the
    context, as a node with less memory would size it). The Service would select it by its labels
    the moment it is Ready; the operator's readiness gate must keep it un-Ready for good."""
    if not isinstance(story, ClusterStory):
        pytest.skip("cluster only: the operator's readiness gate on a pod (the local variant is the previous test)")
    stable = story.stable()
    violations: list[str] = []

    def never_an_endpoint(pod: str) -> bool:
        for role in ("decode",):
            if ready_endpoint_of(story.endpoint_slices(stable, role), pod):
                violations.append(f"{pod} is a ready endpoint of the {role} Service")
        return not violations

    with story.smaller_pool_pod(stable, pool_tokens=1024) as small:  # 1x the 1,024-token context: below 2x
        name = small["metadata"]["name"]

        def gate_says_too_small() -> dict[str, Any] | None:
            pod = story.pod(name)
            gate = pod_condition(pod or {}, GATE_CONDITION)
            return pod if never_an_endpoint(name) and gate is not None and gate.get("reason") == "KVPoolTooSmall" else None

        pod = wait_for(gate_says_too_small, f"the readiness gate to judge {name}", MAX_SECONDS, interval=1.0)
        assert pod_condition(pod, GATE_CONDITION)["status"] == "False" and not violations, violations  # type: ignore[index]
        assert pod_condition(pod, "Ready")["status"] == "False"  # type: ignore[index]
        node = pod["spec"]["nodeName"]

        def degraded() -> dict[str, Any] | None:
            found = next((c for c in story.model_status().get("conditions") or [] if c["type"] == "Degraded"), None)
            return found if found and found["status"] == "True" and name in found["message"] else None

        condition = wait_for(degraded, f"Degraded naming {name}", MAX_SECONDS, interval=1.0)
        assert condition["reason"] == "PodKVPoolTooSmall" and f"on node {node}" in condition["message"], condition
        assert "kept out of rotation" in condition["message"]
        pools = {p["pod"]: p for p in story.model_status().get("pools") or []}
        assert pools[name]["reason"] == "KVPoolTooSmall" and not pools[name]["verified"]

        with Traffic(story.url()) as traffic:
            wait_for(lambda: never_an_endpoint(name) and len(traffic.answers) >= 30, "30 answers", MAX_SECONDS, interval=0.5)
        assert not violations, violations
        assert {status for _, status in traffic.answers} == {200} and set(traffic.served()) == {stable}, traffic.served()
        with port_forward_pod(story, name) as port:  # no request reached the small pod
            assert _sample(port, "kvguard_requests_total") == 0

    def cleared() -> bool:
        found = next((c for c in story.model_status().get("conditions") or [] if c["type"] == "Degraded"), None)
        return found is not None and found["status"] == "False" and found["reason"] == "AsExpected"

    wait_for(cleared, f"Degraded to clear once {name} is gone", MAX_SECONDS, interval=1.0)


def port_forward_pod(story: ClusterStory, pod: str) -> Any:
    from harness_cluster import port_forward

    return port_forward(story.namespace, f"pod/{pod}", METRICS_PORT)


@dataclass(frozen=True)
class Stable:
    revision: str
    url: str


def _restart_with_pool(story: LocalStory, revision: str, name: str, pool: str) -> str:
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


def _status_text(story: LocalStory) -> str:
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
