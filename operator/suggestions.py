"""Complete changes that make a blocked KV plan pass on every role (S7).

A suggestion is a fix only if the whole spec passes once it is applied: every failing role is
fixed, and when one knob is not enough for a role it is combined with what that role also needs
(a cap that is in the way is raised too; fp8 KV is combined with the per-role change that still
has to follow it). Each suggestion is applied to the spec's wire form, re-planned at the safe end
of every estimate, and dropped unless it passes. Families, gentlest first:

- raise the explicit caps (kvPoolTokens) of roles whose memory already holds the pool;
- a higher memory fraction per failing role (at most 0.95: above it activations and CUDA graphs
  have no room);
- an fp8 KV cache (never for a role whose only problem is its cap: fp8 cannot help a token cap),
  plus the smallest per-role change that still has to follow;
- more tensor parallelism per failing role. MLA keeps the whole latent on every GPU, so for MLA
  models only the weights per GPU shrink, and the suggestion says so. A measured weight figure is
  scaled to the new split (`measuredShards` records the split it was measured at);
- more pipeline stages per failing role (each GPU holds its stage's layers of KV and weights);
- the longest context the current pools hold.

Pure: no torch, kopf or kubernetes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from kvguard.operator.api import (
    EngineKind,
    FieldChange,
    InferenceModelSpec,
    KVCacheDtype,
    PlanSuggestion,
    RolePlan,
    WorkerRole,
)
from kvguard.operator.engine_support import engine_problems
from kvguard.operator.planner import (
    PlanInputError,
    _role_problems,
    check_spec,
    kv_element_bytes,
    memory_fraction,
    needed_tokens,
    plan_role,
    plan_roles,
    pool_cap,
)
from kvguard.workers.pool_ratio import longest_context, ratio_text

MAX_SUGGESTED_FRACTION = 0.95
MAX_TENSOR_PARALLEL = 64
MAX_PIPELINE_PARALLEL = 16

Changes = list[FieldChange]
RoleFixer = Callable[[InferenceModelSpec, str], Changes | None]


def suggest(spec: InferenceModelSpec, roles: dict[str, RolePlan]) -> list[PlanSuggestion]:
    """Complete changes, any one of which makes every role of `spec` pass."""
    failing = [name for name, r in roles.items() if not r.sufficient]
    found: list[PlanSuggestion] = []
    for family in (_raise_caps, _memory_fraction, _fp8_kv, _tensor_parallel, _pipeline_parallel, _both_splits, _context_length):
        if family is _both_splits and any(_splits(s.changes) for s in found):
            continue  # one of the two alone passes: no need of both
        suggestion = family(spec, roles, failing)
        if suggestion is not None and all(s.changes != suggestion.changes for s in found):
            found.append(suggestion)
    return found


def _splits(changes: Changes) -> bool:
    return any(c.field.endswith((".tensorParallel", ".pipelineParallel")) for c in changes)


def apply_changes(spec: InferenceModelSpec, changes: Changes) -> InferenceModelSpec:
    """`spec` with each change written into its wire form (as a user would edit the manifest) and
    validated again. Raises ValidationError when a value is not accepted."""
    wire = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    for change in changes:
        *parents, leaf = change.field.removeprefix("spec.").split(".")
        node = wire
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = change.value
    return InferenceModelSpec.model_validate(wire)


def apply_suggestion(spec: InferenceModelSpec, suggestion: PlanSuggestion) -> InferenceModelSpec:
    return apply_changes(spec, suggestion.changes or [FieldChange(field=suggestion.field, value=suggestion.value)])


def change_summary(suggestion: PlanSuggestion) -> str:
    """Every field the suggestion sets, as `field=value` pairs (what to write into the manifest)."""
    changes = suggestion.changes or [FieldChange(field=suggestion.field, value=suggestion.value)]
    return ", ".join(f"{c.field}={c.value}" for c in changes)


# --- Families ------------------------------------------------------------------------------------


def _raise_caps(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    changes = _per_role(spec, failing, _cap_only)
    if changes is None:
        return None
    raised = ", ".join(f"{_role_of(c)} {c.value:,}" for c in changes)
    return _verified(spec, changes, f"raise the explicit KV pool caps (kvPoolTokens: {raised}); memory already holds them")


def _memory_fraction(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    changes = _per_role(spec, failing, _chain(_cap_only, _fraction_fix))
    if changes is None or not any(c.field.endswith(".memoryFraction") for c in changes):
        return None
    return _verified(spec, changes, _knob_message(spec, changes, "memoryFraction", "memory fraction"))


def _fp8_kv(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    element = kv_element_bytes(spec)
    if element <= 1 or spec.engine.kind is EngineKind.KVGUARD:
        return None
    needed = needed_tokens(spec)
    if all(roles[name].memory_pool_tokens >= needed for name in failing):
        return None  # every failing pool is held back by its cap: fp8 cannot help
    dtype = FieldChange(field="spec.kvCacheDtype", value=KVCacheDtype.FP8_E4M3.value)
    fp8 = _applied(spec, [dtype])
    if fp8 is None:
        return None
    still = [name for name, r in plan_roles(fp8).items() if not r.sufficient]
    rest = _per_role(fp8, still, _chain(_cap_only, _fraction_fix, _tensor_parallel_fix, _pipeline_parallel_fix))
    if rest is None:
        return None
    verb = {2: "halves", 4: "quarters"}.get(int(element), f"cuts {float(element):g}x")
    source = spec.kv_cache_dtype.value if spec.kv_cache_dtype is not KVCacheDtype.AUTO else f"auto = {_model_dtype(spec)}"
    message = f"an fp8 (e4m3) KV cache {verb} the bytes per token ({source} -> fp8)"
    if any(not c.field.endswith(".kvPoolTokens") for c in rest):
        message += ", with " + "; ".join(_describe(spec, c, label=True) for c in rest if not c.field.endswith(".kvPoolTokens"))
    return _verified(spec, [dtype, *rest], message + _cap_note(rest))


def _tensor_parallel(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    changes = _per_role(spec, failing, _chain(_cap_only, _tensor_parallel_fix))
    if changes is None or not any(c.field.endswith(".tensorParallel") for c in changes):
        return None
    arch = spec.model.architecture
    why = (
        "MLA keeps the whole KV latent on every GPU, so only the weights per GPU shrink"
        if arch is not None and arch.mla is not None
        else "fewer KV heads and weights per GPU"
    )
    return _verified(spec, changes, _knob_message(spec, changes, "tensorParallel", "tensor parallelism") + f": {why}")


def _pipeline_parallel(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    changes = _per_role(spec, failing, _chain(_cap_only, _pipeline_parallel_fix))
    if changes is None or not any(c.field.endswith(".pipelineParallel") for c in changes):
        return None
    message = _knob_message(spec, changes, "pipelineParallel", "pipeline stages")
    return _verified(spec, changes, message + ": each GPU holds only its stage's layers of KV and weights")


def _both_splits(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    """Tensor and pipeline parallelism raised together, when neither alone passes (an outside
    probe: Llama-3.3-70B at 1M context on 22 GiB GPUs was offered nothing, though TP8 x PP4 passes)."""
    changes = _per_role(spec, failing, _chain(_cap_only, _both_splits_fix))
    if changes is None or not _splits(changes):
        return None
    parts = []
    for name in dict.fromkeys(n for c in changes if _splits([c]) and (n := _role_of(c)) is not None):
        role, new = _role(spec, name), {c.field.rsplit(".", 1)[-1]: c.value for c in changes if _role_of(c) == name}
        tp, pp = new.get("tensorParallel", role.tensor_parallel), new.get("pipelineParallel", role.pipeline_parallel)
        parts.append(f"{name} TP {tp} x PP {pp} (now {role.tensor_parallel} x {role.pipeline_parallel}, {tp * pp} GPUs per instance)")
    message = "tensor parallelism and pipeline stages together: " + ", ".join(parts) + _cap_note(changes)
    return _verified(spec, changes, message + ": neither alone leaves room for the pool")


def _context_length(spec: InferenceModelSpec, roles: dict[str, RolePlan], failing: list[str]) -> PlanSuggestion | None:
    longest = longest_context(min(r.pool_tokens for r in roles.values()), spec.min_kv_ratio, spec.page_size)
    for _ in range(3):  # a shorter context can change an estimate (vLLM without chunked prefill)
        if longest <= 0:
            return None
        candidate = _applied(spec, [FieldChange(field="spec.contextLength", value=longest)])
        if candidate is None:
            return None
        pools = plan_roles(candidate)
        if all(r.sufficient for r in pools.values()):
            break
        longest = longest_context(min(r.pool_tokens for r in pools.values()), spec.min_kv_ratio, spec.page_size)
    message = f"the longest safe context with these pools is {longest:,} tokens (now {spec.context_length:,})"
    trained = spec.model.architecture.max_position_embeddings if spec.model.architecture else None
    if trained is not None and longest > trained:  # the pools allow more than the model was built for
        longest = trained
        message = (f"the model's max_position_embeddings, {trained:,} tokens (now {spec.context_length:,}); "
                   "these pools would hold a longer one")  # fmt: skip
    return _verified(spec, [FieldChange(field="spec.contextLength", value=longest)], message)


# --- Per-role fixes ------------------------------------------------------------------------------


def _per_role(spec: InferenceModelSpec, failing: list[str], fixer: RoleFixer) -> Changes | None:
    """The fixes of every failing role, together; None when one of them has none."""
    changes: Changes = []
    for name in failing:
        fix = fixer(spec, name)
        if fix is None:
            return None
        changes += fix
    return _merge_shards(changes)


def _chain(*fixers: RoleFixer) -> RoleFixer:
    """The first of `fixers` that fixes the role."""

    def first(spec: InferenceModelSpec, name: str) -> Changes | None:
        for fixer in fixers:
            fix = fixer(spec, name)
            if fix is not None:
                return fix
        return None

    return first


def _role(spec: InferenceModelSpec, name: str) -> WorkerRole:
    return spec.roles.worker_roles()[name]


def _uncapped(spec: InferenceModelSpec, name: str) -> WorkerRole:
    """The role with its cap (its own or the spec's) raised to what passes, so memory alone decides."""
    role = _role(spec, name)
    cap = pool_cap(spec, role)
    return role if cap is None else role.model_copy(update={"kv_pool_tokens": max(cap, needed_tokens(spec))})


def _cap_change(spec: InferenceModelSpec, name: str) -> Changes:
    """Raising the role's cap to what passes, when a cap below that is set."""
    cap, needed = pool_cap(spec, _role(spec, name)), needed_tokens(spec)
    if cap is None or cap >= needed:
        return []
    return [FieldChange(field=f"spec.roles.{name}.kvPoolTokens", value=needed)]


def _cap_only(spec: InferenceModelSpec, name: str) -> Changes | None:
    cap = _cap_change(spec, name)
    return cap if cap and plan_role(spec, _uncapped(spec, name)).sufficient else None


def _fraction_fix(spec: InferenceModelSpec, name: str) -> Changes | None:
    role = _uncapped(spec, name)
    start = math.floor(memory_fraction(spec, role) * 100) + 1
    for hundredths in range(start, round(MAX_SUGGESTED_FRACTION * 100) + 1):
        fraction = hundredths / 100
        if plan_role(spec, role.model_copy(update={"memory_fraction": fraction})).sufficient:
            return [FieldChange(field=f"spec.roles.{name}.memoryFraction", value=fraction), *_cap_change(spec, name)]
    return None


def _tensor_parallel_fix(spec: InferenceModelSpec, name: str) -> Changes | None:
    role = _role(spec, name)
    return _split_fix(spec, name, [{"tensor_parallel": tp} for tp in range(role.tensor_parallel + 1, MAX_TENSOR_PARALLEL + 1)])


def _pipeline_parallel_fix(spec: InferenceModelSpec, name: str) -> Changes | None:
    role = _role(spec, name)
    return _split_fix(spec, name, [{"pipeline_parallel": pp} for pp in range(role.pipeline_parallel + 1, _most_stages(spec) + 1)])


def _both_splits_fix(spec: InferenceModelSpec, name: str) -> Changes | None:
    """Both splits raised, the fewest GPUs per instance first (then the fewer stages)."""
    role = _role(spec, name)
    pairs = [(tp, pp) for tp in range(role.tensor_parallel + 1, MAX_TENSOR_PARALLEL + 1)
             for pp in range(role.pipeline_parallel + 1, _most_stages(spec) + 1)]  # fmt: skip
    pairs.sort(key=lambda pair: (pair[0] * pair[1], pair[1]))
    return _split_fix(spec, name, [{"tensor_parallel": tp, "pipeline_parallel": pp} for tp, pp in pairs])


def _most_stages(spec: InferenceModelSpec) -> int:
    arch = spec.model.architecture
    return min(MAX_PIPELINE_PARALLEL, arch.num_layers if arch is not None else 1)


_WIRE = {"tensor_parallel": "tensorParallel", "pipeline_parallel": "pipelineParallel"}


def _split_fix(spec: InferenceModelSpec, name: str, splits: Sequence[dict[str, int]]) -> Changes | None:
    """The first valid split of `splits` that passes, with a measured weight figure scaled to it."""
    arch, role = spec.model.architecture, _uncapped(spec, name)
    record = _shards_to_record(spec)
    if arch is None or record is None:
        return None
    scaled = spec
    if record:
        weights = spec.weights.model_copy(update={"measured_shards": record[0].value})
        scaled = spec.model_copy(update={"weights": weights})
    for split in splits:
        candidate = role.model_copy(update=split)
        if any(True for _ in _role_problems("", candidate, arch)):
            continue
        if plan_role(scaled, candidate).sufficient:
            changes = [FieldChange(field=f"spec.roles.{name}.{_WIRE[attr]}", value=size) for attr, size in split.items()]
            return [*changes, *record, *_cap_change(spec, name)]
    return None


def _shards_to_record(spec: InferenceModelSpec) -> Changes | None:
    """The measuredShards change a new split needs, so the measured weight figure is scaled to it:
    none when there is no measured figure or its split is recorded; None (no split suggestion) when
    the roles differ in split: the plan then takes the figure as measured over the widest (the safe
    end, `estimates.scaled_weights`), a guess a what-if should not build on, so measuredShards must say it."""
    weights = spec.weights
    if weights.measured_bytes_per_device is None or weights.measured_shards is not None:
        return []
    splits = {r.tensor_parallel * r.pipeline_parallel for r in spec.roles.worker_roles().values()}
    if len(splits) != 1:
        return None
    return [FieldChange(field="spec.weights.measuredShards", value=splits.pop())]  # taken as TP alone, as the plan takes it


def _merge_shards(changes: Changes) -> Changes:
    """One measuredShards change at most (several roles record the same split)."""
    merged: Changes = []
    for change in changes:
        if change.field == "spec.weights.measuredShards" and any(c.field == change.field for c in merged):
            continue
        merged.append(change)
    return merged


# --- Checking and wording ------------------------------------------------------------------------


def _applied(spec: InferenceModelSpec, changes: Changes) -> InferenceModelSpec | None:
    """The spec with `changes`, when it is one the planner and the spec's engine both take (a
    tensor-parallel split passes the plan, but the kvguard engine runs one device per instance)."""
    try:
        candidate = apply_changes(spec, changes)
        check_spec(candidate)
    except (ValidationError, PlanInputError):
        return None
    return None if engine_problems(candidate) else candidate


def _verified(spec: InferenceModelSpec, changes: Changes, message: str) -> PlanSuggestion | None:
    """The suggestion, if the whole spec passes with every change applied (else None)."""
    candidate = _applied(spec, changes)
    if candidate is None:
        return None
    pools = plan_roles(candidate)
    if not all(r.sufficient for r in pools.values()):
        return None
    ratios = ", ".join(f"{name} {ratio_text(r.pool_tokens, candidate.context_length)}" for name, r in pools.items())
    roles = {_role_of(c) for c in changes}
    first = changes[0]
    return PlanSuggestion(
        field=first.field, value=first.value, role=roles.pop() if len(roles) == 1 and None not in roles else None,
        message=f"{message} -> {ratios}", changes=changes,
    )  # fmt: skip


def _role_of(change: FieldChange) -> str | None:
    """The role a change is about (spec.roles.<role>.<field>), None for spec-wide fields."""
    parts = change.field.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "roles" else None


def _model_dtype(spec: InferenceModelSpec) -> str:
    return spec.model.architecture.dtype.value if spec.model.architecture is not None else "bf16"


def _cap_note(changes: Changes) -> str:
    caps = [c for c in changes if c.field.endswith(".kvPoolTokens")]
    if not caps:
        return ""
    return " (and raise kvPoolTokens: " + ", ".join(f"{_role_of(c)} to {c.value:,}" for c in caps) + ")"


def _knob_message(spec: InferenceModelSpec, changes: Changes, wire: str, what: str) -> str:
    parts = [_describe(spec, c) for c in changes if c.field.endswith("." + wire)]
    return f"{what} " + ", ".join(parts) + _cap_note(changes)


def _describe(spec: InferenceModelSpec, change: FieldChange, label: bool = False) -> str:
    name, leaf = _role_of(change), change.field.rsplit(".", 1)[-1]
    role = _role(spec, name) if name else None
    if role is None:
        return f"{change.field}={change.value}"
    now: dict[str, Any] = {
        "tensorParallel": role.tensor_parallel, "pipelineParallel": role.pipeline_parallel,
        "memoryFraction": f"{memory_fraction(spec, role):.2f}",
    }  # fmt: skip
    knob = {"tensorParallel": "TP", "pipelineParallel": "PP", "memoryFraction": "memory fraction"}.get(leaf, leaf)
    value = f"{change.value:.2f}" if leaf == "memoryFraction" else change.value
    gpus = ""
    if leaf in ("tensorParallel", "pipelineParallel"):
        split = change.value * (role.pipeline_parallel if leaf == "tensorParallel" else role.tensor_parallel)
        gpus = f", {split} GPUs per instance"
    return f"{name} {knob + ' ' if label else ''}{value} (now {now.get(leaf, '-')}{gpus})"


__all__ = ["MAX_SUGGESTED_FRACTION", "apply_changes", "apply_suggestion", "change_summary", "suggest"]
