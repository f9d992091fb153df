"""The operator on what a real cluster does to it, against the emulator (tests/kmock_api.py, which
enforces resourceVersion preconditions, selectors and server-side apply as an API server does):

- two operator replicas: one leads, the other stands by; when the Lease moves, the old leader stops
  everything it runs in the background (canary included) and the new one finishes the rollout:
  exactly one promotion, and every status write was conditional on the version it was decided on;
- transport failures (connections dropped mid-request) back off exponentially with jitter, and the
  pass succeeds once the API server answers again;
- a field removed from the spec is removed from the Deployment (server-side apply);
- a Secret planted under a revision's name is never used (the operator reads no Secret), and a
  squatted Deployment name halts only the revision that needs it;
- a deleted model's metrics are gone; every LIST and watch of children carries a label selector.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kmock as km
import kubernetes
import pytest
from aiohttp import web
from kmock_api import ApiServer, client_configuration
from loopback import serving
from operator_harness import (
    CANARY_WAIT,
    DEPLOYMENTS,
    EMULATOR_URL,
    NETPOLS,
    NS,
    SECRETS,
    SERVICES,
    Operator,
    apply_model,
    condition,
    events_of,
    fast_settings,
    http,
    mark_ready,
    never_finishes,
    objects_of,
    patch_model,
    promoted,
    status_of,
    stays,
    tiny_model,
    two_revisions,
    until,
)

from kvguard.operator import metrics, reconcile
from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.controller import Controller
from kvguard.operator.kube import Kube, KubeError, ObjectRef
from kvguard.operator.leader import LeaderElector, LeaseConfig, LeaseRecord, Move, decide
from kvguard.operator.render import transfer_secret_of
from kvguard.operator.revision import revision_of

pytestmark = [pytest.mark.kmock(cls=ApiServer)]
LEASES = km.resource("coordination.k8s.io", "v1", "leases")


# --- leader election ------------------------------------------------------------------------------


def test_the_lease_rule() -> None:
    held = LeaseRecord(holder="a", renew_time="t1", transitions=0, resource_version="7")
    assert decide(None, "a", 0, 15) is Move.CREATE
    assert decide(held, "a", 100, 15) is Move.RENEW
    assert decide(held, "b", 14.9, 15) is Move.FOLLOW  # renewing, as far as b has seen
    assert decide(held, "b", 15.0, 15) is Move.ACQUIRE  # unchanged for a whole duration on b's clock
    assert decide(LeaseRecord("", "t1", 3, "8"), "b", 0, 15) is Move.ACQUIRE  # released


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_two_electors_one_leader_takeover_only_after_the_lease_is_stale(kmock: Any) -> None:
    from kmock_api import declare_kvguard_resources

    url = declare_kvguard_resources(kmock)
    config = LeaseConfig(duration=15, renew_deadline=10, retry_period=2)
    clock, events = Clock(), []

    def elector(name: str) -> LeaderElector:
        async def started() -> None:
            events.append(f"{name} leads")

        async def stopped() -> None:
            events.append(f"{name} stops")

        return LeaderElector(Kube(kubernetes.client.ApiClient(client_configuration(url))), name, config, started, stopped, clock)

    a, b = elector("a"), elector("b")
    await asyncio.gather(a.attempt(), b.attempt())  # both see no Lease: one create wins (409 for the other)
    assert [a.leading, b.leading].count(True) == 1
    leader, standby = (a, b) if a.leading else (b, a)
    await standby.attempt()  # the standby sees the Lease (and starts its own clock on it)
    clock.now += 14
    await standby.attempt()
    assert not standby.leading  # the holder may still be renewing
    clock.now += 2  # the holder stopped renewing 16 s ago (standby's clock)
    await standby.attempt()
    assert standby.leading
    # Paused past its renew deadline (SIGSTOP, a stalled node), the old holder still says `leading`
    # until its next attempt runs; whatever it had in hand must not be written meanwhile.
    assert leader.leading and not leader.holds_lease() and standby.holds_lease()
    await leader.attempt()  # it sees another holder: stops at once, before doing anything else
    assert not leader.leading and events[-2:] == [f"{standby.identity} leads", f"{leader.identity} stops"]
    lease = kmock.objects[LEASES, "kvguard-system", "kvguard-operator"]
    assert lease["spec"]["holderIdentity"] == standby.identity and lease["spec"]["leaseTransitions"] == 1
    await standby.release()
    assert not standby.leading and "holderIdentity" not in kmock.objects[LEASES, "kvguard-system", "kvguard-operator"]["spec"]


def test_a_write_the_guard_refuses_is_never_sent() -> None:
    """The operator's Kube asks its write guard (Controller._write_guard: a fresh Lease) before
    every write; reads go through. Nothing listens at this address: a sent call would fail as a
    transport error, not with the guard's reason."""
    from kvguard.operator.kube import KubeError, ObjectRef

    kube = Kube(kubernetes.client.ApiClient(client_configuration("http://127.0.0.1:9")))
    kube.write_guard = lambda method, path: None if "/leases" in path else "no fresh Lease"
    for write in (lambda: kube.delete(ObjectRef("Secret", "s", "ns")), lambda: kube.create({"apiVersion": "v1", "kind": "Secret",
                                                                                          "metadata": {"name": "s", "namespace": "ns"}})):  # fmt: skip
        with pytest.raises(KubeError, match="not sent: no fresh Lease"):
            write()
    with pytest.raises(KubeError, match="transport error"):
        kube.get(ObjectRef("Secret", "s", "ns"))  # reads are not guarded


async def test_two_operators_one_promotion_no_lost_status_write_and_the_old_leader_stops(
    operator: Operator, serving: Any
) -> None:
    cluster = operator.kmock
    await operator.restart(suite=never_finishes)  # A: leads; its canary never finishes
    b = Operator(cluster)
    await b.start()  # B: the real suite; stands by
    try:
        await until(lambda: operator.controller.leading and not b.controller.leading, "A leading, B standing by")
        await apply_model(tiny_model())
        rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
        await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
        await mark_ready(cluster, rev)
        await until(lambda: status_of(cluster).get("rollout", {}).get("state") == "CanaryVerifying"
                    and operator.controller.runner.active == 1, "A's canary running")  # fmt: skip
        assert not b.controller.leading and b.controller.passes == 0  # a standby never reconciles

        # The Lease moves to B (A could not renew, say): A must stop driving at once.
        writes_before = len(model_status_writes(cluster))
        lease_path = "/apis/coordination.k8s.io/v1/namespaces/kvguard-system/leases/kvguard-operator"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await http("PATCH", lease_path, {"spec": {"holderIdentity": b.controller.settings.identity, "renewTime": stamp}},
                   "application/merge-patch+json")  # fmt: skip
        a = operator.controller
        await until(lambda: not a.leading, "A to notice it lost the Lease")
        # `leading` turns False first; its work then stops over a few turns of A's loop (another thread).
        await until(lambda: a.runner.active == 0 and a.queue.pending == 0 and a.queue.timers == 0,
                    "A's canary, queue and timers to stop with its leadership")  # fmt: skip

        status = await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster), "B promotes", CANARY_WAIT)
        assert status["rollout"]["state"] == "Stable" and status["rollout"]["canary"]["verdict"] == "pass"
        await promoted(cluster, rev)
        await stays(lambda: [e.get("count", 1) for e in events_of(cluster, "RevisionPromoted")] == [1], "exactly one promotion")
        writes = model_status_writes(cluster)
        assert writes and all(w["precondition"] is not None for w in writes), "every status write is conditional"
        a_agent = operator.controller.settings.identity
        assert not [w for w in writes[writes_before:] if a_agent in w["agent"] and w["accepted"]], "A wrote after losing the Lease"
    finally:
        await b.stop()


# --- transport failures ----------------------------------------------------------------------------


def model_status_writes(cluster: Any) -> list[dict[str, Any]]:
    return [w for w in cluster.status_writes if w["resource"] == "inferencemodels"]


class ChaosProxy:
    """An HTTP proxy in front of the emulator that drops the connection (no HTTP answer at all)
    on the requests `drop` matches: what a reset or a timeout looks like to the client."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.drop: Callable[[web.Request], bool] = lambda _request: False
        self.dropped = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._session = aiohttp.ClientSession()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if self.drop(request):
            self.dropped += 1
            assert request.transport is not None
            request.transport.abort()  # the client sees its connection die: a transport error
            raise ConnectionResetError("dropped by the chaos proxy")
        assert self._session is not None
        body = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers={k: v for k, v in request.headers.items() if k.lower() != "host"}) as upstream:  # fmt: skip
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type=upstream.content_type)  # fmt: skip

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def chaos(operator: Operator) -> AsyncIterator[tuple[Operator, ChaosProxy]]:
    """The operator whose controller talks to the API server through the chaos proxy (kopf's
    watches go direct: what fails here is the controller's own requests)."""
    proxy = ChaosProxy(EMULATOR_URL[-1])
    cfg = client_configuration(await proxy.start())
    cfg.retries = 0  # no urllib3 retries: every dropped connection reaches the controller
    await operator.stop()
    await operator.start(kube=Kube(kubernetes.client.ApiClient(cfg), user_agent="kvguard-operator/chaos"))
    await until(lambda: operator.controller.leading, "the controller to lead")
    try:
        yield operator, proxy
    finally:
        await proxy.stop()


async def test_transport_errors_back_off_exponentially_with_jitter_then_the_pass_succeeds(chaos: tuple[Operator, ChaosProxy]) -> None:
    op, proxy = chaos
    cluster = op.kmock
    # Every write about the model fails at the transport level (its status, its children, the
    # Secret); the Lease still renews, so what backs off is the model's pass, not leadership.
    proxy.drop = lambda r: r.method in ("PATCH", "POST") and "/leases/" not in r.path
    await apply_model(tiny_model())
    await until(lambda: len(op.controller.retries) >= 4, "four failed passes")
    assert not status_of(cluster)
    failures = [r for r in op.controller.retries if r[0] == (NS, "tiny")]
    assert all("TransportError" in error for *_, error in failures)
    errors = op.controller.settings.errors
    for attempt, delay in [(a, d) for _, a, d, _ in failures]:
        nominal = min(errors.cap, errors.base * 2**attempt)
        assert nominal * (1 - errors.jitter) - 1e-9 <= delay <= nominal * (1 + errors.jitter) + 1e-9, (attempt, delay)
    assert [a for _, a, _, _ in failures[:4]] == [0, 1, 2, 3]  # exponential: one attempt more each time
    proxy.drop = lambda _r: False
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "the status once the API answers")
    assert status["phase"] == "Progressing"
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "the Deployments")


# --- server-side apply, ownership, metrics, selectors ----------------------------------------------


def engine_pod(cluster: Any, name: str) -> dict[str, Any]:
    return objects_of(cluster, DEPLOYMENTS)[name]["spec"]["template"]["spec"]


async def test_a_field_removed_from_the_spec_is_removed_from_the_deployment(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"].update(nodeSelector={"pool": "cpu-big"}, resources={"limits": {"memory": "2Gi"}})
    await apply_model(body)
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    name = f"tiny-{rev}-decode"
    await until(lambda: name in objects_of(cluster, DEPLOYMENTS), "the decode Deployment")
    assert engine_pod(cluster, name)["nodeSelector"] == {"pool": "cpu-big"}
    await patch_model("tiny", {"spec": {"roles": {"decode": {"nodeSelector": None, "resources": None}}}})  # placement: same revision
    await until(lambda: "nodeSelector" not in engine_pod(cluster, name), "the nodeSelector gone from the Deployment")
    container = engine_pod(cluster, name)["containers"][0]
    assert "limits" not in container.get("resources", {})
    assert status_of(cluster)["targetRevision"] == rev
    applies = [r for r in list(cluster) if r.method == "PATCH" and f"/deployments/{name}" in r.url.path and not r.url.path.endswith("/status")]
    assert applies and all(r.params.get("fieldManager") == "kvguard" and r.headers["Content-Type"] == "application/apply-patch+yaml"
                           for r in applies)  # fmt: skip


async def test_S3_a_transfer_secret_planted_under_the_revisions_name_is_never_used(cluster: Any) -> None:
    """The operator reads no Secret (RBAC: create and delete only). A Secret created ahead of it
    under the name a revision's key would have had is not in the way: the operator's own has a
    random suffix, and the planted one is neither used nor touched."""
    body = tiny_model()
    rev = revision_of(InferenceModelSpec.model_validate(body["spec"]))
    planted_name = f"tiny-{rev}-kv-transfer"
    planted = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {"key": "YXR0YWNrZXI="},
               "metadata": {"name": planted_name, "namespace": NS, "labels": {"kvguard.io/revision": rev}}}  # fmt: skip
    await http("POST", f"/api/v1/namespaces/{NS}/secrets", planted)
    await apply_model(body)
    deployments = await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3 and objects_of(cluster, DEPLOYMENTS), "the rollout")
    used = {transfer_secret_of(d.raw) for d in deployments.values()}
    assert len(used) == 1 and planted_name not in used  # every pod reads the operator's own key
    (own_name,) = used
    own = await until(lambda: objects_of(cluster, SECRETS).get(own_name), "the operator's Secret")
    assert own["metadata"]["ownerReferences"][0]["uid"] == "uid-tiny" and own["data"]["key"] != "YXR0YWNrZXI="
    assert objects_of(cluster, SECRETS)[planted_name]["data"]["key"] == "YXR0YWNrZXI="  # never used, never modified
    assert not [r for r in list(cluster) if r.method == "GET" and "/secrets" in r.url.path]  # no Secret is ever read


async def test_a_spec_change_is_rolled_out_past_a_foreign_object_only_the_old_revision_needed(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside probe: the foreign object was remembered for the model, not for the spec, so a new
    spec (a new revision, which never needs that object) stayed halted on it with the old plan in
    its status. A new spec is tried afresh; the squatted object is still never touched."""
    monkeypatch.setattr(reconcile, "FOREIGN_RECHECK_SECONDS", 0.5)
    body = tiny_model()
    rev = revision_of(InferenceModelSpec.model_validate(body["spec"]))
    squatted = f"tiny-{rev}-router"
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": squatted, "namespace": NS, "labels": {"team": "someone-else"}},
              "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "theirs"}},
                       "template": {"metadata": {"labels": {"app": "theirs"}}, "spec": {"containers": [{"name": "c", "image": "theirs"}]}}}}  # fmt: skip
    await http("POST", f"/apis/apps/v1/namespaces/{NS}/deployments", theirs)
    await apply_model(body)
    status = await until(lambda: status_of(cluster).get("phase") == "Degraded" and status_of(cluster), "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "ForeignObject" and f"Deployment {NS}/{squatted}" in degraded["message"]
    await patch_model("tiny", {"spec": {"contextLength": 512}})
    status = await until(lambda: status_of(cluster).get("targetRevision") not in (None, rev) and status_of(cluster), "the new revision")
    new = status["targetRevision"]
    assert status["plan"]["contextLength"] == 512
    await until(lambda: sum(name.startswith(f"tiny-{new}-") for name in objects_of(cluster, DEPLOYMENTS)) == 3,
                "the new revision's Deployments")  # fmt: skip
    assert objects_of(cluster, DEPLOYMENTS)[squatted]["spec"]["template"]["spec"]["containers"] == [{"name": "c", "image": "theirs"}]


async def test_a_deleted_models_metrics_are_cleared(cluster: Any) -> None:
    await apply_model(tiny_model())
    labels = {"namespace": NS, "model": "tiny", "role": "decode"}
    await until(lambda: metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", labels) == 4.0, "the kv_ratio gauge")
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", labels) is None, "the gauge removed")
    for role in ("prefill", "decode"):
        assert metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", {**labels, "role": role}) is None


async def test_every_list_and_watch_of_children_carries_a_label_selector(cluster: Any) -> None:
    await apply_model(tiny_model())
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("phase") == "Ready", "Ready", CANARY_WAIT)
    collections = [r for r in list(cluster) if r.method == "GET" and r.name is None and r.resource is not None
                   and r.resource.plural in ("deployments", "services", "networkpolicies", "pods", "secrets", "configmaps")]  # fmt: skip
    assert collections, "kopf lists and watches the children"
    assert all(r.params.get("labelSelector") for r in collections), [str(r.url) for r in collections if not r.params.get("labelSelector")]


async def test_S3_a_model_deleted_and_created_again_with_the_same_spec_gets_a_new_secret(cluster: Any) -> None:
    """Outside probe: the operator remembered a revision's Secret by model name and revision, so the
    same spec under a new model (a new uid) was given the old model's Secret name, which the garbage
    collector had deleted: its pods could not have started, and anyone who may create Secrets could
    plant the key under the name its Deployments show."""
    await apply_model(tiny_model())
    first = await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3 and objects_of(cluster, SECRETS), "the first model's children")
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    # The garbage collector (kmock has none), as Kubernetes runs it: for as long as the test goes
    # on, every child of the deleted model goes. Collected once, a pass of the model still in
    # flight put them back (a level-based reconcile), and they blocked the new model (two workers' load).
    collector = asyncio.create_task(_collect_children_of(cluster, "uid-tiny"))
    try:
        await apply_model(tiny_model(uid="uid-tiny-2"))
        deployments = await until(lambda: len(new := _owned_by(cluster, DEPLOYMENTS, "uid-tiny-2")) == 3 and new, "the new model's")
    finally:
        collector.cancel()
    (used,) = {transfer_secret_of(d.raw) for d in deployments.values()}
    assert used not in first
    secret = await until(lambda: objects_of(cluster, SECRETS).get(used), "the new model's own Secret")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-tiny-2"


def _owned_by(cluster: Any, kind: Any, uid: str) -> dict[str, Any]:
    return {name: o for name, o in objects_of(cluster, kind).items()
            if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or ())}  # fmt: skip


async def _collect_children_of(cluster: Any, uid: str) -> None:
    """Delete every child of the owner `uid` as soon as one exists, until cancelled."""
    kinds = (("/apis/apps/v1", DEPLOYMENTS), ("/api/v1", SECRETS), ("/api/v1", SERVICES), ("/apis/networking.k8s.io/v1", NETPOLS))

    def orphans() -> list[tuple[str, Any, str]]:
        return [(path, kind, name) for path, kind in kinds for name in _owned_by(cluster, kind, uid)]

    while True:
        for path, kind, name in await until(orphans, "a child of the deleted model", timeout=3600):
            with contextlib.suppress(AssertionError):  # gone already (404)
                await http("DELETE", f"{path}/namespaces/{NS}/{kind.plural}/{name}")


async def test_deletions_leave_nothing_behind_in_the_leader_or_a_standby_and_cost_no_reads_at_a_hand_over(operator: Operator) -> None:
    """Audit: a standby recorded, for a later look by name, every child the leader deleted (it had
    deleted none itself), and read them all (404s) when it took over; the leader kept the keys of
    its own deletions whose watch event came before the DELETE's answer, and of its Secrets (no
    watch event ever comes for them). A standby records nothing, and the leader marks a deletion
    before sending it, for watched children only."""
    cluster = operator.kmock
    b = Operator(cluster)
    await b.start()
    try:
        await until(lambda: operator.controller.leading and not b.controller.leading, "A leading, B standing by")
        rev1, _ = await two_revisions(cluster, scale_down_delay=0, history=0)
        kinds = (DEPLOYMENTS, SERVICES, NETPOLS, SECRETS)
        await until(lambda: not [n for k in kinds for n in objects_of(cluster, k) if f"-{rev1}-" in n], "rev1 deleted", CANARY_WAIT)
        await until(lambda: not operator.controller.backend._deleting and operator.controller.queue.pending == 0,
                    "the leader's deletions done and their events seen")  # fmt: skip
        # B's watch sees the deletions in its own time: a child still in its cache when it takes the
        # lead is one more revision to delete (read by name), not a record left behind (CI, loaded).
        await until(lambda: not [o for o in b.controller.backend.index.children(NS, "tiny") if f"-{rev1}-" in o["metadata"]["name"]],
                    "B's watch saw rev1's children go")  # fmt: skip
        assert not b.controller.backend._left and not operator.controller.backend._left
        seen = len(list(cluster))
        lease_path = "/apis/coordination.k8s.io/v1/namespaces/kvguard-system/leases/kvguard-operator"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await http("PATCH", lease_path, {"spec": {"holderIdentity": b.controller.settings.identity, "renewTime": stamp}},
                   "application/merge-patch+json")  # fmt: skip
        await until(lambda: b.controller.leading and b.controller.passes > 0, "B leads and passes")
        await until(lambda: b.controller.queue.pending == 0, "B's first passes done")
        assert not [r for r in list(cluster)[seen:] if r.method == "GET" and f"-{rev1}-" in str(r.url)]
    finally:
        await b.stop()


async def test_a_renewal_answered_late_counts_from_when_it_was_sent(kmock: Any) -> None:
    """Outside probe: the holder counted its renew deadline from when a renewal's answer came
    back, not from when it was sent. The API server may have recorded the renewal long before (a
    slow answer, up to the client's 30 s timeout); a standby's clock starts at that record, so the
    holder went on writing past the point where a standby may already have taken over."""
    from kmock_api import declare_kvguard_resources

    url = declare_kvguard_resources(kmock)
    config = LeaseConfig(duration=15, renew_deadline=10, retry_period=2)
    clock = Clock()

    async def nothing() -> None:
        return None

    kube = Kube(kubernetes.client.ApiClient(client_configuration(url)))
    elector = LeaderElector(kube, "a", config, nothing, nothing, clock)
    await elector.attempt()
    assert elector.leading and elector.holds_lease()
    sent = kube.amerge_patch

    async def answered_late(*args: Any, **kwargs: Any) -> Any:
        written = await sent(*args, **kwargs)
        clock.now += 12  # the renewal was recorded at once; its answer took longer than the renew deadline
        return written

    kube.amerge_patch = answered_late  # type: ignore[method-assign]
    await elector.attempt()
    assert not elector.holds_lease(), "a renewal sent 12 s ago keeps no Lease with a 10 s renew deadline"
    kube.amerge_patch = sent  # type: ignore[method-assign]
    await elector.attempt()  # a prompt renewal holds it again
    assert elector.holds_lease()


@pytest.mark.parametrize(("headers", "details", "asked"), [({"Retry-After": "3"}, None, 3.0), ({}, {"retryAfterSeconds": 4}, 4.0),
                                                            ({}, None, None)])  # fmt: skip
async def test_throttling_waits_at_least_as_long_as_the_api_server_asks(headers: dict[str, str], details: Any, asked: float | None) -> None:
    """Outside probe: a 429 (API Priority and Fairness) with Retry-After: 3 was retried after
    1 s, then 2 s: the backoff ignored what the API server asked. The wait is now no shorter
    than the header (or the Status's details.retryAfterSeconds), within the error cap."""
    async def throttled(_request: web.Request) -> web.Response:
        body = {"kind": "Status", "code": 429, "reason": "TooManyRequests", "message": "too many requests", **({"details": details} if details else {})}
        return web.json_response(body, status=429, headers=headers)

    async with serving(throttled) as url:
        cfg = client_configuration(url)
        cfg.retries = 0
        kube = Kube(kubernetes.client.ApiClient(cfg))
        with pytest.raises(KubeError) as raised:
            await kube.apatch_status(ObjectRef("InferenceModel", "tiny", NS), {"phase": "Ready"}, "1")
        assert raised.value.status == 429 and raised.value.retry_after == asked
        controller = Controller(kube, None, list, fast_settings())  # type: ignore[arg-type]
        controller._failed((NS, "tiny"), raised.value)
        (_, attempt, delay, _) = controller.retries[-1]
        assert attempt == 0
        if asked is not None:
            assert delay >= asked
        else:
            assert delay < 1.0  # the error backoff's first step (base 0.2 s, jittered)
        controller.queue.clear()
