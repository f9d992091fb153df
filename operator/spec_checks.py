"""The field checks an InferenceModel spec must pass before anything plans or deploys it: one
place that decides, for the admission webhook (`webhook.check_plannable`) and `kvguard plan`.

What they are: the engine's support for the spec (`engine_support`), the `extraArgs` checks
(owned flags, the flags the plan reads, speculative decoding without draft layers:
`planner.extra_args_problems`), the planner's own input checks, the renderer's field checks (a KV
dtype or encryption an engine does not take, engine-only options, `nvidia.com/gpu` in resources
other than the role's GPUs, images) and the prefill/decode parity check (sglang#19398). A blocked
plan is not a field error: the spec is still checked, on the flag-check plan
(`planner.plan_to_render`). An outside probe found `kvguard plan` exiting 0 for specs the webhook
refused (422) and `kvguard render` refused (exit 2): it ran only some of these.

Pure: no kopf, kubernetes or torch (`kvguard plan` runs without the operator's extras).
"""

from __future__ import annotations

from kvguard.operator.api import InferenceModelSpec, KVPlan
from kvguard.operator.canary.spec import LONG_PROMPT_MIN_TOKENS, ProbeName
from kvguard.operator.engine_support import engine_problems, placement_problems
from kvguard.operator.pd_parity import parity_problem
from kvguard.operator.planner import PlanInputError, extra_args_problems, plan, plan_to_render
from kvguard.operator.render import (
    MISSING_SOURCE,
    Owner,
    RenderError,
    render_revision,
    with_stand_in_images,
    with_stand_in_source,
)
from kvguard.workers.pool_ratio import ratio_number

STAND_IN = "field-check"
"""The claim and image names a check renders with where the spec has none (nothing is applied)."""


class SpecInvalid(ValueError):
    """A spec refused by field: each problem is one `field: message` line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def check_spec_fields(spec: InferenceModelSpec, *, name: str, namespace: str, deploying: bool = True,
                      before: InferenceModelSpec | None = None) -> KVPlan | None:
    """Raise SpecInvalid when the spec fails a field check; else its plan (None when the
    architecture is in a ConfigMap this caller cannot read: reconcile plans it, every check that
    needs no architecture ran on the flag-check plan). A spec without a model source is checked on
    a stand-in one, then refused where it is deployed (`deploying`: admission; no backend runs one
    without a source: the cluster renders none, `apply --local` takes it from `--model-dir` or
    refuses). `deploying=False` (`kvguard plan`, which deploys nothing) plans it, and also stands in
    for images the spec does not name: an image, like a source, is needed to deploy, not to plan,
    and changes no flag a check reads. `before`: the spec an update replaces (`canary_problems`).

    Checks added after models were stored under an older CRD run here, at admission, not in
    reconcile (`placement_problems`): a model already running is not made Degraded by an upgrade."""
    problems = engine_problems(spec) + placement_problems(spec) + [f"{path}: {message}" for path, message in extra_args_problems(spec)]
    problems += canary_problems(spec, before)
    if problems:
        raise SpecInvalid(problems)
    rendered = with_stand_in_source(spec, STAND_IN)
    if not deploying:
        rendered = with_stand_in_images(rendered, STAND_IN)
    kv_plan = None
    try:
        if spec.model.architecture is not None or spec.model.architecture_config_map is None:
            kv_plan = plan(spec)
        checked = plan_to_render(spec, kv_plan)
        render_revision(rendered, checked, Owner(name=name, namespace=namespace, uid=STAND_IN), STAND_IN)
    except PlanInputError as exc:
        raise SpecInvalid([f"{field}: {message}" for field, message in exc.problems]) from None
    except RenderError as exc:
        raise SpecInvalid([str(exc)]) from None
    if (mismatch := parity_problem(rendered, checked)) is not None:  # sglang#19398
        raise SpecInvalid([mismatch])
    if deploying and spec.model.source is None:
        raise SpecInvalid([f"{MISSING_SOURCE[0]}: {MISSING_SOURCE[1]}"])
    return kv_plan


def canary_problems(spec: InferenceModelSpec, before: InferenceModelSpec | None = None) -> list[str]:
    """The canary's fields that only fail against the rest of the spec: each makes a healthy
    revision fail its canary (and roll back) where the planner passed it, so it is refused when
    written, as `field: message` lines (outside probe: each was admitted and failed later).

    minRatio against minKVRatio is judged only when minRatio is written (`before`: the spec an
    update replaces): an older CRD defaulted minRatio to 2 into every stored model, and one at
    minKVRatio 1.5 must stay editable (the operator runs its canary at 1.5:
    `InferenceModelSpec.canary_to_run`). longRequestMaxTokens is judged where isolation runs (on
    its own, or in the continuous canary's light set)."""
    canary, context = spec.canary, spec.context_length
    problems = []
    ratio = canary.capacity.min_ratio  # filled in with minKVRatio where unset (InferenceModelSpec)
    unchanged = before is not None and before.canary.capacity.min_ratio == ratio
    if ratio is not None and ratio > spec.min_kv_ratio and not unchanged:
        ours, theirs = ratio_number(ratio), ratio_number(spec.min_kv_ratio)  # 2.0000001 above 2: not "2 is above 2"
        problems.append(
            f"spec.canary.capacity.minRatio: {ours} is above spec.minKVRatio {theirs}: the planner "
            f"sizes pools to {theirs}x contextLength, so the canary would fail (and roll back) every revision "
            "it passed; leave minRatio unset to judge by minKVRatio, or raise minKVRatio"
        )
    long_max = canary.isolation.long_request_max_tokens
    # Isolation runs when enabled, and in the continuous canary's light set when the spec enables
    # none of that set (CanarySpec.for_continuous).
    continuous = canary.continuous.interval_seconds is not None
    isolation_runs = canary.isolation.enabled or (continuous and ProbeName.ISOLATION in canary.for_continuous().enabled_probes())
    if isolation_runs and context <= LONG_PROMPT_MIN_TOKENS:
        # No longRequestMaxTokens fits: naming it (a default the user never wrote) misled a new user.
        problems.append(
            f"spec.contextLength: {context:,} leaves no room for the isolation probe's long request (a prompt of "
            f"at least {LONG_PROMPT_MIN_TOKENS} tokens and one to generate): raise contextLength above "
            f"{LONG_PROMPT_MIN_TOKENS} or disable spec.canary.isolation"
        )
    elif isolation_runs and long_max > context - LONG_PROMPT_MIN_TOKENS:
        problems.append(
            f"spec.canary.isolation.longRequestMaxTokens: {long_max:,} leaves no room for a long request's prompt "
            f"in contextLength {context:,}: at most contextLength - {LONG_PROMPT_MIN_TOKENS} "
            f"({max(context - LONG_PROMPT_MIN_TOKENS, 0):,}); a healthy engine refuses a longer request (or disable "
            "spec.canary.isolation)"
        )
    for i, prompt in enumerate(canary.golden.prompts):
        if prompt.max_tokens is not None and prompt.max_tokens >= context:
            problems.append(
                f"spec.canary.golden.prompts[{i}].maxTokens: {prompt.max_tokens:,} must be below contextLength "
                f"{context:,} (the prompt needs room); a healthy engine refuses the request"
            )
    return problems


def resplit_problem(old: InferenceModelSpec, new: InferenceModelSpec) -> str | None:
    """An update that changes a worker role's split (tensorParallel, pipelineParallel) while
    `weights.measuredBytesPerDevice` stays and `measuredShards` is unset: the figure was measured
    at the old split and would be planned as-is at the new one (an outside probe moved TP4 to
    TP1: 7 GiB planned where 28 GiB sit, PASS). The brief's rule: re-check after every change of
    parallelism. Said for the field that fixes it.

    A role with dataParallelAttention whose dataParallel changes (or that turns it on or off with
    more than one DP rank) is refused whatever measuredShards says: its attention weights are split
    over tensorParallel / dataParallel GPUs, so every GPU holds a different share of them while the
    split stays; no scaling by GPUs fixes the figure (`kvguard plan --dp` drops it in the same case)."""
    weights = new.weights
    if weights.measured_bytes_per_device is None:
        return None
    if old.weights.measured_bytes_per_device != weights.measured_bytes_per_device:
        return None  # measured again with the change
    if problem := _dp_attention_problem(old, new):
        return problem
    if weights.measured_shards is not None:
        return None
    before, after = _splits(old), _splits(new)
    dropped = old.weights.measured_shards
    if dropped is not None:
        # measuredShards dropped: the figure is still the one measured over that many GPUs (with
        # TP alone, as the planner takes it), and planned as-is wherever a role's split is not
        # that (a review: the rule above, bypassed).
        before = dict.fromkeys(after, (dropped, 1))
    changed = {name: (before[name], after[name]) for name in before.keys() & after.keys() if before[name] != after[name]}
    if not changed:
        return None
    if dropped is not None:
        moves = ", ".join(f"{name} at TP{tp} x PP{pp}" for name, (_, (tp, pp)) in sorted(changed.items()))
        moves = f"measuredShards {dropped} dropped, {moves}"
    else:
        moves = ", ".join(f"{name} {_split_text(a, b)}" for name, (a, b) in sorted(changed.items()))
    return (f"spec.weights.measuredShards: the split changed ({moves}) while measuredBytesPerDevice stayed: set "
            "measuredShards to the split it was measured at (the planner scales it), or measure it again")


def _splits(spec: InferenceModelSpec) -> dict[str, tuple[int, int]]:
    """(tensorParallel, pipelineParallel) per worker role. The shape, not the GPU count: TP8 and
    TP2 x PP4 hold different weights per GPU (each end stage holds a whole vocabulary matrix)."""
    return {name: (role.tensor_parallel, role.pipeline_parallel) for name, role in spec.roles.worker_roles().items()}


def _split_text(before: tuple[int, int], after: tuple[int, int]) -> str:
    (tp, pp), (new_tp, new_pp) = before, after
    if tp * pp != new_tp * new_pp:
        return f"{tp * pp} -> {new_tp * new_pp} GPUs"
    return f"TP{tp} x PP{pp} -> TP{new_tp} x PP{new_pp}"


def _dp_attention_problem(old: InferenceModelSpec, new: InferenceModelSpec) -> str | None:
    before, after = _attention_ranks(old), _attention_ranks(new)
    changed = {name: (before[name], after[name]) for name in before.keys() & after.keys() if before[name] != after[name]}
    if not changed:
        return None
    moves = ", ".join(f"{name} {a} -> {b} DP ranks" for name, (a, b) in sorted(changed.items()))
    return (f"spec.weights.measuredBytesPerDevice: the attention split changed ({moves} sharing attention) while "
            "measuredBytesPerDevice stayed: with dataParallelAttention every DP rank holds the attention weights "
            "of tensorParallel / dataParallel GPUs, so the weights per GPU changed and measuredShards cannot scale it: "
            "measure it again, or remove it (weights are then counted from parameters)")


def _attention_ranks(spec: InferenceModelSpec) -> dict[str, int]:
    """DP ranks that split each worker role's TP group for attention (1 without dataParallelAttention)."""
    return {name: role.data_parallel if role.data_parallel_attention else 1 for name, role in spec.roles.worker_roles().items()}
