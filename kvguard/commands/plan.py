"""`kvguard plan`: does every role's KV pool hold minKVRatio x contextLength tokens? (S7)

Reads an InferenceModel manifest, applies "what if" flags on top of it, and prints the planner's
verdict as a table or JSON. Exit status: 0 pass, 3 blocked, 2 bad input (message on stderr naming
the field): what the admission webhook refuses by field, with its words (spec_checks.py), except
a missing engine or router image, which a plan does not need.

What-if flags set the value for every role they name: --kv-pool-tokens and --mem-fraction replace
the spec-wide field and any per-role kvPoolTokens / memoryFraction too. A measured weight figure
(spec.weights.measuredBytesPerDevice) is scaled to a new --tp/--pp split (recorded as
measuredShards, which every change that passes lists), and dropped for a new --quantization or a
--dp that changes a dataParallelAttention role's attention split (weights are then counted from
parameters).
Memory figures the manifest leaves out are estimated conservatively; the notes say which, and the
verdict uses the safe end of each estimate.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvguard.yaml_files import YAMLFileError, load_all

EXIT_PASS = 0
EXIT_BAD_INPUT = 2
EXIT_BLOCKED = 3

# flag dest -> path of the manifest field it overrides (wire names, under `spec`).
_SPEC_OVERRIDES: dict[str, tuple[str, ...]] = {
    "context_length": ("contextLength",),
    "mem_fraction": ("memoryFraction",),
    "kv_cache_dtype": ("kvCacheDtype",),
    "page_size": ("pageSize",),
    "min_ratio": ("minKVRatio",),
    "kv_pool_tokens": ("kvPoolTokens",),
    "reserve": ("reserve",),
    "engine": ("engine", "kind"),
    "quantization": ("weights", "quantization"),
    "gpu_memory": ("hardware", "memoryPerDevice"),
}
_ROLE_OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "tp": (("prefill", "decode"), "tensorParallel"),
    "prefill_tp": (("prefill",), "tensorParallel"),
    "decode_tp": (("decode",), "tensorParallel"),
    "dp": (("prefill", "decode"), "dataParallel"),
    "pp": (("prefill", "decode"), "pipelineParallel"),
    # A spec-wide value would lose to a per-role one; the flag means "this, everywhere".
    "kv_pool_tokens": (("prefill", "decode"), "kvPoolTokens"),
    "mem_fraction": (("prefill", "decode"), "memoryFraction"),
}


class BadInput(Exception):
    """Input `kvguard plan` cannot use; the message names the file, flag or field."""


class _Help(argparse.RawDescriptionHelpFormatter):
    """--help lists the values of --engine, --quantization and --kv-cache-dtype from the API's own
    enumerations, the ones validation checks (a list written here left fp32 out while the refusal
    offered it). Read only when help is printed: the API module is not imported to parse flags."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.dest in _VALUES_FROM:
            from kvguard.operator import api

            return ", ".join(v.value for v in getattr(api, _VALUES_FROM[action.dest]))
        return super()._get_help_string(action)


_VALUES_FROM = {"engine": "EngineKind", "quantization": "Quantization", "kv_cache_dtype": "KVCacheDtype"}
"""flag dest -> the api enumeration its values come from."""


def _bytes(text: str) -> str:
    """A byte-size flag's value: checked as the manifest field it sets, except that a negative one
    is refused here, by the flag (argparse took `-4Gi` for an option: "expected one argument")."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="check that every role's KV pool holds minKVRatio x contextLength (exit 0 pass, 3 blocked, 2 bad input)",
        description=__doc__,
        formatter_class=_Help,
    )
    # A value that starts with a minus and a digit is a value, never an option (`--reserve -4Gi`):
    # what Python 3.13's argparse does; 3.11's took only plain numbers (-4, -1.5) for values.
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("-f", "--file", required=True, help="InferenceModel manifest (YAML)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument("--hf-config", metavar="PATH", help="fill spec.model.architecture from a HF config.json (file or model dir)")
    what_if = parser.add_argument_group("what if (override manifest fields)")
    what_if.add_argument("--context-length", type=int, metavar="N")
    what_if.add_argument(
        "--mem-fraction", type=float, metavar="F",
        help="SGLang mem_fraction_static / vLLM gpu_memory_utilization for every role (replaces per-role values too)",
    )  # fmt: skip
    what_if.add_argument("--tp", type=int, metavar="N", help="tensor parallelism of prefill and decode")
    what_if.add_argument("--prefill-tp", type=int, metavar="N")
    what_if.add_argument("--decode-tp", type=int, metavar="N")
    what_if.add_argument("--dp", type=int, metavar="N", help="data parallelism of prefill and decode")
    what_if.add_argument("--pp", type=int, metavar="N", help="pipeline parallelism of prefill and decode")
    what_if.add_argument("--kv-cache-dtype", metavar="D", help="(the API's KVCacheDtype values)")
    what_if.add_argument("--page-size", type=int, metavar="N")
    what_if.add_argument("--min-ratio", type=float, metavar="R")
    what_if.add_argument(
        "--kv-pool-tokens", type=int, metavar="N",
        help="explicit pool cap (SGLang --max-total-tokens) for every role: replaces spec.kvPoolTokens and per-role kvPoolTokens",
    )  # fmt: skip
    what_if.add_argument("--reserve", type=_bytes, metavar="BYTES", help="memory kept out of the pool besides weights, e.g. 4Gi (vLLM: its activation peak)")
    what_if.add_argument("--engine", metavar="KIND", help="(the API's EngineKind values)")
    what_if.add_argument("--quantization", metavar="Q", help="(the API's Quantization values)")
    what_if.add_argument("--gpu-memory", type=_bytes, metavar="BYTES", help="memory per device, e.g. 80Gi")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.planner import PlanInputError, plan
    from kvguard.operator.rollout import annotation_problems
    from kvguard.operator.spec_checks import SpecInvalid, check_spec_fields

    notes: list[str] = []
    set_by: dict[str, str] = {}  # field location -> the what-if flag that wrote it
    try:
        manifest = _apply_overrides(_read_manifest(Path(args.file)), args, notes, set_by)
        model = InferenceModel.model_validate(manifest)
        if problems := annotation_problems(model.metadata.annotations):  # as admission and apply read them
            raise BadInput("; ".join(problems))
        # The field checks admission runs (one place decides: spec_checks.py), less the images a
        # plan does not need; then the plan, which is None only for an architecture in a ConfigMap.
        meta = model.metadata
        kv_plan = check_spec_fields(model.spec, name=meta.name, namespace=meta.namespace or "", deploying=False)
        result = _with_implied_changes(kv_plan or plan(model.spec), manifest, set_by)
    except BadInput as exc:
        return _bad_input(str(exc))
    except ValidationError as exc:
        return _bad_input(*_describe_errors(exc.errors(), set_by))
    except PlanInputError as exc:
        return _bad_input(*(f"{field}: {message}" for field, message in exc.problems))
    except SpecInvalid as exc:
        return _bad_input(*exc.problems)
    except (OverflowError, ValueError) as exc:  # a value too large for arithmetic (e.g. a 400-digit contextLength)
        return _bad_input(f"a value in {args.file} is too large to plan with ({exc})")
    for note in notes:
        print(f"kvguard plan: note: {note}", file=sys.stderr)
    if args.output == "json":
        print(json.dumps(result.to_wire(), indent=2))
    else:
        print(render_table(model.metadata.name, result))
    return EXIT_PASS if result.verdict == "pass" else EXIT_BLOCKED


def _with_implied_changes(result: Any, manifest: dict[str, Any], set_by: dict[str, str]) -> Any:
    """The plan with what the what-if flags set without naming it (measuredShards, recorded so the
    measured weight figure scales to a new split) added to every change that passes: each change is
    complete for the manifest with the flags applied, as its header says. Re-planning is not
    needed: the plan was made with that value already set."""
    from kvguard.operator.api import FieldChange

    shards = (manifest.get("spec") or {}).get("weights", {}).get("measuredShards")
    if "spec.weights.measuredShards" not in set_by or not result.suggestions:
        return result
    implied = FieldChange(field="spec.weights.measuredShards", value=shards)
    suggestions = [s if any(c.field == implied.field for c in s.changes) else s.model_copy(update={"changes": [*s.changes, implied]})
                   for s in result.suggestions]  # fmt: skip
    return result.model_copy(update={"suggestions": suggestions})


def _bad_input(*lines: str) -> int:
    for line in lines:
        print(f"kvguard plan: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _describe_errors(errors: list[Any], set_by: dict[str, str]) -> list[str]:
    """One line per field error; a value a what-if flag wrote is named by the flag (once per flag and
    message, with every field it wrote), not as if the manifest held it."""
    from kvguard.operator.api import field_path
    from kvguard.workers.field_messages import field_line

    lines: list[str] = []
    by_flag: dict[str, list[str]] = {}  # "--flag value: message" -> the fields it wrote
    for error in errors:
        location = field_path(error["loc"])
        if (flag := set_by.get(location)) is not None:
            by_flag.setdefault(field_line(flag, error), []).append(location)
        else:
            lines.append(field_line(location, error))
    return [f"{head} (sets {', '.join(fields)})" for head, fields in by_flag.items()] + lines


def _read_manifest(path: Path) -> dict[str, Any]:
    """The single InferenceModel document of a YAML file."""
    try:
        documents = load_all(path)
    except YAMLFileError as exc:
        raise BadInput(str(exc)) from None
    models = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceModel"]
    if len(models) == 1:
        return models[0]
    if not models and len(documents) == 1:
        if not isinstance(documents[0], dict):
            raise BadInput(f"{path}: the document is a {_yaml_kind(documents[0])}, expected an InferenceModel mapping")
        kind = documents[0].get("kind")
        if kind is not None:
            raise BadInput(f"{path}: kind: {kind!r}, expected InferenceModel")
        return documents[0]  # let validation name what is wrong with it (apiVersion, spec...)
    raise BadInput(f"{path} must hold exactly one InferenceModel document, found {len(models)}")


def _yaml_kind(value: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), type(value).__name__)


def _apply_overrides(manifest: dict[str, Any], args: argparse.Namespace, notes: list[str],
                     set_by: dict[str, str]) -> dict[str, Any]:
    """The manifest with flag values written into its spec (validated later with the rest);
    `set_by` records which flag wrote each field."""
    spec = manifest.setdefault("spec", {})
    if not isinstance(spec, dict):
        return manifest  # validation reports it
    _keep_measured_weights_true(spec, args, notes, set_by)
    for dest, path in _SPEC_OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            _set_path(spec, path, value)
            set_by[".".join(("spec", *path))] = _flag(dest, value)
    for dest, (roles, field) in _ROLE_OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            for role in roles:
                _set_path(spec, ("roles", role, field), value)
                set_by[f"spec.roles.{role}.{field}"] = _flag(dest, value)
    if getattr(args, "hf_config", None):
        _fill_from_hf_config(spec, Path(args.hf_config))
    return manifest


def _flag(dest: str, value: Any) -> str:
    return f"--{dest.replace('_', '-')} {value}"


def _keep_measured_weights_true(spec: dict[str, Any], args: argparse.Namespace, notes: list[str], set_by: dict[str, str]) -> None:
    """A measured weight figure describes the manifest's own split and quantization: record the
    split before --tp/--pp change it (the planner then scales the figure), and drop the figure for
    another --quantization (the planner then counts parameters)."""
    weights = spec.get("weights")
    if not isinstance(weights, dict) or weights.get("measuredBytesPerDevice") is None:
        return
    if getattr(args, "quantization", None) and args.quantization != weights.get("quantization"):
        weights.pop("measuredBytesPerDevice", None)
        weights.pop("measuredShards", None)
        notes.append(f"--quantization {args.quantization}: the measured weight figure was for the manifest's "
                     "quantization, so weights are counted from parameters instead")  # fmt: skip
        return
    if getattr(args, "dp", None) and _dp_attention_changes(spec, args.dp):
        weights.pop("measuredBytesPerDevice", None)
        weights.pop("measuredShards", None)
        notes.append(f"--dp {args.dp}: with dataParallelAttention the attention weights are held whole by every DP "
                     "group, so the measured weight figure (taken at the manifest's dataParallel) does not hold; "
                     "weights are counted from parameters instead")  # fmt: skip
        return
    if weights.get("measuredShards") is not None or not _reshaped(spec, args):
        return  # a role's shape unchanged: the figure is still measured at it, taken as it is
    splits = {tp * pp for tp, pp in (_shape_of(spec, role) for role in ("prefill", "decode"))}
    if len(splits) != 1:
        raise BadInput(
            "--tp/--pp with spec.weights.measuredBytesPerDevice: prefill and decode are split differently in the "
            "manifest, so set spec.weights.measuredShards (the GPUs the figure was measured over)"
        )
    # One GPU count in two shapes (TP8 beside TP2 x PP4): the planner takes the figure as measured
    # over those GPUs with TP alone, and so does the what-if (a review: refused, where it planned before).
    weights["measuredShards"] = shards = splits.pop()
    set_by["spec.weights.measuredShards"] = "the manifest's split"
    notes.append(f"measuredBytesPerDevice taken as measured over {shards} GPUs (the manifest's split) and scaled to the new one")


def _dp_attention_changes(spec: dict[str, Any], dp: int) -> bool:
    """Whether --dp changes the attention split of a role with dataParallelAttention (its attention
    TP is tensorParallel / dataParallel: each rank then holds more attention weights)."""
    roles = _mapping(spec.get("roles"))
    for role in ("prefill", "decode"):
        shape = _mapping(roles.get(role))
        if shape.get("dataParallelAttention") is True and shape.get("dataParallel", 1) != dp:
            return True
    return False


def _mapping(value: object) -> dict[str, Any]:
    """A manifest section that should be a mapping, or {} where it is absent or not one."""
    return value if isinstance(value, dict) else {}


def _shape_of(spec: dict[str, Any], role: str) -> tuple[int, int]:
    """The role's (tensorParallel, pipelineParallel) in the manifest ((0, 0) where not numbers:
    validation reports them)."""
    shape = _mapping(_mapping(spec.get("roles")).get(role))
    tp, pp = shape.get("tensorParallel", 1), shape.get("pipelineParallel", 1)
    return (tp, pp) if isinstance(tp, int) and isinstance(pp, int) else (0, 0)


def _reshaped(spec: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether the split flags change a role's shape, as _apply_overrides writes them (a role's own
    --prefill-tp / --decode-tp after --tp). `--pp 4` on a manifest at PP4 changes nothing: the
    figure stays the one measured there, not a TP-alone figure scaled to it (a review)."""
    for role in ("prefill", "decode"):
        tp, pp = _shape_of(spec, role)
        new_tp = next((v for v in (getattr(args, f"{role}_tp", None), getattr(args, "tp", None)) if v is not None), tp)
        new_pp = getattr(args, "pp", None) or pp
        if (new_tp, new_pp) != (tp, pp):
            return True
    return False


def _set_path(root: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = root
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[path[-1]] = value


def _fill_from_hf_config(spec: dict[str, Any], path: Path) -> None:
    from kvguard.operator.hf_config import HFConfigError, architecture_from_hf_config, load_hf_config, quantization_from_hf_config

    try:
        config = load_hf_config(path)
        architecture = architecture_from_hf_config(config)
        quantization = quantization_from_hf_config(config)
    except HFConfigError as exc:
        raise BadInput(f"--hf-config {path}: {exc}") from exc
    except ValidationError as exc:  # what it read, checked as spec.model.architecture: one line per field
        from kvguard.operator.api import ModelArchitecture

        def wire(part: Any) -> Any:  # built from Python names; the manifest's names are camelCase
            field = ModelArchitecture.model_fields.get(str(part))
            return field.alias if field is not None and field.alias else part

        located = [{**e, "loc": ("spec.model.architecture", *map(wire, e["loc"]))} for e in exc.errors()]
        fields = "; ".join(_describe_errors(located, {}))
        raise BadInput(f"--hf-config {path}: {fields}") from exc
    _set_path(spec, ("model", "architecture"), architecture.to_wire())
    weights = _mapping(spec.get("weights"))
    if quantization and not weights.get("quantization"):
        _set_path(spec, ("weights", "quantization"), quantization)


# --- Table ---------------------------------------------------------------------------------------


def render_table(name: str, result: Any) -> str:
    """A readable report of a KVPlan."""
    from kvguard.operator.planner import gib
    from kvguard.operator.suggestions import change_summary
    from kvguard.workers.pool_ratio import ratio_number, ratio_text

    header = (
        f"InferenceModel {name}: engine {result.engine.value}, context {result.context_length:,} tokens, "
        f"min ratio {ratio_number(result.min_ratio)}, page {result.page_size}, KV {result.kv_cache_dtype}"
    )
    columns = ("role", "pools", "gpus/pool", "weights/gpu", "kv/gpu", "bytes/token", "pool tokens", "ratio", "ok")
    rows = [columns]
    for role, r in result.roles.items():
        rows.append((
            role, str(r.instances), str(r.gpus_per_instance), gib(r.weights_bytes_per_gpu), gib(r.kv_bytes_per_gpu),
            f"{r.bytes_per_token:,}", _pool_cell(r), ratio_text(r.pool_tokens, result.context_length)[:-1], "yes" if r.sufficient else "NO",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [header, ""]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += ["", f"verdict: {result.verdict.upper()}"]
    lines += [f"  {reason}" for reason in result.reasons]
    if result.suggestions:
        lines.append("changes that pass (any one; each is complete, re-planned to check):")
        for s in result.suggestions:
            lines += [f"  - {change_summary(s)}", f"      {s.message}"]
    elif result.verdict != "pass":
        lines.append("no change found that passes: caps, memory fraction, fp8 KV, tensor and pipeline parallelism "
                     "(each, and the two together) and a shorter context were tried; give each GPU more memory, "
                     "or write measured figures (spec.weights.measuredBytesPerDevice, deviceOverhead) to plan exactly")
    lines += [f"note: {w}" for w in result.warnings]
    return "\n".join(lines)


def _pool_cell(r: Any) -> str:
    """Pool tokens, marked when a cap set them, or when weights and overheads do not fit at all."""
    if r.kv_budget_bytes < 0:
        from kvguard.operator.planner import gib

        return f"none ({gib(-r.kv_budget_bytes)} short)"
    pool = f"{r.pool_tokens:,}" + (" (cap)" if r.capped_by == "kvPoolTokens" else "")
    if r.optimistic_pool_tokens is not None and r.optimistic_pool_tokens != r.pool_tokens:
        pool += f" (up to {r.optimistic_pool_tokens:,})"
    return pool
