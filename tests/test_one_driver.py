"""One rollout driver: the same story told to the operator (kopf, the emulator, the Kubernetes
backend) and to `kvguard apply --local` (the local backend, real processes) ends in the same
status, field for field, once timestamps and durations are left out. Both run `driver.run_pass`,
so they share one reconcile; this proves nothing drifted apart on the way in or out."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kmock_api import ApiServer
from operator_harness import (
    CANARY_WAIT,
    DEPLOYMENTS,
    FAST_CANARY,
    NS,
    Operator,
    apply_model,
    mark_ready,
    objects_of,
    status_of,
    until,
)

from kvguard.operator.api import InferenceModel
from kvguard.operator.backends.local import LocalBackend
from kvguard.operator.backends.local_rollout import roll_out

pytestmark = [pytest.mark.kmock(cls=ApiServer)]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
VOLATILE = {"since", "lastTransitionTime", "durationSeconds", "canaryRun"}
"""When things happened and how long they took: the only fields allowed to differ (a canary run's
key carries its rollout's `canaryRun` time after its retry value: `canary_run_key`)."""


def story(model_dir: Path) -> dict[str, Any]:
    """tiny-cpu, its weights at an absolute path (the local backend reads it as is; on a cluster
    it is the folder inside the PVC), the lean canary."""
    import yaml

    body = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": "tiny", "namespace": NS, "uid": "uid-tiny", "resourceVersion": "1"}
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": str(model_dir)}, "revision": "r1"}
    body["spec"]["canary"] = copy.deepcopy(FAST_CANARY)
    return body


def without_volatile(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: v.split("@")[0] if k == "attempt" and isinstance(v, str) else without_volatile(v)
                for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


async def test_the_operator_and_kvguard_apply_local_write_the_same_status(operator: Operator, tiny_model_dir: Path, tmp_path: Path) -> None:
    cluster = operator.kmock
    body = story(tiny_model_dir)
    await apply_model(copy.deepcopy(body))
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    on_cluster = await until(lambda: (s := status_of(cluster)).get("phase") == "Ready" and s, "Ready on the cluster", CANARY_WAIT)

    model = InferenceModel.model_validate(body)
    with LocalBackend(tmp_path / "state", models_root=tmp_path) as backend:
        try:
            result = await asyncio.wait_for(roll_out(backend, "tiny", model.spec, namespace=NS), 180)
            local = dict(backend.state.status)
        finally:
            backend.stop_all()
    assert result.promoted and result.revision == rev
    # status.pools is the readiness gate's verdict on every engine pod (S7 while it serves): the
    # local gate judged the real worker processes; the emulated cluster has Deployments but no
    # pods to judge, so its list is empty. Everything else is the same, field for field.
    local_pools, cluster_pools = local.pop("pools", []), on_cluster.pop("pools", [])
    assert cluster_pools == [] and sorted(p["pod"] for p in local_pools) == [f"tiny-{rev}-decode-0", f"tiny-{rev}-prefill-0"]
    assert all(p["verified"] and p["reason"] == "KVPoolVerified" for p in local_pools), local_pools
    assert without_volatile(local) == without_volatile(on_cluster)
    assert local["observedGeneration"] == on_cluster["observedGeneration"] == 1
    assert [h["state"] for h in local["history"]] == ["Stable"]
