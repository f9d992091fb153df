"""The InferenceModel admission webhook (S7): the decision, the kopf handler called directly, and a
real HTTPS round trip through kopf's own webhook server and admission machinery.

The API server is kmock (policies are listed from it); the TLS is real: a CA and a serving
certificate made with the openssl CLI, and an aiohttp client that verifies the chain against the
CA exactly as an API server does with the webhook configuration's caBundle.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import socket
import ssl
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import kubernetes
import pytest
import yaml
from kmock_api import client_configuration, declare_kvguard_resources
from ports import reserved_port
from waiting import until

from kvguard.operator import webhook
from kvguard.operator.api import InferencePolicy
from kvguard.operator.kube import Kube
from kvguard.operator.webhook import FORBIDDEN, INVALID, AdmissionDenied, check_admission

ROOT = Path(__file__).resolve().parent.parent
NS = "models"
EMULATOR_URL: list[str] = []


def tiny_model(name: str = "tiny") -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1}
    return body


def policy_body(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvguard.io/v1alpha1", "kind": "InferencePolicy", "metadata": {"name": name}, "spec": spec}


def policy(name: str, **spec: Any) -> InferencePolicy:
    return InferencePolicy.model_validate(policy_body(name, **spec))


def denial(body: dict[str, Any], policies: list[InferencePolicy], *, old: dict[str, Any] | None = None,
           operation: str = "CREATE") -> AdmissionDenied | None:  # fmt: skip
    try:
        check_admission(body, old, operation, policies)
    except AdmissionDenied as exc:
        return exc
    return None


# --- the decision ------------------------------------------------------------------------------


def test_a_compliant_model_is_admitted() -> None:
    assert denial(tiny_model(), [policy("default", minKVRatio=2.0, requiredCanaryProbes=["isolation"])]) is None


def test_S7_a_policy_violation_is_denied_naming_field_rule_and_policy() -> None:
    body = tiny_model()
    body["spec"]["minKVRatio"] = 1.5
    exc = denial(body, [policy("default", minKVRatio=2.0)])
    assert exc is not None and exc.code == FORBIDDEN
    assert str(exc) == "spec.minKVRatio: 1.5 is below the policy's minimum 2 (InferencePolicy default, rule minKVRatio)"


@pytest.mark.parametrize(("metadata", "field"), [([1], "metadata:"), ({"name": "tiny", "annotations": [1]}, "metadata.annotations:"),
                                                ({"name": "tiny", "annotations": "x"}, "metadata.annotations:")])  # fmt: skip
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_metadata_that_is_not_an_object_is_denied_naming_it(metadata: object, field: str, operation: str) -> None:
    """It raised AttributeError ('list' object has no attribute 'get'), not a denial (outside probe)."""
    body = {**tiny_model(), "metadata": metadata}
    exc = denial(body, [], old=tiny_model() if operation == "UPDATE" else None, operation=operation)
    assert exc is not None and exc.code == INVALID and str(exc).startswith(field), exc


def test_an_update_that_changes_the_split_under_a_measured_weight_figure_is_denied_naming_measured_shards() -> None:
    """The figure was measured at the old split; planned as-is at TP1 it said 7 GiB where 28 GiB
    sit (outside probe: admitted, PASS). Re-check after every change of parallelism."""
    old = tiny_model()
    old["spec"]["weights"] = {"measuredBytesPerDevice": "1Mi"}
    old["spec"]["roles"] = {"prefill": {"tensorParallel": 2}, "decode": {"tensorParallel": 2}}
    new = copy.deepcopy(old)
    new["spec"]["roles"] = {"prefill": {"tensorParallel": 1}, "decode": {"tensorParallel": 1}}
    exc = denial(new, [], old=old, operation="UPDATE")
    assert exc is not None and exc.code == INVALID, exc
    assert str(exc).startswith("spec.weights.measuredShards: the split changed (decode 2 -> 1 GPUs, prefill 2 -> 1 GPUs)"), exc
    recorded = copy.deepcopy(new)
    recorded["spec"]["weights"]["measuredShards"] = 2  # where it was measured: the planner scales it
    remeasured = copy.deepcopy(new)
    remeasured["spec"]["weights"]["measuredBytesPerDevice"] = "2Mi"
    for fixed in (recorded, remeasured):
        found = denial(fixed, [], old=old, operation="UPDATE")
        assert found is None or not str(found).startswith("spec.weights.measuredShards"), found
    dropped = denial(new, [], old=recorded, operation="UPDATE")  # measuredShards removed, the figure kept: the same mistake
    assert dropped is not None and str(dropped).startswith("spec.weights.measuredShards: the split changed (measuredShards 2 dropped, decode at TP1 x PP1"), dropped


def test_an_update_that_reshapes_the_same_gpus_under_a_measured_weight_figure_is_denied() -> None:
    """TP8 -> TP2 x PP4 keeps 8 GPUs, so a check of GPU counts admitted it and the figure was planned
    as-is, but each end stage holds a whole vocabulary matrix over 2 GPUs where TP8 spread two over
    8 (a review). With measuredShards the planner scales it to the stage (heaviest_stage)."""
    old = tiny_model()
    old["spec"]["weights"] = {"measuredBytesPerDevice": "1Mi"}
    old["spec"]["roles"] = {"prefill": {"tensorParallel": 8}, "decode": {"tensorParallel": 8}}
    new = copy.deepcopy(old)
    new["spec"]["roles"]["decode"] = {"tensorParallel": 2, "pipelineParallel": 4}
    exc = denial(new, [], old=old, operation="UPDATE")
    assert exc is not None and str(exc).startswith(
        "spec.weights.measuredShards: the split changed (decode TP8 x PP1 -> TP2 x PP4)"), exc
    new["spec"]["weights"]["measuredShards"] = 8
    found = denial(new, [], old=old, operation="UPDATE")
    assert found is None or not str(found).startswith("spec.weights.measuredShards"), found


def _dp_attention_model(data_parallel: int, *, attention: bool = True, **weights: Any) -> dict[str, Any]:
    body = _sglang_model(weights={"measuredBytesPerDevice": "6Gi", **weights})
    body["spec"]["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    role = {"tensorParallel": 4, "dataParallel": data_parallel, "dataParallelAttention": attention}
    body["spec"]["roles"] = {"prefill": {"tensorParallel": 4}, "decode": role}
    return body


@pytest.mark.parametrize("measured_shards", [None, 4])
def test_an_update_that_changes_dp_attention_under_a_measured_weight_figure_is_denied_naming_it(measured_shards: int | None) -> None:
    """With dataParallelAttention each rank holds the attention weights of TP / DP GPUs: DP 2 -> 4
    changes the weights per GPU while TP x PP stays, so the split check let it through (outside
    probe), and no measuredShards scales it. `kvguard plan --dp` drops the figure in this case."""
    weights = {} if measured_shards is None else {"measuredShards": measured_shards}
    old = _dp_attention_model(2, **weights)
    assert denial(old, []) is None
    exc = denial(_dp_attention_model(4, **weights), [], old=old, operation="UPDATE")
    assert exc is not None and exc.code == INVALID, exc
    assert str(exc).startswith("spec.weights.measuredBytesPerDevice: the attention split changed (decode 2 -> 4 DP ranks "
                               "sharing attention) while measuredBytesPerDevice stayed"), exc  # fmt: skip
    toggled = denial(_dp_attention_model(2, attention=False, **weights), [], old=old, operation="UPDATE")
    assert toggled is not None and "(decode 2 -> 1 DP ranks sharing attention)" in str(toggled), toggled
    remeasured = _dp_attention_model(4, **weights)
    remeasured["spec"]["weights"]["measuredBytesPerDevice"] = "5Gi"
    assert denial(remeasured, [], old=old, operation="UPDATE") is None
    plain = _dp_attention_model(2, attention=False, **weights)  # DP without attention sharing: every rank holds it all
    more = _dp_attention_model(4, attention=False, **weights)
    assert denial(more, [], old=plain, operation="UPDATE") is None


def test_an_unplannable_spec_is_denied_with_the_planner_field_even_without_policies() -> None:
    body = tiny_model()
    body["spec"]["roles"] = {"decode": {"tensorParallel": 3}}
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID and str(exc).startswith("spec.roles.decode.tensorParallel:")


def test_an_unrenderable_spec_is_denied_with_the_render_field() -> None:
    body = tiny_model()
    body["spec"]["model"]["source"] = {"huggingFace": "org/model"}  # the kvguard engine loads from a directory
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID and str(exc).startswith("spec.model.source:")


def test_a_schema_error_is_denied_with_the_wire_field_name() -> None:
    body = tiny_model()
    body["spec"]["contextLenght"] = 4096
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID and "spec.contextLenght" in str(exc)


def set_path(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`body` with the dotted `path` set to `value` (missing parents created)."""
    node = body
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return body


# What a real API server refuses in the rendered Deployments (or what would run wrongly), refused
# here with the field named, rather than left to a 422 on a child object the model never reports.
REFUSED_FIELDS = [
    ("metadata.name", "1model", "metadata.name: '1model' must be lowercase letters"),
    ("metadata.name", "my.model", "metadata.name: 'my.model' must be lowercase letters"),
    ("metadata.namespace", "Bad_NS", "metadata.namespace: 'Bad_NS' must be a DNS-1123 label"),  # as docs/webhook.md says
    ("spec.roles.decode.nodeSelector", {"bad key!": "x"}, "nodeSelector key 'bad key!' is not a qualified name"),
    ("spec.roles.decode.nodeSelector", {"zone": "not a value"}, "is not a label value"),
    ("spec.roles.decode.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}], "value must be empty when operator is Exists"),
    ("spec.roles.decode.tolerations", [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 5}],
     "tolerationSeconds applies only to effect NoExecute"),
    ("spec.engine.image", " img:1 ", "spec.engine.image"),
    # Outside probe: the kubelet cannot parse these; the pods sat in InvalidImageName until the deadline.
    ("spec.engine.image", "Foo/Bar:latest", "spec.engine.image: 'Foo/Bar:latest' is not an image reference"),
    ("spec.engine.routerImage", "foo@sha256:abc", "spec.engine.routerImage: 'foo@sha256:abc' is not an image reference"),
    ("spec.engine.image", "foo::1", "is not an image reference"),
    ("spec.roles.decode.resources", {"limits": {"not a resource!": "1"}}, "resource name 'not a resource!' is not a qualified name"),
    ("spec.roles.decode.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}},
     "requests.memory (2Gi) must not exceed limits.memory (1Gi)"),
    # Outside probe: compared as floats, 2^53 + 1 bytes read as equal to 2^53 (the API server compares exactly).
    ("spec.roles.decode.resources", {"requests": {"memory": "9007199254740993"}, "limits": {"memory": "9007199254740992"}},
     "must not exceed limits.memory"),
    # Outside probe: a value here was silently replaced by the rendered GPU count.
    ("spec.roles.decode.resources", {"limits": {"nvidia.com/gpu": "8"}}, "spec.roles.decode.resources.limits: nvidia.com/gpu: 8 differs"),
    ("spec.roles.decode.replicas", 10**12, "spec.roles.decode.replicas"),
    ("spec.kvTransfer.port", 8001, "port: 8001 is decode's metrics port already"),
    ("spec.roles.decode.gpuCount", 4, "spec.roles.decode.gpuCount: hardware.device is cpu"),
    ("spec.roles.prefill.gpuType", "NVIDIA-H100", "spec.roles.prefill.gpuType: hardware.device is cpu"),
    ("spec.kvTransfer.backend", "nixl", "spec.kvTransfer.backend: nixl is SGLang's transfer backend"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "says"), REFUSED_FIELDS, ids=[f"{p}={v!r}"[:60] for p, v, _ in REFUSED_FIELDS])
def test_fields_a_real_api_server_or_the_engine_would_refuse_are_denied_by_name(path: str, value: Any, says: str) -> None:
    exc = denial(set_path(tiny_model(), path, value), [])
    assert exc is not None and exc.code == INVALID and says in str(exc), exc


def _sglang_model(**spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples/llama-3.1-8b-sglang-h100.yaml").read_text())
    body["metadata"] = {"name": "llama", "namespace": NS, "uid": "uid-llama", "generation": 1}
    body["spec"]["engine"]["image"] = "lmsysorg/sglang:v0.5.22"
    body["spec"]["model"]["source"] = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    body["spec"].update(spec)
    return body


def _in_a_configmap(body: dict[str, Any]) -> dict[str, Any]:
    del body["spec"]["model"]["architecture"]
    body["spec"]["model"]["architectureConfigMap"] = {"name": "config"}
    return body


@pytest.mark.parametrize("shape", ["no source", "blocked plan", "architecture in a ConfigMap"])
def test_render_checks_run_whatever_the_plan_and_source(shape: str) -> None:
    """Outside probe: the renderer's field checks ran only for a spec with a source, a passing
    plan and its architecture inline; every other shape stored a spec that could never deploy."""
    body = _sglang_model(kvTransfer={"encryption": "aes-gcm"})
    if shape == "blocked plan":
        body["spec"]["minKVRatio"] = 50.0
    elif shape == "architecture in a ConfigMap":
        _in_a_configmap(body)
    else:
        del body["spec"]["model"]["source"]
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID and str(exc).startswith("spec.kvTransfer.encryption:"), exc
    fixed = _sglang_model(**({"minKVRatio": 50.0} if shape == "blocked plan" else {}))
    if shape != "no source":
        assert denial(fixed, []) is None
        return
    del fixed["spec"]["model"]["source"]  # then refused for the source itself: nothing could deploy it
    exc = denial(fixed, [])
    assert exc is not None and exc.code == INVALID and str(exc) == "spec.model.source: required to deploy: set huggingFace or pvc"


def test_flag_and_parity_checks_need_no_architecture() -> None:
    """Outside probe: with the architecture in a ConfigMap, an extraArgs override of a rendered
    flag and a prefill/decode KV checksum mismatch (sglang#19398) were admitted."""
    override = _in_a_configmap(_sglang_model())
    override["spec"]["engine"]["extraArgs"] = ["--context-length", "999999"]
    exc = denial(override, [])
    assert exc is not None and str(exc).startswith("spec.engine.extraArgs:"), exc
    mismatch = _in_a_configmap(_sglang_model())
    mismatch["spec"]["roles"]["decode"]["extraArgs"] = ["--disaggregation-enable-kv-checksum"]
    exc = denial(mismatch, [])
    assert exc is not None and "prefill and decode must agree" in str(exc), exc


def test_a_blocked_plan_is_left_to_reconcile_when_no_policy_applies() -> None:
    body = tiny_model()
    body["spec"]["minKVRatio"] = 8.0  # the 4,096-token pool is 4x: blocked, reported by reconcile
    assert denial(body, []) is None
    assert denial(body, [policy("prod-only", namespaces=["prod"], minKVRatio=8.0, maxContextLength=16)]) is None


def test_metadata_only_updates_and_deletions_are_admitted_even_when_non_compliant() -> None:
    old = tiny_model()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"] = {"kvguard.io/last-handled-configuration": "{}"}  # kopf's bookkeeping
    strict = [policy("strict", maxContextLength=16)]
    assert denial(new, strict, old=old, operation="UPDATE") is None
    deleting = copy.deepcopy(new)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    deleting["metadata"]["finalizers"] = []  # the finalizer removed: metadata only
    assert denial(deleting, strict, old=old, operation="UPDATE") is None
    # Outside probe: a spec change riding on a deleting object was stored unchecked.
    deleting["spec"]["contextLength"] = 2048
    exc = denial(deleting, strict, old=old, operation="UPDATE")
    assert exc is not None and "rule maxContextLength" in str(exc)
    changed = copy.deepcopy(old)
    changed["spec"]["contextLength"] = 512
    exc = denial(changed, strict, old=old, operation="UPDATE")
    assert exc is not None and "spec.contextLength" in str(exc) and "rule maxContextLength" in str(exc)


@pytest.mark.parametrize("value", ["XYZ", "542C16A180", "542c16a18", "542c16a1800", "542c 16a180"])
def test_a_rollback_annotation_that_names_no_revision_is_refused_by_field(value: str) -> None:
    """An outside probe: `kvguard.io/rollback-to: XYZ` rolled the spec out, as a rollback to a
    revision that is not kept does, and `kvguard apply --local` said nothing of it. A value no
    revision can have is refused where it is written, as a pause that would not pause is."""
    body = tiny_model()
    body["metadata"]["annotations"] = {"kvguard.io/rollback-to": value}
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID and "metadata.annotations[kvguard.io/rollback-to]" in str(exc)
    relabelled = copy.deepcopy(body)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert denial(relabelled, [], old=body, operation="UPDATE") is None  # already stored: not locked out
    for good in ("542c16a180", " 542c16a180", "542c16a180\n", ""):  # read stripped, "" as none (reconcile)
        body["metadata"]["annotations"] = {"kvguard.io/rollback-to": good}
        assert denial(body, []) is None, good


@pytest.mark.parametrize("value", ["True", "yes", "1", "on", ""])
def test_a_pause_annotation_that_would_not_pause_is_refused_by_field(value: str) -> None:
    """Only "true" pauses (rollout.py); any other value was read as no pause at all, so a rollout
    its user meant to hold went on. Refused where it is written: on CREATE and on an UPDATE that
    writes it; an unrelated update of a model that already carries one is still admitted."""
    body = tiny_model()
    body["metadata"]["annotations"] = {"kvguard.io/pause": value}
    exc = denial(body, [])
    assert exc is not None and exc.code == INVALID
    assert "metadata.annotations[kvguard.io/pause]" in str(exc) and repr(value) in str(exc)
    old = tiny_model()
    exc = denial(body, [], old=old, operation="UPDATE")
    assert exc is not None and "kvguard.io/pause" in str(exc)
    relabelled = copy.deepcopy(body)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert denial(relabelled, [], old=body, operation="UPDATE") is None
    for good in ("true", "false", " true "):
        body["metadata"]["annotations"] = {"kvguard.io/pause": good}
        assert denial(body, []) is None
        assert denial(body, [], old=old, operation="UPDATE") is None


def policy_denial(body: dict[str, Any], *, old: dict[str, Any] | None = None, operation: str = "CREATE") -> AdmissionDenied | None:
    try:
        webhook.check_policy_admission(body, old, operation)
    except AdmissionDenied as exc:
        return exc
    return None


def test_a_readable_policy_is_admitted() -> None:
    body = policy_body("prod", minKVRatio=2.5, minEngineVersions={"sglang": "0.5.22", "vllm": "v0.11.0rc1"},
                       requiredCanaryProbes=["isolation", "over-length", "overLength"], maxContextLength=4096,
                       requiredEngineFlags=[{"engine": "sglang", "flags": ["--enable-metrics", "--schedule-policy=lpm", "--tp-size"]},
                                            {"engine": "kvguard", "flags": ["--header-timeout", "--page-size"]}],
                       namespaces=["prod", "team-a"],
                       namespaceSelector={"matchLabels": {"tier": "gpu"}, "matchExpressions": [
                           {"key": "team", "operator": "In", "values": ["a"]}, {"key": "frozen", "operator": "DoesNotExist"}]})  # fmt: skip
    assert policy_denial(body) is None
    assert policy_denial(policy_body("empty")) is None


@pytest.mark.parametrize(("spec", "says"), [
    ({"minEngineVersions": {"sglng": "0.5.22"}}, "spec.minEngineVersions.sglng: not an engine kind"),
    ({"minEngineVersions": {"vllm": "latest"}}, "spec.minEngineVersions.vllm: 'latest' is not a version"),
    ({"requiredCanaryProbes": ["isolation", "isolaton"]}, "spec.requiredCanaryProbes[1]: unknown probe 'isolaton'"),
    ({"minKVRatio": 0.5}, "spec.minKVRatio:"),
    ({"maxContextLength": 0}, "spec.maxContextLength:"),
    ({"sglangKVCanary": "warn"}, "spec.sglangKVCanary:"),
    # Outside probe: each admitted, then every kvguard model in scope got a 403 for the flag and a 422
    # for adding it to extraArgs; or the scope matched nothing and maxContextLength applied to no one.
    ({"requiredEngineFlags": [{"engine": "kvguard", "flags": ["--enable-metrics"]}]},
     "spec.requiredEngineFlags[0].flags[0]: --enable-metrics is not a kvguard worker flag"),
    ({"requiredEngineFlags": [{"engine": "sglang", "flags": ["--enable-metrics", ""]}]},
     "spec.requiredEngineFlags[0].flags[1]: '' is not a flag"),
    ({"requiredEngineFlags": [{"engine": "sglang", "flags": ["enable-metrics"]}]},
     "spec.requiredEngineFlags[0].flags[0]: 'enable-metrics' is not a flag"),
    ({"requiredEngineFlags": [{"engine": "sglang", "flags": ["--context-length=4096"]}]},
     "spec.requiredEngineFlags[0].flags[0]: --context-length=4096 is set by spec.contextLength"),
    ({"namespaces": ["prod", "Default"], "maxContextLength": 1}, "spec.namespaces[1]: 'Default' is not a namespace name"),
    ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": []}]}},
     "spec.namespaceSelector.matchExpressions[0].values: must be non-empty for operator In"),
    ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Exists", "values": ["a"]}]}},
     "spec.namespaceSelector.matchExpressions[0].values: must be empty for operator Exists"),
    ({"namespaceSelector": {"matchLabels": {"team": "a b"}}}, "spec.namespaceSelector.matchLabels[team]: 'a b' is not a label value"),
])  # fmt: skip
def test_a_policy_with_a_rule_that_cannot_be_read_is_denied_naming_the_field(spec: dict[str, Any], says: str) -> None:
    """Admitted, such a rule would fail closed on every model it covers at the next reconcile."""
    denied = policy_denial(policy_body("bad", **spec))
    assert denied is not None and denied.code == INVALID
    assert says in str(denied)


def test_policy_metadata_updates_and_deletions_are_admitted_even_when_unreadable() -> None:
    bad = policy_body("old", minEngineVersions={"tgi": "1.0"})  # written before this check existed
    relabel = copy.deepcopy(bad)
    relabel["metadata"]["labels"] = {"team": "platform"}
    assert policy_denial(relabel, old=bad, operation="UPDATE") is None
    assert policy_denial(bad, operation="DELETE") is None
    fixed = policy_body("old", minEngineVersions={"sglang": "0.5.22"})
    assert policy_denial(fixed, old=bad, operation="UPDATE") is None
    assert policy_denial(bad, old=fixed, operation="UPDATE") is not None  # a spec change is checked


def test_unreadable_policies_are_skipped_not_fatal() -> None:
    good = policy_body("good", maxContextLength=2048)
    bad = policy_body("bad", maxContextLength=-1)
    assert [p.metadata.name for p in webhook.parse_policies([good, bad])] == ["good"]


def test_policies_from_index_flattens_and_sorts() -> None:
    index = {None: [policy("b"), policy("a")]}
    assert [p.metadata.name for p in webhook.policies_from_index(index)] == ["a", "b"]


def test_webhook_server_settings_from_env(tmp_path: Path) -> None:
    assert webhook.webhook_server({}) is webhook.webhook_off
    assert webhook.webhook_server({"KVGUARD_WEBHOOK_CERT_DIR": str(tmp_path)}) is webhook.webhook_off  # no Secret yet
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).write_text("x")
    server = webhook.webhook_server({"KVGUARD_WEBHOOK_CERT_DIR": str(tmp_path), "KVGUARD_WEBHOOK_PORT": "8443"})
    assert isinstance(server, kopf.WebhookServer)
    assert (server.port, server.addr, server.certfile, server.cafile) == (8443, "0.0.0.0", tmp_path / "tls.crt", tmp_path / "ca.crt")


# --- kmock: the API server the policies are listed from -----------------------------------------


def _login(**_: Any) -> kopf.ConnectionInfo:  # test-only: point kopf at the emulator
    return kopf.ConnectionInfo(server=EMULATOR_URL[-1], insecure=True)


def webhook_registry() -> kopf.OperatorRegistry:
    """The webhook's handlers alone, as `kvguard.operator.webhook.register` installs them, plus the
    emulator login (kept off kopf's default registry, which other test modules' operators use)."""
    registry = kopf.OperatorRegistry()
    webhook.register(registry)
    kopf.on.login(registry=registry)(_login)
    kopf.on.event(*webhook.POLICIES, registry=registry)(_record_index)
    return registry


INDEXED: list[list[str]] = []


def _record_index(inference_policies: kopf.Index[Any, InferencePolicy], **_: Any) -> None:
    """What a reconcile handler sees in the policy index (kopf fills it before calling handlers)."""
    INDEXED.append([p.metadata.name for p in webhook.policies_from_index(inference_policies)])


@pytest.fixture
def api(kmock: Any) -> Any:
    url = declare_kvguard_resources(kmock, policies=True)
    EMULATOR_URL.append(url)
    webhook._KUBE[:] = [Kube(kubernetes.client.ApiClient(client_configuration(url)))]
    yield kmock
    webhook._KUBE.clear()
    EMULATOR_URL.pop()


async def create_policy(name: str, **spec: Any) -> None:
    async with aiohttp.ClientSession() as session:
        url = f"{EMULATOR_URL[-1]}/apis/kvguard.io/v1alpha1/inferencepolicies"
        async with session.post(url, json=policy_body(name, **spec)) as resp:
            assert resp.status < 300, await resp.text()


async def test_the_kopf_handler_called_directly_lists_policies_and_denies(api: Any) -> None:
    await create_policy("default", minKVRatio=2.0, requiredCanaryProbes=["isolation"])
    body = tiny_model()
    await webhook.validate_inference_model(body=kopf.Body(body), old=None, operation="CREATE")  # admitted
    body["spec"]["canary"] = {"isolation": {"enabled": False}}
    with pytest.raises(kopf.AdmissionError) as caught:
        await webhook.validate_inference_model(body=kopf.Body(body), old=None, operation="CREATE")
    assert caught.value.code == FORBIDDEN
    assert "spec.canary.isolation.enabled" in str(caught.value) and "rule requiredCanaryProbes" in str(caught.value)


# --- real HTTPS through kopf's webhook server ---------------------------------------------------


def make_certificates(folder: Path) -> None:
    """A CA and a serving certificate for 127.0.0.1/localhost signed by it (like cert-manager's
    self-signed Issuer + CA Issuer would produce), as tls.crt / tls.key / ca.crt."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl CLI to make test certificates")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvguard-test-ca")
    run("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=localhost")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")  # fmt: skip


def admission_review(body: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "kvguard.io", "version": "v1alpha1", "kind": "InferenceModel"},
            "resource": {"group": "kvguard.io", "version": "v1alpha1", "resource": "inferencemodels"},
            "name": body["metadata"]["name"],
            "namespace": body["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": body,
            "oldObject": old,
            "dryRun": False,
        },
    }


@pytest.fixture
def port() -> Iterator[int]:
    with reserved_port() as held:  # until the test ends: no one else can take it before kopf binds it
        yield held


@pytest.fixture
async def https_webhook(api: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, port: int) -> AsyncIterator[str]:
    """The real operator (kopf, this module's handlers) with its webhook on loopback HTTPS."""
    make_certificates(tmp_path)
    INDEXED.clear()
    monkeypatch.setenv("KVGUARD_WEBHOOK_CERT_DIR", str(tmp_path))
    monkeypatch.setenv("KVGUARD_WEBHOOK_ADDR", "127.0.0.1")
    monkeypatch.setenv("KVGUARD_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("KVGUARD_METRICS_PORT", "0")
    client_configuration(EMULATOR_URL[-1], make_default=True)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.watching.server_timeout = 5
    stop = threading.Event()
    operator = kopf.operator(clusterwide=True, standalone=True, settings=settings, registry=webhook_registry(), stop_flag=stop)
    thread = threading.Thread(target=asyncio.run, args=(operator,), daemon=True)  # kopf owns its loop
    thread.start()
    try:
        await until(lambda: _listening(port), "the webhook server to listen")
        yield f"https://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 60)
        assert not thread.is_alive(), "kopf did not stop"
        kubernetes.client.ApiClient.set_default(None)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def post_review(base: str, ca: Path, review: dict[str, Any], path: str = webhook.WEBHOOK_ID) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=str(ca))  # verify the chain and the 127.0.0.1 SAN
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/{path}", json=review, ssl=context) as resp:
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())


async def test_https_round_trip_allows_and_denies(https_webhook: str, tmp_path: Path) -> None:
    await create_policy("default", minKVRatio=2.0, requiredCanaryProbes=["isolation", "over_length"])
    await create_policy("prod", namespaces=[NS], maxContextLength=1024)
    ca = tmp_path / "ca.crt"
    await until(lambda: INDEXED and INDEXED[-1] == ["default", "prod"], "both policies in the index")

    review = admission_review(tiny_model())
    allowed = await post_review(https_webhook, ca, review)
    assert allowed["kind"] == "AdmissionReview" and allowed["response"]["uid"] == review["request"]["uid"]
    assert allowed["response"]["allowed"] is True

    too_long = tiny_model()
    too_long["spec"]["contextLength"] = 2048
    denied = (await post_review(https_webhook, ca, admission_review(too_long)))["response"]
    assert denied["allowed"] is False and denied["status"]["code"] == FORBIDDEN
    assert denied["status"]["message"] == (
        "spec.contextLength: 2,048 exceeds the policy's maximum 1,024 (InferencePolicy prod, rule maxContextLength)"
    )

    # An UPDATE that changes the spec is checked; one that only touches metadata is not.
    old = tiny_model()
    tags_off = copy.deepcopy(old)
    tags_off["spec"]["canary"] = {"overLength": {"enabled": False}}
    denied = (await post_review(https_webhook, ca, admission_review(tags_off, "UPDATE", old)))["response"]
    assert denied["allowed"] is False and "spec.canary.overLength.enabled" in denied["status"]["message"]
    relabel = copy.deepcopy(too_long)
    relabel["metadata"]["labels"] = {"team": "a"}
    ok = (await post_review(https_webhook, ca, admission_review(relabel, "UPDATE", too_long)))["response"]
    assert ok["allowed"] is True


async def test_https_round_trip_for_an_inference_policy(https_webhook: str, tmp_path: Path) -> None:
    """The policy webhook through kopf's server at its own path, as the API server calls it."""
    ca = tmp_path / "ca.crt"
    good = policy_body("prod", minEngineVersions={"sglang": "0.5.22"})
    review = policy_review(good)
    allowed = await post_review(https_webhook, ca, review, path=webhook.POLICY_WEBHOOK_ID)
    assert allowed["response"]["uid"] == review["request"]["uid"] and allowed["response"]["allowed"] is True
    bad = policy_body("prod", requiredCanaryProbes=["isolaton"])
    denied = (await post_review(https_webhook, ca, policy_review(bad), path=webhook.POLICY_WEBHOOK_ID))["response"]
    assert denied["allowed"] is False and denied["status"]["code"] == INVALID
    assert denied["status"]["message"].startswith("spec.requiredCanaryProbes[0]: unknown probe 'isolaton'")


def policy_review(body: dict[str, Any]) -> dict[str, Any]:
    """What the API server sends for a CREATE of a (cluster-scoped) InferencePolicy."""
    review = admission_review({**body, "metadata": {**body["metadata"], "namespace": ""}})
    review["request"]["kind"] = {"group": "kvguard.io", "version": "v1alpha1", "kind": "InferencePolicy"}
    review["request"]["resource"] = {"group": "kvguard.io", "version": "v1alpha1", "resource": "inferencepolicies"}
    return review


async def test_https_planner_error_and_untrusted_clients(https_webhook: str, tmp_path: Path) -> None:
    bad = tiny_model()
    bad["spec"]["roles"] = {"prefill": {"tensorParallel": 3}}
    response = (await post_review(https_webhook, tmp_path / "ca.crt", admission_review(bad)))["response"]
    assert response["allowed"] is False and response["status"]["code"] == INVALID
    assert response["status"]["message"].startswith("spec.roles.prefill.tensorParallel:")

    # A client that does not trust the CA (an API server with the wrong caBundle) cannot connect.
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        async with aiohttp.ClientSession() as session:
            await session.post(f"{https_webhook}/{webhook.WEBHOOK_ID}", json=admission_review(bad))


# --- what any client that reaches the webhook's port may send (outside probe) -------------------


async def _post_raw(base: str, ca: Path, data: bytes, path: str = webhook.WEBHOOK_ID) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/{path}", data=data, ssl=context, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, resp.reason or ""


def _reshaped(change: Callable[[dict[str, Any]], object]) -> bytes:
    review = admission_review(tiny_model(), "UPDATE", tiny_model())
    change(review)
    return json.dumps(review).encode()


HOSTILE_REVIEWS = {
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "a list": b"[1, 2]",
    "no request": b'{"kind": "AdmissionReview"}',
    "a huge number": b'{"request": ' + b"9" * 100_000 + b"}",
    "not UTF-8": b'{"request": "\xff"}',
    "a DELETE with a 512 KiB uid": _reshaped(lambda r: r["request"].update(operation="DELETE", uid="u" * (1 << 19))),
    "an object uid of 512 KiB": _reshaped(lambda r: r["request"]["object"]["metadata"].update(uid="u" * (1 << 19))),
    "metadata a string": _reshaped(lambda r: r["request"]["object"].update(metadata="m")),
    "no resource": _reshaped(lambda r: r["request"].pop("resource")),
    "no userInfo": _reshaped(lambda r: r["request"].pop("userInfo")),
}


async def test_reviews_no_api_server_sends_are_400s_before_kopf_keeps_anything(https_webhook: str, tmp_path: Path) -> None:
    """kopf keeps a memo under the object's uid of every review that is not a CREATE, for good:
    300 DELETE reviews with 1 MiB uids took the operator from 79 to 397 MB; the other shapes were
    500s with a traceback logged. Now each is a 400 naming what is wrong, and kopf never sees it."""
    ca = tmp_path / "ca.crt"
    for what, data in HOSTILE_REVIEWS.items():
        status, reason = await _post_raw(https_webhook, ca, data)
        assert status == 400, (what, status, reason)
        assert reason, what
    good = admission_review(tiny_model(), "UPDATE", tiny_model())
    assert (await post_review(https_webhook, ca, good))["response"]["allowed"] is True  # the guard lets real ones through


async def test_a_review_body_sent_slowly_is_cut_off(https_webhook: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-sent body was held for good (400 of them: +0.7 GB)."""
    monkeypatch.setattr(webhook, "REVIEW_BODY_TIMEOUT_S", 0.5)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    host, port = https_webhook.removeprefix("https://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context, server_hostname="127.0.0.1")
    writer.write(f"POST /{webhook.WEBHOOK_ID} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readline(), 30)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head


def test_a_client_ca_makes_the_webhook_hear_only_certificates_it_signed(tmp_path: Path) -> None:
    """With client-ca.crt beside the serving certificate, the server asks every client for a
    certificate signed by it (the API server's, named in its AdmissionConfiguration)."""
    make_certificates(tmp_path)
    assert webhook.webhook_server({"KVGUARD_WEBHOOK_CERT_DIR": str(tmp_path)}).verify_mode is None
    (tmp_path / "client-ca.crt").write_bytes((tmp_path / "ca.crt").read_bytes())
    server = webhook.webhook_server({"KVGUARD_WEBHOOK_CERT_DIR": str(tmp_path)})
    assert isinstance(server, webhook.GuardedWebhookServer)
    assert server.verify_mode == ssl.CERT_REQUIRED and Path(server.verify_cafile) == tmp_path / "client-ca.crt"
    _, context = server._build_ssl()
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    (tmp_path / "client-ca.crt").unlink()  # removed while running: the next build (a renewed tls.crt) serves without it
    _, context = server._build_ssl()
    assert context is not None and context.verify_mode == ssl.CERT_NONE and server.verify_cafile is None


def test_a_spec_too_large_for_an_update_review_is_denied_at_create() -> None:
    """An UPDATE's review carries the model twice and the webhook reads at most 1 MiB: a model of
    256 arguments of 4 KiB each was admitted, and then every update of it -- its finalizer's
    removal too -- got a 413 (a review)."""
    big = tiny_model()
    big["spec"]["engine"] = {**big["spec"].get("engine", {}), "extraArgs": ["--x=" + "a" * 2000] * 256}
    exc = denial(big, [])
    assert exc is not None and str(exc).startswith("spec: ") and "bytes of JSON; at most 409,600" in str(exc)
    assert denial(tiny_model(), []) is None
