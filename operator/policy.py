"""InferencePolicy enforcement as a pure function: `evaluate(spec, namespace, policies)` (S7).

Used twice: by the admission webhook (`kvguard.operator.webhook`), which rejects a non-compliant
InferenceModel, and by every reconcile (`PolicyCompliant` condition; a model that becomes
non-compliant after a policy change blocks its next rollout and is reported, not killed).

Pure: no kopf, no kubernetes, no I/O. Every violation names the policy, the rule (the policy's
spec field, e.g. `minKVRatio`) and the InferenceModel field path it is about (e.g.
`spec.minKVRatio`), so admission rejections and conditions tell the user exactly what to change.
Several policies combine: all that apply must pass.

Rules, per applicable policy:
- minKVRatio (S7): spec.minKVRatio >= the policy's, and the planned pool of every worker role holds
  at least the policy's ratio x contextLength tokens.
- minEngineVersions: spec.engine.version >= the policy's minimum for spec.engine.kind (unset fails).
- requiredEngineFlags: each flag is on the rendered prefill and decode command lines.
- requireKVIntegrity (S1, S3): see `InferencePolicySpec.require_kv_integrity`.
- requiredCanaryProbes: each probe is enabled in spec.canary.
- sglangKVCanary (SGLang models only): SGLang's own read-time KV canary runs on prefill and decode
  at least at the policy's level (`log` < `raise`), as rendered (spec.engine.kvCanary or extraArgs).
- maxContextLength: spec.contextLength <= the policy's.
Scope: `namespaces` (names) and `namespaceSelector` (labels; see `applies_to`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

from pydantic import BaseModel

from kvguard.operator import engine_flags
from kvguard.operator.api import (
    EngineKind,
    InferenceModelSpec,
    InferencePolicy,
    InferencePolicySpec,
    KVPlan,
    LabelSelector,
    LabelSelectorRequirement,
    label_value_problem,
    qualified_name_problem,
)
from kvguard.operator.canary.spec import ProbeName
from kvguard.operator.planner import PlanInputError, flag_check_plan, plan
from kvguard.operator.render import ADAPTERS, Owner, RenderError, RoleContext, with_stand_in_source
from kvguard.workers.pool_ratio import ratio_number

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label Kubernetes puts on every namespace: the one label known from a namespace's name."""

SGLANG_KV_CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
SGLANG_KV_CANARY_FLAG = "--kv-canary"
KV_CANARY_LEVELS = {"none": 0, "log": 1, "raise": 2}
WORKER_ROLES = ("prefill", "decode")


class PolicyViolation(BaseModel):
    """One broken rule of one policy."""

    policy: str
    """Name of the InferencePolicy."""
    rule: str
    """The policy's rule (its spec field), e.g. minKVRatio, requiredCanaryProbes."""
    field: str
    """The InferenceModel field path to change, e.g. spec.minKVRatio."""
    message: str
    """What is wrong, with the numbers."""


class PolicyVerdict(BaseModel):
    """The result of evaluating every applicable policy against one InferenceModel spec."""

    compliant: bool
    """True when no applicable policy is violated."""
    violations: list[PolicyViolation]
    """Every violation, ordered by policy name then rule."""
    policies: list[str] = []
    """Names of the policies that applied to the model's namespace."""


# --- versions ------------------------------------------------------------------------------------

_VERSION_RE = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|alpha|b|beta|rc|c|dev)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?:post|p)[-_.]?(?P<post>\d+))?"
    r"(?:\+[0-9A-Za-z.\-_]*)?\s*$",
    re.IGNORECASE,
)
_PRE_RANK = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "c": 3, "rc": 3}
_FINAL_RANK = 4  # a release sorts after its pre-releases


def version_key(text: str) -> tuple[tuple[int, ...], int, int, int]:
    """A sortable key for an engine version (`0.5.22`, `v0.11.0`, `0.5.0rc2`, `0.5.4.post1`,
    `0.6.0.dev3`, `0.5.22+cu129`). Release numbers compare numerically with trailing zeros ignored;
    pre-releases sort before their release, post-releases after; a local `+tag` is ignored.
    Raises ValueError on anything else. (PEP 440's order for these forms; `packaging` is not a
    runtime dependency of the operator image.)"""
    match = _VERSION_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a version (examples: 0.5.22, v0.11.0, 0.5.0rc2)")
    release = tuple(int(part) for part in match["release"].split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    pre = match["pre"]
    rank = _PRE_RANK[pre.lower()] if pre else _FINAL_RANK
    return release, rank, int(match["pre_n"] or 0), int(match["post"] or -1) + 1


def version_at_least(version: str, minimum: str) -> bool:
    """version >= minimum under `version_key`'s order."""
    return version_key(version) >= version_key(minimum)


# --- scope ---------------------------------------------------------------------------------------


def _requirement_holds(req: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = req.key in labels
    if req.operator == "Exists":
        return present
    if req.operator == "DoesNotExist":
        return not present
    if req.operator == "In":
        return present and labels[req.key] in req.values
    return not present or labels[req.key] not in req.values  # NotIn


def selector_matches(selector: LabelSelector, labels: Mapping[str, str], *, known_keys: set[str] | None) -> bool:
    """metav1.LabelSelector semantics. With `known_keys` given, a requirement on a key outside it
    cannot be decided and counts as matching (fail closed: the policy applies)."""
    requirements = [LabelSelectorRequirement(key=k, operator="In", values=[v]) for k, v in selector.match_labels.items()]
    requirements += selector.match_expressions
    for req in requirements:
        if known_keys is not None and req.key not in known_keys:
            continue
        if not _requirement_holds(req, labels):
            return False
    return True


def applies_to(policy: InferencePolicy, namespace: str, namespace_labels: Mapping[str, str] | None = None) -> bool:
    """Whether `policy` covers `namespace`. Without `namespace_labels` only the name is known (the
    admission request and reconcile see no namespace labels): the selector is evaluated on the
    label kubernetes.io/metadata.name, and requirements on other labels count as matching."""
    scope = policy.spec
    if scope.namespaces and namespace not in scope.namespaces:
        return False
    if namespace_labels is None:
        labels, known = {NAMESPACE_NAME_LABEL: namespace}, {NAMESPACE_NAME_LABEL}
        return selector_matches(scope.namespace_selector, labels, known_keys=known)
    labels = {NAMESPACE_NAME_LABEL: namespace, **namespace_labels}
    return selector_matches(scope.namespace_selector, labels, known_keys=None)


def policy_min_kv_ratio(namespace: str, policies: Sequence[InferencePolicy]) -> float | None:
    """The highest minKVRatio of the InferencePolicies covering `namespace` (None: none covers it).
    The readiness gate raises each pod's own ratio to it (S7 while a pod serves, pool_gate.py)."""
    ratios = [p.spec.min_kv_ratio for p in policies if applies_to(p, namespace)]
    return max(ratios) if ratios else None


# --- rules ---------------------------------------------------------------------------------------

Finding = tuple[str, str, str]  # (rule, field, message)


def _plan_or_problem(spec: InferenceModelSpec) -> tuple[KVPlan | None, Finding | None]:
    """The plan; None without a problem when the architecture is only known from a ConfigMap
    (admission cannot read it; reconcile evaluates again with the resolved spec)."""
    if spec.model.architecture is None and spec.model.architecture_config_map is not None:
        return None, None
    try:
        return plan(spec), None
    except PlanInputError as exc:
        return None, ("minKVRatio", exc.field, f"the KV pool cannot be planned: {exc}")


def check_min_kv_ratio(spec: InferenceModelSpec, minimum: float, kv_plan: KVPlan | None) -> Iterator[Finding]:
    """S7: the declared ratio and the planned pool of every worker role reach the policy's ratio."""
    if spec.min_kv_ratio < minimum:
        ours, theirs = ratio_number(spec.min_kv_ratio), ratio_number(minimum)  # 1.9999999999999998: not "2 is below 2"
        yield "minKVRatio", "spec.minKVRatio", f"{ours} is below the policy's minimum {theirs}"
    if kv_plan is None:
        return
    needed = minimum * spec.context_length
    for role, role_plan in kv_plan.roles.items():
        if role_plan.pool_tokens < needed:
            yield (
                "minKVRatio",
                f"spec.roles.{role}",
                f"planned KV pool {role_plan.pool_tokens:,} tokens = {role_plan.pool_tokens / spec.context_length:.2f}x "
                f"contextLength {spec.context_length:,}, below the policy's {minimum:g}x ({needed:,.0f} tokens)",
            )


def rule_problems(spec: InferencePolicySpec) -> list[str]:
    """`field: why` for every rule of the policy that cannot be read or met, and every scope entry
    that matches nothing (`scope_problems`). Each rule fails closed when a model is judged (a
    blocking finding on every model it covers); this names them where the policy is loaded, before
    anything runs."""
    problems = []
    kinds = {kind.value for kind in EngineKind}
    for kind, minimum in spec.min_engine_versions.items():
        if kind not in kinds:
            problems.append(f"spec.minEngineVersions.{kind}: not an engine kind ({', '.join(sorted(kinds))})")
            continue
        try:
            version_key(minimum)
        except ValueError as exc:
            problems.append(f"spec.minEngineVersions.{kind}: {exc}")
    for i, name in enumerate(spec.required_canary_probes):
        try:
            ProbeName.parse(name)
        except ValueError as exc:
            problems.append(f"spec.requiredCanaryProbes[{i}]: {exc}")
    for i, requirement in enumerate(spec.required_engine_flags):
        for j, flag in enumerate(requirement.flags):
            if (problem := required_flag_problem(requirement.engine, flag)) is not None:
                problems.append(f"spec.requiredEngineFlags[{i}].flags[{j}]: {problem}")
    return problems + scope_problems(spec)


_NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_WITH_VALUES = ("In", "NotIn")


def scope_problems(spec: InferencePolicySpec) -> list[str]:
    """`field: why` for a scope entry that can match no namespace, or that the API server's
    LabelSelector validation refuses: with it, the policy's rules would apply to less than its author
    wrote (an outside probe's `namespaces: [Default]` left `maxContextLength: 1` applying to nothing)."""
    problems = []
    for i, name in enumerate(spec.namespaces):
        if not _NAMESPACE_NAME.fullmatch(name):
            problems.append(f"spec.namespaces[{i}]: {name[:80]!r} is not a namespace name (a DNS-1123 label: at most 63 "
                            "lowercase letters, digits and '-'), so it matches no namespace")  # fmt: skip
    path = "spec.namespaceSelector"
    for key, value in spec.namespace_selector.match_labels.items():
        if (problem := qualified_name_problem(key) or label_value_problem(value)) is not None:
            problems.append(f"{path}.matchLabels[{key}]: {problem}")
    for i, req in enumerate(spec.namespace_selector.match_expressions):
        where = f"{path}.matchExpressions[{i}]"
        if (problem := qualified_name_problem(req.key)) is not None:
            problems.append(f"{where}.key: {problem}")
        if req.operator in _WITH_VALUES and not req.values:
            problems.append(f"{where}.values: must be non-empty for operator {req.operator} (the API server's "
                            "LabelSelector rule; an empty In matches no namespace)")  # fmt: skip
        elif req.operator not in _WITH_VALUES and req.values:
            problems.append(f"{where}.values: must be empty for operator {req.operator} (the API server's LabelSelector rule)")
        for j, value in enumerate(req.values):
            if (problem := label_value_problem(value)) is not None:
                problems.append(f"{where}.values[{j}]: {problem}")
    return problems


def required_flag_problem(engine: EngineKind, flag: str) -> str | None:
    """Why no model of `engine` could ever carry `flag` on its rendered prefill and decode command
    lines (`has_flag`), None where one can: it is not a flag; for the kvguard engine, not a flag of
    `kvguard worker`; or a flag the spec owns (engine_flags.py: extraArgs may not set it) that the
    renderer does not write on both lines in that spelling, or that is required with `=value` (the
    renderer writes the value as the next argument). Admitted, every model of that engine in scope
    would be refused, and adding the flag to extraArgs refused too: no way out (outside probe:
    `--enable-metrics` for kvguard)."""
    name = flag.split("=", 1)[0]
    if engine_flags.flag_name(flag) is None or not name.strip("-") or any(c.isspace() for c in name):
        return (f"{flag[:80]!r} is not a flag: write it as on the command line, with its dashes "
                "(--enable-metrics, --schedule-policy=lpm)")  # fmt: skip
    tunable = engine_flags.KVGUARD_TUNABLE_FLAGS
    if engine is EngineKind.KVGUARD:
        if name in tunable:
            return None
        if name not in engine_flags.KVGUARD_OWNED:
            return (f"{flag} is not a kvguard worker flag; the worker would not start with it, and extraArgs may set only "
                    f"{' and '.join(tunable)}, so no kvguard model could comply")  # fmt: skip
        owner = engine_flags.KVGUARD_OWNED[name]
    else:
        owned = list(engine_flags.overrides([flag], engine_flags.OWNED[engine]))
        if not owned:
            return None  # extraArgs may add it
        owner = owned[0][2]
    rendered = engine_flags.RENDERED_ON_WORKERS[engine]
    if name not in rendered:
        return (f"{flag} is set by {owner}, so extraArgs may not add it, and the operator does not write {name} on both "
                f"the prefill and decode command lines of {engine.value}: no {engine.value} model could comply")  # fmt: skip
    if "=" in flag:
        return (f"{flag} is set by {owner}, so extraArgs may not add it, and the operator writes {name} with its value "
                f"as the next argument, never as {flag}: require {name} alone")  # fmt: skip
    return None


def check_engine_version(spec: InferenceModelSpec, minimums: Mapping[str, str]) -> Iterator[Finding]:
    minimum = minimums.get(spec.engine.kind.value)
    if minimum is None:
        return
    version = spec.engine.version
    if version is None:
        yield "minEngineVersions", "spec.engine.version", f"is unset; the policy requires {spec.engine.kind.value} >= {minimum}"
        return
    try:
        minimum_key = version_key(minimum)
    except ValueError as exc:
        yield "minEngineVersions", "spec.engine.version", f"the policy's minimum cannot be read ({exc}); fix the policy"
        return
    try:
        ok = version_key(version) >= minimum_key
    except ValueError as exc:
        yield "minEngineVersions", "spec.engine.version", str(exc)
        return
    if not ok:
        yield "minEngineVersions", "spec.engine.version", f"{spec.engine.kind.value} {version} is older than the policy's minimum {minimum}"


def worker_command_lines(spec: InferenceModelSpec, kv_plan: KVPlan | None) -> dict[str, list[str]]:
    """The prefill and decode command lines as the operator renders them: with the plan, or with
    the flag-check plan where there is none (the architecture in a ConfigMap) or it renders nothing
    (a pool of 0) -- engine.extraArgs alone once saw neither a role's own extraArgs nor the flags
    the spec's fields render (outside probe: a wrong denial, and a bypass). engine.extraArgs alone
    only when the spec cannot be rendered at all (a render error reported elsewhere)."""
    owner = Owner(name="policy-check", namespace="policy-check", uid="policy-check")
    renderable = with_stand_in_source(spec, "policy-check")
    for candidate in (kv_plan, flag_check_plan(spec)):
        if candidate is None:
            continue
        try:
            return {
                role: ADAPTERS[spec.engine.kind].command(RoleContext(renderable, candidate, owner, "policy", role))  # type: ignore[arg-type]
                for role in WORKER_ROLES
            }
        except RenderError:
            continue
    return {role: list(spec.engine.extra_args) for role in WORKER_ROLES}


def has_flag(command: Sequence[str], flag: str) -> bool:
    """`--flag` or `--flag=value` is on the command line (a required `--flag=value` must match exactly)."""
    return any(arg == flag or ("=" not in flag and arg.startswith(flag + "=")) for arg in command)


def check_required_flags(spec: InferenceModelSpec, policy: InferencePolicy, commands: Mapping[str, list[str]]) -> Iterator[Finding]:
    for requirement in policy.spec.required_engine_flags:
        if requirement.engine is not spec.engine.kind:
            continue
        for flag in requirement.flags:
            missing = [role for role, command in commands.items() if not has_flag(command, flag)]
            if missing:
                yield "requiredEngineFlags", "spec.engine.extraArgs", f"{flag} is required for {requirement.engine.value} but missing on {', '.join(missing)}"


def check_kv_integrity(spec: InferenceModelSpec, commands: Mapping[str, list[str]]) -> Iterator[Finding]:
    """S1/S3. kvguard's page tags and chunk checksums have no off switch an InferenceModel can
    reach, so it complies by construction."""
    kind = spec.engine.kind
    if kind is EngineKind.SGLANG:
        missing = [role for role, command in commands.items() if not has_flag(command, SGLANG_KV_CHECKSUM_FLAG)]
        if missing:
            # On one side only, SGLang skips the check and logs it: both roles need it.
            yield "requireKVIntegrity", "spec.kvTransfer.checksum", f"set it to true ({SGLANG_KV_CHECKSUM_FLAG} on prefill and decode); missing on {', '.join(missing)}"
    elif kind is EngineKind.VLLM:
        yield "requireKVIntegrity", "spec.engine.kind", "vllm has no prefill-to-decode KV checksum; use kvguard or sglang"


def flag_value(command: Sequence[str], flag: str) -> str | None:
    """The last value given to `flag` (`--flag v` or `--flag=v`): argparse keeps the last one."""
    value = None
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def check_sglang_kv_canary(spec: InferenceModelSpec, required: str | None, commands: Mapping[str, list[str]]) -> Iterator[Finding]:
    if required is None or spec.engine.kind is not EngineKind.SGLANG:
        return
    for role, command in commands.items():
        mode = flag_value(command, SGLANG_KV_CANARY_FLAG) or "none"
        if KV_CANARY_LEVELS.get(mode, 0) < KV_CANARY_LEVELS[required]:
            yield "sglangKVCanary", "spec.engine.kvCanary.mode", f"{role} runs --kv-canary {mode}; the policy requires {required}" + (" or raise" if required == "log" else "")


def _probe_field(probe: ProbeName) -> str:
    camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), probe.value)
    return f"spec.canary.{camel}.enabled"


def check_canary_probes(spec: InferenceModelSpec, required: Sequence[str]) -> Iterator[Finding]:
    for name in required:
        try:
            probe = ProbeName.parse(name)
        except ValueError as exc:
            yield "requiredCanaryProbes", "spec.canary", f"the policy names an unknown probe: {exc}; fix the policy"
            continue
        if not spec.canary.probe_enabled(probe):
            yield "requiredCanaryProbes", _probe_field(probe), f"the {probe.value} probe is required and must be enabled"


def check_context_length(spec: InferenceModelSpec, maximum: int | None) -> Iterator[Finding]:
    if maximum is not None and spec.context_length > maximum:
        yield "maxContextLength", "spec.contextLength", f"{spec.context_length:,} exceeds the policy's maximum {maximum:,}"


def policy_findings(
    spec: InferenceModelSpec, policy: InferencePolicy, kv_plan: KVPlan | None, plan_problem: Finding | None,
    commands: Mapping[str, list[str]] | None = None,
) -> Iterator[Finding]:
    """Every broken rule of one policy. `commands`: the rendered prefill/decode command lines when
    the caller has rendered the revision already (reconcile); otherwise rendered here."""
    rules = policy.spec
    if plan_problem is not None:
        yield plan_problem
    yield from check_min_kv_ratio(spec, rules.min_kv_ratio, kv_plan)
    yield from check_engine_version(spec, rules.min_engine_versions)
    if commands is None:
        needs_commands = rules.required_engine_flags or rules.require_kv_integrity or rules.sglang_kv_canary
        commands = worker_command_lines(spec, kv_plan) if needs_commands else {}
    yield from check_required_flags(spec, policy, commands)
    if rules.require_kv_integrity:
        yield from check_kv_integrity(spec, commands)
    yield from check_sglang_kv_canary(spec, rules.sglang_kv_canary, commands)
    yield from check_canary_probes(spec, rules.required_canary_probes)
    yield from check_context_length(spec, rules.max_context_length)


# --- entry points --------------------------------------------------------------------------------


def evaluate(
    spec: InferenceModelSpec,
    namespace: str,
    policies: Sequence[InferencePolicy],
    *,
    namespace_labels: Mapping[str, str] | None = None,
    kv_plan: KVPlan | None = None,
    commands: Mapping[str, list[str]] | None = None,
) -> PolicyVerdict:
    """Evaluate every policy that applies to `namespace` against `spec`; all must pass (S7).

    `kv_plan` may be passed when the caller has planned the spec already (reconcile); otherwise
    it is computed with `planner.plan`; `commands` likewise (the rendered prefill/decode command
    lines, so the flags checked are the ones that run). A spec the planner cannot plan is a minKVRatio violation
    naming the planner's field, except when its architecture comes from a ConfigMap (see
    `_plan_or_problem`). `namespace_labels`: see `applies_to`.
    """
    applicable = sorted((p for p in policies if applies_to(p, namespace, namespace_labels)), key=lambda p: p.metadata.name)
    plan_problem: Finding | None = None
    if applicable and kv_plan is None:
        kv_plan, plan_problem = _plan_or_problem(spec)
    violations = [
        PolicyViolation(policy=policy.metadata.name, rule=rule, field=field, message=message)
        for policy in applicable
        for rule, field, message in policy_findings(spec, policy, kv_plan, plan_problem, commands)
    ]
    return PolicyVerdict(compliant=not violations, violations=violations, policies=[p.metadata.name for p in applicable])


def describe_violations(violations: Sequence[PolicyViolation]) -> str:
    """One line naming each field and rule, for admission rejections and the PolicyCompliant
    condition: `spec.minKVRatio: 1.5 is below ... (InferencePolicy default, rule minKVRatio); ...`."""
    return "; ".join(f"{v.field}: {v.message} (InferencePolicy {v.policy}, rule {v.rule})" for v in violations)
