"""Pydantic models of kvguard's Kubernetes resources (API group `kvguard.io`, version `v1alpha1`).

These models are the single source of truth for the `InferenceModel` CRD: the CRD YAML in `crds/`
is generated from them, so every field docstring below becomes user-facing documentation. Field
names are snake_case in Python and camelCase on the wire (`contextLength`, `kvCacheDtype`);
both spellings are accepted on input. Unknown fields are rejected, so a typo in a manifest gives a
field-level error instead of being silently ignored.

This module is pure: it imports neither kopf, kubernetes nor torch. Cross-field consistency that
needs the whole spec (does TP divide the heads, does the pool fit the context...) lives in
`kvguard.operator.planner`, which raises errors naming the offending field path.

The planner's output models (`KVPlan`, `RolePlan`, `PlanSuggestion`) live here too, because the
plan is recorded in `InferenceModel.status` (safety invariant S7: the operator never promotes a
revision whose planned KV pool is below `minKVRatio` x `contextLength` on any role).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvguard.operator.canary.spec import (
    CONTEXT_BOUND,
    GATE_REPETITIONS,
    MAX_CONTEXT_TOKENS,
    MIN_CONTEXT_TOKENS,
    CanarySpec,
    context_within_bound,
)
from kvguard.operator.conditions import Condition
from kvguard.operator.continuous import ContinuousStatus
from kvguard.operator.json_numbers import numbers_only
from kvguard.operator.pool_gate import PodPool
from kvguard.operator.rollout import RolloutStatus, Scale
from kvguard.workers.pool_ratio import DEFAULT_MIN_KV_RATIO, MAX_KV_RATIO
from kvguard.workers.protocol import MAX_EVENT_TOKENS

API_GROUP: Final = "kvguard.io"
API_VERSION: Final = "v1alpha1"
GROUP_VERSION: Final = "kvguard.io/v1alpha1"  # spelled out, not joined, so that it types as the Literal below
assert GROUP_VERSION == f"{API_GROUP}/{API_VERSION}"

GiB = 1024**3


def _wire_name(field_name: str) -> str:
    """camelCase, with the acronym KV capitalised inside a name (`minKVRatio`, `numKVHeads`).

    A leading `kv` stays lower case as Kubernetes does with leading acronyms (`kvCacheDtype`).
    """
    return re.sub(r"(?<=[a-z0-9])Kv(?=[A-Z]|$)", "KV", to_camel(field_name))


def field_path(loc: tuple[int | str, ...] | list[int | str], root: str = "") -> str:
    """A pydantic error location as the API server writes a field path: `spec.a[0].b` (a list
    index in brackets), under `root` when given."""
    path = root + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    return path.removeprefix(".")


class ApiModel(BaseModel):
    """Base of every kvguard API shape: camelCase on the wire, typos rejected, docstrings documented."""

    model_config = ConfigDict(
        alias_generator=_wire_name,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return numbers_only(cls, value, info)  # `true` or "32" where a number belongs is refused

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready camelCase dict Kubernetes stores (unset optional fields omitted)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- Quantities ----------------------------------------------------------------------------------

_QUANTITY_SUFFIXES: dict[str, int] = {
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
BYTE_QUANTITY_PATTERN = r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([KMGTPE]i|[kKMGTPE])?\s*$"
"""What `parse_byte_quantity` accepts as a string; the CRD carries the same pattern, so the API
server refuses `"lots"` before the operator ever sees it."""
_QUANTITY_RE = re.compile(BYTE_QUANTITY_PATTERN)
POSITIVE_BYTE_QUANTITY_PATTERN = (r"^\s*((?:[0-9]*[1-9][0-9]*(?:\.[0-9]*)?|[0-9]+\.[0-9]*[1-9][0-9]*)(?:[eE][+-]?[0-9]+)?)"
                                  r"\s*([KMGTPE]i|[kKMGTPE])?\s*$")
"""The same, with a digit other than 0: a field that must be above 0 bytes (`"0Gi"` was stored by the
API server and refused only by the webhook, while the integer 0 failed the schema's minimum)."""
POSITIVE_BYTES_SCHEMA: dict[str, Any] = {"minimum": 1, "pattern": POSITIVE_BYTE_QUANTITY_PATTERN}
K8S_QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
"""A Kubernetes resource.Quantity (`500m`, `8`, `64Gi`), as controller-gen writes it into CRDs."""


MAX_BYTE_QUANTITY = 2**63 - 1
"""The largest quantity Kubernetes stores (int64); anything larger is a typo, not a device."""


def parse_byte_quantity(value: Any) -> int:
    """A Kubernetes-style memory quantity (`80Gi`, `79.18Gi`, `16G`, `1e9`, or a plain number of
    bytes) as an integer number of bytes. Raises ValueError on anything else, a negative value, a
    value that is not finite (`.inf`, `.nan`, `1e400Gi`) or one above 2^63-1 bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a byte quantity such as 80Gi, not a boolean")
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        raise ValueError(f"{value!r} is not a whole number of bytes")  # the CRD's integer type refuses it too
    if isinstance(value, int | float):
        return _checked_bytes(value, repr(value) if isinstance(value, float) else "the value")
    if not isinstance(value, str):
        raise ValueError(f"expected a byte quantity such as 80Gi, got {type(value).__name__}")
    match = _QUANTITY_RE.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a byte quantity (examples: 80Gi, 79.18Gi, 16G, 1048576)")
    number, suffix = match.groups()
    return _checked_bytes(float(number) * _QUANTITY_SUFFIXES.get(suffix or "", 1), repr(value))


def _checked_bytes(value: float, shown: str) -> int:
    # Checked before int(): int(inf) raises OverflowError, which pydantic does not turn into a
    # field-level error, so `.inf` or `1e400Gi` would end in a traceback.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{shown} is not a finite number of bytes")
    if value < 0:
        raise ValueError("must not be negative")
    if value > MAX_BYTE_QUANTITY:
        raise ValueError(f"{shown} exceeds the largest quantity Kubernetes stores (2^63-1 bytes)")
    return int(value)


ByteQuantity = Annotated[
    int,
    BeforeValidator(parse_byte_quantity),
    PlainSerializer(int, return_type=int),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": BYTE_QUANTITY_PATTERN,
            "description": "Bytes, as an integer or a Kubernetes quantity such as 80Gi.",
        }
    ),
]
"""Bytes. Accepts an integer or a Kubernetes quantity string; always stored as integer bytes."""

ResourceQuantity = Annotated[str, Field(pattern=K8S_QUANTITY_PATTERN, max_length=64)]
"""A Kubernetes resource quantity string (cpu: `500m`, memory: `64Gi`)."""

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
MAX_INT32 = 2**31 - 1
Replicas = Annotated[int, Field(ge=0, le=MAX_INT32)]
"""A Deployment's replicas: an int32 on the API server."""
Int32Seconds = Annotated[int, Field(ge=0, le=MAX_INT32)]
"""A duration the API server (or the rollout's clock) holds as an int32 of seconds (68 years): an
unbounded one overflowed the date arithmetic of a promotion, which then failed on every pass."""
MAX_INT64 = 2**63 - 1
PoolTokens = Annotated[int, Field(gt=0, le=MAX_INT64)]
"""A KV-pool cap in tokens: at most what the API server stores (an int64); an outside probe's
`kvguard plan --kv-pool-tokens 1e26` planned PASS with a value no cluster could hold."""
PageTokens = Annotated[int, Field(gt=0, le=MAX_CONTEXT_TOKENS)]
"""Tokens per KV page: at most the longest context kvguard plans (a larger one was reported as a
pool too small, exit 3, where it is bad input)."""
MAX_PARALLEL = 65536
"""Bound of every parallel size: far beyond any real deployment, small enough that products of them
stay within the API server's integers."""
ParallelSize = Annotated[int, Field(gt=0, le=MAX_PARALLEL)]
# ASCII control characters (NUL above all: exec cannot pass it, so a pod holding one in its
# command never starts, and the rollout would wait out its deadline) have no place in a value that
# becomes a command-line argument, an image reference or a path. One class for RE2 and Rust regex.
_CONTROL = r"\x00-\x1f\x7f"
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
_DIGEST = r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
IMAGE_REFERENCE = (
    rf"^(?:(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?/)?{_PATH_PART}(?:/{_PATH_PART})*"
    rf"{_TAG}{_DIGEST}$"
)
"""The container image reference grammar (github.com/distribution/reference): [registry[:port]/]
lowercase path components [:tag] [@algorithm:hex]. One expression for RE2 (the API server) and
Python; no component can match what its neighbour does, so neither backtracks far."""


MAX_IMAGE_NAME = 255
"""The longest repository name (registry and path, no tag or digest) a reference may have
(distribution/reference's NameTotalLengthMax); the kubelet refuses longer ones."""
IMAGE_NAME_RULE = {
    # The name's length for the API server, where no webhook runs. The schema's pattern cannot count
    # across the grammar's parts, and `maxLength` bounds the whole reference (a 256-character name
    # with a short tag is within any bound that admits a 255-character one with a long tag and a
    # digest). So a rule needing only `matches` (no string extension: the tests' CEL evaluator,
    # cel-python, runs it as the API server does): at most 255 characters of anything, then the tag
    # and the digest. On a reference the pattern admits, that first part cannot end inside the name
    # (a port's `:` is followed by `/`, which no tag holds; `@` opens only the digest), so the rule
    # holds exactly when the name is at most 255 characters (tests/test_schema_bounds.py compares
    # it with `_image_name`). A longer name never ran (InvalidImageName): no stored model the rule
    # refuses was serving.
    "rule": f"self.matches('^.{{0,{MAX_IMAGE_NAME}}}{_TAG}{_DIGEST}$')",
    "message": f"the repository name (registry and path, without tag and digest) must be at most {MAX_IMAGE_NAME} "
               "characters: the kubelet refuses a longer one (InvalidImageName)",
}  # fmt: skip


def _image_name(reference: str) -> str:
    """The repository name of a reference: without its digest, and its tag (a colon after the last
    slash; one before it is a registry's port)."""
    name = reference.split("@", 1)[0]
    colon, slash = name.rfind(":"), name.rfind("/")
    return name[:colon] if colon > slash else name


def _image_reference(value: str) -> str:
    # A reference the kubelet cannot parse holds the pods in InvalidImageName, and the rollout
    # waited out its progress deadline (outside probe: `Foo/Bar:latest`, `foo@sha256:abc` admitted).
    if not re.fullmatch(IMAGE_REFERENCE, value) or len(_image_name(value)) > MAX_IMAGE_NAME:
        raise ValueError(f"{value[:80]!r} is not an image reference ([registry[:port]/]lowercase/path[:tag][@sha256:<hex>], "
                         "e.g. lmsysorg/sglang:v0.5.22)")  # fmt: skip
    return value


Image = Annotated[str, Field(min_length=1, max_length=1024, json_schema_extra={"pattern": IMAGE_REFERENCE,
                                                                              "x-kubernetes-validations": [IMAGE_NAME_RULE]}),
                  AfterValidator(_image_reference)]  # fmt: skip
"""A container image reference, as the kubelet parses it (the CRD holds the same pattern)."""
ArgValue = Annotated[str, Field(max_length=4096, pattern=r"^[^\x00]*$")]
"""One command-line argument, verbatim: anything but NUL, which no argv can carry."""
MAX_EXTRA_ARGS = 256
"""Arguments in one extraArgs list: more than any engine's command line needs. Unbounded, 170,000
of them made each admission and each reconcile pass of that model hold the operator's event loop
3-5 s, every other model's reconciles and the leader lease waiting behind it (outside probe)."""

_DECIMAL_SUFFIXES = {suffix: Decimal(f"1e{power}") for suffix, power in
                     {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}.items()}  # fmt: skip
_RESOURCE_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:[eE]([+-]?[0-9]+))?([KMGTPE]i|[numkMGTPE])?")


def quantity_value(text: str) -> Decimal:
    """A resource.Quantity as an exact number (`500m` -> 0.5, `64Gi` -> 2^36), for comparing two of
    them as the API server does: exactly (as floats, 2^53 + 1 bytes read as equal to 2^53)."""
    match = _RESOURCE_QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, exponent, suffix = match.groups()
    scale = _QUANTITY_SUFFIXES[suffix] if suffix and suffix.endswith("i") else _DECIMAL_SUFFIXES[suffix or ""]
    # Decimal of the whole decimal, not x 10**exponent: `1e400` stays a number (an int power of it
    # raised OverflowError, which pydantic passes on as a traceback, not a field error).
    return Decimal(f"{number}e{exponent or 0}") * Decimal(scale)


# Label keys and values, and resource names, as the API server checks them (apimachinery validation).
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME = re.compile(rf"(({_DNS_SUBDOMAIN})/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a qualified name (a label key, a taint key) the API server takes; None if it is."""
    prefix, _, name = key.rpartition("/")
    if not _QUALIFIED_NAME.fullmatch(key) or len(prefix) > 253 or len(name) > 63:
        return f"{key!r} is not a qualified name (an optional DNS prefix and '/', then 1-63 of [A-Za-z0-9-_.])"
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is not a label value the API server takes; None if it is."""
    if not _LABEL_VALUE.fullmatch(value):
        return f"{value!r} is not a label value (0-63 of [A-Za-z0-9-_.])"
    return None


def _gpu_product_label(value: str) -> str:
    # Rendered as the nodeSelector value of nvidia.com/gpu.product: the API server refuses a
    # Deployment whose selector value is not a label value, so the model could never run.
    if (problem := label_value_problem(value)) is not None:
        raise ValueError(f"{problem}: it is the node label nvidia.com/gpu.product, so use the label's form, "
                         "e.g. NVIDIA-H100-80GB-HBM3 (`kubectl get nodes -L nvidia.com/gpu.product`)")  # fmt: skip
    return value


GPUProduct = Annotated[str, AfterValidator(_gpu_product_label)]
"""A GPU product as the node label nvidia.com/gpu.product spells it (a label value)."""

KVRatio = Annotated[float, Field(ge=1.0, le=MAX_KV_RATIO, allow_inf_nan=False)]
"""A pool-to-context ratio (spec.minKVRatio, InferencePolicy spec.minKVRatio)."""


# --- Enumerations --------------------------------------------------------------------------------


class EngineKind(StrEnum):
    """Which inference engine serves the model. Each has its own KV pool sizing rule."""

    KVGUARD = "kvguard"
    SGLANG = "sglang"
    VLLM = "vllm"


class ModelDtype(StrEnum):
    """Unquantized weight / activation dtype of the checkpoint (config.json `torch_dtype`)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Quantization(StrEnum):
    """Weight format. `bf16`/`fp16`/`fp32` mean unquantized; the others store quantized linear
    layers with their scales (AWQ/GPTQ: 4-bit with one fp16 scale and 4-bit zero per group;
    mxfp4: 4-bit with one 8-bit scale per 32 weights; nvfp4: one fp8 scale per 16)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    AWQ = "awq"
    GPTQ = "gptq"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"


class QuantizedLayers(StrEnum):
    """Which parameters a quantization applies to. Embeddings, norms and the LM head stay in the
    model dtype either way."""

    ALL_LINEAR = "allLinear"
    EXPERTS_ONLY = "expertsOnly"


class KVCacheDtype(StrEnum):
    """Element type of the KV cache. `auto` follows the model dtype (SGLang/vLLM default)."""

    AUTO = "auto"
    BF16 = "bf16"
    BFLOAT16 = "bfloat16"
    FP16 = "fp16"
    FLOAT16 = "float16"
    FP32 = "fp32"
    FLOAT32 = "float32"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP4_E2M1 = "fp4_e2m1"


class DeviceKind(StrEnum):
    """Where the engine keeps weights and KV. On `cpu` the device memory is the configured budget."""

    CUDA = "cuda"
    CPU = "cpu"


# --- Model ---------------------------------------------------------------------------------------


class MLAConfig(ApiModel):
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-5 family): the KV cache stores one
    compressed latent plus a shared RoPE key per token and layer, identical on every GPU."""

    kv_lora_rank: PositiveInt
    """Width of the compressed KV latent (config.json `kv_lora_rank`, 512 for DeepSeek-V3)."""
    qk_rope_head_dim: NonNegativeInt
    """Width of the decoupled RoPE key stored next to the latent (`qk_rope_head_dim`, 64)."""
    indexer_head_dim: NonNegativeInt = 0
    """Sparse-attention indexer key width cached per token and layer (DeepSeek-V3.2 / GLM-5
    `index_head_dim`); 0 when the model has no indexer."""


_NARROW_HEADS = ("hiddenSize must be at least numAttentionHeads when headDim is not set: the head width "
                 "hiddenSize / numAttentionHeads would be 0")  # fmt: skip


class ModelArchitecture(ApiModel):
    """The shape of the transformer, as far as KV cache and weight memory depend on it. Fill it by
    hand or from a Hugging Face config.json (`kvguard plan --hf-config`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.headDim) || !has(self.hiddenSize) || self.hiddenSize >= self.numAttentionHeads",
                 "message": _NARROW_HEADS},
                # The planner's own checks (planner._architecture_problems), for clusters without the
                # webhook: stored, the model went Degraded instead of being refused at apply (outside probe).
                {"rule": "has(self.mla) || self.numKVHeads <= self.numAttentionHeads",
                 "message": "numKVHeads: must not exceed numAttentionHeads"},
                {"rule": "has(self.mla) || self.numKVHeads > self.numAttentionHeads || self.numAttentionHeads % self.numKVHeads == 0",
                 "message": "numKVHeads: must divide numAttentionHeads"},
                {"rule": "!has(self.totalParameters) || self.totalParameters >= "
                         "(has(self.embeddingParameters) ? self.embeddingParameters : 0) + "
                         "(has(self.attentionParameters) ? self.attentionParameters : 0) + "
                         "(has(self.expertParameters) ? self.expertParameters : 0)",
                 "message": "totalParameters: must be at least embedding + attention + expert parameters"},
                {"rule": "!has(self.moeLayers) || self.moeLayers <= self.numLayers",
                 "message": "moeLayers: must not exceed numLayers"},
            ]
        }
    )

    num_layers: PositiveInt
    """Transformer layers that own a KV cache (config.json `num_hidden_layers`)."""
    num_attention_heads: PositiveInt
    """Query heads per layer (`num_attention_heads`)."""
    num_kv_heads: PositiveInt
    """Key/value heads per layer (`num_key_value_heads`; equals the query heads for MHA)."""
    head_dim: PositiveInt | None = None
    """Per-head width. Some models set it explicitly (Qwen3, Mistral-Small, gpt-oss); when absent it
    is hiddenSize / numAttentionHeads."""
    hidden_size: PositiveInt | None = None
    """Model width (`hidden_size`); needed when headDim is not given."""
    vocab_size: PositiveInt | None = None
    """Vocabulary size (`vocab_size`); informational."""
    dtype: ModelDtype = ModelDtype.BF16
    """Dtype of unquantized weights and of the KV cache when kvCacheDtype is `auto`."""
    total_parameters: PositiveInt | None = None
    """All parameters of the checkpoint, including embeddings, the LM head and every expert.
    Needed unless spec.weights.measuredBytesPerDevice is given."""
    embedding_parameters: NonNegativeInt = 0
    """Parameters of the input embedding and LM head (never quantized; vocab-parallel over TP)."""
    attention_parameters: NonNegativeInt = 0
    """Parameters of the attention projections of all layers (sharded over the attention TP group,
    i.e. replicated per rank with data-parallel attention); 0 when unknown."""
    expert_parameters: NonNegativeInt = 0
    """Parameters of routed MoE experts (sharded by expert/tensor parallelism); 0 for dense models."""
    num_experts: NonNegativeInt = 0
    """Routed experts per MoE layer; 0 for dense models. Informational."""
    moe_layers: PositiveInt | None = None
    """Layers that carry the routed experts, when not all do (DeepSeek's and GLM's first dense
    layers, Qwen's `mlp_only_layers`); unset: every layer. With pipeline parallelism a stage of MoE
    layers only is the heaviest, and the plan is that stage's. The planner's alone: it changes no
    rendered flag, so it is not part of a revision (revision.py)."""
    max_position_embeddings: PositiveInt | None = None
    """Longest sequence the model was built for (config.json `max_position_embeddings`); the
    planner warns when contextLength exceeds it."""
    mla: MLAConfig | None = None
    """Present for multi-head latent attention models; replaces the per-head K/V cache."""

    @model_validator(mode="after")
    def _heads_have_width(self) -> ModelArchitecture:
        # The CEL rule above, for where no API server runs it. A head width of 0 made every
        # token's KV 0 bytes and the pool size a division by zero (webhook, reconcile, CLI).
        if self.head_dim is None and self.hidden_size is not None and self.hidden_size < self.num_attention_heads:
            raise ValueError(_NARROW_HEADS)
        return self

    @property
    def effective_head_dim(self) -> int | None:
        """headDim, or hiddenSize / numAttentionHeads when not given (None if neither is known)."""
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.num_attention_heads if self.hidden_size else None


# A path inside the model volume: no `..` segment (RE2 and ECMA both lack lookahead, so the segment
# forms are spelled out: not starting with a dot, a dot and one more, or `..` and more).
_PATH_SEGMENT = rf"(?:[^./{_CONTROL}][^/{_CONTROL}]*|\.[^./{_CONTROL}][^/{_CONTROL}]*|\.\.[^/{_CONTROL}]+)"
_VOLUME_PATH = rf"^/?$|^/?[^./{_CONTROL}][^/{_CONTROL}]*(?:/{_PATH_SEGMENT})*/?$"
# Both go onto the engine's command line as values (`--model-path ID --revision REV`): neither may
# start with `-`, or it would be read as a flag (`huggingFace: --num-gpu-blocks-override=9`).
_HF_REPO_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"
_REVISION = rf"^$|^[^\s{_CONTROL}-][^{_CONTROL}]*$"


class PVCSource(ApiModel):
    """Weights on a PersistentVolumeClaim in the model's namespace, mounted read-only."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=rf"^{_DNS_SUBDOMAIN}$")
    """Name of the PersistentVolumeClaim (a DNS-1123 subdomain, as every PVC's name is: another
    name would render pods that wait for a claim that cannot exist)."""
    path: str = Field(default="", max_length=4096, pattern=_VOLUME_PATH)
    """Directory of the model inside the volume (config.json, tokenizer, safetensors); no `..`
    segment (it would leave the volume's mount)."""


class ModelSource(ApiModel):
    """Exactly one of huggingFace or pvc."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.huggingFace) != has(self.pvc)",
                 "message": "set exactly one of huggingFace or pvc"},
            ]
        }
    )

    hugging_face: str | None = Field(default=None, min_length=1, max_length=256, pattern=_HF_REPO_ID)
    """Hugging Face repository id, e.g. meta-llama/Llama-3.1-8B-Instruct (sglang and vllm only:
    the kvguard engine loads from a directory)."""
    pvc: PVCSource | None = None
    """A directory on a PersistentVolumeClaim."""
    revision: str | None = Field(default=None, max_length=256, pattern=_REVISION)
    """Weights revision: a Hugging Face commit or tag, or any label naming the volume's contents.
    A new value makes a new rollout revision."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSource:
        # The CEL rule above, for where no API server runs it (kvguard plan/render/apply --local);
        # with both, the renderer silently took the volume.
        if (self.hugging_face is None) == (self.pvc is None):
            raise ValueError("set exactly one of huggingFace or pvc")
        return self


class ConfigMapKeySelector(ApiModel):
    """A key of a ConfigMap in the model's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """ConfigMap name."""
    key: str = Field(default="config.json", min_length=1, max_length=253)
    """Key holding the Hugging Face config.json."""


class ModelSpec(ApiModel):
    """Which model is served and what it looks like."""

    name: str = Field(min_length=1, max_length=256, pattern=rf"^[^\s{_CONTROL}-][^\s{_CONTROL}]*$")
    """Model name clients send (usually the Hugging Face id, e.g. meta-llama/Llama-3.1-8B-Instruct):
    at most 256 characters, no whitespace or control characters, not starting with `-` (it is a
    worker flag's value)."""
    architecture: ModelArchitecture | None = None
    """Shape of the model. Required for planning; `kvguard plan --hf-config` can supply it."""
    extra_draft_layers: NonNegativeInt = 0
    """Speculative-decoding draft layers (EAGLE, MTP) that share the target model's KV pool."""
    source: ModelSource | None = None
    """Where the weights come from: a Hugging Face id or a path on a PersistentVolumeClaim, plus the
    weights revision. Required to deploy; `kvguard plan` does not need it."""
    architecture_config_map: ConfigMapKeySelector | None = None
    """A ConfigMap holding the model's config.json; the operator fills `architecture` from it when
    `architecture` is not given."""


class WeightsSpec(ApiModel):
    """Weight format, or measured weight memory when it is known from a log."""

    quantization: Quantization | None = None
    """Weight format; omitted means unquantized in the model dtype."""
    quantized_layers: QuantizedLayers | None = None
    """Which parameters the quantization covers; default: `expertsOnly` for mxfp4 (gpt-oss),
    `allLinear` otherwise."""
    group_size: PositiveInt = 128
    """Weights per scale group for AWQ/GPTQ/int4."""
    measured_bytes_per_device: ByteQuantity | None = None
    """Weight memory per GPU as measured (e.g. SGLang's `Load weight end ... mem usage`). Overrides
    the estimate from parameters and quantization."""
    measured_shards: PositiveInt | None = None
    """GPUs the weights were split over when measuredBytesPerDevice was measured, taken as tensor
    parallelism alone (leave it unset for a figure measured at the roles' own split). When set, the
    planner scales the figure to each role's own split, a role with pipeline stages to its heaviest
    stage (ceil(numLayers / PP) layers and a whole vocabulary matrix), and says it did. When omitted the figure is used as-is where every role has one split;
    where the roles' splits differ it is taken as measured over the widest (the safe end), and
    admission refuses an update that changes a role's split while the figure stays."""


# --- Deployment ----------------------------------------------------------------------------------


class SGLangKVCanary(ApiModel):
    """SGLang's read-time KV check (`--kv-canary`, sglang >= 0.5.22, `srt/kv_canary/`): canary
    tokens written beside each KV slot and verified on every forward (and by a periodic sweep).
    Violations are only logged (`log`) or stop the whole server (`raise`); see docs/sglang-kv-canary.md."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.sweepInterval) || self.sweepInterval == 0 || self.mode != 'none'",
                 "message": "sweepInterval requires mode log or raise"},
            ]
        }
    )

    mode: Literal["none", "log", "raise"] = "none"
    """`none` (off), `log` (violations logged as WARNING, the server keeps serving) or `raise`
    (the first violation stops the server: test clusters)."""
    real_data: Literal["none", "partial", "all"] = "none"
    """`--kv-canary-real-data`: also hash the real KV bytes (`partial`: the first 16 bytes of each slot)."""
    sweep_interval: NonNegativeInt = 0
    """`--kv-canary-sweep-interval`: every N forward steps also verify every slot the radix cache
    holds (0: never)."""

    @model_validator(mode="after")
    def _sweep_needs_a_mode(self) -> SGLangKVCanary:
        # sglang 0.5.23 srt/arg_groups/validation_hook.py refuses the same combination at start-up.
        if self.sweep_interval > 0 and self.mode == "none":
            raise ValueError("sweepInterval requires mode log or raise (SGLang refuses it otherwise)")
        return self


class EngineSpec(ApiModel):
    """The inference engine and how it is launched."""

    kind: EngineKind = EngineKind.KVGUARD
    """`kvguard` (our tagged engine), `sglang` or `vllm`."""
    image: Image | None = None
    """Container image; defaults to the kvguard worker image for `kvguard`."""
    version: str | None = Field(default=None, max_length=256, pattern=rf"^[^{_CONTROL}]*$")
    """Engine version, recorded in status and used to pick version-specific defaults."""
    extra_args: list[ArgValue] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS)
    """Extra command-line arguments passed to every worker of the engine, verbatim."""
    router_image: Image | None = None
    """Image of the router. Default: the engine image (kvguard; SGLang images ship sglang_router);
    required for vllm (e.g. an image with vllm-router)."""
    kv_canary: SGLangKVCanary | None = None
    """SGLang's own read-time KV canary, on prefill and decode (sglang only)."""
    stream_interval: int | None = Field(None, ge=1, le=MAX_EVENT_TOKENS)
    """Tokens per streamed event, rendered as `--stream-interval` on decode workers (kvguard,
    SGLang and vLLM name and mean it alike). The first token always goes at once; then one event
    per N tokens. Unset: the engine's default, 1, every token as soon as it is made. Larger trades
    smoothness for less per-event CPU in decode, router and client."""


class HardwareSpec(ApiModel):
    """The device each worker process runs on."""

    device: DeviceKind = DeviceKind.CUDA
    """`cuda` for GPUs; `cpu` runs the kvguard engine on host memory."""
    memory_per_device: ByteQuantity = Field(gt=0, json_schema_extra=POSITIVE_BYTES_SCHEMA)  # the CRD's bounds, both forms
    """Memory of one device as the driver reports it (torch `mem_get_info` total: 79.18Gi for an
    H100 80GB). On CPU: the memory budget for weights and KV of one worker."""
    device_overhead: ByteQuantity | None = None
    """Memory per device the engine's pool rule subtracts besides weights and reserve. SGLang and
    kvguard: memory already in use before the engine loads weights (CUDA context, NCCL and
    all-reduce buffers at TP > 1, other processes): SGLang's "free before load" is memoryPerDevice
    minus this. vLLM: its "non-torch memory" (NCCL, custom all-reduce, cuBLAS workspaces; the CUDA
    context is not counted, vLLM measures from after it). Omitted: the planner uses a conservative
    per-engine estimate and says so (0 on cpu)."""
    gpu_product: GPUProduct | None = None
    """GPU product name (e.g. NVIDIA-H100-80GB-HBM3); informational."""


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """`Equal` matches key and value; `Exists` matches the key alone."""
    value: str | None = None
    """Taint value to match with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None  # an int64 on the API server
    """For NoExecute: how long the pod stays bound after the taint appears."""

    @model_validator(mode="after")
    def _as_the_api_server_checks_it(self) -> Toleration:
        if (problem := self._problem()) is not None:
            raise ValueError(problem)
        return self

    def _problem(self) -> str | None:
        # core/v1 ValidateTolerations: the API server refuses a Deployment carrying any of these.
        if self.operator == "Exists" and self.value:
            return "value must be empty when operator is Exists"
        if self.operator == "Equal" and not self.key:
            return "key is required when operator is Equal (the default); an empty key with operator Exists tolerates every taint"
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            return "tolerationSeconds applies only to effect NoExecute"
        if self.key and (problem := qualified_name_problem(self.key)) is not None:
            return f"key: {problem}"
        if self.value and (problem := label_value_problem(self.value)) is not None:
            return f"value: {problem}"
        return None


class ResourceRequirements(ApiModel):
    """Extra container resources (core/v1 ResourceRequirements). GPUs come from gpuCount, not here."""

    requests: dict[str, ResourceQuantity] = Field(default_factory=dict)
    """Requested quantities, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, ResourceQuantity] = Field(default_factory=dict)
    """Limits, e.g. {memory: 96Gi}."""

    @model_validator(mode="after")
    def _as_the_api_server_checks_it(self) -> ResourceRequirements:
        # core/v1 ValidateResourceRequirements: the API server refuses a Deployment breaking any.
        for name in {**self.requests, **self.limits}:
            if (problem := _resource_name_problem(name)) is not None:
                raise ValueError(problem)
        for kind, quantities in (("requests", self.requests), ("limits", self.limits)):
            for name, quantity in quantities.items():
                if (problem := _quantity_problem(name, quantity)) is not None:
                    raise ValueError(f"{kind}.{name}: {problem}")
        for name, request in self.requests.items():
            if (problem := _request_limit_problem(name, request, self.limits.get(name))) is not None:
                raise ValueError(problem)
        return self


_STANDARD_CONTAINER_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})


def _is_extended_resource(name: str) -> bool:
    # Kubernetes' IsNativeResource: no '/', or a kubernetes.io/ prefix. Anything else with a '/'
    # (nvidia.com/gpu, example.com/foo) is an extended resource: counted, never overcommitted.
    return "/" in name and "kubernetes.io/" not in name


def _resource_name_problem(name: str) -> str | None:
    """The API server's check of a container resource name (validateContainerResourceName)."""
    if (problem := qualified_name_problem(name)) is not None:
        return f"resource name {problem}"
    if "/" not in name and name not in _STANDARD_CONTAINER_RESOURCES and not name.startswith("hugepages-"):
        return (f"resource name {name!r} is not a standard container resource (cpu, memory, ephemeral-storage, "
                "hugepages-<size>) nor an extended one with a domain (example.com/foo)")  # fmt: skip
    if _is_extended_resource(name) and name.startswith("requests."):
        return f"resource name {name!r}: an extended resource name must not begin with 'requests.'"
    return None


def _quantity_problem(name: str, quantity: str) -> str | None:
    value = quantity_value(quantity)
    if value < 0:
        return f"{quantity} must not be negative"
    if _is_extended_resource(name) and value != value.to_integral_value():
        return f"{quantity} must be a whole number (extended resources are counted in units)"
    return None


def _request_limit_problem(name: str, request: str, limit: str | None) -> str | None:
    # Extended resources and hugepages cannot be overcommitted (Kubernetes IsOvercommitAllowed):
    # a request needs a limit, and the two must be equal.
    exact = _is_extended_resource(name) or name.startswith("hugepages-")
    if limit is None:
        return f"requests.{name} ({request}) needs limits.{name}: it cannot be overcommitted" if exact else None
    if exact and quantity_value(request) != quantity_value(limit):
        return f"requests.{name} ({request}) must equal limits.{name} ({limit}): it cannot be overcommitted"
    if quantity_value(request) > quantity_value(limit):
        return f"requests.{name} ({request}) must not exceed limits.{name} ({limit})"
    return None


class PodPlacement(ApiModel):
    """Where and with what the pods of one role run. Only gpuType and gpuCount change the plan's
    revision; the rest is applied to the running revision in place."""

    gpu_type: GPUProduct | None = None
    """GPU product the pods must land on (node label nvidia.com/gpu.product), e.g.
    NVIDIA-H100-80GB-HBM3. Default: spec.hardware.gpuProduct."""
    gpu_count: Annotated[int, Field(ge=0, le=MAX_PARALLEL)] | None = None
    """GPUs per pod (nvidia.com/gpu). Default: tensorParallel x pipelineParallel (x dataParallel
    for vLLM and for SGLang without DP attention; the kvguard engine runs a pod per rank) for
    workers, 0 for the router (which runs no engine: more is refused). Never fewer on a GPU spec. At most 65536, as every parallel size
    (a count of 2**70 rendered a pod no node could ever take)."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """CPU, memory and other resources of the engine container."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods require. On a worker role, nvidia.com/gpu.product must agree with
    gpuType / spec.hardware.gpuProduct where those are set (set them instead)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pods tolerate (GPU nodes are often tainted)."""

    @model_validator(mode="after")
    def _node_selector_is_labels(self) -> PodPlacement:
        for key, value in self.node_selector.items():
            if (problem := qualified_name_problem(key)) is not None:
                raise ValueError(f"nodeSelector key {problem}")
            if (problem := label_value_problem(value)) is not None:
                raise ValueError(f"nodeSelector[{key}]: {problem}")
        return self



def _or_one(field: str) -> str:
    return f"(has(self.{field}) ? self.{field} : 1)"


# `_fits_its_pods` for the API server (no product overflows CEL's int64: 2^31 x 2^16 x 2^16 at most).
# A stored role breaking either has not parsed since the check came (reconcile: InvalidSpec).
_WORKER_ROLE_RULES: list[dict[str, str]] = [
    {"rule": f"{_or_one('replicas')} * {_or_one('dataParallel')} <= {MAX_INT32}",
     "message": f"replicas x dataParallel is more pods than a Deployment holds ({MAX_INT32})"},
    {"rule": f"!has(self.gpuCount) || self.gpuCount == 0 || "
             f"self.gpuCount >= {_or_one('tensorParallel')} * {_or_one('pipelineParallel')}",
     "message": "gpuCount is below tensorParallel x pipelineParallel: one engine instance needs that many GPUs in its pod"},
]  # fmt: skip


class WorkerRole(PodPlacement):
    """One disaggregated role (prefill or decode): how many engine instances, how each is split."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{**rule} for rule in _WORKER_ROLE_RULES]})

    replicas: Replicas = 1
    """Engine instances of this role. Each has its own KV pool."""
    tensor_parallel: ParallelSize = 1
    """GPUs that shard every layer of one instance (SGLang `--tp-size`, vLLM `-tp`)."""
    pipeline_parallel: ParallelSize = 1
    """Pipeline stages; each GPU holds layers / stages of the KV cache."""
    data_parallel: ParallelSize = 1
    """Data-parallel ranks (SGLang `--dp-size`, vLLM `-dp`). Each rank has its own KV pool."""
    data_parallel_attention: bool = False
    """SGLang `--enable-dp-attention`: the DP ranks split the tensor-parallel group for attention
    (attention TP = tensorParallel / dataParallel) and each keeps the full KV heads."""
    expert_parallel: ParallelSize = 1
    """Expert-parallel size: MoE experts are sharded over max(tensorParallel, expertParallel) GPUs."""
    memory_fraction: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    """Overrides spec.memoryFraction for this role."""
    kv_pool_tokens: PoolTokens | None = None
    """Overrides spec.kvPoolTokens for this role (`kvguard plan --kv-pool-tokens` replaces both)."""
    extra_args: list[ArgValue] | None = Field(default=None, max_length=MAX_EXTRA_ARGS)
    """Arguments for this role only, after engine.extraArgs (sglang and vllm). Prefill and decode
    must still agree on everything their KV exchange depends on (P/D parity, sglang#19398): model
    revision, KV dtype, page size, transfer backend, KV checksum and engine build."""
    image: Image | None = None
    """Container image for this role only (sglang and vllm); default engine.image. Prefill and
    decode must run the same build (P/D parity)."""

    @model_validator(mode="after")
    def _fits_its_pods(self) -> WorkerRole:
        if self.replicas * self.data_parallel > MAX_INT32:  # the kvguard engine renders a pod per DP rank
            raise ValueError(f"replicas x dataParallel ({self.replicas * self.data_parallel}) is more pods than a "
                             f"Deployment holds ({MAX_INT32})")  # fmt: skip
        split = self.tensor_parallel * self.pipeline_parallel
        if self.gpu_count and self.gpu_count < split:
            raise ValueError(f"gpuCount {self.gpu_count} is below tensorParallel x pipelineParallel ({split}): "
                             "one engine instance needs that many GPUs in its pod")  # fmt: skip
        return self


class RouterRole(PodPlacement):
    """The request router in front of prefill and decode."""

    replicas: Replicas = Field(1, gt=0)
    """Router instances."""


class RolesSpec(ApiModel):
    """Per-role deployment shape."""

    prefill: WorkerRole = Field(default_factory=WorkerRole)
    """Prefill workers: compute the prompt's KV and send it to decode."""
    decode: WorkerRole = Field(default_factory=WorkerRole)
    """Decode workers: receive KV into pre-allocated pages and generate tokens."""
    router: RouterRole = Field(default_factory=RouterRole)
    """The router that admits requests (S2) and pairs prefill with decode."""

    def worker_roles(self) -> dict[str, WorkerRole]:
        """The roles that own a KV pool, by name."""
        return {"prefill": self.prefill, "decode": self.decode}


WORKER_PORTS = {8000: "API port", 8001: "metrics port"}
"""The ports every rendered worker container listens on (render.HTTP_PORT, render.METRICS_PORT)."""


class KVTransferSpec(ApiModel):
    """How prefill sends KV to decode. Rendered as worker flags (kvguard), environment (SGLang's
    PD and Mooncake variables) or the KV-transfer config (vLLM)."""

    # `_port_is_free_on_decode` for the API server; a stored port it refuses has not parsed since it came.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.port) || !(self.port in [" + ", ".join(map(str, WORKER_PORTS)) + "])",
         "message": "port: " + " and ".join(f"{port} is decode's {what}" for port, what in WORKER_PORTS.items())
                    + " already; pick another (default 9000)"}]})  # fmt: skip

    max_batch: ByteQuantity = Field(default=64 * 1024**2, gt=0, json_schema_extra=POSITIVE_BYTES_SCHEMA)
    """Bytes in flight per prefill->decode pair before back-pressure (S6; kvguard
    `--max-transfer-batch`)."""
    timeout_seconds: PositiveInt = 30
    """A transfer that makes no progress for this long aborts its request on both sides (S4;
    kvguard `--transfer-timeout`, from prefill's OPEN on; Mooncake `MC_TRANSFER_TIMEOUT`)."""
    bootstrap_timeout_seconds: PositiveInt = 300
    """How long prefill waits for decode's destination pages before it aborts the request and
    frees its pages (kvguard `--bootstrap-timeout` on prefill: no transfer ticket in time is a 504
    `bootstrap_timeout`; SGLang `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`), and how long decode's
    granted pages wait for prefill to open the transfer (kvguard `--bootstrap-timeout` on decode,
    SGLang `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`: prefill sends only after computing the prompt,
    so this bounds its queue and compute; `timeoutSeconds` governs once the transfer is open)."""
    port: int = Field(default=9000, ge=1024, le=65535)
    """Decode's KV-transfer port (kvguard); the NetworkPolicy admits only prefill pods to it. Not
    8000 or 8001: every worker listens there already (its control API and its metrics)."""
    backend: Literal["mooncake", "nixl"] = "mooncake"
    """Transfer backend for SGLang (`--disaggregation-transfer-backend`); vLLM always uses NIXL."""
    checksum: bool = False
    """SGLang `--disaggregation-enable-kv-checksum` on prefill and decode: an Adler-32 digest of each
    request's KV pages, verified on decode; a mismatch aborts the request. kvguard checks every
    chunk always; vLLM has no such option."""
    encryption: Literal["none", "aes-gcm"] = "none"
    """KV payloads in flight (kvguard engine): `none` authenticates every frame (HMAC, per-request
    ticket) and checksums payloads but sends KV readable; `aes-gcm` also encrypts each request's
    KV with its own key. Turn it on when prefill-to-decode traffic crosses a network you do not
    trust (nodes, zones, shared tenancy) and no mesh encrypts it (docs/threat-model.md)."""

    @model_validator(mode="after")
    def _port_is_free_on_decode(self) -> KVTransferSpec:
        if self.port in WORKER_PORTS:
            raise ValueError(f"port: {self.port} is decode's {WORKER_PORTS[self.port]} already; pick another (default 9000)")
        return self


STARTUP_PROBE_SECONDS = 10 * 180
"""What the rendered startupProbe allows a worker to load weights (periodSeconds x failureThreshold)."""
DEFAULT_PROGRESS_DEADLINE_SECONDS = STARTUP_PROBE_SECONDS + 600
"""The startup budget plus 10 minutes for scheduling and image pulls."""


# --- Progressive delivery: traffic in steps, analysis on live traffic (spec.rollout.*) ------------

DURATION_PATTERN = r"^([0-9]+|[0-9]+h([0-9]+m)?([0-9]+s)?|[0-9]+m([0-9]+s)?|[0-9]+s)$"
"""Seconds as an integer, or a duration such as `90s`, `2m`, `1h30m`: ASCII digits, at least one
part, no spaces (the CRD carries the same pattern, and the webhook parses no more than it admits)."""
_DURATION_RE = re.compile(r"(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")
MAX_DURATION_SECONDS = 7 * 24 * 3600
_DURATION_MAX_LENGTH = 32  # bounds the CEL rules' cost from Kubernetes 1.34 (before: see _UNIT_ENDED)
# The API server's side of parse_duration_seconds' range (the pattern checks the form). Go's
# duration() reads every form the pattern admits but the bare number of seconds.
#
# No rule calls matches() (or any function whose cost grows with the string) on a duration: an API
# server before 1.34 costs an int-or-string field at the request's size whatever its maxLength
# (kubernetes#132837), and a matches() per rollout step came to ~19M, over the 10M a rule may
# cost, so the CRD would not install there (an outside probe). endsWith() costs its argument's
# length, and the conversions a constant. The pattern has held: a string that ends in h, m or s is
# a Go duration, any other is digits.
_UNIT_ENDED = "({0}.endsWith('h') || {0}.endsWith('m') || {0}.endsWith('s'))"
_DURATION_RANGE_RULE = {
    "rule": f"type(self) == int ? (self >= 0 && self <= {MAX_DURATION_SECONDS}) : ({_UNIT_ENDED.format('self')} ? "
            f"duration(self) <= duration('{MAX_DURATION_SECONDS}s') : int(self) <= {MAX_DURATION_SECONDS})",
    "message": f"must be between 0 and {MAX_DURATION_SECONDS} seconds (7 days)",
}  # fmt: skip
# A zero duration in any form: `0`, `"00"`, `"0m"`, `"0h0m0s"` (the pattern holds already).
_ZERO_DURATION_CEL = f"(type({{0}}) == int ? {{0}} == 0 : ({_UNIT_ENDED} ? duration({{0}}) == duration('0s') : int({{0}}) == 0))"


def parse_duration_seconds(value: Any) -> int:
    """`90`, `"90"`, `"90s"`, `"2m"`, `"1h30m"` as whole seconds; ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s or 2m, not a boolean")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        seconds = value
    elif isinstance(value, str) and len(value) <= _DURATION_MAX_LENGTH and re.fullmatch(DURATION_PATTERN, value):
        match = _DURATION_RE.fullmatch(value)
        parts = (int(g) if g else 0 for g in match.groups()) if match else (0, 0, int(value))
        hours, minutes, secs = parts
        seconds = hours * 3600 + minutes * 60 + secs
    else:
        raise ValueError(f"{value!r} is not a duration (examples: 30, 30s, 2m, 1h30m)")
    if not 0 <= seconds <= MAX_DURATION_SECONDS:
        raise ValueError(f"must be between 0 and {MAX_DURATION_SECONDS} seconds (7 days)")
    return seconds


DurationSeconds = Annotated[
    int,
    BeforeValidator(parse_duration_seconds),
    PlainSerializer(int, return_type=int),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": DURATION_PATTERN,
            "maxLength": _DURATION_MAX_LENGTH,
            "x-kubernetes-validations": [_DURATION_RANGE_RULE],
            "description": "Seconds, as an integer or a duration such as 30s, 2m or 1h30m.",
        }
    ),
]
"""Whole seconds. Accepts an integer or a duration string; always stored as integer seconds."""


class TrafficRouter(StrEnum):
    """How user traffic reaches a revision's routers."""

    SERVICE = "service"
    """The model's Service selects one revision's routers: all traffic moves at once (no split)."""
    GATEWAY_API = "gatewayAPI"
    """An HTTPRoute the operator owns, with weighted backendRefs to the stable and candidate
    routers' Services."""
    INFERENCE_POOL = "inferencePool"
    """One InferencePool (Gateway API Inference Extension) per revision, selecting its routers,
    and the HTTPRoute weighting the pools."""


class RolloutStep(ApiModel):
    """One step of the traffic shift: the candidate gets `weight` percent of user traffic for at
    least `pause`, while the analysis runs on its live traffic."""

    weight: int = Field(ge=1, le=100)
    """Percent of user traffic sent to the candidate in this step."""
    pause: DurationSeconds = 0
    """How long to hold this weight before the next step (the analysis must also have passed)."""


_GATEWAY_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class GatewayParentRef(ApiModel):
    """A Gateway the HTTPRoute attaches to (gateway.networking.k8s.io ParentReference)."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Gateway."""
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace of the Gateway; default: the model's namespace. The Gateway must allow routes
    from the model's namespace."""
    section_name: str | None = Field(default=None, min_length=1, max_length=253, pattern=_GATEWAY_NAME)
    """A listener of the Gateway, by name; default: every listener that allows the route."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """A listener of the Gateway, by port."""


class GatewaySpec(ApiModel):
    """Where the operator's HTTPRoute attaches (trafficRouter gatewayAPI or inferencePool). The
    route matches only the OpenAI API (`/v1/...`) on the given hostnames."""

    parent_refs: list[GatewayParentRef] = Field(min_length=1, max_length=32)
    """Gateways the HTTPRoute attaches to."""
    hostnames: list[Annotated[str, Field(min_length=1, max_length=253, pattern=_HOSTNAME)]] = Field(default_factory=list, max_length=16)
    """Host names the route answers for; empty: every host the Gateway listens on."""


class EndpointPickerRef(ApiModel):
    """The Endpoint Picker (EPP) extension Service of the InferencePools."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the EPP Service in the model's namespace."""
    port: int = Field(default=9002, ge=1, le=65535)
    """The EPP Service's port."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the Gateway does when the EPP does not answer."""


class InferencePoolOptions(ApiModel):
    """The per-revision InferencePools (trafficRouter inferencePool)."""

    endpoint_picker_ref: EndpointPickerRef | None = None
    """The EPP every pool names; omitted: the Gateway implementation's default picking."""


class ErrorRatioCheck(ApiModel):
    """The candidate's share of failed requests (5xx answers and streams it broke off), from its
    routers' kvguard_requests_total, per measurement. Requests whose client disconnected are not
    counted either way."""

    enabled: bool = True
    """Run the check (kvguard engine; other engines' routers do not export the counter)."""
    max_ratio: float = Field(default=0.05, ge=0, le=1, allow_inf_nan=False)
    """Largest share of the candidate's requests in a measurement that may fail."""
    failure_limit: NonNegativeInt = 0
    """Failed measurements tolerated before the analysis fails (0: the first one fails it)."""


class LatencyCheck(ApiModel):
    """A latency percentile of the candidate relative to the stable revision's, from the routers'
    histograms (kvguard_router_time_to_first_token_seconds, ..._inter_token_latency_seconds)."""

    enabled: bool = True
    """Run the check (kvguard engine only, as for errorRatio)."""
    percentile: float = Field(default=0.95, gt=0, lt=1, allow_inf_nan=False)
    """Which percentile to compare (0.95: p95)."""
    max_ratio_to_stable: float = Field(default=1.5, ge=1, allow_inf_nan=False)
    """The candidate's percentile may be at most this many times the stable's."""
    failure_limit: NonNegativeInt = 1
    """Failed measurements tolerated before the analysis fails."""


ANALYSIS_BUILTIN_CHECKS = ("safety", "errorRatio", "ttft", "itl")
"""Names of the built-in checks in status.rollout.analysis (queries may not reuse them)."""


class PrometheusQuery(ApiModel):
    """A PromQL query against spec.rollout.analysis.prometheusURL, measured with the other checks."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.max) || has(self.min)", "message": "set max, min or both: the bound the value must keep"},
                {"rule": "!has(self.max) || !has(self.min) || self.min <= self.max",
                 "message": "min must not exceed max: no value could pass"},
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Name of the result in status.rollout.analysis."""
    query: str = Field(min_length=1, max_length=4096)
    """PromQL giving one number (a scalar or a one-sample vector). `$revision` (the candidate),
    `$stable`, `$model` and `$namespace` are replaced before it is sent."""
    max: float | None = Field(default=None, allow_inf_nan=False)
    """The value must be at most this."""
    min: float | None = Field(default=None, allow_inf_nan=False)
    """The value must be at least this."""
    failure_limit: NonNegativeInt = 0
    """Failed measurements tolerated before the analysis fails."""

    @model_validator(mode="after")
    def _has_a_bound(self) -> PrometheusQuery:
        if self.max is None and self.min is None:
            raise ValueError("set max, min or both: the bound the value must keep")
        if self.max is not None and self.min is not None and self.min > self.max:  # outside probe: admitted, failed every rollout
            raise ValueError(f"min ({self.min:g}) must not exceed max ({self.max:g}): no value could pass")
        return self


class AnalysisSpec(ApiModel):
    """Analysis of the candidate's live traffic while traffic moves and while it bakes: kvguard's
    safety counters (any increase aborts at once), the error ratio, TTFT and ITL relative to the
    stable revision, and optional PromQL queries. A failed analysis sends all traffic back to the
    stable revision and fails the rollout; an inconclusive one (no data) holds the current step."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.queries) || size(self.queries) == 0 || has(self.prometheusURL)",
                 "message": "spec.rollout.analysis.queries need spec.rollout.analysis.prometheusURL"},
                # The names' check of `_queries_are_answerable` (at most 16 queries: 256 comparisons).
                {"rule": "!has(self.queries) || self.queries.all(q, !(q.name in ["
                         + ", ".join(f"'{n}'" for n in ANALYSIS_BUILTIN_CHECKS)
                         + "]) && self.queries.exists_one(o, o.name == q.name))",
                 "message": f"query names must be unique and not one of {', '.join(ANALYSIS_BUILTIN_CHECKS)}"},
            ]
        }
    )

    interval_seconds: PositiveInt = 30
    """Time between two measurements; each measurement covers the traffic since the previous one."""
    min_requests: PositiveInt = 20
    """Candidate requests a measurement needs for the router checks; fewer: inconclusive. A stable
    window that served fewer is not compared with: its last window that served enough is."""
    error_ratio: ErrorRatioCheck = Field(default_factory=ErrorRatioCheck)
    """Failed requests (5xx, or broken off by the revision) of the candidate's ended requests;
    requests their clients abandoned count on neither side."""
    ttft: LatencyCheck = Field(default_factory=LatencyCheck)
    """Time to first token, relative to the stable revision."""
    itl: LatencyCheck = Field(default_factory=LatencyCheck)
    """Inter-token latency, relative to the stable revision."""
    prometheus_url: str | None = Field(default=None, alias="prometheusURL", max_length=2048, pattern=r"^https?://[^\s]+$")
    """Base URL of a Prometheus (its /api/v1/query) for `queries`."""
    queries: list[PrometheusQuery] = Field(default_factory=list, max_length=16)
    """Extra checks: PromQL queries and the bounds their value must keep."""
    consecutive_error_limit: NonNegativeInt = Field(default=4, le=1000)
    """Measurements in a row that may error (the candidate's metrics unreadable, Prometheus
    unreachable or answering an error) before the analysis fails, as Argo Rollouts'
    consecutiveErrorLimit (also 4 by default). Else a Prometheus outage held the candidate at its
    step, up to the whole bake at 100%, for ever."""

    @model_validator(mode="after")
    def _queries_are_answerable(self) -> AnalysisSpec:
        if self.queries and self.prometheus_url is None:
            raise ValueError("spec.rollout.analysis.queries need spec.rollout.analysis.prometheusURL")
        names = [q.name for q in self.queries]
        clash = sorted({n for n in names if n in ANALYSIS_BUILTIN_CHECKS or names.count(n) > 1})
        if clash:
            raise ValueError(f"query names must be unique and not one of {', '.join(ANALYSIS_BUILTIN_CHECKS)}: {', '.join(clash)}")
        return self


_SPLITTING_ROUTERS = "(has(self.trafficRouter) && self.trafficRouter != 'service')"
MAX_ROLLOUT_STEPS = 20
_ROLLOUT_RULES: list[dict[str, str]] = [
    {"rule": f"!{_SPLITTING_ROUTERS} || has(self.gateway)",
     "message": "spec.rollout.gateway: required with trafficRouter gatewayAPI or inferencePool (the HTTPRoute's parentRefs)"},
    {"rule": f"{_SPLITTING_ROUTERS} || !has(self.steps) || (size(self.steps) == 1 && self.steps[0].weight == 100)",
     "message": "spec.rollout.steps: trafficRouter service switches the model Service's selector, which cannot split "
                "traffic; use one step of weight 100, or trafficRouter gatewayAPI or inferencePool"},
    {"rule": "!has(self.steps) || size(self.steps) == 0 || self.steps[size(self.steps) - 1].weight == 100",
     "message": "spec.rollout.steps: the last step must send 100% of the traffic to the candidate"},
    {"rule": f"{_SPLITTING_ROUTERS} || ((!has(self.bakeSeconds) || self.bakeSeconds == 0) "
             f"&& (!has(self.steps) || self.steps.all(s, !has(s.pause) || {_ZERO_DURATION_CEL.format('s.pause')})))",
     "message": "spec.rollout.bakeSeconds / steps[].pause: the analysis runs on the candidate's share of live traffic, "
                "which trafficRouter service cannot give it; use trafficRouter gatewayAPI or inferencePool"},
    # check_steps' last rule (an outside probe: the CRD stored [50, 10, 100]); CEL has no index
    # range, so each neighbouring pair of the at most MAX_ROLLOUT_STEPS is written out.
    {"rule": "!has(self.steps) || (" + " && ".join(
        f"(size(self.steps) <= {i + 1} || self.steps[{i}].weight < self.steps[{i + 1}].weight)"
        for i in range(MAX_ROLLOUT_STEPS - 1)) + ")",
     "message": "spec.rollout.steps: weights must increase from step to step"},
]  # fmt: skip


def check_steps(router: TrafficRouter, steps: list[RolloutStep]) -> None:
    """The field-level rules of spec.rollout.steps (ValueError naming the field)."""
    if steps[-1].weight != 100:
        raise ValueError("spec.rollout.steps: the last step must send 100% of the traffic to the candidate")
    if router is TrafficRouter.SERVICE and len(steps) > 1:
        raise ValueError(_ROLLOUT_RULES[1]["message"])
    if router is TrafficRouter.SERVICE and steps[0].pause:
        raise ValueError(_ROLLOUT_RULES[3]["message"])
    weights = [s.weight for s in steps]
    if any(b <= a for a, b in zip(weights, weights[1:], strict=False)):
        raise ValueError(f"spec.rollout.steps: weights must increase from step to step (got {weights})")


class RolloutSpec(ApiModel):
    """How a new revision is brought up beside the stable one, and how traffic moves to it."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{**rule} for rule in _ROLLOUT_RULES]})

    canary_replicas: PositiveInt = 1
    """Replicas of each prefill and decode role (and one router) while the candidate is verified,
    capped at the role's replicas. Before traffic moves, the candidate is scaled to full replicas
    and every worker's reported KV pool is measured again (S7: every node)."""
    progress_deadline_seconds: Annotated[int, Field(gt=0, le=MAX_INT32)] = DEFAULT_PROGRESS_DEADLINE_SECONDS
    """How long the candidate's workloads may take to become ready (at canary scale, and again at
    full scale) before the rollout fails. The default covers the workers' startup probe (30 min of
    weight loading) plus image pulls; lower it for small models to fail faster."""
    # --- progressive delivery (docs/rollouts.md, "Traffic in steps") ---
    traffic_router: TrafficRouter = TrafficRouter.SERVICE
    """`service` (the model Service's selector: all traffic at once), `gatewayAPI` (a weighted
    HTTPRoute) or `inferencePool` (an InferencePool per revision, weighted by the HTTPRoute)."""
    steps: list[RolloutStep] = Field(default_factory=lambda: [RolloutStep(weight=100)], min_length=1, max_length=MAX_ROLLOUT_STEPS)
    """Traffic steps once the candidate passed its canary at full scale, e.g. 5% for 2m, 25%,
    50%, 100%. Default: one step of 100% (all traffic at once). Weights increase and the last is
    100; trafficRouter service takes only one step of 100."""
    gateway: GatewaySpec | None = None
    """Where the HTTPRoute attaches (required with gatewayAPI and inferencePool)."""
    inference_pool: InferencePoolOptions | None = None
    """Settings of the per-revision InferencePools (trafficRouter inferencePool)."""
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    """Checks on the candidate's live traffic between steps and while it bakes."""
    bake_seconds: Int32Seconds = 0
    """After the last step (100%): how long the analysis goes on before the candidate becomes the
    stable revision; a failure in this time still sends traffic back to the old one."""
    scale_down_delay_seconds: Int32Seconds = 300
    """How long the old revision keeps running after the candidate became stable, so that
    kvguard.io/rollback-to it is instant (no new pods); then it is scaled to zero."""

    @model_validator(mode="after")
    def _steps_fit_the_router(self) -> RolloutSpec:
        check_steps(self.traffic_router, self.steps)
        if self.traffic_router is TrafficRouter.SERVICE and self.bake_seconds:
            raise ValueError(_ROLLOUT_RULES[3]["message"])
        if self.traffic_router is not TrafficRouter.SERVICE and self.gateway is None:
            raise ValueError(_ROLLOUT_RULES[0]["message"])
        return self

    @property
    def progressive(self) -> bool:
        """Does traffic move in steps, or is the candidate analysed before it becomes stable?
        (Never with trafficRouter service, which cannot give the candidate a share.)"""
        return len(self.steps) > 1 or self.steps[0].pause > 0 or self.bake_seconds > 0


class InferenceModelSpec(ApiModel):
    """Desired state of an InferenceModel: what to serve, on what, and how safely."""

    model: ModelSpec
    """The served model."""
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    """Weight format or measured weight memory."""
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    """KV cache element type (SGLang/vLLM `--kv-cache-dtype`)."""
    page_size: PageTokens = 1
    """Tokens per KV page (SGLang `--page-size`, vLLM `--block-size`). Pools are whole pages."""
    context_length: PositiveInt = Field(json_schema_extra=CONTEXT_BOUND)
    """Longest request (prompt + completion) the service accepts, in tokens (at most 16,777,216)."""
    min_kv_ratio: KVRatio = DEFAULT_MIN_KV_RATIO
    """Every role's KV pool must hold at least this many times contextLength tokens (S7)."""
    kv_pool_tokens: PoolTokens | None = None
    """Explicit cap on the KV pool per engine instance (kvguard `--kv-pool-tokens`, SGLang
    `--max-total-tokens`). The pool is the smaller of this and what memory allows."""
    memory_fraction: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    """Share of device memory for weights plus KV pool (SGLang `--mem-fraction-static`, vLLM
    `--gpu-memory-utilization`). Default: the engine's (0.88 SGLang, 0.9 vLLM, 0.9 kvguard)."""
    reserve: ByteQuantity | None = None
    """Memory per device kept out of the KV pool besides weights and deviceOverhead. vLLM: its
    profiled activation peak (the startup log's "peak activation" / torch peak increase); omitted,
    the planner estimates it from vLLM's own profile run (max_num_batched_tokens, max_num_seqs x
    vocabulary) and says so. SGLang and kvguard carve activations and CUDA graphs out of
    (1 - memoryFraction) instead: omitted means 0, set it only for extra headroom."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """The inference engine."""
    hardware: HardwareSpec
    """The device each worker runs on."""
    roles: RolesSpec = Field(default_factory=RolesSpec)
    """Prefill, decode and router shapes."""
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    """Prefill-to-decode KV transfer settings (S3, S4, S6)."""
    canary: CanarySpec = Field(default_factory=CanarySpec)
    """The canary coherence suite a new revision must pass before promotion (S7)."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How the candidate runs while it is verified."""
    revision_history_limit: NonNegativeInt = 2
    """Previous stable revisions kept (scaled to zero) as targets for kvguard.io/rollback-to."""

    @field_validator("context_length")
    @classmethod
    def _context_bounded(cls, value: int) -> int:
        # The canary, which gates every revision, sizes its requests from it and reads no server's
        # context above the bound (canary/discovery.py).
        return context_within_bound(value)

    @model_validator(mode="after")
    def _canary_knows_the_context(self) -> InferenceModelSpec:
        # The canary sizes its long and over-length requests from the context length; servers that
        # do not advertise one (no max_model_len) are judged against the declared contextLength.
        # Copied only where canary.contextLength itself would accept it: the stored spec must
        # validate again as it was dumped (`kvguard apply --local` re-reads its state folder).
        if self.canary.context_length is None and self.context_length >= MIN_CONTEXT_TOKENS:
            self.__dict__["canary"] = self.canary.model_copy(update={"context_length": self.context_length})
        return self

    @model_validator(mode="after")
    def _canary_judges_the_planned_ratio(self) -> InferenceModelSpec:
        # The canary's capacity probe judges the pools the planner sized to minKVRatio: by default
        # by the same ratio (a fixed 2 failed, in the canary, every pool the planner had passed at
        # minKVRatio 1.5, and rolled the revision back). An explicit minRatio above minKVRatio is
        # refused by the webhook (spec_checks.canary_problems), not here: the stored spec must
        # validate again as it was dumped, whatever it holds (`canary_to_run` clamps it).
        capacity = self.canary.capacity
        if capacity.min_ratio is None:
            filled = capacity.model_copy(update={"min_ratio": self.min_kv_ratio})
            self.__dict__["canary"] = self.canary.model_copy(update={"capacity": filled})
        return self

    def canary_to_run(self) -> CanarySpec:
        """spec.canary as the operator runs it:
        - the capacity probe never asks more of a pool than the planner sized it for (minKVRatio).
          A model stored under an older CRD holds minRatio 2, that CRD's default, whatever its
          minKVRatio (an outside review: at 1.5 every revision failed its canary);
        - the determinism probe repeats its request at least GATE_REPETITIONS times. An older CRD
          stored its default of 2 into every model, and 2 let a build that corrupted 1 transfer
          in 10 ship (an outside probe); the stored number cannot tell a choice from that default
          (a review), and the gate is not to be weakened by either."""
        canary = self.canary
        capacity = canary.capacity
        if capacity.min_ratio is not None and capacity.min_ratio > self.min_kv_ratio:
            canary = canary.model_copy(update={"capacity": capacity.model_copy(update={"min_ratio": self.min_kv_ratio})})
        if canary.determinism.repetitions < GATE_REPETITIONS:
            determinism = canary.determinism.model_copy(update={"repetitions": GATE_REPETITIONS})
            canary = canary.model_copy(update={"determinism": determinism})
        return canary

    def replicas_at(self, role: str, scale: Scale) -> int:
        """Replicas of a role (prefill, decode, router) at canary or full scale."""
        full = self.roles.router.replicas if role == "router" else self.roles.worker_roles()[role].replicas
        if scale == "full":
            return full
        return min(full, 1 if role == "router" else self.rollout.canary_replicas)


# --- Plan (recorded in status) -------------------------------------------------------------------


class EstimatedInput(ApiModel):
    """A memory figure the spec did not give, which the planner estimated (per device). The plan's
    pool and verdict use the safe end; `optimisticBytes` shows how far the estimate could be off."""

    field: str
    """The spec field that, when set, replaces the estimate (e.g. spec.reserve)."""
    description: str
    """What the figure is, in the engine's terms (e.g. vLLM activation peak)."""
    safe_bytes: NonNegativeInt
    """The end of the range that leaves the smallest pool: the one the plan uses."""
    optimistic_bytes: NonNegativeInt
    """The other end of the range."""
    basis: str
    """How the figure was estimated (the engine accounting it follows)."""


class RolePlan(ApiModel):
    """The planned KV pool of one role (per engine instance, i.e. per DP rank)."""

    gpus_per_instance: PositiveInt
    """Devices behind one KV pool: tensorParallel x pipelineParallel, divided by dataParallel with
    DP attention (each DP rank owns a pool on its share of the TP group)."""
    instances: NonNegativeInt
    """KV pools of this role: replicas x dataParallel (one per DP rank)."""
    bytes_per_token: PositiveInt
    """KV bytes one token occupies on one device of this role."""
    weights_bytes_per_gpu: NonNegativeInt
    """Weight memory per device."""
    kv_bytes_per_gpu: NonNegativeInt
    """KV pool memory per device (poolTokens x bytesPerToken)."""
    memory_fraction: float
    """Memory fraction the plan used."""
    memory_pool_tokens: NonNegativeInt
    """Tokens the memory allows, in whole pages, before any explicit cap."""
    pool_tokens: NonNegativeInt
    """KV pool in tokens per engine instance (whole pages, after the explicit cap)."""
    capped_by: Literal["memory", "kvPoolTokens"]
    """What limited the pool."""
    ratio: float
    """poolTokens / contextLength, rounded down to 4 decimals."""
    sufficient: bool
    """poolTokens holds minKVRatio x contextLength, in whole tokens."""
    kv_budget_bytes: int = 0
    """Memory per device left for the KV pool after weights and overheads, at the safe end of every
    estimate. Negative when they do not fit: the engine would not start."""
    optimistic_pool_tokens: NonNegativeInt | None = None
    """The pool with every estimated input at its optimistic end; omitted when nothing was
    estimated. poolTokens (the safe end) is what the verdict uses."""
    estimates: list[EstimatedInput] = Field(default_factory=list)
    """Memory figures the spec did not give, as the planner estimated them for this role."""


class FieldChange(ApiModel):
    """One field of a suggested change."""

    field: str
    """Spec field path, e.g. spec.roles.prefill.kvPoolTokens."""
    value: Any
    """Its new value."""


class PlanSuggestion(ApiModel):
    """One complete change that makes a blocked plan pass on every role (re-planned to check)."""

    field: str
    """The change's main field, e.g. spec.memoryFraction or spec.roles.decode.tensorParallel."""
    value: Any
    """The main field's value that passes (for contextLength: the longest safe context)."""
    role: str | None = None
    """The role the change applies to, when it touches only one."""
    message: str
    """Human-readable explanation."""
    changes: list[FieldChange] = Field(default_factory=list)
    """Every field the change sets, the main one first: all of them together make the plan pass."""


class KVPlan(ApiModel):
    """The planner's verdict on an InferenceModelSpec (S7)."""

    verdict: Literal["pass", "blocked"]
    """`pass` when every role's pool holds minRatio x contextLength tokens."""
    engine: EngineKind
    """Engine whose pool rule was applied."""
    context_length: PositiveInt
    """Context length planned for."""
    min_ratio: float
    """Required pool/context ratio."""
    page_size: PositiveInt
    """Tokens per page."""
    kv_cache_dtype: str
    """Resolved KV element type (auto replaced by the model dtype)."""
    roles: dict[str, RolePlan]
    """Per role (prefill, decode)."""
    suggestions: list[PlanSuggestion] = Field(default_factory=list)
    """When blocked: complete changes, any one of which passes (each re-planned to check)."""
    warnings: list[str] = Field(default_factory=list)
    """Assumptions the plan had to make (estimated memory figures, context beyond the model's)."""
    reasons: list[str] = Field(default_factory=list)
    """When blocked: why, one line per failing role (pool below the ratio, or memory short)."""


# --- Top-level resource --------------------------------------------------------------------------


class ObjectMeta(BaseModel):
    """Kubernetes object metadata. Only the fields kvguard reads are typed; the API server's own
    fields (uid, resourceVersion, managedFields...) pass through."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """A DNS-1123 label, as the API server requires of a namespace."""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None


class Phase(StrEnum):
    """Lifecycle summary of an InferenceModel (status.phase)."""

    PENDING = "Pending"
    BLOCKED = "Blocked"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"


class RevisionRecord(ApiModel):
    """One revision the operator has seen (status.history)."""

    revision: str
    """Hash of the KV-relevant spec."""
    state: Literal["Blocked", "Candidate", "Stable", "Superseded", "Failed"]
    """Blocked by the planner; Candidate rolling out; Stable serving; Superseded by a newer
    stable; Failed (rollout abandoned)."""
    since: str
    """RFC 3339 time the revision entered this state."""
    generation: int | None = None
    """metadata.generation that produced it."""
    kv_ratio: float | None = None
    """Smallest planned pool/context ratio over the roles."""
    message: str | None = None
    """Why it is in this state."""


CONDITIONS_LIST_MAP: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
"""metav1.Conditions convention: one entry per type, so server-side apply merges them by type."""


class InferenceModelStatus(ApiModel):
    """Observed state of an InferenceModel, written by the operator."""

    observed_generation: int | None = None
    """metadata.generation this status describes."""
    plan: KVPlan | None = None
    """The last KV pool plan of the spec (S7)."""
    phase: Phase | None = None
    """Pending, Blocked, Progressing, Ready or Degraded."""
    revision: str | None = None
    """The stable revision: the one the model's Service routes to."""
    target_revision: str | None = None
    """The revision of the current spec (the hash of its KV-relevant fields)."""
    kv_ratio: float | None = None
    """The smallest planned poolTokens / contextLength over the roles of the target revision."""
    canary: str | None = None
    """Canary summary of the target revision (Pending, Passed, Failed, NotRun)."""
    message: str | None = None
    """One line on what the operator is doing or waiting for."""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=CONDITIONS_LIST_MAP)
    """KVPoolSufficient, PolicyCompliant, CanaryPassed, Progressing, Ready, Degraded."""
    history: list[RevisionRecord] = Field(default_factory=list)
    """Recent revisions, newest first (bounded)."""
    rollout: RolloutStatus | None = None
    """Every step of the current rollout (state, candidate, measured pools, canary verdict), so an
    operator restart resumes it exactly (S8)."""
    continuous: ContinuousStatus | None = None
    """The continuous canary against the serving revision (spec.canary.continuous): its schedule
    and last run."""
    pools: list[PodPool] = Field(default_factory=list)
    """Every engine pod's reported KV pool against the ratio, as its readiness gate
    kvguard.io/kv-pool-verified judged it (S7 for as long as a pod serves); unverified first."""


MODEL_NAME_MAX = 40
"""Child objects are named `<model>-<revision>-<role>` (render.object_name): 40 + 1 + 10 + 1 +
7 + the longest suffix stays a valid Service name (63)."""
MODEL_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label, as Service names must be: a lowercase letter first, no dots."""
REVISION_SEGMENT = "-[0-9a-f]{10}(-|$)"
"""How a child object names its revision (revision.REVISION_LENGTH hex digits): a model named
`tiny-89c0e86f3e-decode` would be model `tiny`'s decode Service, so no model name contains one."""


def model_name_problem(name: str) -> str | None:
    """Why an InferenceModel name would make child objects the API server refuses (None: fine)."""
    if len(name) > MODEL_NAME_MAX:
        return f"metadata.name: at most {MODEL_NAME_MAX} characters (child objects append -<revision>-<role>)"
    if not re.fullmatch(MODEL_NAME_PATTERN[1:-1], name):
        return (f"metadata.name: {name!r} must be lowercase letters, digits and '-', start with a letter and end with a "
                "letter or digit (child Services are named after it)")  # fmt: skip
    if re.search(REVISION_SEGMENT, name):
        return ("metadata.name: no part of 10 hex digits (child objects name their revision so: <model>-<revision>-<role>); "
                f"{name!r} could be another model's object")  # fmt: skip
    return None


def namespace_problem(namespace: str) -> str | None:
    """Why a `--namespace` can name no namespace (a DNS-1123 label), None when it can."""
    if re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
        return None
    return f"--namespace: must be a DNS-1123 label (at most 63 lowercase letters, digits and '-'), got {namespace[:80]!r}"


def effective_namespace(manifest: str | None, flag: str | None) -> str:
    """The namespace of a manifest's object as kubectl picks it: its metadata.namespace, which a
    `--namespace` flag may only repeat (ValueError, naming both, when it does not), else the flag's,
    else `default`."""
    if flag is not None and (problem := namespace_problem(flag)):
        raise ValueError(problem)
    if manifest is not None and flag is not None and flag != manifest:
        raise ValueError(f"the manifest's metadata.namespace is {manifest!r}, not {flag!r} (--namespace)")
    return manifest or flag or "default"


class InferenceModel(ApiModel):
    """An LLM served behind kvguard's safety gates (namespaced, kind InferenceModel)."""

    api_version: Literal["kvguard.io/v1alpha1"] = Field(default=GROUP_VERSION, alias="apiVersion")
    kind: Literal["InferenceModel"] = "InferenceModel"
    metadata: ObjectMeta
    spec: InferenceModelSpec
    status: InferenceModelStatus | None = None

    @model_validator(mode="after")
    def _name_makes_valid_children(self) -> InferenceModel:
        if (problem := model_name_problem(self.metadata.name)) is not None:
            raise ValueError(problem)
        return self


# --- InferencePolicy (cluster-scoped; enforced by the rollout/admission layer) -------------------


class LabelSelectorRequirement(ApiModel):
    """metav1.LabelSelectorRequirement."""

    key: str
    """Label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key's value is matched."""
    values: list[str] = Field(default_factory=list)
    """Values for In and NotIn."""


class LabelSelector(ApiModel):
    """metav1.LabelSelector; empty selects everything."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    """Labels that must all be present with these values."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)
    """Requirements that must all hold."""


class EngineFlagRequirement(ApiModel):
    """Flags an engine's workers must be started with."""

    engine: EngineKind
    """The engine the rule applies to."""
    flags: list[str] = Field(min_length=1)
    """Flags that must appear on the rendered command line, e.g. --enable-metrics."""


class InferencePolicySpec(ApiModel):
    """Cluster-wide rules every InferenceModel in the selected namespaces must satisfy."""

    namespaces: list[str] = Field(default_factory=list)
    """Namespaces the policy applies to, by name; empty means all (subject to namespaceSelector)."""
    namespace_selector: LabelSelector = Field(default_factory=LabelSelector)
    """Namespaces the policy applies to, by label; empty means all. The operator sees a namespace's
    name only (the label kubernetes.io/metadata.name), not its other labels: a requirement on any
    other label is treated as matching (the policy applies). Prefer `namespaces` for exact scoping."""
    min_kv_ratio: KVRatio = DEFAULT_MIN_KV_RATIO
    """Floor for spec.minKVRatio: every role's KV pool must hold this many contexts (S7)."""
    min_engine_versions: dict[str, str] = Field(default_factory=dict)
    """Oldest allowed engine version per engine kind, e.g. {sglang: 0.5.22, vllm: 0.11.0}; compared
    numerically (0.5.22 > 0.5.4), pre-releases (rc, dev) before their release, post-releases after."""
    required_engine_flags: list[EngineFlagRequirement] = Field(default_factory=list)
    """Flags that must be on the command line, per engine."""
    require_kv_integrity: bool = False
    """Prefill-to-decode KV must be integrity-checked (S1, S3). kvguard: page tags and chunk
    checksums are always on (only the test-only KVGUARD_FAULTS switch, which an InferenceModel
    cannot set, turns them off); sglang: `--disaggregation-enable-kv-checksum` on prefill and decode
    (spec.kvTransfer.checksum, or the flag in extraArgs); vllm has no KV checksum and cannot comply."""
    required_canary_probes: list[str] = Field(default_factory=list)
    """Canary probes that must be enabled (e.g. isolation, over_length)."""
    sglang_kv_canary: Literal["log", "raise"] | None = None
    """SGLang models must run SGLang's read-time KV canary (spec.engine.kvCanary.mode) at least at
    this level: `log` accepts log or raise; `raise` (test clusters) accepts raise only."""
    max_context_length: PositiveInt | None = None
    """Longest contextLength an InferenceModel may declare."""


class InferencePolicyStatus(ApiModel):
    """Observed state of an InferencePolicy."""

    observed_generation: int | None = None
    """metadata.generation this status describes."""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=CONDITIONS_LIST_MAP)
    """Reserved: the operator does not write it. Whether a policy applies, and what it refuses,
    shows on each InferenceModel it covers (the PolicyCompliant condition)."""


class InferencePolicy(ApiModel):
    """Cluster-scoped rules for InferenceModels (kind InferencePolicy)."""

    api_version: Literal["kvguard.io/v1alpha1"] = Field(default=GROUP_VERSION, alias="apiVersion")
    kind: Literal["InferencePolicy"] = "InferencePolicy"
    metadata: ObjectMeta
    spec: InferencePolicySpec = Field(default_factory=InferencePolicySpec)
    status: InferencePolicyStatus | None = None
