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

from kvguard.operator.canary.report import one_line


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


class ChatTopLogprob(_Lenient):
    token: str
    logprob: float


class ChatTokenLogprob(_Lenient):
    token: str
    logprob: float
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(_Lenient):
    """Chat completions: `choices[].logprobs.content[]` (OpenAI shape; vLLM and SGLang follow it)."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Lenient):
    """Legacy completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (OpenAI shape)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the top alternatives the server sent."""

    token: str
    logprob: float | None
    top: dict[str, float]


def token_logprobs(raw: Any) -> list[TokenLogprob] | None:
    """Either OpenAI logprobs shape as one list; None when absent or unreadable."""
    if not isinstance(raw, dict):
        return None
    if "content" in raw:
        try:
            chat = ChatLogprobs.model_validate(raw)
        except ValidationError:
            return None
        if chat.content is None:
            return None
        return [TokenLogprob(t.token, t.logprob, {a.token: a.logprob for a in t.top_logprobs}) for t in chat.content]
    try:
        legacy = CompletionLogprobs.model_validate(raw)
    except ValidationError:
        return None
    tops = legacy.top_logprobs or [None] * len(legacy.tokens)
    return [
        TokenLogprob(token, lp, dict(top or {}))
        for token, lp, top in zip(legacy.tokens, legacy.token_logprobs, tops)
    ]


class Choice(_Lenient):
    index: int | None = None
    text: str | None = None
    message: ChatMessage | None = None
    delta: ChatMessage | None = None
    finish_reason: str | dict[str, Any] | None = None
    logprobs: dict[str, Any] | None = None

    def content(self) -> str:
        """The text a client reads: a chat choice's `message` (a stream's `delta`) content, a
        completion's `text`. Not the first non-empty of them: a chat answer whose stray `text` was
        right while its `message` carried another tenant's nonce passed (outside probe)."""
        if self.message is not None:
            return self.message.content or ""
        if self.delta is not None:
            return self.delta.content or ""
        return self.text or ""

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
    completion_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None


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
    logprobs = [t for c in body.choices for t in (token_logprobs(c.logprobs) or [])]
    return ParsedBody(
        text="".join(choice.content() for choice in body.choices),
        finish_reason=finish if isinstance(finish, str) else json.dumps(finish) if finish else None,
        prompt_tokens=body.usage.prompt_tokens if body.usage else None,
        completion_tokens=body.usage.completion_tokens if body.usage else None,
        logprobs=logprobs or None,
    )


def choice_texts(payload: Any) -> tuple[dict[int, str], str | None]:
    """Each choice's text by its `index` (its position when a server sends none), or the error the
    body carries. For answers with several choices (a prompt list), which `parse_body` joins."""
    parsed = parse_body(payload)
    if parsed.error is not None:
        return {}, parsed.error
    body = CompletionBody.model_validate(payload)  # parse_body accepted it
    texts: dict[int, str] = {}
    for position, choice in enumerate(body.choices):
        index = choice.index if choice.index is not None else position
        if index in texts:  # a client lists both; keeping one hid the other (outside probe: a leak first, then the right one)
            return {}, f"two choices carry index {index}"
        texts[index] = choice.content()
    return texts, None


def choice_finishes(payload: Any) -> dict[int, str]:
    """index -> finish_reason of the choices a body or stream frame finishes (by position where a
    server sends no index); a body `parse_body` refuses finishes none."""
    if parse_body(payload).error is not None:
        return {}
    body = CompletionBody.model_validate(payload)
    return {c.index if c.index is not None else i: c.finish_reason if isinstance(c.finish_reason, str) else json.dumps(c.finish_reason)
            for i, c in enumerate(body.choices) if c.finish_reason}  # fmt: skip


def parse_json_text(raw: str) -> tuple[Any, str | None]:
    """Decode JSON; the error names the problem instead of raising."""
    try:
        return json.loads(raw), None
    except json.JSONDecodeError as exc:
        # Its first characters name what came instead (an HTML error page from a proxy, a plain-text
        # panic); one_line keeps them one clean line (outside probe: only the parse error was shown).
        start = f": it begins {one_line(raw[:60])!r}" if raw.strip() else ": it is empty"
        return None, f"malformed JSON body ({exc.msg} at position {exc.pos}){start}"
    except (ValueError, RecursionError) as exc:  # an integer past Python's digit limit; nesting past its stack
        return None, f"a JSON body Python will not hold ({type(exc).__name__}: {str(exc)[:120]})"


def sse_data(line: str) -> str | None:
    """The payload of one SSE `data:` line, or None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"
