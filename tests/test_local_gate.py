"""S7 while a local worker serves: the local backend's pool verdicts reach the model's status.

Workers here are small HTTP servers on loopback that report a KV pool on /metrics in the kvguard
engine's metric names (what the gate reads from a real worker); the gate scrapes them for real,
judges with the cluster's `pool_gate.judge`, and reconcile's rule turns the verdicts into
`status.pools` and `Degraded` naming the worker by role, port and PID, cleared once the worker is
back with a pool that meets the ratio. The whole path with real worker processes is
e2e/test_local_progressive.py's last scenario.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvguard.operator import conditions as cond
from kvguard.operator.backends.local import LocalRevision, LocalState, LocalWorker
from kvguard.operator.backends.local_gate import LocalPoolGate, worker_node
from kvguard.operator.pool_gate import PodPool
from kvguard.operator.reconcile import POD_POOL_REASON, pool_gate_degraded, with_pool_gate

ROOT = Path(__file__).resolve().parent.parent

CONTEXT = 1024
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class FakeWorker:
    """/metrics with the pool a worker reports, and /health; `pool` can change (a restart)."""

    def __init__(self, pool: int) -> None:
        self.pool = pool
        self.scrapes = 0
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self.server = TestServer(app, host="127.0.0.1")

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        text = ("# TYPE kvguard_kv_pool_capacity_tokens gauge\n"
                f"kvguard_kv_pool_capacity_tokens {self.pool}\n"
                "# TYPE kvguard_context_length_tokens gauge\n"
                f"kvguard_context_length_tokens {CONTEXT}\n")  # fmt: skip
        return web.Response(text=text, content_type="text/plain")


@pytest.fixture
async def workers() -> AsyncIterator[dict[str, FakeWorker]]:
    fakes = {"decode-0": FakeWorker(4096), "decode-1": FakeWorker(4096), "prefill-0": FakeWorker(4096)}
    for fake in fakes.values():
        await fake.server.start_server()
    yield fakes
    for fake in fakes.values():
        await fake.server.close()


def state_of(fakes: dict[str, FakeWorker], pids: dict[str, int]) -> LocalState:
    workers = [LocalWorker(name=name, role=name.split("-")[0], port=40000 + i, metrics_port=fake.server.port or 0, argv=[],
                           pid=pids[name]) for i, (name, fake) in enumerate(fakes.items())]  # fmt: skip
    workers.append(LocalWorker(name="router", role="router", port=41000, metrics_port=41001, argv=[], pid=1))
    revision = LocalRevision(revision="aaa111", model_dir="m", created_at="2026-01-01T00:00:00Z", workers=workers,
                             context_length=CONTEXT, min_kv_ratio=2.0)  # fmt: skip
    return LocalState(model="tiny", serving="aaa111", revisions={"aaa111": revision},
                      status={"revision": "aaa111", "conditions": [{"type": "Ready", "status": "True", "reason": "StableRevisionServing",
                                                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]})  # fmt: skip


def degraded(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), None)


async def test_a_worker_below_the_ratio_raises_degraded_naming_it_and_it_clears_once_back_s7(workers: dict[str, FakeWorker]) -> None:
    pids = {"decode-0": 100, "decode-1": 101, "prefill-0": 102}
    gate = LocalPoolGate(ready=lambda _: True)
    pools = await gate.pools(state_of(workers, pids))
    assert [p.reason for p in pools] == ["KVPoolVerified"] * 3
    assert pool_gate_degraded(pools, None) is None  # nothing kept out, nothing set

    # decode-1 restarts (a new PID) with a 1x pool, as on a node with less memory.
    workers["decode-1"].pool, pids["decode-1"] = CONTEXT, 202
    state = state_of(workers, pids)
    pools = await gate.pools(state)
    small = next(p for p in pools if p.pod == "tiny-aaa111-decode-1")
    assert small.reason == "KVPoolTooSmall" and not small.verified and small.node == "local:40001 (pid 202)"
    shown = with_pool_gate(state.status, pools, NOW)
    condition = degraded(shown)
    assert condition is not None and condition["status"] == "True" and condition["reason"] == POD_POOL_REASON
    assert "tiny-aaa111-decode-1 (decode, revision aaa111) on node local:40001 (pid 202)" in condition["message"]
    assert "1024 tokens = 1.00x context 1024 < 2x required (2048 tokens); kept out of rotation" in condition["message"]
    assert "decode-0" not in condition["message"]
    assert [p["pod"] for p in shown["pools"]][0] == "tiny-aaa111-decode-1"  # unverified first, as on a cluster
    assert degraded(state.status) is None  # the stored status is left as it was (a view, not a write)

    # Back with a pool that meets the ratio (another restart): Degraded clears.
    workers["decode-1"].pool, pids["decode-1"] = 4096, 303
    state = state_of(workers, pids)
    state.status = shown  # as if the status last recorded said Degraded
    pools = await gate.pools(state)
    cleared = degraded(with_pool_gate(state.status, pools, NOW))
    assert all(p.verified for p in pools)
    assert cleared is not None and cleared["status"] == "False" and cleared["reason"] == "AsExpected"


def test_a_model_whose_url_does_not_answer_is_degraded_not_ready() -> None:
    """An outside probe: with the local router or splitter killed (the URL refused connections, or
    answered 503) `kvguard status` said Ready. `front_door` names what is down."""
    stored = {"phase": "Ready", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Serving", "message": "ok", "lastTransitionTime": "2026-12-04T00:00:00Z"},
        {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "", "lastTransitionTime": "2026-12-04T00:00:00Z"},
    ]}  # fmt: skip
    assert with_pool_gate(stored, [], NOW, serving="r1")["phase"] == "Ready"
    shown = with_pool_gate(stored, [], NOW, serving="r1", front_door="the splitter (port 1, the model's URL) is not running")
    assert shown["phase"] == "Degraded"
    by_type = {c["type"]: c for c in shown["conditions"]}
    assert by_type["Degraded"]["status"] == "True" and by_type["Ready"]["status"] == "False"
    assert by_type["Degraded"]["reason"] == "NotListening" and "splitter (port 1" in by_type["Degraded"]["message"]


async def test_a_verdict_holds_for_the_process_it_was_made_on(workers: dict[str, FakeWorker]) -> None:
    """One scrape per process incarnation, as the cluster's gate checks a pod once per restart count:
    the pool of a running process does not change, so a driver polling every 0.3 s does not re-read it."""
    pids = {"decode-0": 100, "decode-1": 101, "prefill-0": 102}
    gate = LocalPoolGate(ready=lambda _: True)
    await gate.pools(state_of(workers, pids))
    await gate.pools(state_of(workers, pids))
    assert {n: f.scrapes for n, f in workers.items()} == {"decode-0": 1, "decode-1": 1, "prefill-0": 1}
    pids["decode-0"] = 200  # restarted: judged again
    await gate.pools(state_of(workers, pids))
    assert workers["decode-0"].scrapes == 2 and workers["decode-1"].scrapes == 1


async def test_a_worker_not_up_yet_is_verifying_never_unreadable(workers: dict[str, FakeWorker]) -> None:
    """A worker still starting (no /health yet) is out of rotation until judged, but a slow start
    never counts towards KVPoolUnreadable (which would raise Degraded after five scrapes)."""
    pids = {"decode-0": 100, "decode-1": 101, "prefill-0": 102}
    gate = LocalPoolGate(ready=lambda w: w.name != "decode-1", alive=lambda _: True)  # (the fakes' pids are made up)
    for _ in range(6):
        pools = await gate.pools(state_of(workers, pids))
    starting = next(p for p in pools if p.pod.endswith("decode-1"))
    assert starting.reason == "Verifying" and starting.unreadable_scrapes == 0 and workers["decode-1"].scrapes == 0
    assert pool_gate_degraded(pools, None) is None
    # Whether it is starting or its process died is said (`status --local` called a dead one "restarted").
    assert starting.message.endswith("decode-1: starting; its KV pool is verified again once it is ready")
    gone = LocalPoolGate(ready=lambda w: w.name != "decode-1", alive=lambda w: w.name != "decode-1")
    dead = next(p for p in await gone.pools(state_of(workers, pids)) if p.pod.endswith("decode-1"))
    assert "decode-1: process not running (the next `kvguard apply` restarts it)" in dead.message


def test_the_gates_rule_leaves_a_degraded_of_another_cause_alone() -> None:
    other = cond.make_condition("Degraded", "True", "RolloutFailed", "canary failed", now=NOW, generation=1)
    fine = PodPool(pod="p", revision="r", role="decode", required_ratio=2.0, verified=True, reason="KVPoolVerified")
    assert pool_gate_degraded([fine], other) is None


def test_a_worker_is_named_by_port_and_pid_in_place_of_a_node() -> None:
    worker = LocalWorker(name="decode-1", role="decode", port=4321, metrics_port=4322, argv=[], pid=77)
    assert worker_node(worker) == "local:4321 (pid 77)"
    assert worker_node(worker.model_copy(update={"pid": None})) == "local:4321"


def test_a_rollout_rests_when_s7_keeps_the_serving_revisions_only_worker_out() -> None:
    """An outside probe: with the stable's only decode worker kept out for its pool, `kvguard
    apply` printed `waiting for router not ready` until it was killed: a kept-out worker stays out
    until its pool changes, so the rollout rests (Degraded names it) instead of waiting."""
    from kvguard.operator.api import InferenceModelSpec, InferenceModelStatus
    from kvguard.operator.backends.local_rollout import unsettled
    from kvguard.operator.reconcile import Observed
    from kvguard.operator.rollout import RevisionView

    spec = InferenceModelSpec.model_validate(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"])
    status = InferenceModelStatus(revision="r1", target_revision="r1")
    view = RevisionView(ready=False, worker_replicas=2, waiting=("router not ready",))
    small = PodPool(pod="tiny-r1-decode-0", revision="r1", role="decode", required_ratio=2.0, reason="KVPoolTooSmall",
                    message="pool 1024 below 2x")  # fmt: skip
    starting = small.model_copy(update={"reason": "Verifying", "message": "starting"})
    assert unsettled(Observed(revisions={"r1": view}, pools=(starting,)), status, spec) == "revision r1: waiting for router not ready"
    assert unsettled(Observed(revisions={"r1": view}, pools=(small,)), status, spec) is None


def test_apply_does_not_exit_0_for_a_promoted_revision_that_answers_503() -> None:
    """The same probe, after the fix above: apply rested, then said exit 0 ("the spec's revision
    serves") while every request got a 503. A promoted revision with no worker of a role in
    rotation is exit 1, naming the roles."""
    from kvguard.commands.apply import EXIT_ERROR, EXIT_OK, exit_code
    from kvguard.operator.api import InferenceModelStatus
    from kvguard.operator.backends.local_rollout import RolloutResult
    from kvguard.operator.rollout import RolloutState

    small = PodPool(pod="tiny-r1-decode-0", revision="r1", role="decode", required_ratio=2.0, reason="KVPoolTooSmall", message="small")
    fine = PodPool(pod="tiny-r1-prefill-0", revision="r1", role="prefill", required_ratio=2.0, verified=True, reason="KVPoolVerified")

    def result(*pools: PodPool) -> RolloutResult:
        return RolloutResult(revision="r1", state=RolloutState.STABLE, stable="r1", serving_url=None, plan=None,  # type: ignore[arg-type]
                             status=InferenceModelStatus(revision="r1", pools=list(pools)))  # fmt: skip

    assert result(fine, small).roles_out_of_rotation == ["decode"] and exit_code(result(fine, small)) == EXIT_ERROR
    verified = small.model_copy(update={"verified": True, "reason": "KVPoolVerified"})
    assert exit_code(result(fine, verified)) == EXIT_OK
    # ... nor while nothing of ours answers at the model's URL (the splitter down, its port taken).
    door_shut = dataclasses.replace(result(fine, verified), front_door_problem="port 1, the model's URL, is taken")
    assert exit_code(door_shut) == EXIT_ERROR


def test_a_local_revision_is_judged_in_its_own_pages() -> None:
    """S7 counts whole pages of whole contexts: a local revision records its page size with its
    requirement (a review: no test covered it), and one recorded before reads as page 1."""
    from kvguard.operator.backends.local_gate import revision_requirement
    from kvguard.operator.pool_gate import PoolRequirement

    made = {"revision": "aaa111", "model_dir": "m", "created_at": "2026-01-01T00:00:00Z", "context_length": 1000, "min_kv_ratio": 2.0}
    assert revision_requirement(LocalRevision(**made, page_size=700), None) == PoolRequirement(2.0, 1000, 700)
    assert LocalRevision.model_validate(made).requirement() == PoolRequirement(2.0, 1000, 1)
