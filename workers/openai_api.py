"""The OpenAI-compatible surface of the router: request bodies, response bodies, error bodies, SSE.

Unknown request fields are ignored (clients send vendor extensions freely), but fields we know and
cannot honour (``n > 1``, ``logprobs``, ``echo``...) are refused with an error naming the field, so
a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvguard.workers.protocol import SamplingParams


class OpenAIError(Exception):
    """An error the client sees as an OpenAI-shaped body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _error_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 409:
        return "conflict_error"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error as a field-level 400."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return OpenAIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


class _Request(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: None = None
    stream_options: dict[str, Any] | None = None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt


APIRequest = _Request


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max_tokens)


def context_length_exceeded(prompt_tokens: int, max_tokens: int, limit: int, what: str) -> OpenAIError:
    """S2: the one error every over-length request gets, wherever on its path it is caught."""
    return OpenAIError(
        400,
        f"This request needs {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{max_tokens} for the completion), more than the {what} of {limit} tokens.",
        code="context_length_exceeded",
        param="max_tokens" if prompt_tokens < limit else "prompt",
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Shapes one request's output as a completion or a chat completion, whole or as SSE chunks."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        return {
            **self._envelope(chunk=False),
            "choices": [choice],
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or not first else {}
            if first:
                delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        return {**self._envelope(chunk=True), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self._envelope(chunk=True), "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OpenAIError -> its JSON body; anything unexpected -> a 500 for that request only."""
    try:
        return await handler(request)
    except OpenAIError as err:
        return web.json_response(err.body(), status=err.status)
    except (web.HTTPException, ConnectionResetError):
        raise
    except Exception:
        logging.getLogger("kvguard.http").exception("unexpected error serving %s", request.path)
        return web.json_response(OpenAIError(500, "internal error", code="internal_error").body(), status=500)
