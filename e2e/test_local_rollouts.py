"""Whole-system rollout scenarios on the local backend: real worker processes on loopback, the real
rollout state machine, the real canary suite, the official openai client.

One model ("e2e-tiny") is rolled through a story; each scenario starts from whatever is stable when
it begins and checks its own outcome against that (the started revisions are shared, which keeps
the suite to a couple of minutes on 2 cores). The base spec is the tiny model in bf16 with a memory
budget that gives a 2,304-token pool (2.25x the 1,024 context), so that un-quantizing to fp32
breaks the ratio (1.81x) honestly.

The `backend` fixture is parametrized local/cluster; the cluster variant needs KUBECONFIG, the
worker image and the tiny model on a PVC, and is skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.operator.api import InferenceModel, InferencePolicy
from kvguard.operator.backends.local import LocalBackend
from kvguard.operator.backends.local_rollout import RolloutResult, roll_out
from kvguard.operator.revision import revision_of
from kvguard.operator.rollout import RolloutState

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
NAME = "e2e-tiny"
PROMPTS = ("The capital of France is", "1, 2, 3, 4,")
# Fault modes a black-box canary must catch (see workers/faults.py and bench/canary_detection.py).
FAULT_MODES = (
    "unsafe_reject_path,no_tags",
    "unsafe_reject_path",
    "corrupt_chunk=1",
    "corrupt_chunk=1,no_checksum",
    "no_abort_propagation",
    "ignore_manifest,drop_chunk=0.3,no_tags",
)
# Left out for CI time: crash_prefill_after_chunks=1 is caught too (the restarted prefill dies on
# every request), but each probe then waits out its request timeout: over a minute on 2 cores.


def base_body(model_dir: Path) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": NAME}
    spec = body["spec"]
    spec["model"]["source"] = {"pvc": {"claimName": "models", "path": str(model_dir)}, "revision": "seed-0"}
    spec["weights"] = {"quantization": "bf16"}
    spec.pop("kvPoolTokens")
    spec["hardware"]["memoryPerDevice"] = "1.5Mi"
    spec["canary"] = {"golden": {"compareBaseline": False}}  # weights change on purpose in one scenario
    return body


@dataclass
class Applied:
    result: RolloutResult
    answers: dict[str, str]


class LocalHarness:
    """Applies InferenceModel bodies through the local backend, as `kvguard apply --local` does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.log: list[str] = []

    def apply(self, body: dict[str, Any], *, faults: str = "", policies: tuple[InferencePolicy, ...] = ()) -> Applied:
        model = InferenceModel.model_validate(body)
        with LocalBackend(self.state_dir, models_root=self.root) as backend:
            result = asyncio.run(
                roll_out(backend, NAME, model.spec, faults=faults, policies=policies,
                         annotations=model.metadata.annotations, say=self.log.append, max_seconds=240)  # fmt: skip
            )
        return Applied(result, ask(result.serving_url) if result.serving_url else {})

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "state.json").read_text())

    def pids(self, revision: str) -> dict[str, int | None]:
        return {w["name"]: w["pid"] for w in self.state()["revisions"][revision]["workers"]}

    def running(self, revision: str) -> bool:
        with LocalBackend(self.state_dir) as backend:
            return bool(backend.views(heal=False)[revision].ready)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.state_dir.exists():
            with LocalBackend(self.state_dir) as backend:
                backend.stop_all()


def ask(api_base: str) -> dict[str, str]:
    from openai import OpenAI

    client = OpenAI(base_url=api_base, api_key="none", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    return {
        p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, seed=1).choices[0].text
        for p in PROMPTS
    }


@pytest.fixture(scope="module", params=["local", "cluster"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHarness]:
    if request.param == "cluster":
        if not os.environ.get("KUBECONFIG"):
            pytest.skip("KUBECONFIG is unset: no cluster to run the rollout scenarios against")
        pytest.skip("cluster variant: needs the worker image and the tiny model on a PVC in the cluster; "
                    "only e2e/test_cluster_operator.py runs there so far")  # fmt: skip
    root = tmp_path_factory.mktemp("e2e-local")
    for seed in (0, 1):
        subprocess.run([sys.executable, "-P", "-m", "kvguard", "model", "tiny", str(root / f"tiny-{seed}"), "--seed", str(seed)],
                       check=True, stdout=subprocess.DEVNULL, cwd=root)  # fmt: skip
    harness = LocalHarness(root)
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def stable(backend: LocalHarness) -> dict[str, Any]:
    """The first rollout (scenario 1) as a precondition of the others: its body and answers."""
    body = base_body(backend.root / "tiny-0")
    applied = backend.apply(body)
    assert applied.result.promoted, backend.log
    return {"body": body, "applied": applied}


def current(backend: LocalHarness) -> tuple[str, str, dict[str, str], dict[str, int | None]]:
    """The stable revision, its URL, its greedy answers now and its worker PIDs."""
    state = backend.state()
    revision = state["status"]["revision"]
    url = state["revisions"][revision]["workers"][-1]["port"]
    api = f"http://127.0.0.1:{url}/v1"
    return revision, api, ask(api), backend.pids(revision)


def assert_untouched(backend: LocalHarness, before: tuple[str, str, dict[str, str], dict[str, int | None]]) -> None:
    """S8: same stable revision, same processes, same URL, same greedy outputs."""
    assert current(backend) == before


# --- scenarios ----------------------------------------------------------------------------------


def test_first_rollout_promotes_after_pools_and_canary(backend: LocalHarness, stable: dict[str, Any]) -> None:
    result = stable["applied"].result
    rollout = result.status.rollout
    assert result.state == RolloutState.STABLE and result.stable == result.revision
    assert rollout is not None and rollout.canary is not None and rollout.canary.verdict == "pass"
    planned = result.plan.roles["decode"].pool_tokens
    assert planned == 2304
    assert {(w.role, w.pool_tokens) for w in rollout.workers} == {("prefill", planned), ("decode", planned)}  # S7: reported
    assert len(stable["applied"].answers) == len(PROMPTS)
    assert [c.type for c in result.status.conditions if c.status == "True"].count("CanaryPassed") == 1


def test_weights_change_promotes_new_revision(backend: LocalHarness, stable: dict[str, Any]) -> None:
    old_revision, _, old_answers, _ = current(backend)
    body = copy.deepcopy(stable["body"])
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": str(backend.root / "tiny-1")}, "revision": "seed-1"}
    applied = backend.apply(body)
    assert applied.result.promoted and applied.result.stable != old_revision
    assert applied.answers != old_answers  # other weights, other greedy text
    state = backend.state()
    assert state["revisions"][old_revision]["scaled_to_zero"]  # kept at zero for a rollback
    assert [h["state"] for h in state["status"]["history"][:2]] == ["Stable", "Superseded"]


def test_quantization_change_breaking_ratio_is_blocked_stable_untouched(backend: LocalHarness, stable: dict[str, Any]) -> None:
    before = current(backend)
    body = copy.deepcopy(stable["body"])
    body["spec"]["weights"] = {"quantization": "fp32"}  # twice the weight bytes: pool 1,856 = 1.81x < 2x
    applied = backend.apply(body)
    assert applied.result.state == RolloutState.BLOCKED
    assert revision_of(InferenceModel.model_validate(body).spec) not in backend.state()["revisions"]  # S7: never started
    assert "1.81x" in (applied.result.status.rollout.message or "")
    assert_untouched(backend, before)


def test_parallelism_change_runs_two_decode_instances(backend: LocalHarness, stable: dict[str, Any]) -> None:
    old_revision = current(backend)[0]
    body = copy.deepcopy(stable["body"])
    body["spec"]["roles"]["decode"]["dataParallel"] = 2
    applied = backend.apply(body)
    assert applied.result.promoted and applied.result.stable != old_revision
    workers = applied.result.status.rollout.workers
    assert sorted(w.worker for w in workers) == ["decode-0", "decode-1", "prefill-0"]  # every instance measured (S7)
    assert all(w.sufficient for w in workers)
    stable["body"] = body  # later scenarios build on this stable spec


@pytest.mark.parametrize("faults", FAULT_MODES)
def test_canary_failure_rolls_back(backend: LocalHarness, stable: dict[str, Any], faults: str) -> None:
    before = current(backend)
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = f"build-{faults}"  # a new engine build, carrying the fault
    applied = backend.apply(body, faults=faults)
    result = applied.result
    assert result.state == RolloutState.ROLLED_BACK, backend.log[-5:]
    assert result.status.rollout.canary is not None and result.status.rollout.canary.verdict == "fail"
    candidate = backend.state()["revisions"].get(result.revision)
    assert candidate is None or candidate["scaled_to_zero"]  # S8: the failed build stops
    assert_untouched(backend, before)


def test_restart_mid_rollout_resumes(backend: LocalHarness, stable: dict[str, Any], tmp_path: Path) -> None:
    """S8: `kvguard apply` killed (SIGKILL) mid-rollout; the next one adopts the candidate's
    processes from the state folder and finishes the rollout - no duplicate, no orphan."""
    old_revision = current(backend)[0]
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = "restart-test"
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(body))
    candidate = revision_of(InferenceModel.model_validate(body).spec)
    argv = [sys.executable, "-P", "-m", "kvguard", "apply", "-f", str(manifest), "--local",
            "--state-dir", str(backend.state_dir), "--models-root", str(backend.root)]  # fmt: skip
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rollout = (backend.state().get("status") or {}).get("rollout") or {}
            if rollout.get("revision") == candidate and rollout.get("state") in ("CanaryDeploying", "CanaryVerifying"):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the rollout never reached CanaryDeploying")
        first.send_signal(signal.SIGKILL)  # no cleanup, no last words: like an operator pod killed
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    interrupted = backend.state()
    assert interrupted["status"]["revision"] == old_revision  # nothing promoted yet
    started_pids = {w: p for w, p in backend.pids(candidate).items() if p} if candidate in interrupted["revisions"] else {}
    second = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    state = backend.state()
    assert state["status"]["revision"] == candidate and state["serving"] == candidate
    assert state["status"]["rollout"]["state"] == "Stable"
    resumed_pids = backend.pids(candidate)
    adopted = {w: p for w, p in started_pids.items() if resumed_pids.get(w) == p}
    assert adopted, "the resumed rollout restarted every candidate process instead of adopting them"
    assert sum(1 for h in state["status"]["history"] if h["revision"] == candidate and h["state"] == "Stable") == 1
    stable["body"] = body


def test_policy_rejection_blocks_and_keeps_stable(backend: LocalHarness, stable: dict[str, Any]) -> None:
    before = current(backend)
    policy = InferencePolicy.model_validate({
        "apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": "short-contexts"},
        "spec": {"maxContextLength": 512},
    })  # fmt: skip
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = "policy-test"
    applied = backend.apply(body, policies=(policy,))
    assert applied.result.state == RolloutState.BLOCKED
    message = applied.result.status.rollout.message or ""
    assert "spec.contextLength" in message and "short-contexts" in message
    compliant = next(c for c in applied.result.status.conditions if c.type == "PolicyCompliant")
    assert compliant.status == "False"
    assert applied.result.revision not in backend.state()["revisions"]
    assert_untouched(backend, before)
