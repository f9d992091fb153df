"""Pure builders of the Kubernetes objects one revision of an InferenceModel runs on.

Per revision: prefill, decode and router Deployments and Services, the KV-transfer HMAC Secret
and one NetworkPolicy per role that admits exactly that role's audiences (S9,
docs/threat-model.md): the router's API from clients, the workers' internal control API from the
revision's routers only, decode's KV-transfer port from the revision's prefill pods only, and the
read-only metrics port from the operator's and labelled scraper namespaces. Per model: the
Service clients use, pointing at the stable revision's routers. Engine adapters turn the spec
into the command line of our workers, SGLang or vLLM (flags from `../shared/reference/engines.md`).

Everything here is a function of its arguments: no kopf, no kubernetes client, no clock, no
randomness (the Secret's key and its name are passed in).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvguard.operator.api import (
    GROUP_VERSION,
    STARTUP_PROBE_SECONDS,
    WORKER_PORTS,
    DeviceKind,
    EngineKind,
    InferenceModelSpec,
    KVCacheDtype,
    KVPlan,
    ModelSource,
    PodPlacement,
    PVCSource,
    SGLangKVCanary,
    WorkerRole,
)
from kvguard.operator.engine_support import gpus_per_worker_pod, kvguard_dtype_flag, kvguard_role_options
from kvguard.operator.planner import memory_fraction
from kvguard.operator.pool_gate import CONTEXT_ANNOTATION, GATE_CONDITION, GATED_ROLES, PAGE_ANNOTATION, RATIO_ANNOTATION
from kvguard.operator.rollout import Scale
from kvguard.workers.args import DEFAULT_DRAIN_TIMEOUT_S, WorkerArgs
from kvguard.workers.pool_ratio import ratio_number

Role = Literal["prefill", "decode", "router"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "router")
Manifest = dict[str, Any]

HTTP_PORT = 8000
"""kvguard: the router's public API and the workers' internal control API; SGLang/vLLM: everything."""
METRICS_PORT = 8001
assert set(WORKER_PORTS) == {HTTP_PORT, METRICS_PORT}  # what spec.kvTransfer.port may not collide with
"""kvguard only: read-only /metrics and /health (probes, scrapers)."""
DNS_PORT = 53
SGLANG_BOOTSTRAP_PORT = 8998
VLLM_NIXL_PORT = 5600
MODEL_MOUNT = "/models"
TRANSFER_KEY_ENV = "KVGUARD_TRANSFER_KEY"
TRANSFER_KEY_FIELD = "key"
DEFAULT_WORKER_IMAGE = "ghcr.io/kvguard/worker:0.1.0"
OPERATOR_NAMESPACE_LABEL = "kvguard.io/operator"
METRICS_SCRAPER_NAMESPACE_LABEL = "kvguard.io/metrics-scraper"
"""A namespace labelled with it (`"true"`, e.g. Prometheus's) may reach engine pods' metrics port."""
FAULTS_ENV = "KVGUARD_FAULTS"
SCALE_ANNOTATION = "kvguard.io/scale"
"""On a revision's Deployments: canary (replicas capped while verified) or full."""
TRANSFER_SECRET_ANNOTATION = "kvguard.io/transfer-secret"
"""On a revision's Deployments: the Secret their pods read the KV-transfer key from (the record of
its name, which has a random suffix; kept in the operator's watch cache, unlike the pod template)."""

LABEL_MODEL = "kvguard.io/model"
LABEL_REVISION = "kvguard.io/revision"
LABEL_ROLE = "kvguard.io/role"
LABEL_ENGINE = "kvguard.io/engine"
ENGINE_CONTAINER = "engine"  # the one container of every prefill/decode pod (pods/log reads it by name)
"""On engine pods: kvguard, sglang or vllm (the PodMonitors pick the metrics port by it)."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvguard-operator"}


class RenderError(ValueError):
    """The spec cannot be rendered for its engine; `field` names the offending spec path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Owner:
    """The InferenceModel that owns every rendered object (garbage collection on delete)."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": GROUP_VERSION,
            "kind": "InferenceModel",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


MISSING_SOURCE = ("spec.model.source", "required to deploy: set huggingFace or pvc")
"""(field, message) for a spec deployed without a model source (render, and admission: spec_checks)."""


def with_stand_in_source(spec: InferenceModelSpec, claim: str) -> InferenceModelSpec:
    """`spec`, with a stand-in model source (PVC `claim`) if it has none, for rendering only to
    read its flags and field checks (admission, policies, P/D parity): where the weights come from
    changes no flag, and a spec without a source is valid for planning (refused at deploy time).
    Nothing rendered from it is applied. A spec with a source keeps it."""
    if spec.model.source is not None:
        return spec
    stand_in = ModelSource(pvc=PVCSource(claim_name=claim))
    return spec.model_copy(update={"model": spec.model.model_copy(update={"source": stand_in})})


def with_stand_in_images(spec: InferenceModelSpec, image: str) -> InferenceModelSpec:
    """`spec`, with a stand-in engine image where neither the engine nor a role names one, and a
    stand-in vLLM router image, for `kvguard plan` only: it deploys nothing, and an image changes
    no flag a check reads (the examples plan without one). Where the spec is deployed -- admission,
    render, apply -- a missing image is refused (`image_for`). A role image without an engine image
    is not stood in for: the other role's image is then what is missing, as admission says."""
    engine = spec.engine
    update: dict[str, str] = {}
    role_images = any(role.image for role in spec.roles.worker_roles().values())
    if engine.image is None and not role_images and engine.kind is not EngineKind.KVGUARD:
        update["image"] = image
    if engine.router_image is None and engine.kind is EngineKind.VLLM:
        update["router_image"] = image
    return spec.model_copy(update={"engine": engine.model_copy(update=update)}) if update else spec


# --- names and labels ------------------------------------------------------------------------


def object_name(model: str, revision: str, role: Role | str) -> str:
    return f"{model}-{revision}-{role}"


def transfer_secret_prefix(model: str, revision: str) -> str:
    """The start of the name of a revision's KV-transfer Secret. The operator adds a random suffix
    when it creates one (`transfer_secret_name`), so nobody can create a Secret under the name
    before it does; rendered Deployments name the Secret by this prefix until the operator puts
    in the name it created (`with_transfer_secret`)."""
    return f"{model}-{revision}-kv-transfer"


def transfer_secret_name(model: str, revision: str, suffix: str) -> str:
    """`suffix`: 8 random hex digits."""
    return f"{transfer_secret_prefix(model, revision)}-{suffix}"


def is_transfer_secret_name(name: str, model: str, revision: str) -> bool:
    """A name the operator may have given this revision's Secret: the prefix, with or without a
    suffix (an operator before the suffix used the bare prefix; its Deployments still name it)."""
    prefix = transfer_secret_prefix(model, revision)
    return name == prefix or (name.startswith(prefix + "-") and re.fullmatch(r"[0-9a-f]{8}", name[len(prefix) + 1:]) is not None)


def network_policy_name(model: str, revision: str, role: Role | str) -> str:
    return f"{model}-{revision}-{role}"


def labels(model: str, revision: str | None = None, role: Role | None = None) -> dict[str, str]:
    result = {"app.kubernetes.io/name": "kvguard-engine", "app.kubernetes.io/instance": model, LABEL_MODEL: model}
    result.update(MANAGED_BY)
    if revision:
        result[LABEL_REVISION] = revision
    if role:
        result[LABEL_ROLE] = role
        result["app.kubernetes.io/component"] = role
    return result


OPERATOR_LABEL_KEYS = frozenset(labels("model", "revision", "prefill"))
"""Every label key the operator puts on a child (what it puts back on one someone took them off)."""


def selector(model: str, revision: str, role: Role) -> dict[str, str]:
    return {LABEL_MODEL: model, LABEL_REVISION: revision, LABEL_ROLE: role}


def owned_metadata(owner: Owner, name: str, revision: str | None, role: Role | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, revision, role),
        "ownerReferences": [owner.reference()],
    }


# --- engine adapters -------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleContext:
    """Everything an engine adapter needs to render one role of one revision."""

    spec: InferenceModelSpec
    plan: KVPlan
    owner: Owner
    revision: str
    role: Role
    scale: Scale = "full"
    faults: str = ""
    """Test-only KVGUARD_FAULTS (the operator passes it only with fault injection allowed)."""

    @property
    def worker(self) -> WorkerRole:
        assert self.role != "router"
        return getattr(self.spec.roles, self.role)

    def service_url(self, role: Role) -> str:
        name = object_name(self.owner.name, self.revision, role)
        return f"http://{name}.{self.owner.namespace}.svc:{HTTP_PORT}"

    def model_location(self) -> str:
        """A directory inside the pod (PVC source) or the Hugging Face id."""
        source = self.spec.model.source
        if source is None:
            raise RenderError(*MISSING_SOURCE)
        if source.pvc is not None:
            return f"{MODEL_MOUNT}/{source.pvc.path.strip('/')}".rstrip("/")
        assert source.hugging_face is not None
        return source.hugging_face

    def memory_fraction_flag(self) -> str:
        """The memory fraction the plan checked, written so that it parses back to the same float.
        `:g` rounded 0.1234564999 down to 0.123456: a pool below the planned 2x context (S7)."""
        return repr(memory_fraction(self.spec, self.worker))


class EngineAdapter(Protocol):
    kind: EngineKind

    def command(self, ctx: RoleContext) -> list[str]: ...

    def env(self, ctx: RoleContext) -> list[dict[str, Any]]: ...

    def container_ports(self, ctx: RoleContext) -> list[dict[str, Any]]: ...

    def transfer_ports(self, spec: InferenceModelSpec) -> list[int] | None:
        """Decode ports prefill must reach for KV; None means every port (dynamic transports)."""
        ...

    def health_path(self, role: Role) -> str: ...

    def liveness_path(self, role: Role) -> str:
        """What the liveness probe asks: the health path, unless that also judges other pods."""
        ...

    def probe_port(self) -> str:
        """The named container port probes and scrapers use (kvguard: `metrics`; others: `http`)."""
        ...

    def pods_per_replica(self, ctx: RoleContext) -> int:
        """Pods one replica of the role takes (an engine that runs one DP rank per pod needs dataParallel)."""
        ...


def _http_port() -> dict[str, Any]:
    return {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}


class KvguardAdapter:
    """Our tagged engine: `kvguard worker --role ...` (flags of issue 4's worker)."""

    kind = EngineKind.KVGUARD

    def command(self, ctx: RoleContext) -> list[str]:
        spec = ctx.spec
        source = spec.model.source
        if source is not None and source.pvc is None:
            raise RenderError("spec.model.source", "the kvguard engine loads weights from a directory: use pvc")
        # Bind every interface (the pod's IP), and advertise the pod IP as decode's transfer
        # address: prefill connects to it directly, as the NetworkPolicy expects.
        common: dict[str, Any] = {
            "role": ctx.role, "model": ctx.model_location(), "model_name": spec.model.name, "host": "0.0.0.0",
            "port": HTTP_PORT, "metrics_port": METRICS_PORT,
        }  # fmt: skip
        if ctx.role == "router":
            # --revision-id: every answer names its revision (x-kvguard-revision), through any Gateway.
            # --discovery dns: the workers' Services are headless (render_service), and the router
            # addresses each pod itself, so a request's calls all reach the pod holding its KV.
            args = WorkerArgs(**common, prefill=(ctx.service_url("prefill"),), decode=(ctx.service_url("decode"),),
                              revision_id=ctx.revision, discovery="dns")  # fmt: skip
            return ["kvguard", "worker", *args.to_argv()]
        pool_tokens = ctx.plan.roles[ctx.role].pool_tokens
        if pool_tokens < 1:  # the weights leave no memory for KV: the plan blocks it; nothing to run
            raise RenderError(f"spec.roles.{ctx.role}", f"the {ctx.role} KV pool is {pool_tokens} tokens: the weights leave no memory for it")
        args = WorkerArgs(
            **common,
            context_length=spec.context_length,
            kv_pool_tokens=pool_tokens,
            page_size=spec.page_size,
            device=spec.hardware.device.value,
            dtype=kvguard_dtype_flag(spec),
            transfer_port=spec.kv_transfer.port if ctx.role == "decode" else None,
            advertise_host=f"$({POD_IP_ENV})" if ctx.role == "decode" else None,
            max_transfer_batch=spec.kv_transfer.max_batch,
            transfer_timeout=spec.kv_transfer.timeout_seconds,
            transfer_encryption=spec.kv_transfer.encryption,
            **kvguard_role_options(spec, ctx.role),
        )
        return ["kvguard", "worker", *args.to_argv(), *spec.engine.extra_args]

    def env(self, ctx: RoleContext) -> list[dict[str, Any]]:
        # Every role holds the revision key: the router signs internal calls and issues transfer
        # tickets with it; the workers verify both and authenticate KV frames (S9).
        key = _secret_env(TRANSFER_KEY_ENV, transfer_secret_prefix(ctx.owner.name, ctx.revision))
        if ctx.role == "router":
            return [key]
        return [key, {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]

    def container_ports(self, ctx: RoleContext) -> list[dict[str, Any]]:
        ports = [_http_port(), {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
        if ctx.role == "decode":
            ports.append({"name": "kv-transfer", "containerPort": ctx.spec.kv_transfer.port, "protocol": "TCP"})
        return ports

    def transfer_ports(self, spec: InferenceModelSpec) -> list[int] | None:
        return [spec.kv_transfer.port]

    def health_path(self, role: Role) -> str:
        return "/health"

    def liveness_path(self, role: Role) -> str:
        # The router's /health is ready only while its workers answer: as liveness, a worker down
        # for a minute restarted every router, which came back to the same worker (an outside probe).
        return "/livez" if role == "router" else "/health"

    def probe_port(self) -> str:
        return "metrics"

    def pods_per_replica(self, ctx: RoleContext) -> int:
        # One kvguard worker is one DP rank with its own KV pool, as on the local backend.
        return 1 if ctx.role == "router" else ctx.worker.data_parallel


# Provenance of the SGLang and vLLM mappings below: the releases' own argument definitions, checked
# by tests/test_engine_conformance.py (`make verify-engines`; docs/engines.md has the last run).
# sglang 0.5.22/0.5.23: srt/arg_groups/fields/model.py kv_cache_dtype choices are auto, fp8_e5m2,
# fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16: the older `fp4_e2m1` is gone (its two
# successors are recipes kvCacheDtype cannot name), so it is refused rather than guessed.
_SGLANG_KV_DTYPES = {
    KVCacheDtype.AUTO: "auto", KVCacheDtype.BF16: "bf16", KVCacheDtype.BFLOAT16: "bf16",
    KVCacheDtype.FP8: "fp8_e4m3", KVCacheDtype.FP8_E4M3: "fp8_e4m3", KVCacheDtype.FP8_E5M2: "fp8_e5m2",
}  # fmt: skip
# vllm 0.33.0: vllm/config/cache.py CacheDType.
_VLLM_KV_DTYPES = {
    KVCacheDtype.AUTO: "auto", KVCacheDtype.BF16: "bfloat16", KVCacheDtype.BFLOAT16: "bfloat16",
    KVCacheDtype.FP8: "fp8", KVCacheDtype.FP8_E4M3: "fp8_e4m3", KVCacheDtype.FP8_E5M2: "fp8_e5m2",
}  # fmt: skip


def _engine_kv_dtype(spec: InferenceModelSpec, table: Mapping[KVCacheDtype, str], engine: str) -> str:
    try:
        return table[spec.kv_cache_dtype]
    except KeyError:
        allowed = ", ".join(sorted({k.value for k in table}))
        raise RenderError("spec.kvCacheDtype", f"{engine} does not take {spec.kv_cache_dtype.value!r}; use one of {allowed}") from None


def _refuse_encryption(spec: InferenceModelSpec, engine: str) -> None:
    """kvTransfer.encryption is the kvguard engine's; silently sending KV in clear would be worse."""
    if spec.kv_transfer.encryption != "none":
        raise RenderError("spec.kvTransfer.encryption", f"{engine} has no KV encryption setting kvguard can render; use none "
                          "and encrypt the network (a service mesh), or the kvguard engine")  # fmt: skip


def _hf_revision_args(ctx: RoleContext) -> list[str]:
    source = ctx.spec.model.source
    if source is not None and source.hugging_face and source.revision:
        return ["--revision", source.revision]
    return []


SGLANG_KV_CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"  # sglang 0.5.22+ srt/arg_groups/fields/disagg.py
SGLANG_ATTN_DP_SINCE = (0, 5, 22)
"""sglang 0.5.22 added `--attn-dp-size N` (srt/arg_groups/fields/parallel.py attn_dp_size) and
deprecated `--dp-size N --enable-dp-attention` (srt/server_args.py, DeprecatedStoreTrueAction,
"remove after 2026-12-31"); older releases only know the old spelling."""


def release_of(version: str | None) -> tuple[int, ...] | None:
    """(0, 5, 22) for "0.5.22", "v0.5.22rc1", "0.5.22.post1+cu129"; None when unset or unreadable."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(x) for x in match.group(1).split(".")) if match else None


def _sglang_data_parallel_args(spec: InferenceModelSpec, role: WorkerRole) -> list[str]:
    """DP ranks in the version's spelling (see SGLANG_ATTN_DP_SINCE); an unknown version is taken
    as a supported one (>= 0.5.22)."""
    if not role.data_parallel_attention:
        return ["--dp-size", str(role.data_parallel)]
    release = release_of(spec.engine.version)
    if release is not None and release < SGLANG_ATTN_DP_SINCE:
        return ["--dp-size", str(role.data_parallel), "--enable-dp-attention"]
    return ["--dp-size", "1", "--attn-dp-size", str(role.data_parallel)]


def _stream_interval_args(ctx: RoleContext) -> list[str]:
    """SGLang's and vLLM's `--stream-interval` (the same name and meaning as kvguard's): where
    tokens stream from in PD serving, the decode workers."""
    interval = ctx.spec.engine.stream_interval
    return ["--stream-interval", str(interval)] if interval is not None and ctx.role == "decode" else []


def _sglang_kv_canary_args(canary: SGLangKVCanary | None) -> list[str]:
    """sglang 0.5.22/0.5.23 srt/arg_groups/fields/observability.py (`--kv-canary`,
    `--kv-canary-sweep-interval`) and srt/server_args.py (`--kv-canary-real-data`)."""
    if canary is None or canary.mode == "none":
        return []
    return [
        "--kv-canary", canary.mode, "--kv-canary-real-data", canary.real_data,
        "--kv-canary-sweep-interval", str(canary.sweep_interval),
    ]  # fmt: skip


class SGLangAdapter:
    """`python3 -m sglang.launch_server --disaggregation-mode prefill|decode` and sglang_router."""

    kind = EngineKind.SGLANG

    def command(self, ctx: RoleContext) -> list[str]:
        spec = ctx.spec
        _refuse_encryption(spec, "sglang")
        if ctx.role == "router":
            return [
                "python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", ctx.service_url("prefill"), str(SGLANG_BOOTSTRAP_PORT),
                "--decode", ctx.service_url("decode"),
                "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            ]  # fmt: skip
        role = ctx.worker
        args = ["python3", "-m", "sglang.launch_server", "--model-path", ctx.model_location(), *_hf_revision_args(ctx)]
        args += [
            "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--disaggregation-mode", ctx.role,
            "--disaggregation-transfer-backend", spec.kv_transfer.backend,
            "--context-length", str(spec.context_length),
            "--mem-fraction-static", ctx.memory_fraction_flag(),
            "--tp-size", str(role.tensor_parallel),
            "--pp-size", str(role.pipeline_parallel),
            *_sglang_data_parallel_args(spec, role),
            "--ep-size", str(role.expert_parallel),
            "--page-size", str(spec.page_size),
            "--kv-cache-dtype", _engine_kv_dtype(spec, _SGLANG_KV_DTYPES, "sglang"),
            "--enable-metrics",  # the canary's capacity and safety-counter probes read /metrics
        ]  # fmt: skip
        if ctx.role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(SGLANG_BOOTSTRAP_PORT)]
        cap = role.kv_pool_tokens or spec.kv_pool_tokens
        if cap is not None:
            args += ["--max-total-tokens", str(cap)]
        if spec.kv_transfer.checksum:
            args.append(SGLANG_KV_CHECKSUM_FLAG)  # both roles: on one side only SGLang skips the check
        args += _sglang_kv_canary_args(spec.engine.kv_canary) + _stream_interval_args(ctx)
        return args + list(spec.engine.extra_args) + list(role.extra_args or [])

    def env(self, ctx: RoleContext) -> list[dict[str, Any]]:
        if ctx.role == "router":
            return []
        transfer = ctx.spec.kv_transfer
        return [
            {"name": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "value": str(transfer.bootstrap_timeout_seconds)},
            # Decode's wait for the KV from its allocation on: prefill's queue and compute included,
            # so the bootstrap bound, not the stall one (as kvguard decode's --bootstrap-timeout).
            {"name": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "value": str(transfer.bootstrap_timeout_seconds)},
            {"name": "MC_TRANSFER_TIMEOUT", "value": str(transfer.timeout_seconds)},
            {"name": "MC_TCP_ENABLE_CONNECTION_POOL", "value": "1"},
        ] + _longer_context_env(ctx.spec, "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")

    def container_ports(self, ctx: RoleContext) -> list[dict[str, Any]]:
        ports = [_http_port()]
        if ctx.role == "prefill":
            ports.append({"name": "bootstrap", "containerPort": SGLANG_BOOTSTRAP_PORT, "protocol": "TCP"})
        return ports

    def transfer_ports(self, spec: InferenceModelSpec) -> list[int] | None:
        return None  # Mooncake/NIXL pick their ports at run time

    def health_path(self, role: Role) -> str:
        return "/health"

    def liveness_path(self, role: Role) -> str:
        return "/health"

    def probe_port(self) -> str:
        return "http"

    def pods_per_replica(self, ctx: RoleContext) -> int:
        return 1


class VLLMAdapter:
    """`vllm serve` with the NIXL KV connector, behind vllm-router's PD mode."""

    kind = EngineKind.VLLM

    def command(self, ctx: RoleContext) -> list[str]:
        spec = ctx.spec
        _refuse_encryption(spec, "vllm")
        if ctx.role == "router":
            return [
                "vllm-router", "--vllm-pd-disaggregation",
                "--prefill", ctx.service_url("prefill"), "--decode", ctx.service_url("decode"),
                "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            ]  # fmt: skip
        role = ctx.worker
        kv_role = "kv_producer" if ctx.role == "prefill" else "kv_consumer"
        transfer_config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_load_failure_policy": "fail"}
        args = ["vllm", "serve", ctx.model_location(), *_hf_revision_args(ctx)]
        args += [
            "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--max-model-len", str(spec.context_length),
            "--gpu-memory-utilization", ctx.memory_fraction_flag(),
            "--tensor-parallel-size", str(role.tensor_parallel),
            "--pipeline-parallel-size", str(role.pipeline_parallel),
            "--data-parallel-size", str(role.data_parallel),
            "--block-size", str(spec.page_size),
            "--kv-cache-dtype", _engine_kv_dtype(spec, _VLLM_KV_DTYPES, "vllm"),
            "--kv-transfer-config", json.dumps(transfer_config, separators=(",", ":")),
        ]  # fmt: skip
        if role.expert_parallel > 1:
            args.append("--enable-expert-parallel")
        args += _stream_interval_args(ctx)
        return args + list(spec.engine.extra_args) + list(role.extra_args or [])

    def env(self, ctx: RoleContext) -> list[dict[str, Any]]:
        if ctx.role == "router":
            return []
        nixl: list[dict[str, Any]] = [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(VLLM_NIXL_PORT)},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
        return nixl + _longer_context_env(ctx.spec, "VLLM_ALLOW_LONG_MAX_MODEL_LEN")

    def container_ports(self, ctx: RoleContext) -> list[dict[str, Any]]:
        ports = [_http_port()]
        if ctx.role != "router":
            ports.append({"name": "nixl", "containerPort": VLLM_NIXL_PORT, "protocol": "TCP"})
        return ports

    def transfer_ports(self, spec: InferenceModelSpec) -> list[int] | None:
        return None  # NIXL side channel plus UCX's run-time ports

    def health_path(self, role: Role) -> str:
        return "/health"

    def liveness_path(self, role: Role) -> str:
        return "/health"

    def probe_port(self) -> str:
        return "http"

    def pods_per_replica(self, ctx: RoleContext) -> int:
        return 1


ADAPTERS: dict[EngineKind, EngineAdapter] = {
    EngineKind.KVGUARD: KvguardAdapter(),
    EngineKind.SGLANG: SGLangAdapter(),
    EngineKind.VLLM: VLLMAdapter(),
}


POD_IP_ENV = "KVGUARD_POD_IP"  # expanded by the kubelet in `$(KVGUARD_POD_IP)` args


def _longer_context_env(spec: InferenceModelSpec, name: str) -> list[dict[str, Any]]:
    """The engine's switch for a context longer than the model's max_position_embeddings, when the
    spec asks for one (the plan warns of it): without it SGLang and vLLM exit at start, and a spec
    that planned PASS rendered pods that never served (an outside probe)."""
    arch = spec.model.architecture
    limit = arch.max_position_embeddings if arch is not None else None
    return [{"name": name, "value": "1"}] if limit is not None and spec.context_length > limit else []


def _secret_env(name: str, secret: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": TRANSFER_KEY_FIELD}}}


# --- pods --------------------------------------------------------------------------------------


def gpu_count(spec: InferenceModelSpec, role: Role) -> int:
    placement: PodPlacement = getattr(spec.roles, role)
    if placement.gpu_count is not None:
        return placement.gpu_count
    if role == "router" or spec.hardware.device == DeviceKind.CPU:
        return 0
    return gpus_per_worker_pod(spec, role)


def image_for(spec: InferenceModelSpec, role: Role) -> str:
    engine = spec.engine
    if role == "router" and engine.router_image:
        return engine.router_image
    if role == "router" and engine.kind == EngineKind.VLLM:
        # vllm-router is its own project (vllm-project/router): the vllm/vllm-openai image has no such command.
        raise RenderError("spec.engine.routerImage", "required for vllm: an image with vllm-router (vllm-project/router)")
    if role != "router" and getattr(spec.roles, role).image:
        return str(getattr(spec.roles, role).image)
    if engine.image:
        return engine.image
    if engine.kind == EngineKind.KVGUARD:
        return DEFAULT_WORKER_IMAGE
    raise RenderError("spec.engine.image", f"required for engine {engine.kind.value}")


GPU_RESOURCE = "nvidia.com/gpu"


def _resources(spec: InferenceModelSpec, role: Role) -> dict[str, Any]:
    placement: PodPlacement = getattr(spec.roles, role)
    requests = dict(placement.resources.requests)
    limits = dict(placement.resources.limits)
    gpus = gpu_count(spec, role)
    for kind, given in (("requests", requests), ("limits", limits)):
        # Owned by gpuCount (the plan's devices): a different value here was silently replaced.
        if GPU_RESOURCE in given and given[GPU_RESOURCE] != str(gpus):
            raise RenderError(f"spec.roles.{role}.resources.{kind}", f"{GPU_RESOURCE}: {given[GPU_RESOURCE]} differs from the "
                              f"role's GPUs ({gpus}, from gpuCount and the parallel sizes); set gpuCount, not this")  # fmt: skip
    if gpus:
        requests[GPU_RESOURCE] = str(gpus)
        limits[GPU_RESOURCE] = str(gpus)
    result: dict[str, Any] = {}
    if requests:
        result["requests"] = requests
    if limits:
        result["limits"] = limits
    return result


_STARTUP_PERIOD_SECONDS = 10

# A deleted pod is taken out of its Service's endpoints and signalled at the same time, and an
# HTTPRoute's weight change takes seconds to reach the gateway: a router that closed its listener
# on SIGTERM at once would refuse connections still sent to it. The preStop hook keeps it serving
# this long first, then SIGTERM starts its drain (`--drain-timeout`, servers.Drain). An exec of
# `sleep` (every engine image has it) rather than the `sleep` handler, which API servers before
# 1.30 refuse as a handler-less hook; where an image lacks it, the kubelet goes on to SIGTERM.
PRESTOP_SLEEP_SECONDS = 5
# The kubelet's budget covers the preStop sleep, the drain and the shutdown after it, with room.
TERMINATION_GRACE_SECONDS = PRESTOP_SLEEP_SECONDS + int(DEFAULT_DRAIN_TIMEOUT_S) + 15
_LIFECYCLE = {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}


def _probes(path: str, live_path: str, port: str) -> dict[str, Any]:
    """Readiness asks `path`; liveness, and the startup probe that holds it off, ask `live_path`."""
    ready, live = {"httpGet": {"path": path, "port": port}}, {"httpGet": {"path": live_path, "port": port}}
    startup_failures = STARTUP_PROBE_SECONDS // _STARTUP_PERIOD_SECONDS
    return {
        # Weight loading can take many minutes; the startup probe holds liveness off until then
        # (spec.rollout.progressDeadlineSeconds defaults to this budget plus scheduling time).
        "startupProbe": {**live, "periodSeconds": _STARTUP_PERIOD_SECONDS, "failureThreshold": startup_failures, "timeoutSeconds": 5},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {**live, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 10},
    }


RESTRICTED_CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _volumes(spec: InferenceModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Writable scratch (the root filesystem is read-only) plus the weights volume."""
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    source = spec.model.source
    if source is not None and source.pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def render_deployment(ctx: RoleContext) -> Manifest:
    spec, adapter = ctx.spec, ADAPTERS[ctx.spec.engine.kind]
    placement: PodPlacement = getattr(spec.roles, ctx.role)
    volumes, mounts = _volumes(spec)
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/cache/huggingface"}]
    if ctx.faults:
        env.append({"name": FAULTS_ENV, "value": ctx.faults})
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image_for(spec, ctx.role),
        "command": adapter.command(ctx),
        "env": env + adapter.env(ctx),
        "ports": adapter.container_ports(ctx),
        "volumeMounts": mounts,
        "securityContext": RESTRICTED_CONTAINER_SECURITY,
        "lifecycle": _LIFECYCLE,
        **_probes(adapter.health_path(ctx.role), adapter.liveness_path(ctx.role), adapter.probe_port()),
    }
    resources = _resources(spec, ctx.role)
    if resources:
        container["resources"] = resources
    node_selector = dict(placement.node_selector)
    gpu_type = placement.gpu_type or (spec.hardware.gpu_product if gpu_count(spec, ctx.role) else None)
    if gpu_type:
        node_selector.setdefault("nvidia.com/gpu.product", gpu_type)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never call the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if ctx.role in GATED_ROLES:  # S7 while it serves: no traffic until the operator verified its pool (pool_gate.py)
        pod_spec["readinessGates"] = [{"conditionType": GATE_CONDITION}]
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if placement.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in placement.tolerations]
    pod_annotations = {"kvguard.io/revision": ctx.revision}
    if ctx.role in GATED_ROLES:  # what the gate requires of this revision's pools (pool_gate.py)
        pod_annotations |= {RATIO_ANNOTATION: ratio_number(spec.min_kv_ratio), CONTEXT_ANNOTATION: str(spec.context_length)}
        if spec.context_length % spec.page_size:
            pod_annotations[PAGE_ANNOTATION] = str(spec.page_size)
    if spec.engine.kind == EngineKind.SGLANG and ctx.role == "prefill":
        pod_annotations["sglang.ai/bootstrap-port"] = str(SGLANG_BOOTSTRAP_PORT)
    pod_labels = {**labels(ctx.owner.name, ctx.revision, ctx.role), LABEL_ENGINE: spec.engine.kind.value}
    metadata = owned_metadata(ctx.owner, object_name(ctx.owner.name, ctx.revision, ctx.role), ctx.revision, ctx.role)
    metadata["annotations"] = {SCALE_ANNOTATION: ctx.scale}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": spec.replicas_at(ctx.role, ctx.scale) * adapter.pods_per_replica(ctx),
            # Kubernetes' own Progressing condition agrees with the operator's deadline.
            "progressDeadlineSeconds": spec.rollout.progress_deadline_seconds,
            "selector": {"matchLabels": selector(ctx.owner.name, ctx.revision, ctx.role)},
            "template": {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec},
        },
    }


def render_service(ctx: RoleContext) -> Manifest:
    """The role's Service: the ports other pods address by name. Metrics are scraped per pod
    (PodMonitor), and prefill reaches decode's transfer port at the pod IP decode advertises, so
    neither is published here. The kvguard engine's prefill and decode Services are headless: its
    router resolves them to the ready pods' IPs (`--discovery dns`, workers/discovery.py), since
    a request's calls must reach one pod, which a virtual IP does not promise."""
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in ADAPTERS[ctx.spec.engine.kind].container_ports(ctx) if p["name"] not in ("metrics", "kv-transfer")]  # fmt: skip
    spec: dict[str, Any] = {"type": "ClusterIP", "selector": selector(ctx.owner.name, ctx.revision, ctx.role), "ports": ports}
    if ctx.spec.engine.kind == EngineKind.KVGUARD and ctx.role != "router":
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(ctx.owner, object_name(ctx.owner.name, ctx.revision, ctx.role), ctx.revision, ctx.role),
        "spec": spec,
    }


def render_transfer_secret(owner: Owner, revision: str, key: bytes, name: str) -> Manifest:
    """The KV-transfer HMAC key (S3), one per revision, as Secret `name`. Created once, never
    patched, read or logged."""
    if len(key) < 32:
        raise ValueError("the KV-transfer key must be at least 32 bytes")
    if not is_transfer_secret_name(name, owner.name, revision):
        raise ValueError(f"{name!r} is not a name for the KV-transfer Secret of revision {revision}")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owned_metadata(owner, name, revision),
        "type": "Opaque",
        "immutable": True,
        "data": {TRANSFER_KEY_FIELD: base64.b64encode(key.hex().encode()).decode()},
    }


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _pods(owner: Owner, revision: str, role: Role) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector(owner.name, revision, role)}}


_SCRAPERS = [
    {"namespaceSelector": {"matchLabels": {OPERATOR_NAMESPACE_LABEL: "true"}}},  # the canary and S7 scrapes
    {"namespaceSelector": {"matchLabels": {METRICS_SCRAPER_NAMESPACE_LABEL: "true"}}},  # Prometheus
]
_DNS = {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}


def _kvguard_policy_rules(spec: InferenceModelSpec, owner: Owner, revision: str, role: Role) -> tuple[list[Any], list[Any] | None]:
    """(ingress, egress) of one kvguard role: exactly the audiences of workers/args.py's table."""
    metrics = {"from": _SCRAPERS, "ports": _tcp(METRICS_PORT)}
    transfer = spec.kv_transfer.port
    if role == "router":  # clients from anywhere; it calls only its own revision's workers (and DNS)
        ingress = [{"ports": _tcp(HTTP_PORT)}, metrics]
        egress = [{"to": [_pods(owner, revision, "prefill"), _pods(owner, revision, "decode")], "ports": _tcp(HTTP_PORT)}, _DNS]
        return ingress, egress
    control = {"from": [_pods(owner, revision, "router")], "ports": _tcp(HTTP_PORT)}
    if role == "prefill":  # it sends KV to its own revision's decode pods, nowhere else
        return [control, metrics], [{"to": [_pods(owner, revision, "decode")], "ports": _tcp(transfer)}]
    kv_in = {"from": [_pods(owner, revision, "prefill")], "ports": _tcp(transfer)}
    return [control, kv_in, metrics], []  # decode opens no connection at all


def _engine_policy_rules(spec: InferenceModelSpec, owner: Owner, revision: str, role: Role) -> list[Any]:
    """Ingress of an SGLang/vLLM role. Their KV transports (Mooncake, NIXL/UCX) pick ports at run
    time and their pods may download weights, so the policy is by peer, and egress stays open."""
    http = _tcp(HTTP_PORT)
    from_router = {"from": [_pods(owner, revision, "router")], "ports": http}
    scrape = {"from": _SCRAPERS, "ports": http}
    if role == "router":
        return [{"ports": http}, scrape]
    peers = [_pods(owner, revision, "prefill"), _pods(owner, revision, "decode")]  # bootstrap and KV, both ways
    ports = ADAPTERS[spec.engine.kind].transfer_ports(spec)
    kv = {"from": peers, **({"ports": _tcp(*ports)} if ports is not None else {})}
    return [from_router, kv, scrape]


def render_network_policy(spec: InferenceModelSpec, owner: Owner, revision: str, role: Role) -> Manifest:
    """One role's NetworkPolicy (S9): who may reach its pods, and for kvguard where they may go."""
    if spec.engine.kind == EngineKind.KVGUARD:
        ingress, egress = _kvguard_policy_rules(spec, owner, revision, role)
    else:
        ingress, egress = _engine_policy_rules(spec, owner, revision, role), None
    policy: dict[str, Any] = {
        "podSelector": {"matchLabels": selector(owner.name, revision, role)},
        "policyTypes": ["Ingress"] if egress is None else ["Ingress", "Egress"],
        "ingress": ingress,
    }
    if egress is not None:
        policy["egress"] = egress
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owned_metadata(owner, network_policy_name(owner.name, revision, role), revision, role),
        "spec": policy,
    }


def check_engine_options(spec: InferenceModelSpec) -> None:
    """Options only some engines have: refused by name instead of silently dropped."""
    kind = spec.engine.kind
    canary = spec.engine.kv_canary
    if canary is not None and canary.mode != "none" and kind is not EngineKind.SGLANG:
        raise RenderError("spec.engine.kvCanary", f"only sglang has a KV canary; {kind.value} cannot run it")
    if spec.kv_transfer.checksum and kind is EngineKind.VLLM:
        raise RenderError("spec.kvTransfer.checksum", "vllm has no prefill-to-decode KV checksum")
    if kind is EngineKind.KVGUARD:
        for name, role in spec.roles.worker_roles().items():
            for field, value in (("extraArgs", role.extra_args), ("image", role.image)):
                if value:
                    raise RenderError(f"spec.roles.{name}.{field}", "per-role engine settings are for sglang and vllm only")


def render_revision(
    spec: InferenceModelSpec, plan: KVPlan, owner: Owner, revision: str, scale: Scale = "full", faults: str = ""
) -> list[Manifest]:
    """Deployments, Services and NetworkPolicy of one revision at canary or full replicas (the
    Secret is rendered apart, because it is created once and never updated). Raises RenderError on
    a spec the engine cannot run."""
    check_engine_options(spec)
    objects: list[Manifest] = []
    for role in ROLES:
        ctx = RoleContext(spec=spec, plan=plan, owner=owner, revision=revision, role=role, scale=scale, faults=faults)
        objects += [render_deployment(ctx), render_service(ctx), render_network_policy(spec, owner, revision, role)]
    return objects


@dataclass(frozen=True)
class RenderedRevision:
    """One revision rendered once per reconcile (at full scale), ready to apply at either scale:
    only replicas and the scale annotation of the Deployments differ between the two."""

    objects: tuple[Manifest, ...]
    canary_replicas: Mapping[str, int]
    """Deployment name -> replicas at canary scale."""

    def at(self, scale: Scale) -> list[Manifest]:
        if scale == "full":
            return list(self.objects)
        return [self._canary(o) if o["kind"] == "Deployment" else o for o in self.objects]

    def _canary(self, deployment: Manifest) -> Manifest:
        meta = deployment["metadata"]
        replicas = self.canary_replicas[meta["name"]]
        annotations = {**meta.get("annotations", {}), SCALE_ANNOTATION: "canary"}
        return {**deployment, "metadata": {**meta, "annotations": annotations}, "spec": {**deployment["spec"], "replicas": replicas}}

    def worker_commands(self) -> dict[str, list[str]]:
        """The engine command of the prefill and decode Deployments (what policies check)."""
        commands = {}
        for obj in self.objects:
            role = obj["metadata"]["labels"].get(LABEL_ROLE)
            if obj["kind"] == "Deployment" and role in ("prefill", "decode"):
                commands[role] = list(obj["spec"]["template"]["spec"]["containers"][0]["command"])
        return commands

    def uses_transfer_key(self) -> bool:
        return reads_transfer_key(self.objects)

    def with_transfer_secret(self, name: str) -> RenderedRevision:
        """The revision with its pods reading the key from Secret `name` (the one the operator
        created for it, whose suffix only the operator knows)."""
        return dataclasses.replace(self, objects=tuple(_naming_transfer_secret(o, name) for o in self.objects))


def _key_refs(deployment: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The secretKeyRef of every container env entry that carries the KV-transfer key."""
    if deployment.get("kind") != "Deployment":
        return []
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [ref for c in pod.get("containers") or [] for e in c.get("env") or []
            if e.get("name") == TRANSFER_KEY_ENV and (ref := (e.get("valueFrom") or {}).get("secretKeyRef"))]  # fmt: skip


def reads_transfer_key(objects: Sequence[Manifest]) -> bool:
    """Whether a pod of these objects reads the KV-transfer key (kvguard's engine: every role)."""
    return any(transfer_secret_of(o) is not None for o in objects)


def transfer_secret_of(deployment: Mapping[str, Any]) -> str | None:
    """The name of the Secret a Deployment's pods read the KV-transfer key from, if any: its
    annotation, or (a whole object from before the annotation) its pods' env."""
    annotated = ((deployment.get("metadata") or {}).get("annotations") or {}).get(TRANSFER_SECRET_ANNOTATION)
    if deployment.get("kind") == "Deployment" and annotated:
        return str(annotated)
    return next((str(ref["name"]) for ref in _key_refs(deployment) if ref.get("name")), None)


def _naming_transfer_secret(obj: Manifest, name: str) -> Manifest:
    if not _key_refs(obj):
        return obj
    named = copy.deepcopy(obj)
    for ref in _key_refs(named):
        ref["name"] = name
    named["metadata"].setdefault("annotations", {})[TRANSFER_SECRET_ANNOTATION] = name
    return named


def render_rollout_revision(
    spec: InferenceModelSpec, plan: KVPlan, owner: Owner, revision: str, faults: str = ""
) -> RenderedRevision:
    """`render_revision` at full scale plus each Deployment's canary replicas. Raises RenderError."""
    objects = render_revision(spec, plan, owner, revision, "full", faults)
    canary = {}
    for role in ROLES:
        ctx = RoleContext(spec=spec, plan=plan, owner=owner, revision=revision, role=role, scale="canary", faults=faults)
        canary[object_name(owner.name, revision, role)] = spec.replicas_at(role, "canary") * ADAPTERS[spec.engine.kind].pods_per_replica(ctx)
    return RenderedRevision(tuple(objects), canary)


def render_model_service(owner: Owner, stable_revision: str) -> Manifest:
    """The Service clients use (`<model>.<namespace>.svc:8000`): the stable revision's routers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(owner, owner.name, None),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner.name, stable_revision, "router"),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
