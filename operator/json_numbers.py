"""Numbers in the API's shapes, read as the Kubernetes API server reads them: a JSON number (a whole
one for integer fields: `2.0` is 2, `1e10` is 10,000,000,000), never a boolean or a string.

Pydantic's lax mode reads `true` (YAML's `yes`, `on`) as 1 and `"32"` as 32: an outside probe's
`contextLength: true` was planned as a 1-token context and passed for the incident's blocked
configuration, and `minKVRatio: true` lowered S7's bar to 1. Strict mode goes too far the other way:
it refuses `2.0` and `1e10` for integers, which the API server accepts. So the models stay lax and a
before-validator on every field (`numbers_only`) refuses booleans and text where a number belongs.
Fields with their own parser (byte quantities such as `80Gi`) are left to it. Booleans likewise:
only `true` and `false` (lax mode read `1`, `"true"` and `"no"`, which the API server's schema
refuses, so `kvguard plan`, `render` and `apply --local` accepted manifests a cluster rejects).
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo
from pydantic.functional_validators import AfterValidator, BeforeValidator, PlainValidator, WrapValidator
from pydantic_core import PydanticKnownError

_PARSERS = (BeforeValidator, PlainValidator, WrapValidator, AfterValidator)
_ERROR_TYPES = {int: "int_type", float: "float_type", bool: "bool_type"}


def numbers_only(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """`value` for field `info.field_name` of `model`, or the error pydantic gives a value of
    another JSON type (`Input should be a valid integer`, `... a valid boolean`): a boolean or text
    where the field holds numbers, anything but `true`/`false` where it holds a boolean."""
    if info.field_name is None or value is None:
        return value
    kind, in_list = _field_number_kind(model, info.field_name)
    if kind is None:
        return value
    items = value if in_list and isinstance(value, (list, tuple)) else [] if in_list else [value]
    if not all(_is_json(kind, item) for item in items):
        raise PydanticKnownError(_ERROR_TYPES[kind])  # type: ignore[arg-type]
    return value


def _is_json(kind: type, item: Any) -> bool:
    """Whether `item` is what a JSON value of a `kind` field may be."""
    if kind is bool:
        return type(item) is bool
    return not isinstance(item, (bool, str, bytes))


@functools.cache
def _field_number_kind(model: type[BaseModel], name: str) -> tuple[type | None, bool]:
    field = model.model_fields[name]
    if any(isinstance(item, _PARSERS) for item in field.metadata):
        return None, False
    return _number_kind(field.annotation)


def _number_kind(annotation: Any) -> tuple[type | None, bool]:
    """(int or float, whether a list of them) when every non-None form of `annotation` is that
    number (or a list of it) without a parser of its own; (None, False) otherwise."""
    forms = [a for a in _union_args(annotation) if a is not type(None)]
    kinds = {_plain_number(a) for a in forms}
    if len(kinds) == 1 and (kind := kinds.pop()) is not None:
        return kind, False
    origins = {typing.get_origin(a) for a in forms}
    if len(forms) == 1 and origins <= {list, tuple}:
        args = [a for a in typing.get_args(forms[0]) if a is not Ellipsis]
        if len(args) == 1 and (item := _plain_number(args[0])) is not None:
            return item, True
    return None, False


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _plain_number(annotation: Any) -> type | None:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return None if any(isinstance(m, _PARSERS) for m in metadata) else _plain_number(base)
    return annotation if annotation in _ERROR_TYPES else None
