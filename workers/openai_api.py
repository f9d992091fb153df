"""The OpenAI-compatible surface's errors: the error body, pydantic errors as field-level 400s, SSE
framing, and the middleware that gives every failure -- unknown path (404), wrong method (405),
oversized body (413), a bug (500) -- an OpenAI error body instead of aiohttp's plain text; and
reading a request's body within its limits (router and splitter alike).

Request bodies are in openai_requests.py, response bodies in openai_responses.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler  # aiohttp's own 100-continue answer
from multidict import CIMultiDictProxy
from pydantic import ValidationError

from kvguard.workers.backpressure import BodyLease, BodyMemory
from kvguard.workers.servers import reading_body

REVISION_HEADER = "x-kvguard-revision"
"""Names the revision that answered, on every response of the public API: set by the router
itself (`--revision-id`), so a client behind a Gateway can tell who served it as it can behind the
local splitter (which sets it too, to the same value)."""
JSON_DEPTH_LIMIT = 200  # pydantic-core's JSON parser refuses deeper nesting ("recursion limit exceeded")


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
        retry_after_s: int | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _error_type(status)
        self.retry_after_s = retry_after_s  # sent as Retry-After: when the same request may succeed
        self.close_connection = close_connection  # Connection: close, and closed once answered

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        response = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close_connection:
            response.force_close()
        return response

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
    # A 404 (unknown model or path) is an invalid_request_error at OpenAI; clients branch on `code`.
    if status == 409:
        return "conflict_error"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


MAX_ERRORS_ITEMIZED = 64
"""pydantic turns every error of a body into a dict when asked for any one of them: the first of a
body with 1.5 million invalid list items or 700,000 unknown keys (8 MiB) took 3-8 s of the event
loop every tenant shares (outside probe). Beyond this many errors the 400 counts them instead."""


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming the parameter, worded as OpenAI words it; a body
    with more than MAX_ERRORS_ITEMIZED errors gets their count (work bounded per request)."""
    if (count := exc.error_count()) > MAX_ERRORS_ITEMIZED:
        return OpenAIError(400, f"the request body has {count} invalid parameters or items (unknown keys, or values of the "
                           "wrong type or range); it is refused without naming each", code="invalid_value")  # fmt: skip
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    param = _param_path(loc) or None
    kind, msg = first["type"], first["msg"]
    if kind == "json_invalid":
        if "recursion limit" in msg:
            return OpenAIError(400, f"the request body nests JSON more than {JSON_DEPTH_LIMIT} levels deep", code="invalid_json")
        detail = msg.removeprefix("Invalid JSON: ")
        if "hex escape" in detail:  # what the parser says of a lone surrogate, which json.dumps writes
            detail += " (a \\ud800-\\udfff escape must be one half of a surrogate pair: a lone one is not Unicode)"
        return OpenAIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "model_type" and not loc:
        return OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    if kind == "extra_forbidden":
        shown = param or '""'  # the empty key: no path to name, and "None" named nothing
        return OpenAIError(400, f"Unrecognized request argument supplied: {shown}", code="unknown_parameter", param=param)
    if kind == "missing" and param == "model":
        return OpenAIError(400, "you must provide a model parameter", code="missing_required_parameter", param="model")
    if kind == "model_empty":  # `"model": ""`: present, so not missing, but naming no model
        return OpenAIError(400, msg, code="invalid_value", param=param)
    msg = msg.removeprefix("Value error, ")
    return OpenAIError(400, f"{param}: {msg}" if param else msg, code=_validation_code(kind, first.get("ctx")), param=param)


# pydantic error types -> the `code` OpenAI's API answers for the same mistake (a client branches
# on it: `invalid_type`, `integer_above_max_value`, ...); anything else is `invalid_value`.
_TYPE_CODES = {"missing": "missing_required_parameter", "unsupported_parameter": "unsupported_parameter",
               "empty_array": "empty_array", "too_long": "array_above_max_length",
               "array_above_max_length": "array_above_max_length",  # openai_requests._too_many
               "too_short": "array_below_min_length", "string_too_long": "string_above_max_length",
               "string_too_short": "string_below_min_length"}  # fmt: skip
_BOUND_CODES = {"greater_than": "below_min_value", "greater_than_equal": "below_min_value",
                "less_than": "above_max_value", "less_than_equal": "above_max_value"}  # fmt: skip


def _validation_code(kind: str, ctx: dict[str, Any] | None) -> str:
    if kind in _TYPE_CODES:
        return _TYPE_CODES[kind]
    if kind in _BOUND_CODES:  # the bound's type is the field's: temperature's 2.0, n's 128
        number = "decimal" if any(isinstance(bound, float) for bound in (ctx or {}).values()) else "integer"
        return f"{number}_{_BOUND_CODES[kind]}"
    if kind.endswith(("_type", "_parsing")) or kind in ("model_attributes_type", "dict_type", "list_type"):
        return "invalid_type"
    return "invalid_value"


MAX_PARAM_PART_CHARS = 64
"""A parameter name is the client's text (an unknown key, a logit_bias key): echoed at most this long."""


def _param_path(loc: list[str]) -> str:
    """('messages', '0', 'content') -> 'messages[0].content', each part clipped: a 4 MiB unknown
    key was echoed whole in both `message` and `param`."""
    path = ""
    for part in loc:
        if len(part) > MAX_PARAM_PART_CHARS:
            part = part[: MAX_PARAM_PART_CHARS - 3] + "..."
        path += f"[{part}]" if part.isascii() and part.isdigit() and path else (f".{part}" if path else part)
    return path


def context_length_exceeded(
    prompt_tokens: int, max_tokens: int, limit: int, what: str, prompt_param: str = "prompt", budget_param: str = "max_tokens"
) -> OpenAIError:
    """S2: the one error every over-length request gets, wherever on its path it is caught.
    `prompt_param` is "prompt" for completions and "messages" for chat; `budget_param` the
    parameter the completion budget came from (chat's max_completion_tokens, else max_tokens)."""
    return OpenAIError(
        400,
        f"This request needs {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_param}, "
        f"{max_tokens} for the completion), more than the {what} of {limit} tokens.",
        code="context_length_exceeded",
        param=budget_param if prompt_tokens < limit else prompt_param,
    )


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OpenAIError -> its JSON body; aiohttp's own errors (404, 405, 413...) -> the same shape;
    anything unexpected -> a 500 for that request only."""
    try:
        return await handler(request)
    except OpenAIError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_error_response(request, exc)
    except ConnectionResetError:
        raise
    except Exception:
        logging.getLogger("kvguard.http").exception("unexpected error serving %s", request.path)
        return web.json_response(OpenAIError(500, "internal error", code="internal_error").body(), status=500)


def check_transfer_codings(headers: CIMultiDictProxy[str]) -> None:
    """501 for a Transfer-Encoding other than chunked (RFC 9112 6.1). aiohttp's parser de-chunks
    and hands on the rest as it came: a gzip body was read as JSON (a 400 invalid_json), and the
    splitter forwarded it without the header, where the router then took it (an outside probe,
    a review). Every listener that reads a client's body checks it first."""
    codings = [c.strip().lower() for line in headers.getall("Transfer-Encoding", []) for c in line.split(",") if c.strip()]
    if any(coding != "chunked" for coding in codings):
        raise OpenAIError(501, f"Transfer-Encoding {', '.join(codings)[:40]!r} is not implemented: send the body "
                          "uncompressed, chunked or with a Content-Length", code="not_implemented")  # fmt: skip


async def prepare_stream(request: web.Request, response: web.StreamResponse) -> None:
    """Send a streamed answer's head. An HTTP/1.0 client's answer without a Content-Length ends
    only when the connection closes, and aiohttp (3.14) decides so for the head it writes but not
    for the connection: kept alive, the client saw [DONE] at once and the end of the body 30 s
    later, its place at the connection cap held meanwhile (an outside probe)."""
    if request.version < (1, 1) and response.content_length is None:
        response.force_close()
    await response.prepare(request)


def too_large_error(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")


def bodies_full_error(capacity: int) -> OpenAIError:
    return OpenAIError(503, f"the server holds as many request body bytes as it may at once ({capacity}); retry the "
                       "request", code="server_busy", retry_after_s=1)  # fmt: skip


async def read_body(request: web.Request, max_bytes: int, timeout_s: float, lease: BodyLease) -> bytes:
    """The request's whole body, read as it arrives and charged to `lease` (backpressure.BodyMemory).
    413 when it announces or reaches more than `max_bytes` (from its headers when it announces it:
    not a byte is read), 408 when it has not arrived within `timeout_s`, 503 when the bodies held
    at once would pass their limit."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large_error(max_bytes)
    parts: list[bytes] = []
    size = 0
    try:
        with reading_body(request):  # a flood of slow bodies cannot hold every connection: servers.py
            async with asyncio.timeout(timeout_s):
                async for chunk in request.content.iter_any():
                    size += len(chunk)
                    if size > max_bytes:
                        raise too_large_error(max_bytes)
                    if not lease.grow_to(size):
                        raise bodies_full_error(lease.capacity)
                    parts.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    return b"".join(parts)


async def answer_expect(request: web.Request, max_body_bytes: int, bodies: BodyMemory) -> web.StreamResponse | None:
    """The `expect_handler` of a route taking bodies (router, splitter): `Expect: 100-continue`
    (curl's default for large bodies) gets the invitation to upload, unless its Content-Length is
    already over the limit (413 instead) or would not fit the bodies held at once now (503, as it
    would get once uploaded); any other Expect gets a JSON 417 (aiohttp's own answer is plain
    text). A refusal closes the connection: the client holds its body back."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        err = OpenAIError(417, "the only Expect this server meets is 100-continue", code="expectation_failed", param="Expect")
    elif request.content_length is not None and request.content_length > max_body_bytes:
        err = too_large_error(max_body_bytes)
    elif request.content_length is not None and not bodies.admits(request.content_length):
        err = bodies_full_error(bodies.capacity)
    else:
        await _default_expect_handler(request)
        return None
    response = err.response()
    response.force_close()
    return response


def http_error_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """An aiohttp HTTP error as an OpenAI error body, keeping its headers (Allow on a 405)."""
    if exc.status == 404:
        err = OpenAIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    elif exc.status == 405:
        err = OpenAIError(405, f"Method {request.method} is not allowed for {request.path}", code="method_not_allowed")
    elif exc.status == 413:
        err = OpenAIError(413, f"the request body is too large: {exc.text}", code="request_too_large")
    else:
        err = OpenAIError(exc.status, exc.reason or f"HTTP {exc.status}", code=f"http_{exc.status}")
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    return web.json_response(err.body(), status=err.status, headers=headers)
