"""What kube-apiserver does with a custom object before storing it, for the rules kmock skips.

Order (apiextensions-apiserver): prune unknown fields, apply structural defaults (top-down: a
defaulted object gets its own nested defaults too), validate the OpenAPI schema, then evaluate
every `x-kubernetes-validations` CEL rule at each schema node whose value is present, with `self`
bound to that value (and, for a transition rule on an update, `oldSelf` to the stored one). CEL runs on `cel-python`, the same language kube-apiserver evaluates (it
does not type-check rules against the schema the way the API server does at CRD creation, so
`rule_paths_exist` checks that every `self.a.b` a rule reads is declared).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
from celpy import json_to_cel


@dataclass(frozen=True)
class Rejection:
    """One reason the API server refuses the object: the field path and its message."""

    path: str
    message: str


def openapi_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


ROOT_FIELDS_KEPT = ("apiVersion", "kind", "metadata")
"""What pruning leaves at the root whatever the schema says (ObjectMeta is validated on its own)."""


def prune_unknown(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """structuralpruning.Prune: drop every field the schema does not declare (in place), except
    under `x-kubernetes-preserve-unknown-fields` and in maps (`additionalProperties`). Returns the
    dropped paths (kubectl's default strict field validation refuses them; other clients get a
    warning and the object stored without them)."""
    dropped: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return dropped
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name in list(value):
            where = f"{path}.{name}" if path else name
            if path == "" and name in ROOT_FIELDS_KEPT:
                continue
            if name in properties:
                dropped += prune_unknown(value[name], properties[name], where)
            elif isinstance(extra, dict):
                dropped += prune_unknown(value[name], extra, where)
            elif extra is not True:
                del value[name]
                dropped.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            dropped += prune_unknown(item, schema["items"], f"{path}[{i}]")
    return dropped


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """structuraldefaulting.Default: set missing properties that have a default, then recurse
    into every present property (defaults included), list item and map value."""
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if "default" in prop and (name not in value or value[name] is None):
                value[name] = copy.deepcopy(prop["default"])
        for name, child in value.items():
            prop = (schema.get("properties") or {}).get(name)
            if prop is None and isinstance(schema.get("additionalProperties"), dict):
                prop = schema["additionalProperties"]
            if prop is not None:
                apply_defaults(child, prop)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def _schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[Rejection]:
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI v3's boolean exclusiveMinimum is draft 4's
    return [Rejection(".".join(map(str, e.absolute_path)), e.message) for e in validator.iter_errors(obj)]


def _nodes(value: Any, schema: dict[str, Any], path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Every (path, value, schema) pair where a value is present."""
    if value is None:
        return
    yield path, value, schema
    if isinstance(value, dict):
        for name, child in value.items():
            prop = (schema.get("properties") or {}).get(name)
            if prop is None and isinstance(schema.get("additionalProperties"), dict):
                prop = schema["additionalProperties"]
            if prop is not None:
                yield from _nodes(child, prop, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _nodes(item, schema["items"], f"{path}[{i}]")


_ENV = celpy.Environment()


def is_transition_rule(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


def evaluate_rule(rule: str, value: Any, old: Any = None) -> bool | str:
    """True/False, or the evaluation error's text (the API server refuses the object then too).
    `old`: the stored value at the same node, for a transition rule (one that reads oldSelf)."""
    bindings = {"self": json_to_cel(value)}
    if old is not None:
        bindings["oldSelf"] = json_to_cel(old)
    try:
        result = _ENV.program(_ENV.compile(rule)).evaluate(bindings)
    except Exception as exc:  # celpy raises CELEvalError for "no such key" and type errors
        return f"{type(exc).__name__}: {exc}"
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    return bool(result)


def _stored_at(old: dict[str, Any] | None, path: str) -> Any:
    """The stored object's value at `path` (fields only: no rule here sits under a list)."""
    value: Any = old
    for name in path.split(".") if path else []:
        if not isinstance(value, dict) or "[" in name:
            return None
        value = value.get(name)
    return value


def _rule_errors(obj: dict[str, Any], schema: dict[str, Any], old: dict[str, Any] | None = None) -> list[Rejection]:
    errors = []
    for path, value, node in _nodes(obj, schema, ""):
        for validation in node.get("x-kubernetes-validations") or []:
            stored = None
            if is_transition_rule(validation["rule"]):
                # Evaluated only on an update where the node was stored before too (transition rules).
                stored = _stored_at(old, path)
                if stored is None:
                    continue
            verdict = evaluate_rule(validation["rule"], value, stored)
            if verdict is not True:
                detail = "" if verdict is False else f" (rule error: {verdict})"
                errors.append(Rejection(path, validation.get("message", validation["rule"]) + detail))
    return errors


def admit(obj: dict[str, Any], crd: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Rejection]]:
    """(the object as stored, every rejection). Empty rejections: the API server stores it.
    `old`: the object as stored before, for an update (transition rules read it as oldSelf)."""
    schema = openapi_schema(crd)
    stored = copy.deepcopy(obj)
    prune_unknown(stored, schema)
    stored = apply_defaults(stored, schema)
    schema_errors = _schema_errors(stored, schema)
    if schema_errors:
        return stored, schema_errors  # CEL runs only on objects that pass the schema
    before = None
    if old is not None:  # as stored: pruned and defaulted when it was written, and again when read
        before = copy.deepcopy(old)
        prune_unknown(before, schema)
        before = apply_defaults(before, schema)
    return stored, _rule_errors(stored, schema, before)


def all_rules(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(schema path, rule, node schema) for every x-kubernetes-validations entry."""
    for validation in schema.get("x-kubernetes-validations") or []:
        yield path, validation, schema
    for name, prop in (schema.get("properties") or {}).items():
        yield from all_rules(prop, f"{path}.{name}" if path else name)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from all_rules(schema[key], f"{path}[*]")


_SELF_PATH = re.compile(r"\b(?:self|oldSelf)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def rule_paths_exist(rule: str, node: dict[str, Any]) -> list[str]:
    """Every `self.a.b` in the rule that the node's schema does not declare (metadata.name and
    metadata.generateName are the only metadata a root rule may read)."""
    missing = []
    for match in _SELF_PATH.finditer(rule):
        names = match.group(1).strip(".").split(".")
        if rule[match.end() : match.end() + 1] == "(":
            names = names[:-1]  # `.size()` and friends are CEL methods, not fields
        if names[:1] == ["metadata"]:
            if len(names) != 2 or names[1] not in ("name", "generateName"):
                missing.append(match.group(0))
            continue
        current = node
        for name in names:
            current = (current.get("properties") or {}).get(name)
            if current is None:
                missing.append(match.group(0))
                break
    return missing
