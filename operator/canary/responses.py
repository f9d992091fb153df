"""Reading OpenAI-compatible response bodies, leniently, without I/O.

Servers differ: vLLM and ours nest errors (`{"error": {...}}`), SGLang sends a flat error object
(`{"object": "error", "message": ...}`), some send `{"error": "text"}`, and SGLang reports a
mid-request abort as a 200 whose finish reason is `abort`. Every one of those is an error here: a
canary must never read "HTTP 200" as "it worked".
"""

from __future__ import annotations

import json
import re
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


SEED_REFUSAL_STATUSES = frozenset({400, 422})
"""How a server says a request is malformed: 400 (OpenAI, vLLM, SGLang, ours) or 422 (a FastAPI
server validating the body with pydantic)."""
_SEED = r"['\"`]?\bseed\b['\"`]?"
_NAMES_SEED = re.compile(
    "|".join([
        # "Unrecognized request argument supplied: seed", "Unsupported parameter: 'seed'", "unknown field `seed`"
        r"\b(?:parameter|argument|field|param|property|key|option)s?\b[\w ]{0,24}?[:\s]\s*" + _SEED,
        # "seed is not supported", "'seed' is not a supported parameter", "seed parameter not allowed"
        _SEED + r"\s*(?:(?:parameter|argument|field|param|option)\s+)?(?:is\s+|are\s+)?(?:not\s+(?:a\s+)?|un)"
        r"(?:supported|recognized|recognised|allowed|permitted|known|expected)",
        r"\b(?:does\s+not|doesn't|do\s+not|cannot|can't)\s+(?:support|accept)\s+(?:the\s+)?" + _SEED,
        # pydantic, as a string: "seed\n  Extra inputs are not permitted", "'loc': ('body', 'seed')"
        _SEED + r"\W{0,4}\s*extra\s+(?:inputs|fields)\s+(?:are\s+)?not\s+permitted",
        r"['\"]body['\"]\s*,\s*['\"]seed['\"]",
        # its value refused: "seed must be between 0 and 2^32 - 1", "invalid value for 'seed'"
        _SEED + r"\s+(?:must|should|is\s+out\s+of\s+range|out\s+of\s+range)\b",
        r"\binvalid\s+(?:value\s+for\s+)?" + _SEED,
    ]),
    re.IGNORECASE,
)


def seed_refusal(status: int | None, raw: str) -> str | None:
    """What the server said, one line, when its answer refuses the request's `seed` field (the field
    itself, or its value); None for any other answer. A refusal is a 400 or 422 that says so in the
    shapes servers use: an error whose `param` is "seed" (OpenAI's shape); one without a `param`
    whose message names seed as the parameter refused ("Unrecognized request argument supplied:
    seed", "'seed' is not supported", pydantic's "Extra inputs are not permitted" at ('body',
    'seed')); or a FastAPI `detail` list every entry of which is located at the seed field. An error
    whose `param` names another field, a message that mentions the word in passing, and the input a
    validation error echoes back (which carries the request's seed whatever was wrong) are not."""
    if status not in SEED_REFUSAL_STATUSES:
        return None
    payload, error = parse_json_text(raw)
    if error is not None or not isinstance(payload, dict):
        return None
    detail = payload.get("detail")
    if "error" in payload or payload.get("object") == "error":
        nested = payload.get("error", payload)
        if isinstance(nested, str):
            return _naming_seed(nested)
        if not isinstance(nested, dict):
            return None
        message = nested.get("message")
        message = message if isinstance(message, str) else ""
        param = nested.get("param")
        if isinstance(param, str) and param.strip():
            return one_line(message or "param: seed", 300) if param.strip().lower() == "seed" else None
        return _naming_seed(message)
    if isinstance(detail, str):
        return _naming_seed(detail)
    if isinstance(detail, list) and detail and all(_located_at_seed(entry) for entry in detail):
        return one_line("; ".join(f"{'.'.join(map(str, e['loc']))}: {e.get('msg', '')}" for e in detail), 300)
    return None


def _naming_seed(message: str) -> str | None:
    return one_line(message, 300) if _NAMES_SEED.search(message) else None


def _located_at_seed(entry: Any) -> bool:
    """A FastAPI validation error entry (`{"loc": ["body", "seed"], "msg": ..., "input": ...}`) about the seed field."""
    loc = entry.get("loc") if isinstance(entry, dict) else None
    return isinstance(loc, list | tuple) and bool(loc) and loc[-1] == "seed"


def sse_data(line: str) -> str | None:
    """The payload of one SSE `data:` line, or None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"
