"""pydantic's error messages as the command line says them: the one place every `kvguard` command
turns a ValidationError's entries into words (plan, render, apply, canary, serve, worker), and
the operator's admission webhook and status messages (operator/reconcile.py `field_errors`).

pydantic words some errors for Python programmers: a validator's own message comes prefixed with
"Value error, ", and a section that is not a mapping is "Input should be a valid dictionary or
instance of ObjectMeta" (a class name the manifest never shows). What a user reads is the
validator's message alone, and "must be a mapping". The openai API words its answers itself
(workers/openai_api.py), in OpenAI's error shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_PREFIXES = ("Value error, ", "Assertion failed, ")
_MAPPING_TYPES = frozenset({"model_type", "model_attributes_type", "dict_type", "dataclass_type"})
_FIELD_FIRST = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+|\[\d+\])*: ")
"""A message that names its field itself (`metadata.name: ...`), from a validator of the whole."""


def field_message(error: Mapping[str, Any]) -> str:
    """The message of one pydantic error entry, without pydantic's prefixes or class names."""
    kind, msg = str(error.get("type", "")), str(error.get("msg", ""))
    if kind in _MAPPING_TYPES:
        return "must be a mapping"
    for prefix in _PREFIXES:
        msg = msg.removeprefix(prefix)
    return msg


def field_line(where: str, error: Mapping[str, Any], whole: str = "(manifest)") -> str:
    """`where: message`; an error of the whole document (no location) is `whole: message`, or the
    message alone when it names its field itself (`metadata.name: ...`)."""
    msg = field_message(error)
    if where:
        return f"{where}: {msg}"
    return msg if _FIELD_FIRST.match(msg) else f"{whole}: {msg}"
