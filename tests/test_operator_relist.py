"""A model deleted while the operator's watch was down (its DELETED lost to a relist, as after a
410 Gone) is forgotten at the next resync, metrics included, and by a standby before its first pass
as leader."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from typing import Any

import kopf
import pytest
from kmock_api import ApiServer
from operator_harness import (
    IM,
    NS,
    SECRETS,
    Operator,
    apply_model,
    fast_settings,
    http,
    objects_of,
    status_of,
    tiny_model,
    until,
)

from kvguard.operator import metrics
from kvguard.operator.kube import KubeError

pytestmark = [pytest.mark.kmock(cls=ApiServer)]


async def test_a_model_deleted_while_the_watch_was_down_is_forgotten(operator: Operator, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = operator.kmock
    await operator.stop()
    make = kopf.OperatorSettings

    def settings() -> kopf.OperatorSettings:
        made = make()
        made.watching.client_timeout = 3  # kmock ignores timeoutSeconds: the client ends each watch
        return made

    monkeypatch.setattr(kopf, "OperatorSettings", settings)
    await operator.start(settings=fast_settings(resync_seconds=2.0))
    await apply_model(tiny_model())
    await until(lambda: status_of(cluster).get("targetRevision"), "status")
    await until(lambda: objects_of(cluster, SECRETS), "the transfer Secret")
    # Deleted while the watch was down: the relist no longer shows it, no DELETED ever comes
    # (kopf does not synthesize one; a real API server answers 410 to the old resourceVersion).
    cluster.objects[IM, NS, "tiny"].delete()
    for key in [k for k in list(cluster.objects.keys()) if k[0] == SECRETS]:
        cluster.objects[key].delete()  # the garbage collector follows the owner
    seen = len(list(cluster))
    await until(lambda: sum("watch" in str(r.url) and "inferencemodels" in str(r.url) for r in list(cluster)[seen:]) >= 2,
                "the model watch to reconnect (relist)")
    await until(lambda: (NS, "tiny") not in operator.controller.models, "the vanished model to be forgotten")
    assert not [s for s in metrics.REGISTRY.collect() for x in s.samples if x.labels.get("model") == "tiny"
                and x.labels.get("namespace") == NS], "its metrics"


@pytest.mark.parametrize("failure", [RuntimeError("not a KubeError"), KubeError(403, "forbidden")])
async def test_a_resync_whose_list_fails_forgets_nothing_and_goes_on(failure: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: only a KubeError was caught, and any other failure of the LIST would have ended
    the resync task for good (no model passed again until a restart)."""

    from kvguard.operator.controller import Controller

    class FailingKube:
        async def alist(self, *_: Any, **__: Any) -> list[dict[str, Any]]:
            raise failure

    monkeypatch.setenv("WATCH_NAMESPACES", "")
    controller = Controller.__new__(Controller)  # only what _drop_vanished reads
    controller.kube = FailingKube()  # type: ignore[assignment]
    controller.models = {(NS, "tiny"): {"metadata": {"name": "tiny", "namespace": NS, "uid": "u1"}}}
    await controller._drop_vanished()
    assert (NS, "tiny") in controller.models


async def test_a_new_leader_forgets_models_gone_from_the_api_server_before_passing_any(operator: Operator) -> None:
    """A review: a standby's cache may hold a model deleted while its watch was down; as leader it
    passed that model (reads and writes of an object that is gone) until its first resync, 10
    minutes on. It now LISTs before its first passes."""
    cluster = operator.kmock
    b = Operator(cluster)
    await b.start()
    listing, release = threading.Event(), threading.Event()
    try:
        await until(lambda: operator.controller.leading and not b.controller.leading, "A leading, B standing by")
        await apply_model(tiny_model())
        await until(lambda: status_of(cluster).get("targetRevision"), "status")
        await until(lambda: (NS, "tiny") in b.controller.models, "B's watch to see the model")
        ghost = tiny_model("ghost", uid="uid-ghost")  # in B's cache only: its DELETED lost to a relist
        ghost["metadata"]["resourceVersion"] = "1"
        b.controller.models[(NS, "ghost")] = ghost
        # B's first LIST is held until an event has enqueued every model (a policy changed): a
        # review saw the ghost passed in that window when B's workers ran before the LIST.
        alist = b.controller.kube.alist

        async def held(kind: str, *args: Any, **kwargs: Any) -> Any:
            if kind == "InferenceModel" and not release.is_set():
                listing.set()
                await asyncio.to_thread(release.wait, 120)
            return await alist(kind, *args, **kwargs)

        b.controller.kube.alist = held  # type: ignore[method-assign]
        seen = len(list(cluster))
        lease_path = "/apis/coordination.k8s.io/v1/namespaces/kvguard-system/leases/kvguard-operator"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await http("PATCH", lease_path, {"spec": {"holderIdentity": b.controller.settings.identity, "renewTime": stamp}},
                   "application/merge-patch+json")  # fmt: skip
        await until(listing.is_set, "B's first LIST as leader")
        assert b.controller._elector_task is not None
        b.controller._elector_task.get_loop().call_soon_threadsafe(b.controller.policies_changed)
        await until(lambda: b.controller.queue.pending >= 2, "both models enqueued by the policy event")
        release.set()
        await until(lambda: b.controller.leading and b.controller.passes > 0, "B leads and passes")
        await until(lambda: b.controller.queue.pending == 0, "B's first passes done")
        assert (NS, "ghost") not in b.controller.models
        assert not [str(r.url) for r in list(cluster)[seen:] if "ghost" in str(r.url)], "B read or wrote the gone model"
    finally:
        release.set()
        await b.stop()
