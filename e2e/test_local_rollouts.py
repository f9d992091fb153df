"""Whole-system rollout scenarios, on the local backend and on a real cluster: real workers, the
real rollout state machine, the real canary suite, the official openai client.

One model ("e2e-tiny") is rolled through a story; each scenario starts from whatever is stable when
it begins and checks its own outcome against that (the started revisions are shared, which keeps
the suite to a couple of minutes on 2 cores). The base spec is the tiny model in bf16 with a memory
budget that gives a 2,304-token pool (2.25x the 1,024 context), so that un-quantizing to fp32
breaks the ratio (1.81x) honestly. The scenarios talk to a `harness.Harness` only:

- local (`harness_local.py`): worker processes on loopback, driven like `kvguard apply --local`;
- cluster (`harness_cluster.py`): the operator in a real cluster drives the rollouts; the harness
  writes the InferenceModel and reads its status, workloads and answers. It needs KUBECONFIG; the
  CRDs and the operator installed with the fault-injection component, `kubectl apply -k e2e/install`
  (manifests/ plus manifests/testing/fault-injection, which sets KVGUARD_ALLOW_FAULT_INJECTION=true
  so that the `kvguard.io/faults` annotation is honoured), with the webhook's certificate
  (docs/webhook.md); KVGUARD_E2E_WORKER_IMAGE, the worker image (docker/worker.Dockerfile),
  pullable by the cluster; a default StorageClass (a Job writes the tiny models onto a PVC);
  kubectl. Run it with
      KUBECONFIG=... KVGUARD_E2E_WORKER_IMAGE=... .venv/bin/python -P -m pytest e2e/test_local_rollouts.py -k cluster
  Without KUBECONFIG or the image it is skipped with the reason. harness_cluster.py lists the
  optional variables (namespace, PVC, operator namespace).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import NAME, PROMPTS, Harness, Serving
from harness_cluster import ClusterHarness, unavailable
from harness_local import LocalHarness

from kvguard.operator.api import InferencePolicy
from kvguard.operator.numerics import numerics_change
from kvguard.operator.rollout import RolloutState

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
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
CLUSTER = pytest.param("cluster", marks=[pytest.mark.cluster, pytest.mark.timeout(1800)])  # image pulls, pod starts


def base_body(backend: Harness) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": NAME}
    spec = body["spec"]
    spec["model"]["source"] = backend.model_source(0)
    if backend.engine_image:
        spec["engine"]["image"] = backend.engine_image
    spec["weights"] = {"quantization": "bf16"}
    spec.pop("kvPoolTokens")
    spec["hardware"]["memoryPerDevice"] = "1.5Mi"
    # These scenarios check the old revision at zero right after promotion; the default keeps it
    # running scaleDownDelaySeconds for an instant rollback (tests/test_progressive_*.py).
    spec["rollout"] = {"scaleDownDelaySeconds": 0}
    return body


@pytest.fixture(scope="module", params=["local", CLUSTER])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness: Harness
    if request.param == "cluster":
        reason = unavailable()
        if reason:
            pytest.skip(reason)
        harness = ClusterHarness.from_env()
    else:
        harness = LocalHarness.with_tiny_models(tmp_path_factory.mktemp("e2e-local"))
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def stable(backend: Harness) -> dict[str, Any]:
    """The first rollout (scenario 1) as a precondition of the others: its body and answers."""
    body = base_body(backend)
    applied = backend.apply(body)
    assert applied.result.promoted, backend.log
    return {"body": body, "applied": applied}


def assert_untouched(backend: Harness, before: Serving) -> None:
    """S8: same stable revision, same workloads (processes / pods), same greedy outputs."""
    assert backend.current() == before


# --- scenarios ----------------------------------------------------------------------------------


def test_first_rollout_promotes_after_pools_and_canary(backend: Harness, stable: dict[str, Any]) -> None:
    result = stable["applied"].result
    rollout = result.rollout
    assert result.state == RolloutState.STABLE and result.stable == result.revision
    assert rollout.canary is not None and rollout.canary.verdict == "pass"
    planned = result.plan.roles["decode"].pool_tokens
    assert planned == 2304
    assert {(w.role, w.pool_tokens) for w in rollout.workers} == {("prefill", planned), ("decode", planned)}  # S7: reported
    assert len(stable["applied"].answers) == len(PROMPTS)
    assert [c.type for c in result.status.conditions if c.status == "True"].count("CanaryPassed") == 1


def test_weights_change_promotes_new_revision(backend: Harness, stable: dict[str, Any]) -> None:
    before = backend.current()
    body = copy.deepcopy(stable["body"])
    body["spec"]["model"]["source"] = backend.model_source(1)
    applied = backend.apply(body)
    assert applied.result.promoted and applied.result.stable != before.revision
    assert applied.answers != before.answers  # other weights, other greedy text
    rollout = applied.result.rollout  # another model: the canary did not require stable's text (and passed)
    assert numerics_change(rollout.numerics, rollout.baseline_numerics).other_model  # type: ignore[union-attr]
    assert before.revision is not None
    assert backend.revision_present(before.revision) and backend.revision_stopped(before.revision)  # kept at zero for a rollback
    assert [h.state for h in applied.result.status.history[:2]] == ["Stable", "Superseded"]


def test_quantization_change_breaking_ratio_is_blocked_stable_untouched(backend: Harness, stable: dict[str, Any]) -> None:
    before = backend.current()
    body = copy.deepcopy(stable["body"])
    body["spec"]["weights"] = {"quantization": "fp32"}  # twice the weight bytes: pool 1,856 = 1.81x < 2x
    applied = backend.apply(body)
    assert applied.result.state == RolloutState.BLOCKED
    assert not backend.revision_present(applied.result.revision)  # S7: never started
    assert "1.81x" in (applied.result.rollout.message or "")
    assert_untouched(backend, before)


def test_parallelism_change_is_verified_small_then_measured_again_at_full_scale(backend: Harness, stable: dict[str, Any]) -> None:
    """Two decode DP ranks and two prefill replicas: the canary runs one prefill (canaryReplicas 1)
    beside stable; before traffic moves the second prefill starts and every worker is measured."""
    old_revision = backend.current().revision
    body = copy.deepcopy(stable["body"])
    body["spec"]["roles"]["decode"]["dataParallel"] = 2
    body["spec"]["roles"]["prefill"]["replicas"] = 2
    applied = backend.apply(body)
    assert applied.result.promoted and applied.result.stable != old_revision
    rollout = applied.result.rollout
    assert sorted(w.role for w in rollout.workers) == ["decode", "decode", "prefill", "prefill"], rollout.workers  # S7
    assert len({w.worker for w in rollout.workers}) == 4 and all(w.sufficient for w in rollout.workers)
    assert rollout.measured_scale == "full"
    stable["body"] = body  # later scenarios build on this stable spec


@pytest.mark.parametrize("faults", FAULT_MODES)
def test_canary_failure_rolls_back(backend: Harness, stable: dict[str, Any], faults: str) -> None:
    before = backend.current()
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = f"build-{faults}"  # a new engine build, carrying the fault
    applied = backend.apply(body, faults=faults)
    result = applied.result
    assert result.state == RolloutState.ROLLED_BACK, backend.log[-5:]
    assert result.rollout.canary is not None and result.rollout.canary.verdict == "fail"
    assert backend.revision_stopped(result.revision)  # S8: the failed build stops
    assert_untouched(backend, before)


def test_restart_mid_rollout_resumes(backend: Harness, stable: dict[str, Any]) -> None:
    """S8: the driver (local: `kvguard apply`; cluster: the operator pods) killed mid-rollout; the
    next one adopts the candidate's workloads and finishes the rollout - no duplicate, no orphan."""
    old_revision = backend.current().revision
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = "restart-test"
    resumed = backend.interrupt_mid_rollout(body)
    assert resumed.stable_when_interrupted == old_revision  # nothing promoted yet
    result = resumed.result
    assert result.promoted and result.stable == resumed.candidate, backend.log[-5:]
    assert backend.serving() == resumed.candidate
    now = backend.workload_ids(resumed.candidate)
    adopted = {w: i for w, i in resumed.started.items() if now.get(w) == i}
    assert adopted, "the resumed rollout restarted every candidate workload instead of adopting them"
    assert sum(1 for h in result.status.history if h.revision == resumed.candidate and h.state == "Stable") == 1
    stable["body"] = body


def test_policy_rejection_blocks_and_keeps_stable(backend: Harness, stable: dict[str, Any]) -> None:
    before = backend.current()
    policy = InferencePolicy.model_validate({
        "apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": "short-contexts"},
        "spec": {"namespaces": [backend.namespace], "maxContextLength": 512},
    })  # fmt: skip
    body = copy.deepcopy(stable["body"])
    body["spec"]["engine"]["version"] = "policy-test"
    applied = backend.apply(body, policies=(policy,))
    if applied.rejected is not None:  # cluster with the admission webhook: refused before it is stored
        message = applied.rejected.message
    else:  # no webhook (local, or a cluster without one): reconcile blocks it
        assert applied.result.state == RolloutState.BLOCKED
        message = applied.result.rollout.message or ""
        compliant = next(c for c in applied.result.status.conditions if c.type == "PolicyCompliant")
        assert compliant.status == "False"
        assert not backend.revision_present(applied.result.revision)
    assert "spec.contextLength" in message and "short-contexts" in message
    assert_untouched(backend, before)
