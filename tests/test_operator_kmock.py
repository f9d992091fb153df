"""The real operator (kopf + kvguard.operator.handlers) against kmock's Kubernetes emulator.

What this proves: the handlers, the controller and kube.py drive a real HTTP API with real watch
streams; create/update/resume/Deployment events converge on the rendered objects; a blocked plan
changes nothing that runs (S7, S8); children carry the owner references that make deletion clean.
The canary gate (S7/S8) runs for real: the Kubernetes backend's endpoint resolution is pointed at
real `kvguard` router/prefill/decode processes on loopback (`LocalDeployment`), so the operator
scrapes real /metrics and runs the real canary suite; a revision can be mapped to a deployment
started with the incident's faults. What it does not prove: kmock has no scheduler, Deployment
controller, pods, DNS or garbage collector, so the test plays the Deployment controller (it sets
readyReplicas), resolves URLs itself and checks owner references instead of waiting for GC.
e2e/ runs the same flows on a real cluster.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest
from kmock_api import ApiServer
from operator_harness import (
    CANARY_WAIT,
    DEPLOYMENTS,
    EVENTS,
    IM,
    NETPOLS,
    NS,
    ROUTES,
    SECRETS,
    SERVICES,
    Operator,
    apply_model,
    assert_rbac_allows,
    condition,
    events_of,
    http,
    mark_ready,
    never_finishes,
    objects_of,
    patch_model,
    promoted,
    stable_revision,
    status_of,
    stays,
    tiny_model,
    two_revisions,
    until,
)

from kvguard.operator import metrics
from kvguard.operator.render import TRANSFER_SECRET_ANNOTATION, transfer_secret_of
from kvguard.workers.launcher import LocalDeployment

pytestmark = [pytest.mark.kmock(cls=ApiServer)]


async def test_apply_renders_workloads_status_and_conditions(cluster: Any) -> None:
    await apply_model(tiny_model())
    deployments = await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3 and objects_of(cluster, DEPLOYMENTS),
                              "three Deployments")  # fmt: skip
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status")
    rev = status["targetRevision"]
    assert set(deployments) == {f"tiny-{rev}-prefill", f"tiny-{rev}-decode", f"tiny-{rev}-router"}
    decode = deployments[f"tiny-{rev}-decode"]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:4] == ["kvguard", "worker", "--role", "decode"]
    assert cmd[cmd.index("--kv-pool-tokens") + 1] == "4096"  # the plan's pool, not a guess
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    key_ref = next(e for e in container["env"] if e["name"] == "KVGUARD_TRANSFER_KEY")["valueFrom"]["secretKeyRef"]
    # S3: a name with a random suffix, which nobody could have created before the operator did.
    assert key_ref["key"] == "key" and re.fullmatch(f"tiny-{rev}-kv-transfer-[0-9a-f]{{8}}", key_ref["name"])
    for role in ("prefill", "router"):  # every role reads the same Secret
        env = deployments[f"tiny-{rev}-{role}"]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "KVGUARD_TRANSFER_KEY", "valueFrom": {"secretKeyRef": key_ref}} in env
    router_cmd = deployments[f"tiny-{rev}-router"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"http://tiny-{rev}-prefill.{NS}.svc:8000" in router_cmd
    services = await until(lambda: len(objects_of(cluster, SERVICES)) == 3 and objects_of(cluster, SERVICES), "Services")
    assert services[f"tiny-{rev}-decode"]["spec"]["selector"]["kvguard.io/role"] == "decode"
    secret = await until(lambda: objects_of(cluster, SECRETS).get(key_ref["name"]), "Secret")
    assert len(secret["data"]["key"]) >= 64 and list(objects_of(cluster, SECRETS)) == [key_ref["name"]]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-tiny"
    assert not [r for r in list(cluster) if r.method == "GET" and "/secrets" in r.url.path]  # never read
    netpol = await until(lambda: objects_of(cluster, NETPOLS).get(f"tiny-{rev}-decode"), "NetworkPolicy")
    transfer_rule = netpol["spec"]["ingress"][1]
    assert transfer_rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert transfer_rule["from"][0]["podSelector"]["matchLabels"]["kvguard.io/role"] == "prefill"
    assert status["phase"] == "Progressing" and status["kvRatio"] == 4.0
    assert condition(status, "KVPoolSufficient")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "True"
    assert status["plan"]["roles"]["decode"]["poolTokens"] == 4096

    assert status["rollout"]["state"] == "CanaryDeploying" and "revision" not in status
    assert "tiny" not in objects_of(cluster, SERVICES)  # nothing routes to an unverified revision (S7)
    await mark_ready(cluster, rev)  # the Deployment event triggers the next reconcile
    status = await until(lambda: status_of(cluster).get("phase") == "Ready" and status_of(cluster), "phase Ready", CANARY_WAIT)
    assert status["revision"] == rev and status["canary"] == "Passed"
    assert condition(status, "CanaryPassed")["status"] == "True"
    rollout = status["rollout"]
    assert rollout["state"] == "Stable" and rollout["canary"]["verdict"] == "pass"
    assert [(w["role"], w["poolTokens"], w["sufficient"]) for w in rollout["workers"]] == [("prefill", 4096, True), ("decode", 4096, True)]
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "RolloutComplete"
    model_service = await until(lambda: objects_of(cluster, SERVICES).get("tiny"), "the model Service")
    assert model_service["spec"]["selector"]["kvguard.io/revision"] == rev
    assert metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", {"namespace": NS, "model": "tiny", "role": "decode"}) == 4.0


async def test_S7_S8_blocked_change_leaves_running_revision_untouched(cluster: Any) -> None:
    await apply_model(tiny_model())
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status")
    rev = status["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("phase") == "Ready", "Ready", CANARY_WAIT)
    await promoted(cluster, rev)  # every write of the promotion has landed
    before = {kind: copy.deepcopy({n: o.raw for n, o in objects_of(cluster, kind).items()})
              for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)}  # fmt: skip
    blocked_before = metrics.REGISTRY.get_sample_value("kvguard_operator_blocked_plans_total", {"reason": "KVPoolTooSmall"}) or 0

    await patch_model("tiny", {"spec": {"kvPoolTokens": 1024}, "metadata": {"generation": 2}})  # 1x context < 2x
    status = await until(lambda: status_of(cluster).get("phase") == "Blocked" and status_of(cluster), "phase Blocked")
    kv = condition(status, "KVPoolSufficient")
    assert kv["status"] == "False" and kv["reason"] == "KVPoolTooSmall"
    assert "1,024 tokens = 1.00x context 1,024 < 2x required" in kv["message"]
    assert "Suggested fixes" in kv["message"]
    assert status["revision"] == rev and status["targetRevision"] != rev
    assert condition(status, "Ready")["status"] == "True"  # the stable revision still serves
    events = await until(lambda: [e for e in objects_of(cluster, EVENTS).values() if e["reason"] == "KVPoolTooSmall"], "Warning event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "tiny"
    await stays(lambda: {kind: {n: o.raw for n, o in objects_of(cluster, kind).items()} for kind in before} == before,
                "a blocked plan must not change anything that runs")  # fmt: skip
    await until(lambda: metrics.REGISTRY.get_sample_value("kvguard_operator_blocked_plans_total", {"reason": "KVPoolTooSmall"})
                == blocked_before + 1, "the blocked plan counted")  # fmt: skip


async def first_revision_stable(cluster: Any) -> str:
    """The tiny model applied and its first revision promoted (the test plays the kubelet)."""
    await apply_model(tiny_model())
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("revision") == rev, "the first revision stable", CANARY_WAIT)
    return rev


async def a_new_revision(cluster: Any, stable: str) -> str:
    """The model's weights changed: the revision it is rolled out to."""
    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})
    return await until(lambda: (r := status_of(cluster).get("targetRevision")) != stable and r, "a new revision")


async def test_new_revision_rolls_out_beside_stable_then_replaces_it(cluster: Any) -> None:
    rev1 = await first_revision_stable(cluster)
    rev2 = await a_new_revision(cluster, rev1)
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "both revisions running")
    assert objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev1  # S8
    await mark_ready(cluster, rev2)
    await until(lambda: status_of(cluster).get("revision") == rev2, "rev2 promoted", CANARY_WAIT)
    await until(lambda: objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev2, "traffic on rev2")
    scaled = await until(lambda: all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev1 in n)
                         and objects_of(cluster, DEPLOYMENTS), "rev1 scaled to zero, kept for rollback")  # fmt: skip
    assert scaled[f"tiny-{rev1}-decode"]["metadata"]["annotations"]["kvguard.io/replicas-before-scale-down"] == "1"
    states = [(h["revision"], h["state"]) for h in status_of(cluster)["history"]]
    assert states[:2] == [(rev2, "Stable"), (rev1, "Superseded")]


async def test_a_superseded_candidate_is_deleted_with_its_network_policies(cluster: Any) -> None:
    """A candidate replaced before it served (here: by a newer spec) is deleted, all of it --
    Deployments, Services, NetworkPolicies, Secret (its deletion raised a TypeError once, so
    superseded candidates were never deleted) -- and history says it was Superseded."""
    await apply_model(tiny_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, NETPOLS)) == 3 and len(objects_of(cluster, DEPLOYMENTS)) == 3, "rev1's objects")

    await patch_model("tiny", {"spec": {"model": {"source": {"revision": "r2"}}}})  # rev1 never became ready
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    for kind in (DEPLOYMENTS, SERVICES, NETPOLS, SECRETS):
        await until(lambda kind=kind: objects_of(cluster, kind) and not [n for n in objects_of(cluster, kind) if rev1 in n],
                    f"rev1's {kind} deleted")  # fmt: skip
    rev2_policies = {f"tiny-{rev2}-{role}" for role in ("prefill", "decode", "router")}
    await until(lambda: set(objects_of(cluster, NETPOLS)) == rev2_policies, "only rev2's NetworkPolicies")
    history = await until(lambda: [(h["revision"], h["state"]) for h in status_of(cluster)["history"]][:2] == [(rev2, "Candidate"), (rev1, "Superseded")]
                          and status_of(cluster)["history"], "history: the replaced candidate Superseded, not Candidate")  # fmt: skip
    assert history[1]["message"] == f"replaced by {rev2} before it served"


async def test_candidate_runs_at_canary_replicas_and_is_measured_again_at_full_scale_before_traffic(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"]["replicas"] = 2  # canaryReplicas defaults to 1
    await apply_model(body)
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    decode = objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]
    assert decode["spec"]["replicas"] == 1 and decode["metadata"]["annotations"]["kvguard.io/scale"] == "canary"
    await mark_ready(cluster, rev)
    await until(lambda: objects_of(cluster, DEPLOYMENTS)[f"tiny-{rev}-decode"]["spec"]["replicas"] == 2, "the scale-up", CANARY_WAIT,
                lambda: status_of(cluster).get("rollout"))  # fmt: skip
    status = status_of(cluster)
    assert status["rollout"]["state"] == "Promoting" and status["rollout"]["canary"]["verdict"] == "pass"
    assert {w["worker"] for w in status["rollout"]["workers"]} == {f"tiny-{rev}-prefill-0", f"tiny-{rev}-decode-0"}
    assert "tiny" not in objects_of(cluster, SERVICES)  # no traffic before the full-scale measurement
    await mark_ready(cluster, rev)
    status = await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster), "promoted at full scale", CANARY_WAIT,
                         lambda: status_of(cluster).get("rollout"))  # fmt: skip
    assert status["rollout"]["measuredScale"] == "full"
    assert sorted(w["worker"] for w in status["rollout"]["workers"]) == [f"tiny-{rev}-decode-0", f"tiny-{rev}-decode-1", f"tiny-{rev}-prefill-0"]
    await until(lambda: objects_of(cluster, SERVICES).get("tiny"), "the model Service")


@pytest.mark.parametrize("allowed", [False, True])
async def test_fault_annotation_reaches_the_workers_only_where_fault_injection_is_allowed(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, allowed: bool
) -> None:
    if allowed:
        monkeypatch.setenv("KVGUARD_ALLOW_FAULT_INJECTION", "true")  # what manifests/testing/fault-injection sets
    body = tiny_model()
    body["metadata"]["annotations"] = {"kvguard.io/faults": "unsafe_reject_path,no_tags"}
    await apply_model(body)
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    for deployment in objects_of(cluster, DEPLOYMENTS).values():
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env.get("KVGUARD_FAULTS") == ("unsafe_reject_path,no_tags" if allowed else None)
    reason = "FaultInjection" if allowed else "FaultInjectionIgnored"
    event = await until(lambda: [e for e in objects_of(cluster, EVENTS).values() if e["reason"] == reason], f"a {reason} event")
    assert event[0]["type"] == "Warning"


async def test_invalid_spec_becomes_degraded_condition_not_a_crash(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"]["tensorParallel"] = 3  # does not divide 2 KV heads
    await apply_model(body)
    status = await until(lambda: status_of(cluster).get("phase") == "Degraded" and status_of(cluster), "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and "spec.roles.decode.tensorParallel" in degraded["message"]
    assert objects_of(cluster, DEPLOYMENTS) == {}
    await patch_model("tiny", {"spec": {"roles": {"decode": {"tensorParallel": 1}}}})
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "recovery once the spec is fixed")


async def test_children_are_owned_for_garbage_collection(cluster: Any) -> None:
    await apply_model(tiny_model(uid="uid-owner"))
    await until(lambda: len(objects_of(cluster, NETPOLS)) == 3 and len(objects_of(cluster, SECRETS)) == 1, "children")
    children = [o for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for o in objects_of(cluster, kind).values()]
    for child in children:
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "kvguard.io/v1alpha1", "kind": "InferenceModel", "name": "tiny",
                         "uid": "uid-owner", "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: cluster.objects[IM, NS, "tiny"].deleted, "the model deleted")
    logging.getLogger(__name__).info("kmock has no garbage collector; owner references above are what a cluster's GC uses")


def metadata_of(obj: Any) -> tuple[dict[str, str], dict[str, str]]:
    meta = obj["metadata"]
    return dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})


@pytest.mark.parametrize("edit", [
    {"labels": {"kvguard.io/model": None}},  # the child left the operator's index
    {"labels": {"kvguard.io/revision": "bogus"}},  # status read "decode (not created)"
    {"annotations": {"kvguard.io/applied-hash": None}},
    {"labels": {"app.kubernetes.io/managed-by": None}},  # the watch's selector: it leaves as DELETED
])  # fmt: skip
async def test_metadata_edits_to_an_owned_child_are_applied_over(cluster: Any, edit: dict[str, Any]) -> None:
    """Outside probe: an edit of a child's labels or annotations bumps no generation, so the
    operator, which looked only at generations, never put them back (and a child without its model
    label left the index for good: status said its revision's decode was "not created")."""
    rev = await stable_revision(cluster)
    name = f"tiny-{rev}-decode"
    before = metadata_of(objects_of(cluster, DEPLOYMENTS)[name])
    edited = await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", {"metadata": edit}, "application/merge-patch+json")
    assert metadata_of(edited) != before  # the API server's answer: the store may already be put back
    await until(lambda: metadata_of(objects_of(cluster, DEPLOYMENTS)[name]) == before, "the labels and annotations put back")
    # The phase follows the rollout (Ready throughout: the revision stays stable); the Ready
    # condition follows the workloads, and is False while the edit hides the decode Deployment.
    # Waiting on the phase read the status written during the edit (CI, once in 6 runs).
    status = await until(lambda: (s := status_of(cluster)).get("phase") == "Ready" and s.get("conditions")
                         and condition(s, "Ready")["status"] == "True" and s, "Ready again")  # fmt: skip
    assert status["revision"] == rev


async def test_S3_an_edit_of_the_transfer_secret_annotation_moves_no_pod_and_makes_no_secret(cluster: Any) -> None:
    """Audit: the annotation naming a revision's Secret was taken as the truth, so setting it to a
    made-up name (a metadata edit, no Secret rights needed) read as "the Secret was deleted": a new
    Secret, every pod of the revision rolled, the old Secret left behind, at every such edit. The
    Secret this operator made and found there comes first; the edit is applied over."""
    rev = await stable_revision(cluster)
    deployments = objects_of(cluster, DEPLOYMENTS)
    (secret,) = {transfer_secret_of(d) for d in deployments.values()}
    generations = {n: d["metadata"]["generation"] for n, d in deployments.items()}
    edit = {"metadata": {"annotations": {TRANSFER_SECRET_ANNOTATION: f"tiny-{rev}-kv-transfer-deadbeef"}}}
    for name in deployments:
        await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", edit, "application/merge-patch+json")
    await until(lambda: {transfer_secret_of(d) for d in objects_of(cluster, DEPLOYMENTS).values()} == {secret}, "the annotations put back")
    await stays(lambda: {n: d["metadata"]["generation"] for n, d in objects_of(cluster, DEPLOYMENTS).items()} == generations,
                "no pod template changed", 2.0)  # fmt: skip
    assert list(objects_of(cluster, SECRETS)) == [secret]


# A scale-down delay the tests' edits land within, however slow the machine: the delay is counted
# from the promotion pass, whole seconds (up to 1 s shorter), and a loaded machine can stall a test
# for seconds between seeing the promotion and acting on it (3 s was overrun; 10 s left little room).
WITHIN_THE_DELAY_S = 20


async def test_a_retired_revisions_deployment_without_the_operators_labels_is_still_scaled_to_zero(cluster: Any) -> None:
    """Audit: a child that loses the label the watches select by leaves the watch cache, not the
    cluster. The serving revision is applied again, but an old one is only scaled down (and later
    deleted), which looked only in the cache: its decode kept running, unseen, for good. Children
    the cache lacks are read by name; this one is scaled to zero with its labels put back."""
    rev1, _ = await two_revisions(cluster, scale_down_delay=WITHIN_THE_DELAY_S)
    name = f"tiny-{rev1}-decode"
    assert objects_of(cluster, DEPLOYMENTS)[name]["spec"]["replicas"] == 1  # still within its scale-down delay
    unlabelled = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}}
    await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", unlabelled, "application/merge-patch+json")
    scaled = await until(lambda: (d := objects_of(cluster, DEPLOYMENTS)[name])["spec"]["replicas"] == 0 and d, "the old decode at zero",
                         CANARY_WAIT)  # fmt: skip
    assert scaled["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvguard-operator"


UNLABELLED = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}}
API_PATHS = {DEPLOYMENTS: "/apis/apps/v1", SERVICES: "/api/v1", NETPOLS: "/apis/networking.k8s.io/v1"}


async def test_a_kept_revisions_deployment_that_loses_its_labels_gets_them_back_and_stays_at_zero(cluster: Any) -> None:
    """Audit: a child that leaves the watch (its labels taken off) was found again only when its
    revision was applied, scaled or deleted. A kept revision parked at zero is none of those: its
    decode stayed unlabelled, and scaled up by hand it stayed up. The watch's DELETED makes the
    model's next pass look for it by name and put the labels back, whatever the revision's state."""
    rev1, _ = await two_revisions(cluster, scale_down_delay=0)
    name = f"tiny-{rev1}-decode"
    await until(lambda: objects_of(cluster, DEPLOYMENTS)[name]["spec"]["replicas"] == 0, "the kept revision at zero")
    await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", UNLABELLED, "application/merge-patch+json")
    relabelled = await until(lambda: (d := objects_of(cluster, DEPLOYMENTS)[name])["metadata"]["labels"].get("app.kubernetes.io/managed-by")
                             == "kvguard-operator" and d, "its labels back")  # fmt: skip
    assert relabelled["metadata"]["labels"]["kvguard.io/revision"] == rev1
    await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", {"spec": {"replicas": 2}}, "application/merge-patch+json")
    await until(lambda: objects_of(cluster, DEPLOYMENTS)[name]["spec"]["replicas"] == 0, "scaled back to zero")
    assert objects_of(cluster, DEPLOYMENTS)[name]["spec"]["replicas"] == 0


async def test_a_previous_revision_whose_children_all_lose_their_labels_is_still_deleted(cluster: Any) -> None:
    """Audit: with every child of the previous stable revision unlabelled during its scale-down
    delay, nothing of it was left in the watch cache, so it was neither scaled down nor deleted
    (revisionHistoryLimit 0): it ran at full replicas for good."""
    rev1, _ = await two_revisions(cluster, scale_down_delay=WITHIN_THE_DELAY_S, history=0)
    for kind in (DEPLOYMENTS, SERVICES, NETPOLS):
        for name in [n for n in objects_of(cluster, kind) if f"-{rev1}-" in n]:
            await http("PATCH", f"{API_PATHS[kind]}/namespaces/{NS}/{kind.plural}/{name}", UNLABELLED, "application/merge-patch+json")
    assert status_of(cluster)["rollout"].get("scaleDownRevision") == rev1  # all unlabelled within the delay
    await until(lambda: not [n for kind in (DEPLOYMENTS, SERVICES, NETPOLS) for n in objects_of(cluster, kind) if f"-{rev1}-" in n],
                "the previous revision deleted", CANARY_WAIT)  # fmt: skip
    assert not [n for n in objects_of(cluster, DEPLOYMENTS) if f"-{rev1}-" in n]


async def test_an_owned_child_without_the_operators_labels_is_still_its_own_after_a_restart(operator: Operator) -> None:
    """Outside probe: ownership was the labels and the controller owner reference together, so a
    restarted operator called its own Deployment, labels removed, a ForeignObject and halted the
    model. The controller owner reference (this InferenceModel's uid) decides; the labels come back."""
    cluster = operator.kmock
    rev = await stable_revision(cluster)
    name = f"tiny-{rev}-decode"
    before = metadata_of(objects_of(cluster, DEPLOYMENTS)[name])
    unlabelled = {"metadata": {"labels": {"kvguard.io/model": None, "app.kubernetes.io/managed-by": None}}}
    await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", unlabelled, "application/merge-patch+json")
    await operator.restart()  # its watch lists by the managed-by label: the Deployment is not in its cache
    await until(lambda: metadata_of(objects_of(cluster, DEPLOYMENTS)[name]) == before, "the labels put back")
    # Waited on the Ready condition, not the phase: the phase may be read from a status written
    # before the labels were put back (the race test_metadata_edits_to_an_owned_child_are_applied_over had).
    status = await until(lambda: (s := status_of(cluster)).get("phase") == "Ready" and s.get("conditions")
                         and condition(s, "Ready")["status"] == "True" and s, "Ready")  # fmt: skip
    assert not [c for c in status["conditions"] if c["type"] == "Degraded" and c["status"] == "True"]


async def test_a_pod_template_edited_while_no_operator_runs_is_applied_over_when_one_starts(operator: Operator) -> None:
    """Outside probe (churn at scale): a starting operator took every child whose annotations and
    replicas matched as up to date, so an image or env edited while no operator led stayed for
    good, resyncs included. A process applies each child once before it trusts it (a no-op on an
    unchanged object)."""
    cluster = operator.kmock
    rev = await stable_revision(cluster)
    name = f"tiny-{rev}-decode"

    def image() -> str:
        return str(objects_of(cluster, DEPLOYMENTS)[name]["spec"]["template"]["spec"]["containers"][0]["image"])

    rendered = image()
    await operator.stop()
    containers = copy.deepcopy(objects_of(cluster, DEPLOYMENTS)[name]["spec"]["template"]["spec"]["containers"])
    containers[0]["image"] = "example.com/not-what-the-operator-renders:1"
    await http("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", {"spec": {"template": {"spec": {"containers": containers}}}},
               "application/merge-patch+json")  # fmt: skip
    assert image() != rendered
    await operator.start()
    await until(lambda: image() == rendered, "the rendered image back")


async def test_a_model_created_again_under_its_name_does_not_take_over_the_old_models_children(cluster: Any) -> None:
    """Outside probe: the same operator process re-applied, with force, the children the deleted
    model left for the garbage collector, rewriting their owner to the new model (so they escaped
    collection); a restarted operator refused them. It remembered what it applied by name alone.
    Now both refuse (ForeignObject) until the collector has removed the old model's children."""
    rev = await stable_revision(cluster)
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    await until(lambda: cluster.objects[IM, NS, "tiny"].deleted, "the model deleted")
    await apply_model(tiny_model(uid="uid-tiny2"))
    degraded = await until(lambda: next((c for c in status_of(cluster).get("conditions", [])
                                         if c["type"] == "Degraded" and c["reason"] == "ForeignObject"), None), "ForeignObject")  # fmt: skip
    assert f"tiny-{rev}-" in degraded["message"]
    owners = {n: d["metadata"]["ownerReferences"][0]["uid"] for n, d in objects_of(cluster, DEPLOYMENTS).items()}
    assert owners == {f"tiny-{rev}-{role}": "uid-tiny" for role in ("prefill", "decode", "router")}
    assert {s["metadata"]["ownerReferences"][0]["uid"] for s in objects_of(cluster, SECRETS).values()} == {"uid-tiny"}  # none made while blocked
    for kind, path in ((DEPLOYMENTS, "/apis/apps/v1"), (SERVICES, "/api/v1"), (NETPOLS, "/apis/networking.k8s.io/v1"), (SECRETS, "/api/v1")):
        for name in list(objects_of(cluster, kind)):  # the garbage collector, which kmock lacks
            await http("DELETE", f"{path}/namespaces/{NS}/{kind.plural}/{name}")
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "the new model's Deployments")
    assert {d["metadata"]["ownerReferences"][0]["uid"] for d in objects_of(cluster, DEPLOYMENTS).values()} == {"uid-tiny2"}


async def test_S8_failing_canary_scales_it_to_zero_and_leaves_stable_untouched(cluster: Any, incident_build: LocalDeployment) -> None:
    await apply_model(tiny_model())
    rev1 = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev1)
    await until(lambda: status_of(cluster).get("revision") == rev1, "rev1 stable", CANARY_WAIT)
    await promoted(cluster, rev1)
    stable_before = {n: copy.deepcopy(o.raw) for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)
                     for n, o in objects_of(cluster, kind).items()}  # fmt: skip

    await patch_model("tiny", {"spec": {"engine": {"version": "incident-build"}}})
    rev2 = await until(lambda: (r := status_of(cluster).get("targetRevision")) != rev1 and r, "a new revision")
    ROUTES[rev2] = incident_build
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 6, "the canary beside stable")
    await mark_ready(cluster, rev2)
    await until(lambda: all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev2 in n),
                "the failed canary scaled to zero", CANARY_WAIT)  # fmt: skip
    assert status_of(cluster)["rollout"]["state"] == "Failed"  # until its pods are gone
    await mark_ready(cluster, rev2)  # the Deployment controller removes the pods: status.replicas 0
    status = await until(lambda: (s := status_of(cluster)).get("rollout", {}).get("state") == "RolledBack" and s,
                         "the canary rolled back", CANARY_WAIT)  # fmt: skip
    canary = condition(status, "CanaryPassed")
    assert canary["status"] == "False" and "canary fail" in canary["message"] and "over_length" in canary["message"]
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "CanaryFailed" and "kvguard.io/retry" in degraded["message"]
    assert status["revision"] == rev1 and status["phase"] == "Degraded" and status["canary"] == "Failed"
    assert condition(status, "Ready")["status"] == "True"
    assert "over_length" in status["rollout"]["canary"]["failedProbes"]
    assert all(d["spec"]["replicas"] == 0 for n, d in objects_of(cluster, DEPLOYMENTS).items() if rev2 in n)
    events = await until(lambda: [e for e in objects_of(cluster, EVENTS).values() if e["reason"] == "CanaryFailed"], "Warning event")
    assert events[0]["type"] == "Warning" and f"revision {rev1} keeps serving" in events[0]["message"]
    def stable_now() -> dict[str, Any]:
        return {n: o.raw for kind in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for n, o in objects_of(cluster, kind).items()
                if n in stable_before}  # fmt: skip

    await stays(lambda: stable_now() == stable_before, "S8: the stable revision and the model Service are unchanged")
    states = [(h["revision"], h["state"]) for h in status["history"]]
    assert states[:2] == [(rev2, "Failed"), (rev1, "Stable")]


async def test_S8_operator_restart_mid_rollout_resumes_without_double_promotion(operator: Operator) -> None:
    cluster = operator.kmock
    await operator.restart(suite=never_finishes)
    await apply_model(tiny_model())
    rev = (await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "status"))["targetRevision"]
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "Deployments")
    await mark_ready(cluster, rev)
    await until(lambda: status_of(cluster).get("rollout", {}).get("state") == "CanaryVerifying" and status_of(cluster)["rollout"].get("workers"),
                "pools measured, canary running")  # fmt: skip
    await stays(lambda: status_of(cluster)["rollout"]["state"] == "CanaryVerifying" and "revision" not in status_of(cluster)
                and "tiny" not in objects_of(cluster, SERVICES), "no promotion while the canary runs")  # fmt: skip
    await operator.restart()  # the running canary dies with the process; status holds the step
    status = await until(lambda: status_of(cluster).get("revision") == rev and status_of(cluster), "promoted after the restart", CANARY_WAIT)
    assert status["rollout"]["state"] == "Stable" and status["rollout"]["canary"]["verdict"] == "pass"
    await promoted(cluster, rev)
    await stays(lambda: [e.get("count", 1) for e in events_of(cluster, "RevisionPromoted")] == [1], "exactly one promotion")
    await until(lambda: objects_of(cluster, SERVICES)["tiny"]["spec"]["selector"]["kvguard.io/revision"] == rev, "traffic routed")


async def test_the_namespaced_install_allows_everything_its_operator_does(operator: Operator) -> None:
    """The operator as `manifests/namespaced/` runs it (WATCH_NAMESPACES=models, a Role there and a
    read-only ClusterRole) through a rollout, a replacement and a deletion: every request it sends
    is one those roles allow (kmock authorizes nothing; the fixture checks the cluster-wide install)."""
    cluster = operator.kmock
    await operator.stop()
    since = len(list(cluster))
    await operator.start(namespaces=(NS,))
    rev2 = await a_new_revision(cluster, await first_revision_stable(cluster))
    await mark_ready(cluster, rev2)
    await until(lambda: status_of(cluster).get("revision") == rev2, "rev2 promoted", CANARY_WAIT)
    await http("DELETE", f"/apis/kvguard.io/v1alpha1/namespaces/{NS}/inferencemodels/tiny")
    labels = {"namespace": NS, "model": "tiny", "role": "decode"}
    await until(lambda: metrics.REGISTRY.get_sample_value("kvguard_operator_kv_ratio", labels) is None, "the model forgotten")
    assert_rbac_allows(cluster, "manifests/namespaced", since)


async def test_a_model_created_before_its_architecture_configmap_proceeds_once_it_exists(cluster: Any, tiny_model_dir: Any) -> None:
    """Outside probe: the missing ConfigMap was cached as missing for KVGUARD_CONFIGMAP_TTL (300 s)
    and nothing asked again (ConfigMaps are not watched; the Degraded pass set no timer), so the
    model said "not found" for ~12 minutes after the ConfigMap was made, spec edits included."""
    import json

    body = tiny_model()
    del body["spec"]["model"]["architecture"]
    body["spec"]["model"]["architectureConfigMap"] = {"name": "tiny-config"}
    await apply_model(body)
    degraded = await until(lambda: next((c for c in status_of(cluster).get("conditions", [])
                                         if c["type"] == "Degraded" and c["status"] == "True"), None), "Degraded")  # fmt: skip
    assert degraded["reason"] == "ArchitectureUnavailable" and "not found" in degraded["message"]
    config = (tiny_model_dir / "config.json").read_text()
    await http("POST", f"/api/v1/namespaces/{NS}/configmaps",
               {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tiny-config", "namespace": NS},
                "data": {"config.json": config}})  # fmt: skip
    status = await until(lambda: status_of(cluster).get("targetRevision") and status_of(cluster), "planned from the ConfigMap")
    assert condition(status, "Degraded")["status"] == "False" and json.loads(config)["num_hidden_layers"] == 2
    assert status["plan"]["roles"]["decode"]["poolTokens"] == 4096
