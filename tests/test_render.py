"""Renderers and engine adapters, without any API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.operator.api import InferenceModel
from kvguard.operator.numerics import numerics_change
from kvguard.operator.planner import plan
from kvguard.operator.render import (
    TRANSFER_SECRET_ANNOTATION,
    Owner,
    RenderError,
    render_model_service,
    render_revision,
    render_rollout_revision,
    render_transfer_secret,
    transfer_secret_of,
)
from kvguard.operator.revision import numerics_of, revision_of

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
OWNER = Owner(name="m", namespace="ns", uid="u")


def model(example: str, **spec_updates: Any) -> InferenceModel:
    body = yaml.safe_load((EXAMPLES / example).read_text())
    body["spec"].update(spec_updates)
    return InferenceModel.model_validate(body)


def objects(m: InferenceModel) -> dict[tuple[str, str], dict[str, Any]]:
    rendered = render_revision(m.spec, plan(m.spec), OWNER, "r1")
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered}


def command(objs: dict[tuple[str, str], dict[str, Any]], role: str) -> list[str]:
    return objs["Deployment", f"m-r1-{role}"]["spec"]["template"]["spec"]["containers"][0]["command"]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_flags_follow_the_documented_names() -> None:
    m = model("incident-fixed.yaml", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5.4"},
              model={**yaml.safe_load((EXAMPLES / "incident-fixed.yaml").read_text())["spec"]["model"],
                     "source": {"huggingFace": "Qwen/Qwen2.5-14B-Instruct-1M", "revision": "abc123"}})  # fmt: skip
    objs = objects(m)
    prefill, decode = command(objs, "prefill"), command(objs, "decode")
    assert prefill[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(prefill, "--disaggregation-mode") == "prefill" and flag(decode, "--disaggregation-mode") == "decode"
    assert flag(prefill, "--disaggregation-bootstrap-port") == "8998" and "--disaggregation-bootstrap-port" not in decode
    assert flag(prefill, "--context-length") == str(m.spec.context_length)
    assert flag(prefill, "--tp-size") == str(m.spec.roles.prefill.tensor_parallel)
    assert flag(prefill, "--revision") == "abc123" and "--enable-metrics" in prefill
    router = command(objs, "router")
    assert router[:3] == ["python3", "-m", "sglang_router.launch_router"] and "--pd-disaggregation" in router
    assert router[router.index("--prefill") + 2] == "8998"  # bootstrap port rendered explicitly
    pod = objs["Deployment", "m-r1-prefill"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"
    gpus = m.spec.roles.prefill.tensor_parallel
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    # No pod of an SGLang revision reads a kvguard key, so the operator creates no Secret for it.
    assert not render_rollout_revision(m.spec, plan(m.spec), OWNER, "r1").uses_transfer_key()


def test_vllm_flags_and_kv_transfer_config() -> None:
    base = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    m = model("llama-3.1-8b-sglang-h100.yaml", engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0",
              "routerImage": "vllm-router:1"}, model={**base["model"], "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}})  # fmt: skip
    objs = objects(m)
    decode = command(objs, "decode")
    assert decode[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert flag(decode, "--max-model-len") == str(m.spec.context_length)
    assert flag(decode, "--tensor-parallel-size") == "1" and "--gpu-memory-utilization" in decode
    assert json.loads(flag(decode, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    env = objs["Deployment", "m-r1-decode"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env


@pytest.mark.parametrize("kind, fraction_flag", [("sglang", "--mem-fraction-static"), ("vllm", "--gpu-memory-utilization")])
def test_the_memory_fraction_is_rendered_exactly_as_planned(kind: str, fraction_flag: str) -> None:
    """S7: the plan checks the pool at the spec's memoryFraction, so the engine must be given that
    very number. `:g` wrote 0.1234564999 as 0.123456, a smaller pool than the one that passed
    (outside probe: 2,294,552 tokens rendered against 2,294,562 needed)."""
    base = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
    engine = {"kind": kind, "image": "engine:1", "routerImage": "router:1"}
    m = model("llama-3.1-8b-sglang-h100.yaml", engine=engine, memoryFraction=0.1234564999,
              model={**base["model"], "source": {"huggingFace": "org/model"}})  # fmt: skip
    for role in ("prefill", "decode"):
        assert float(flag(command(objects(m), role), fraction_flag)) == 0.1234564999
    default = model("llama-3.1-8b-sglang-h100.yaml", engine=engine, memoryFraction=None, model={**base["model"], "source": {"huggingFace": "org/model"}})
    assert flag(command(objects(default), "decode"), fraction_flag) == {"sglang": "0.88", "vllm": "0.9"}[kind]


def test_kvguard_worker_flags_and_restricted_pods() -> None:
    m = model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"],
              "source": {"pvc": {"claimName": "models", "path": "tiny"}}}, kvTransfer={"maxBatch": "8Mi", "port": 9100})  # fmt: skip
    objs = objects(m)
    decode = command(objs, "decode")
    assert decode[:4] == ["kvguard", "worker", "--role", "decode"]
    assert flag(decode, "--max-transfer-batch") == str(8 * 1024**2) and flag(decode, "--transfer-port") == "9100"
    assert flag(decode, "--device") == "cpu" and flag(decode, "--model") == "/models/tiny"
    netpol = objs["NetworkPolicy", "m-r1-decode"]
    assert netpol["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 9100}]
    for (kind, _), obj in objs.items():
        if kind == "Deployment":
            container = obj["spec"]["template"]["spec"]["containers"][0]
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert container["securityContext"]["runAsNonRoot"] is True
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "u"


def test_kvguard_workers_services_are_headless_and_the_router_resolves_them() -> None:
    """A request's calls must reach one pod (prefill's call and its ticket, decode's call and the
    token channel it names); a Service's virtual IP spreads connections over pods. The router
    resolves the headless Services to the ready pods (`--discovery dns`); the router's own
    Service, which clients and Gateways reach, keeps its virtual IP."""
    m = model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"],
              "source": {"pvc": {"claimName": "models", "path": "tiny"}}})  # fmt: skip
    objs = objects(m)
    assert objs["Service", "m-r1-prefill"]["spec"]["clusterIP"] == "None"
    assert objs["Service", "m-r1-decode"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in objs["Service", "m-r1-router"]["spec"]
    router = command(objs, "router")
    assert flag(router, "--discovery") == "dns"
    assert flag(router, "--prefill") == "http://m-r1-prefill.ns.svc:8000"
    sglang = objects(model("incident-fixed.yaml", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5.4"},
                           model={**yaml.safe_load((EXAMPLES / "incident-fixed.yaml").read_text())["spec"]["model"],
                                  "source": {"huggingFace": "Qwen/Qwen2.5-14B-Instruct-1M", "revision": "abc123"}}))  # fmt: skip
    assert all("clusterIP" not in o["spec"] for (kind, _), o in sglang.items() if kind == "Service")  # its own router


@pytest.mark.parametrize("engine", ["kvguard", "sglang", "vllm"])
def test_retiring_pods_keep_serving_until_the_route_moves_then_drain_within_their_grace(engine: str) -> None:
    """A deleted pod leaves its endpoints while it is signalled, and an HTTPRoute's weight change
    takes seconds to reach the gateway: every engine's container sleeps in preStop before SIGTERM,
    and the pod's grace covers that sleep, the kvguard worker's drain and its shutdown after it."""
    from kvguard.workers.args import DEFAULT_DRAIN_TIMEOUT_S
    from kvguard.workers.servers import SHUTDOWN_GRACE_S

    hf = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    if engine == "kvguard":
        pvc = {"pvc": {"claimName": "models", "path": "tiny"}}
        m = model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"], "source": pvc})
    else:
        base = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]
        m = model("llama-3.1-8b-sglang-h100.yaml", engine={**base["engine"], "kind": engine, "image": f"{engine}:1", "routerImage": "router:1"}, model={**base["model"], "source": hf})
    deployments = [o for o in objects(m).values() if o["kind"] == "Deployment"]
    assert deployments
    for obj in deployments:
        pod = obj["spec"]["template"]["spec"]
        sleep = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) >= 5
        assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + DEFAULT_DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S


def test_kvguard_commands_are_accepted_by_our_own_worker_cli() -> None:
    """The render/CLI contract: every rendered kvguard command parses with `kvguard worker`, binds
    all interfaces, and decode advertises its pod IP (from the downward API) for KV transfer."""
    from kvguard.cli import build_parser

    m = model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"],
              "source": {"pvc": {"claimName": "models", "path": "tiny"}}})  # fmt: skip
    objs = objects(m)
    for role in ("prefill", "decode", "router"):
        cmd = command(objs, role)
        args = build_parser().parse_args(cmd[1:])
        assert args.role == role and args.host == "0.0.0.0" and args.model_name == m.spec.model.name
    decode = objs["Deployment", "m-r1-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert flag(decode["command"], "--advertise-host") == "$(KVGUARD_POD_IP)"
    pod_ip = next(e for e in decode["env"] if e["name"] == "KVGUARD_POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The router names its revision on every answer (x-kvguard-revision): behind a Gateway that is
    # how a client, and e2e's traffic recorder, tell which revision served it.
    assert flag(command(objs, "router"), "--revision-id") == "r1"


def test_engine_limits_become_field_errors() -> None:
    spec_model = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"]
    m = model("tiny-cpu.yaml", model={**spec_model, "source": {"huggingFace": "org/x"}})
    with pytest.raises(RenderError) as err:
        objects(m)
    assert err.value.field == "spec.model.source"


def test_S3_transfer_secret_is_immutable_and_key_sized() -> None:
    secret = render_transfer_secret(OWNER, "r1", b"\x01" * 32, "m-r1-kv-transfer-0a1b2c3d")
    assert secret["immutable"] is True and secret["metadata"]["name"] == "m-r1-kv-transfer-0a1b2c3d"
    with pytest.raises(ValueError):
        render_transfer_secret(OWNER, "r1", b"short", "m-r1-kv-transfer-0a1b2c3d")
    for other in ("m-r2-kv-transfer-0a1b2c3d", "kube-root-ca", "m-r1-kv-transfer-x/y"):  # only this revision's own names
        with pytest.raises(ValueError):
            render_transfer_secret(OWNER, "r1", b"\x01" * 32, other)


def test_S3_the_pods_read_the_key_from_the_secret_the_operator_names() -> None:
    """The operator picks the Secret's name when it creates it (a random suffix): every role's
    pods are pointed at that name, and nothing else in the revision changes."""
    spec_model = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"]
    m = model("tiny-cpu.yaml", model={**spec_model, "source": {"pvc": {"claimName": "models", "path": "tiny"}}})
    rendered = render_rollout_revision(m.spec, plan(m.spec), OWNER, "r1")
    assert rendered.uses_transfer_key()
    named = rendered.with_transfer_secret("m-r1-kv-transfer-0a1b2c3d")
    deployments = [o for o in named.objects if o["kind"] == "Deployment"]
    assert len(deployments) == 3 and {transfer_secret_of(d) for d in deployments} == {"m-r1-kv-transfer-0a1b2c3d"}
    for d in deployments:  # recorded where the operator's watch cache keeps it (it keeps no pod template)
        assert d["metadata"]["annotations"][TRANSFER_SECRET_ANNOTATION] == "m-r1-kv-transfer-0a1b2c3d"
        env = d["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "KVGUARD_TRANSFER_KEY", "valueFrom": {"secretKeyRef": {"name": "m-r1-kv-transfer-0a1b2c3d", "key": "key"}}} in env
    assert {transfer_secret_of(o) for o in rendered.objects if o["kind"] == "Deployment"} == {"m-r1-kv-transfer"}  # unchanged
    assert [o for o in named.objects if o["kind"] != "Deployment"] == [o for o in rendered.objects if o["kind"] != "Deployment"]


def test_revision_changes_only_with_kv_relevant_fields() -> None:
    m = model("tiny-cpu.yaml")
    rev = revision_of(m.spec)
    scaled = m.spec.model_copy(deep=True)
    scaled.roles.decode.replicas = 5
    scaled.roles.decode.node_selector = {"pool": "a"}
    assert revision_of(scaled) == rev
    assert revision_of(m.spec.model_copy(update={"context_length": 512})) != rev


def test_numerics_change_with_what_decides_outputs_not_with_the_engine_build() -> None:
    base = tiny_on_pvc().spec
    same_outputs = [
        tiny_on_pvc(engine={"kind": "kvguard", "version": "new-build"}),
        tiny_on_pvc(contextLength=512, roles={"decode": {"dataParallel": 2, "replicas": 3}}),
    ]
    other_outputs = [
        tiny_on_pvc(weights={"quantization": "fp16"}),
        tiny_on_pvc(kvCacheDtype="fp8"),
        tiny_on_pvc(roles={"decode": {"tensorParallel": 2}}),
        model("tiny-cpu.yaml", model={**base.model.model_dump(by_alias=True, exclude_none=True),
                                      "source": {"pvc": {"claimName": "models", "path": "tiny"}, "revision": "seed-1"}}),
    ]  # fmt: skip
    assert {numerics_of(m.spec) for m in same_outputs} == {numerics_of(base)}
    assert all(numerics_of(m.spec) != numerics_of(base) for m in other_outputs)
    changes = [numerics_change(numerics_of(m.spec), numerics_of(base)) for m in other_outputs]
    assert [c.other_model for c in changes] == [False, False, False, True]  # type: ignore[union-attr]
    assert changes[1].fields == ("spec.kvCacheDtype: auto -> fp8",)  # type: ignore[union-attr]
    assert changes[3].fields == ("spec.model",)  # type: ignore[union-attr]


def tiny_on_pvc(**spec_updates: Any) -> InferenceModel:
    source = {"pvc": {"claimName": "models", "path": "tiny"}}
    return model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"], "source": source},
                 **spec_updates)  # fmt: skip


def test_canary_scale_caps_replicas_and_is_recorded_on_each_deployment() -> None:
    m = tiny_on_pvc(roles={"prefill": {"replicas": 2}, "decode": {"replicas": 3}, "router": {"replicas": 2}},
                    rollout={"canaryReplicas": 2})  # fmt: skip
    for scale, expected in (("canary", {"prefill": 2, "decode": 2, "router": 1}), ("full", {"prefill": 2, "decode": 3, "router": 2})):
        rendered = render_revision(m.spec, plan(m.spec), OWNER, "r1", scale)  # type: ignore[arg-type]
        deployments = {o["metadata"]["labels"]["kvguard.io/role"]: o for o in rendered if o["kind"] == "Deployment"}
        assert {role: d["spec"]["replicas"] for role, d in deployments.items()} == expected
        assert {d["metadata"]["annotations"]["kvguard.io/scale"] for d in deployments.values()} == {scale}
    assert revision_of(m.spec) == revision_of(tiny_on_pvc().spec)  # replicas and rollout settings scale in place


def test_injected_faults_reach_every_container_of_that_revision_only() -> None:
    m = tiny_on_pvc()
    faulty = render_revision(m.spec, plan(m.spec), OWNER, "r2", faults="unsafe_reject_path,no_tags")
    clean = render_revision(m.spec, plan(m.spec), OWNER, "r1")
    for rendered, expected in ((faulty, ["unsafe_reject_path,no_tags"] * 3), (clean, [])):
        env = [e["value"] for o in rendered if o["kind"] == "Deployment"
               for e in o["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "KVGUARD_FAULTS"]  # fmt: skip
        assert env == expected
    assert revision_of(m.spec, "no_tags") != revision_of(m.spec)


def test_a_kvguard_dp_rank_is_a_pod_of_its_own_and_counts_as_a_worker() -> None:
    m = tiny_on_pvc(roles={"decode": {"replicas": 2, "dataParallel": 2}})
    for scale, pods in (("canary", 2), ("full", 4)):
        rendered = render_revision(m.spec, plan(m.spec), OWNER, "r1", scale)  # type: ignore[arg-type]
        decode = next(o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-r1-decode")
        assert decode["spec"]["replicas"] == pods  # replicas x dataParallel, as the local backend runs them
    assert plan(m.spec).roles["decode"].instances == 4  # one KV pool per pod: every one is measured (S7)


def _admits(policy: dict, peer_role: str | None, port: int, *, namespace_label: str | None = None) -> bool:
    """Whether a NetworkPolicy's ingress admits a pod of this revision with `peer_role` (or, with
    `namespace_label`, any pod of a namespace carrying that label) on `port`."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if peer_role and peer.get("podSelector", {}).get("matchLabels", {}).get("kvguard.io/role") == peer_role:
                return True
            if namespace_label and namespace_label in peer.get("namespaceSelector", {}).get("matchLabels", {}):
                return True
    return False


def test_kvguard_network_policies_admit_exactly_each_ports_audience_s9() -> None:
    """S9: the router's API is public; a worker's internal control API takes only this revision's
    router; decode's KV port only this revision's prefill; metrics only scrapers. Egress: the
    router reaches only its workers (and DNS), prefill only decode's KV port, decode nothing."""
    m = model("tiny-cpu.yaml", model={**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"],
              "source": {"pvc": {"claimName": "models", "path": "tiny"}}}, kvTransfer={"port": 9100})  # fmt: skip
    objs = objects(m)
    router, prefill, decode = (objs["NetworkPolicy", f"m-r1-{role}"] for role in ("router", "prefill", "decode"))
    scraper = "kvguard.io/metrics-scraper"
    assert _admits(router, None, 8000) and not _admits(router, None, 8001)
    assert _admits(router, None, 8001, namespace_label=scraper)
    for worker in (prefill, decode):
        assert _admits(worker, "router", 8000)
        assert not _admits(worker, "prefill", 8000) and not _admits(worker, "decode", 8000)
        assert not _admits(worker, None, 8000, namespace_label=scraper)  # a scraper cannot reach /internal/*
        assert _admits(worker, None, 8001, namespace_label=scraper) and not _admits(worker, "router", 8001)
        assert worker["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert _admits(decode, "prefill", 9100) and not _admits(decode, "router", 9100)
    assert not _admits(prefill, "decode", 9100)
    assert decode["spec"]["egress"] == []  # decode opens no connection
    (to_decode,) = prefill["spec"]["egress"]
    assert to_decode == {"to": [{"podSelector": {"matchLabels": {"kvguard.io/model": "m", "kvguard.io/revision": "r1",
                                                                  "kvguard.io/role": "decode"}}}],
                         "ports": [{"protocol": "TCP", "port": 9100}]}  # fmt: skip
    egress_ports = {p["port"] for rule in router["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {8000, 53}
    # Services publish only the addressed port; probes use the read-only listener.
    for role in ("prefill", "decode", "router"):
        assert [p["name"] for p in objs["Service", f"m-r1-{role}"]["spec"]["ports"]] == ["http"]
        container = objs["Deployment", f"m-r1-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
        assert flag(container["command"], "--metrics-port") == "8001"
        # The router is ready while its workers answer, and alive while it answers itself: a
        # worker down must not have every router restarted (an outside probe).
        live = "/livez" if role == "router" else "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == live


def test_every_kvguard_role_gets_the_revision_key_and_encryption_reaches_both_workers_s9() -> None:
    """The router signs internal calls and issues transfer tickets, so it needs the revision key
    too; kvTransfer.encryption is a flag of prefill and decode (both must agree)."""
    spec_model = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"]
    m = model("tiny-cpu.yaml", model={**spec_model, "source": {"pvc": {"claimName": "models", "path": "tiny"}}},
              kvTransfer={"encryption": "aes-gcm"})  # fmt: skip
    objs = objects(m)
    for role in ("router", "prefill", "decode"):
        container = objs["Deployment", f"m-r1-{role}"]["spec"]["template"]["spec"]["containers"][0]
        key = next(e for e in container["env"] if e["name"] == "KVGUARD_TRANSFER_KEY")
        assert key["valueFrom"] == {"secretKeyRef": {"name": "m-r1-kv-transfer", "key": "key"}}
        if role == "router":
            assert "--transfer-encryption" not in container["command"]
        else:
            assert flag(container["command"], "--transfer-encryption") == "aes-gcm"
    assert "--transfer-encryption" not in command(objects(model("tiny-cpu.yaml", model={
        **spec_model, "source": {"pvc": {"claimName": "models", "path": "tiny"}}})), "decode")  # default: none


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_encryption_is_refused_for_engines_that_cannot_render_it(engine: str) -> None:
    example = "llama-3.1-8b-sglang-h100.yaml"
    spec_engine = yaml.safe_load((EXAMPLES / example).read_text())["spec"]["engine"]
    m = model(example, kvTransfer={"encryption": "aes-gcm"}, engine={**spec_engine, "kind": engine, "image": "img:1"})
    with pytest.raises(RenderError) as err:
        objects(m)
    assert err.value.field == "spec.kvTransfer.encryption"


def test_kvguard_engine_roles_get_the_bootstrap_timeout_and_not_the_router() -> None:
    """spec.kvTransfer.bootstrapTimeoutSeconds bounds how long prefill holds a request whose ticket
    never comes, and how long decode holds pages that prefill never opens a transfer to (S4); at
    the default (300 s, the worker's own) no flag is rendered."""
    spec_model = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"]
    source = {**spec_model, "source": {"pvc": {"claimName": "models", "path": "tiny"}}}
    objs = objects(model("tiny-cpu.yaml", model=source, kvTransfer={"bootstrapTimeoutSeconds": 60}))
    assert all(float(flag(command(objs, role), "--bootstrap-timeout")) == 60 for role in ("prefill", "decode"))
    assert "--bootstrap-timeout" not in command(objs, "router")
    defaults = objects(model("tiny-cpu.yaml", model=source))
    assert all("--bootstrap-timeout" not in command(defaults, role) for role in ("prefill", "decode"))


def test_every_object_the_operator_creates_passes_the_api_servers_own_schemas() -> None:
    """kmock validates nothing: each built-in object of a revision (kvguard, SGLang and vLLM), its
    Secret and the model Service are checked against Kubernetes' published OpenAPI schemas
    (kubernetes-validate, strict: an unknown or misplaced field fails as the API server's strict
    field validation would)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    tiny_model = {**yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]["model"], "source": {"pvc": {"claimName": "models", "path": "tiny"}}}
    llama = yaml.safe_load((EXAMPLES / "llama-3.1-8b-sglang-h100.yaml").read_text())["spec"]["model"]
    specs = [
        model("tiny-cpu.yaml", model=tiny_model, kvTransfer={"encryption": "aes-gcm"}),
        model("incident-fixed.yaml", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5.4"},
              model={**yaml.safe_load((EXAMPLES / "incident-fixed.yaml").read_text())["spec"]["model"], "source": {"huggingFace": "org/m"}}),
        model("llama-3.1-8b-sglang-h100.yaml", engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "routerImage": "vllm-router:1"},
              model={**llama, "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}}),
    ]  # fmt: skip
    for m in specs:
        rendered = render_rollout_revision(m.spec, plan(m.spec), OWNER, "r1").with_transfer_secret("m-r1-kv-transfer-0a1b2c3d")
        objects_ = [*rendered.at("canary"), *rendered.at("full"), render_model_service(OWNER, "r1"),
                    render_transfer_secret(OWNER, "r1", b"\x01" * 32, "m-r1-kv-transfer-0a1b2c3d")]  # fmt: skip
        for obj in objects_:
            kubernetes_validate.validate(obj, "1.30", strict=True)  # raises on the first field the schema refuses


@pytest.mark.parametrize(("engine", "switch"), [("sglang", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"),
                                                 ("vllm", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")])
def test_a_context_beyond_the_models_positions_is_allowed_on_the_engine_it_is_asked_of(engine: str, switch: str) -> None:
    """Outside probe: examples/incident-fixed.yaml (1,048,576 tokens of context for a model built
    for 1,010,000) planned PASS with a warning that SGLang refuses it "unless told to", and the
    pods rendered never told it: they would exit at start. The plan's warning stands."""
    example = "llama-3.1-8b-sglang-h100.yaml"
    body = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    engine_spec = {**body["engine"], "kind": engine, "image": "img:1", **({"routerImage": "router:1"} if engine == "vllm" else {})}
    source = {**body["model"], "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}}

    def env(m: InferenceModel, role: str) -> dict[str, Any]:
        container = objects(m)["Deployment", f"m-r1-{role}"]["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container.get("env") or []}

    longer = model(example, engine=engine_spec, model=source, contextLength=140_000)
    assert longer.spec.model.architecture is not None and longer.spec.model.architecture.max_position_embeddings == 131_072
    assert all(env(longer, role)[switch] == "1" for role in ("prefill", "decode"))
    assert any("max_position_embeddings" in warning for warning in plan(longer.spec).warnings)
    within = model(example, engine=engine_spec, model=source)
    assert all(switch not in env(within, role) for role in ("prefill", "decode"))
