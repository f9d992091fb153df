"""Reading OpenAI-compatible response bodies, leniently, without I/O.

Servers differ: vLLM and ours nest errors (`{"error": {...}}`), SGLang sends a flat error object
(`{"object": "error", "message": ...}`), some send `{"error": "text"}`, and SGLang reports a
mid-request abort as a 200 whose finish reason is `abort`. Every one of those is an error here: a
canary must never read "HTTP 200" as "it worked".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Lenient):
    message: str = ""
    type: str | None = None
    param: Any = None
    code: Any = None


class NestedError(_Lenient):
    error: ErrorDetail | str


class FlatError(_Lenient):
    object: str
    message: str = ""
    type: str | None = None
    code: Any = None


class ChatMessage(_Lenient):
    content: str | None = None


class Choice(_Lenient):
    text: str | None = None
    message: ChatMessage | None = None
    delta: ChatMessage | None = None
    finish_reason: str | dict[str, Any] | None = None

    def content(self) -> str:
        for part in (self.text, self.message and self.message.content, self.delta and self.delta.content):
            if part:
                return part
        return ""

    def aborted(self) -> bool:
        reason = self.finish_reason
        if isinstance(reason, dict):
            reason = reason.get("type")
        return reason == "abort"


class Usage(_Lenient):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class CompletionBody(_Lenient):
    choices: list[Choice]
    usage: Usage | None = None
    meta_info: dict[str, Any] | None = None  # SGLang native fields leak through on some builds


class ModelCard(_Lenient):
    id: str
    max_model_len: int | None = None


class ModelList(_Lenient):
    data: list[ModelCard]


@dataclass(frozen=True)
class ParsedBody:
    """What one JSON body (or one SSE frame) says."""

    text: str = ""
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None


def error_message(payload: Any) -> str | None:
    """The error a body carries, in any of the shapes servers use; None when it is not an error."""
    if not isinstance(payload, dict):
        return None
    if "error" in payload and payload["error"]:
        try:
            nested = NestedError.model_validate(payload)
        except ValidationError:
            return f"error: {json.dumps(payload['error'])[:500]}"
        detail = nested.error
        if isinstance(detail, str):
            return detail
        code = f" ({detail.code})" if detail.code not in (None, "") else ""
        return f"{detail.message or detail.type or 'error'}{code}"
    if payload.get("object") == "error":
        flat = FlatError.model_validate(payload)
        return flat.message or flat.type or "error"
    return None


def parse_body(payload: Any) -> ParsedBody:
    """Interpret one decoded JSON body or SSE frame."""
    message = error_message(payload)
    if message is not None:
        return ParsedBody(error=message)
    try:
        body = CompletionBody.model_validate(payload)
    except ValidationError as exc:
        return ParsedBody(error=f"malformed completion body: {_first_error(exc)}")
    meta_reason = (body.meta_info or {}).get("finish_reason")
    if any(choice.aborted() for choice in body.choices) or (
        isinstance(meta_reason, dict) and meta_reason.get("type") == "abort"
    ):
        return ParsedBody(
            text="".join(c.content() for c in body.choices), error="finish_reason is 'abort'"
        )
    finish = next((c.finish_reason for c in body.choices if c.finish_reason), None)
    return ParsedBody(
        text="".join(choice.content() for choice in body.choices),
        finish_reason=finish if isinstance(finish, str) else json.dumps(finish) if finish else None,
        prompt_tokens=body.usage.prompt_tokens if body.usage else None,
    )


def parse_json_text(raw: str) -> tuple[Any, str | None]:
    """Decode JSON; the error names the problem instead of raising."""
    try:
        return json.loads(raw), None
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON body ({exc.msg} at position {exc.pos})"


def sse_data(line: str) -> str | None:
    """The payload of one SSE `data:` line, or None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"
