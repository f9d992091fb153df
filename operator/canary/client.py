"""The suite's HTTP client for one OpenAI-compatible base URL (aiohttp, async).

Every call returns a `Completion` and never raises for a server's misbehaviour: timeouts, refused
connections, malformed bodies and error frames all become `Completion.error`, so that a probe can
put the exchange into its evidence. Streams are read line by line (CR, LF or CRLF ending a line, as
the SSE standard and the official clients say: `sse_lines.py`) so a probe can disconnect after a
given number of chunks, or before the first one (mid-prefill).

Streams are judged as the official OpenAI clients read them: a stream is complete once a choice
carried a `finish_reason`, whether or not a `data: [DONE]` line follows (vLLM, SGLang and ours send
one; `transformers serve` ends with the finish chunk and its usage). A stream is cut short only
when it ends without any finish reason. Every error says what was observed (frames, text chunks,
finish reason, [DONE]) so a report never claims more than the wire showed.

Every answer is read to at most MAX_RESPONSE_BYTES and must be UTF-8: a larger or undecodable one
is that request's error, never the suite's crash or its memory (the operator runs the suite in its
own process, so a candidate pod's answer must not be able to take it down).

One more consistency check, on every answer: `finish_reason: "length"` promises that the generation
stopped at max_tokens (or at the context length). An answer that says so with fewer completion
tokens than that is an aborted request reported as finished (sglang#33507) and is an error. So is
usage claiming more completion tokens than max_tokens allowed, and a stream with more non-empty
text chunks than max_tokens or than its usage counts (each chunk carries at least one token).

A server that refuses the `seed` field (a 400 or 422 about it: `responses.seed_refusal`; an
OpenAI-compatible server that does not support it) is asked once more without it, and the client
remembers that (`EngineClient.seed_refused`): its later requests go without a seed, at no extra
round trip. Every answer a probe compares is greedy (temperature 0), which a seed does not change,
and the sampled requests never carry one, so no check is lost; the report says it was left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import ssl
import statistics
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from kvguard.operator.canary.report import HttpExchange, clip, one_line
from kvguard.operator.canary.responses import (
    ModelList,
    TokenLogprob,
    choice_finishes,
    choice_texts,
    parse_body,
    parse_json_text,
    seed_refusal,
    sse_data,
)
from kvguard.operator.canary.spec import ApiKind
from kvguard.operator.canary.sse_lines import SseLines

API_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Called with (prompt, outcome) after every generation, so the suite can check all text it ever
# received for other requests' secrets, whichever probe sent it.
Observer = Callable[[str, "Completion"], None]

RETRIED_STATUSES = frozenset({429, 503})
"""Answers that say "not now" rather than "no": a server busy, starting, or draining (ours answers
503 while it has no workers and while it drains). A 500 or 502 is not retried: ours reports a
caught stale read (kv_tag_violation) and a failed KV transfer that way, which the suite must see."""
RETRIES = 2  # as the official OpenAI clients do (max_retries=2)
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""The most of one answer (a body, a whole stream, a metrics page) the suite reads. Read whole, a
1 GiB body, or 1 MB of gzip inflating to it, took the canary to 3 GB (outside probe)."""
MAX_STREAM_LINES = 100_000
"""The most lines of one stream the suite reads (a probe's stream has a few per token). 16 MiB of
empty lines, out of 2 MB of gzip, held the event loop for 30 s past the request's timeout
(one read can hold that many lines, read without a pause; outside probe)."""
RETRY_AFTER_CAP_S = 5.0
"""The longest wait a server's Retry-After may ask for; without one the waits are 0.5 s, then 1 s."""


REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class RedirectRefused(aiohttp.ClientError):
    """An endpoint answered with a redirect. The operator follows none: an engine (ours,
    SGLang, vLLM, any image a user names) could otherwise point the operator's requests -- POST
    bodies kept on a 307 -- at any address the operator can reach, such as a cloud metadata
    service, and what came back there landed in the verdict, the report's evidence and a pod's
    readiness condition (outside probe). Where it points is not repeated either."""


async def _refuse_redirects(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
    response = await handler(request)
    if response.status in REDIRECT_STATUSES:
        location = response.headers.get(aiohttp.hdrs.LOCATION)
        with contextlib.suppress(ValueError):
            if location and request.url.join(URL(location)).origin() == request.url.origin():
                return response  # the same server (Starlette's /metrics -> /metrics/): followed, each hop checked here again
        response.close()
        raise RedirectRefused(f"answered HTTP {response.status}, a redirect; the operator follows none")
    return response


def session_without_redirects(**kwargs: Any) -> aiohttp.ClientSession:
    """The HTTP session for everything the operator asks over HTTP -- an engine's pods (the
    canary's requests, /metrics scrapes) and an InferenceModel's prometheusURL, both named by
    whoever deploys a model: redirects are refused (`RedirectRefused`), not followed."""
    return aiohttp.ClientSession(middlewares=(_refuse_redirects,), **kwargs)


class UnreadableAnswer(Exception):
    """An answer the suite will not read further: over MAX_RESPONSE_BYTES (or MAX_STREAM_LINES), or
    not UTF-8. Its message is the request's error."""


@dataclass
class Completion:
    """One request's outcome as the client saw it."""

    label: str
    status: int | None = None
    text: str = ""
    body: str = ""
    error: str | None = None
    chunks: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None  # as requested
    frames_seen: int = 0  # SSE data frames (streams only), [DONE] excluded
    saw_done: bool = False
    logprobs: list[TokenLogprob] | None = None  # when asked for and the server returned them
    choice_finishes: dict[int, str] = field(default_factory=dict)  # several choices (complete_list): index -> finish_reason
    disconnected: bool = False
    clipped: bool = False  # more text than max_tokens x MAX_TOKEN_CHARS: its error, text cut (clip_text_to_budget)
    retried: list[str] = field(default_factory=list)  # what each earlier attempt got (RETRIED_STATUSES, no connection)
    seed_refused_by: Completion | None = None  # the attempt whose answer refused `seed` (EngineClient._send)
    retry_after_header: float | None = None  # the server's Retry-After, in seconds, when it sent one
    seconds: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # seconds after sending, per text chunk

    def seconds_per_chunk(self) -> float | None:
        """Median gap between streamed text chunks (decode speed); None with fewer than two.

        The median, not the mean: the first gap carries the KV hand-off to decode, and one
        descheduled moment on a loaded node stretches one more. The mean of four chunks' three gaps
        doubled a tiny model's speed estimate in CI, which doubled the abort probe's deadline and let
        an engine that ignores aborts pass (S4)."""
        if len(self.chunk_times) < 2:
            return None
        return statistics.median(b - a for a, b in itertools.pairwise(self.chunk_times))

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    def describe_failure(self) -> str:
        status = f"HTTP {self.status}" if self.status is not None else "no HTTP response"
        tries = f" (after {len(self.retried)} retries: {'; '.join(self.retried)})" if self.retried else ""
        return f"{self.label}: {status}: {self.error or 'unexpected status'}{tries}"

    def retry_after(self, attempt: int) -> float | None:
        """Seconds to wait before asking again, or None when this outcome is an answer to keep: only
        a "not now" status, or no connection at all (refused, or closed before any response), is
        asked again, RETRIES times at most (`Retry-After`, capped, when the server sent one)."""
        if attempt >= RETRIES or self.disconnected:
            return None
        if self.status is None and self.error is not None and not self.error.startswith(("timed out", "RedirectRefused")):
            return 0.5 * 2**attempt
        if self.status not in RETRIED_STATUSES:
            return None
        asked = self.retry_after_header
        return min(asked, RETRY_AFTER_CAP_S) if asked is not None else 0.5 * 2**attempt

    def evidence(self) -> HttpExchange:
        return HttpExchange(
            request=self.label,
            status=self.status,
            body=clip(self.body),
            error=self.error,
            tokens_received=self.chunks,
            finish_reason=self.finish_reason,
        )


class EngineClient:
    """Requests against one base URL; greedy decoding and a fixed seed on every generation (none
    once the server has refused it: `seed_refused`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        model: str | None = None,
        seed: int = 1234,
        timeout_seconds: float = 20.0,
        context_length: int | None = None,
    ) -> None:
        self.session = session
        self.base_url = api_root(base_url)
        self.model = model
        self.seed = seed
        self.timeout_seconds = timeout_seconds
        self.context_length = context_length  # for the finish_reason "length" check; None: unknown
        self.observer: Observer | None = None
        self.seed_refused: str | None = None
        """What the server said when it refused `seed` (its first such answer, one line); from then
        on this client sends none. None while it takes the seed (or has not been asked)."""

    def request_body(
        self, api: ApiKind, prompt: str, max_tokens: int, stream: bool, top_logprobs: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if self.seed_refused is None:
            body["seed"] = self.seed
        if api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if top_logprobs is not None:  # the two OpenAI spellings: chat takes a flag plus a count
            body.update({"logprobs": True, "top_logprobs": top_logprobs} if api == "chat" else {"logprobs": top_logprobs})
        return body

    async def list_models(self) -> tuple[ModelList | None, str | None, bool]:
        """GET /v1/models: (model list, error text, whether the server answered at all)."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        try:
            async with self.session.get(f"{self.base_url}/v1/models", timeout=timeout) as resp:
                raw = await read_text(resp)
                if resp.status != 200:
                    return None, f"GET /v1/models: HTTP {resp.status}: {clip(raw, 300)}", True
        except UnreadableAnswer as exc:
            return None, f"GET /v1/models: {exc}", True
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return None, f"GET /v1/models: {_transport_error(exc, self.timeout_seconds)}", False
        payload, error = parse_json_text(raw)
        if error:
            return None, f"GET /v1/models: {error}", True
        try:
            return ModelList.model_validate(payload), None, True
        except ValueError as exc:
            return None, f"GET /v1/models: unexpected shape: {clip(' '.join(str(exc).split()), 300)}", True

    async def complete(
        self,
        prompt: str,
        *,
        api: ApiKind = "completions",
        max_tokens: int = 8,
        stream: bool = False,
        label: str = "",
        disconnect_after_chunks: int | None = None,
        top_logprobs: int | None = None,
        sampled: bool = False,
    ) -> Completion:
        """One generation; streamed when `stream`, and then optionally cut after N chunks. Greedy
        with the client's seed unless `sampled`: then the server's own sampling defaults, as most
        production traffic runs (no temperature, no seed)."""
        body = self.request_body(api, prompt, max_tokens, stream, top_logprobs)
        if sampled:
            del body["temperature"]
            body.pop("seed", None)

        async def read(resp: aiohttp.ClientResponse, result: Completion, started: float) -> None:
            if stream and resp.status == 200 and _is_event_stream(resp):
                await _read_stream(resp, result, disconnect_after_chunks, started)
            else:
                _read_json(await read_text(resp), result)

        result = await self._send(api, body, lambda: Completion(label=label or f"{api} stream={stream}", max_tokens=max_tokens), read)
        over = clip_text_to_budget(result)
        if result.error is None and result.status != 200:
            result.error = f"HTTP {result.status}"
        if result.error is None and result.status == 200:
            result.error = (over or premature_length_finish(result, self.context_length)
                            or over_budget(result) or (streamed_over_budget(result) if stream else None))  # fmt: skip
        self._observe(prompt, result)
        return result

    async def complete_list(
        self, prompts: list[str] | str, *, max_tokens: int, label: str, n: int = 1, api: ApiKind = "completions",
        stream: bool = False,
    ) -> tuple[Completion, dict[int, str]]:
        """One request carrying a list of prompts (completions: one batch on the server), or one
        prompt (either API), `n` choices each: the exchange, and each choice's text by index
        (prompt i's are i*n .. i*n+n-1, as OpenAI numbers them), streamed when `stream` (the
        choices' chunks interleave in one stream, told apart by index). Observed as one answer to
        all its prompts (another request's nonce anywhere in it is a leak); the caller checks each
        choice against the others itself."""
        count = len(prompts) if isinstance(prompts, list) else 1
        body = self.request_body(api, prompts if isinstance(prompts, str) else "", max_tokens, stream=stream)
        if isinstance(prompts, list):
            body["prompt"] = prompts
        if n > 1:
            body["n"] = n
        texts: dict[int, str] = {}
        streamed = False

        async def read(resp: aiohttp.ClientResponse, result: Completion, _started: float) -> None:
            nonlocal streamed
            texts.clear()  # (a retry starts over)
            streamed = stream and resp.status == 200 and _is_event_stream(resp)
            if streamed:
                await _read_choice_stream(resp, result, texts)
            else:
                result.body = await read_text(resp)

        result = await self._send(api, body, lambda: Completion(label=label, max_tokens=max_tokens * count * n), read)
        if result.error is None and not streamed:
            payload, result.error = parse_json_text(result.body)
            if result.error is None:
                texts, result.error = choice_texts(payload)
                result.choice_finishes = choice_finishes(payload)
        if result.error is None and result.status != 200:
            result.error = f"HTTP {result.status}"
        result.text = "".join(texts[k] for k in sorted(texts))
        budget = MAX_TOKEN_CHARS * max_tokens  # each choice's own, as the whole text's is all of theirs
        over = clip_text_to_budget(result)
        if over is None and (long := [k for k in sorted(texts) if len(texts[k]) > budget]):
            over, result.clipped = (f"choice {long[0]}'s text is {len(texts[long[0]]):,} characters for "
                                    f"max_tokens={max_tokens} (at most {MAX_TOKEN_CHARS} a token)"), True  # fmt: skip
        if over is not None:
            result.error = result.error or over
            texts = {k: v[:budget] for k, v in texts.items()}
        self._observe(prompts if isinstance(prompts, str) else "\n".join(prompts), result)
        return result, texts

    async def _send(
        self, api: ApiKind, body: dict[str, Any], fresh: Callable[[], Completion],
        read: Callable[[aiohttp.ClientResponse, Completion, float], Awaitable[None]],
    ) -> Completion:  # fmt: skip
        """`body` POSTed, asked again while its answer says "not now" (`_with_retries`), and once
        more without `seed` when the answer refuses that field (`seed_refusal`): the client then
        sends no seed again (`seed_refused`). The outcome kept lists the refused attempt among its
        retries. An answer refused the same way without `seed` was not about it (a message that
        names seed in passing, a review): that answer stands, and the seed is still sent. `fresh`
        makes each attempt's empty outcome."""
        result = await _with_retries(lambda: self._exchange(api, body, fresh(), read))
        if "seed" not in body or (words := seed_refusal(result.status, result.body)) is None:
            return result
        refused = result
        unseeded = {key: value for key, value in body.items() if key != "seed"}
        result = await _with_retries(lambda: self._exchange(api, unseeded, fresh(), read))
        if (result.status, result.body) == (refused.status, refused.body):
            return refused
        self.seed_refused = self.seed_refused or words
        result.retried = [*refused.retried, f"HTTP {refused.status}: the server refuses `seed`; sent again without it",
                          *result.retried]  # fmt: skip
        result.seed_refused_by = refused  # observed too: a leak can hide in an error's words
        return result

    async def _exchange(
        self, api: ApiKind, body: dict[str, Any], result: Completion,
        read: Callable[[aiohttp.ClientResponse, Completion, float], Awaitable[None]],
    ) -> Completion:  # fmt: skip
        """One POST of `body`, its answer `read` into `result`; a transport failure is its error."""
        started = time.monotonic()
        try:
            async with self.session.post(f"{self.base_url}{API_PATHS[api]}", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_seconds)) as resp:  # fmt: skip
                result.status, result.retry_after_header = resp.status, _retry_after(resp)
                await read(resp, result, started)
        except UnreadableAnswer as exc:
            result.error = str(exc)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            result.error = _transport_error(exc, self.timeout_seconds)
        finally:
            result.seconds = time.monotonic() - started
        return result

    def _observe(self, prompt: str, result: Completion) -> None:
        if self.observer is not None:
            if result.seed_refused_by is not None:
                self.observer(prompt, result.seed_refused_by)
            self.observer(prompt, result)

    async def disconnect_during_prefill(
        self, prompt: str, *, api: ApiKind, max_tokens: int, after_seconds: float, label: str
    ) -> Completion:
        """Send a streaming request and drop the connection after `after_seconds`, whatever came.

        A private session guarantees the socket really closes (a pooled keep-alive connection
        could otherwise survive the cancelled request).
        """
        result = Completion(label=label, disconnected=True)
        connector = aiohttp.TCPConnector(force_close=True)
        async with session_without_redirects(connector=connector) as private:
            solo = EngineClient(
                private, self.base_url, model=self.model, seed=self.seed,
                timeout_seconds=self.timeout_seconds, context_length=self.context_length,
            )
            solo.seed_refused = self.seed_refused
            task = asyncio.create_task(solo.complete(prompt, api=api, max_tokens=max_tokens, stream=True))
            done, _ = await asyncio.wait({task}, timeout=after_seconds)
            self.seed_refused = self.seed_refused or solo.seed_refused
            if done:
                finished = task.result()
                finished.label, finished.disconnected = label, False
                self._observe(prompt, finished)  # the private client has no observer
                return finished
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        return result


async def _with_retries(once: Callable[[], Awaitable[Completion]]) -> Completion:
    """`once()`, asked again while its outcome says "not now" (`Completion.retry_after`): one 503
    from a router that is starting or draining, or a 429, is not a verdict on what the server
    computes (outside probe: one such blip failed a healthy server's whole run). The outcome kept
    lists what the earlier attempts got."""
    earlier: list[str] = []
    for attempt in itertools.count():
        result = await once()
        wait = result.retry_after(attempt)
        if wait is None:
            result.retried = earlier
            return result
        earlier.append(f"HTTP {result.status}" if result.status is not None else result.error or "no response")
        await asyncio.sleep(wait)
    raise AssertionError("unreachable")  # itertools.count never ends


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    """A Retry-After header given in seconds (its HTTP-date form is not used by inference servers)."""
    try:
        seconds = float(resp.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def api_root(base_url: str) -> str:
    """The server root: OpenAI clients are given `http://host:port/v1`, the suite adds `/v1/...`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


async def read_text(resp: aiohttp.ClientResponse, limit: int | None = None) -> str:
    """The whole body as UTF-8 text, read to at most `limit` bytes (default MAX_RESPONSE_BYTES;
    decompressed, as aiohttp inflates it a bounded piece at a time); UnreadableAnswer past that or
    when it is not UTF-8."""
    limit = MAX_RESPONSE_BYTES if limit is None else limit
    body = bytearray()
    async for piece in resp.content.iter_chunked(1 << 16):
        body += piece
        if len(body) > limit:
            raise UnreadableAnswer(f"the answer is over {limit:,} bytes: read that far, then stopped")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableAnswer(f"the answer is not UTF-8 (byte {exc.start}: {bytes(body[exc.start:exc.start + 4])!r})") from None


async def _sse_lines(resp: aiohttp.ClientResponse, raw: bytearray) -> AsyncGenerator[str, None]:
    """A stream's lines (ended by CR, LF or CRLF, `SseLines`), each UTF-8, to at most
    MAX_RESPONSE_BYTES in all, every byte also kept in `raw` (where a leak is searched for: the
    whole stream, not only what a frame's text shows). Kept as bytes: a server streaming empty
    frames for the whole timeout held 555 MB of them as line strings (outside probe)."""
    splitter, count = SseLines(), 0
    async for chunk in resp.content.iter_any():
        if len(raw) + len(chunk) > MAX_RESPONSE_BYTES:
            raise UnreadableAnswer(f"the stream is over {MAX_RESPONSE_BYTES:,} bytes: read that far, then stopped")
        raw += chunk
        for at, line in splitter.feed(chunk):
            count += 1
            if count > MAX_STREAM_LINES:
                raise UnreadableAnswer(f"the stream is over {MAX_STREAM_LINES:,} lines: read that far, then stopped")
            if count % 256 == 0:
                await asyncio.sleep(0)  # the request's timeout, and every other task, get their turn
            yield _utf8_line(at, line)
    for at, line in splitter.finish():
        yield _utf8_line(at, line)


def _read_so_far(raw: bytearray) -> str:
    """The stream as received, for the leak search and the evidence. Every line read was strict
    UTF-8 (`_utf8_line`); a reader that stopped early ([DONE], an error frame, a planned
    disconnect) has received bytes it never read as lines, perhaps ending inside a character:
    those are not the answer's error, and show as U+FFFD."""
    return raw.decode("utf-8", errors="replace")


def _utf8_line(at: int, line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableAnswer(f"the stream is not UTF-8 (byte {at + exc.start})") from None


async def _data_frames(resp: aiohttp.ClientResponse, result: Completion, raw: bytearray) -> AsyncGenerator[str, None]:
    """An SSE body's events' data until [DONE] or its end, each counted in `result.frames_seen`.
    As the SSE standard says (and the official OpenAI clients read it), an event's `data:` lines
    join with newlines until the blank line that ends it (outside probe: a valid event split over
    two lines failed as malformed JSON); one the body ends without a blank line is dropped, as
    those clients drop it (outside probe: counted, it passed a stream whose last token the official
    client never showed). What was read is in `raw` (`_sse_lines`)."""
    data: list[str] = []
    async for line in _sse_lines(resp, raw):
        if line:
            if (payload := sse_data(line)) is not None:
                data.append(payload)
            continue
        event, data = "\n".join(data).strip(), []
        if event:
            if event == "[DONE]":
                result.saw_done = True
                return
            result.frames_seen += 1
            yield event


async def _read_stream(
    resp: aiohttp.ClientResponse, result: Completion, disconnect_after: int | None, started: float
) -> None:
    """Accumulate SSE frames until [DONE] or the end of the body (see the module doc)."""
    pieces: list[str] = []
    raw = bytearray()
    async with contextlib.aclosing(_data_frames(resp, result, raw)) as frames:
        async for data in frames:
            if not _absorb_frame(data, result, pieces, started):
                break
            if disconnect_after is not None and result.chunks >= disconnect_after and result.finish_reason is None:
                result.disconnected = True
                resp.close()
                break
    result.text = "".join(pieces)
    result.body = _read_so_far(raw)
    if result.error is None and result.finish_reason is None and not result.disconnected:
        result.error = stream_cut_short(result)


async def _read_choice_stream(resp: aiohttp.ClientResponse, result: Completion, texts: dict[int, str]) -> None:
    """A stream of several choices: each frame's choices appended to their index's text (a frame
    that names one index twice is an error, as `choice_texts` says for a whole body). Every choice
    heard must end with a finish reason: one cut after another finished is a stream cut short."""
    raw = bytearray()
    async with contextlib.aclosing(_data_frames(resp, result, raw)) as frames:
        async for data in frames:
            payload, error = parse_json_text(data)
            frame, error = choice_texts(payload) if error is None else ({}, error)
            if error is not None:
                result.error = f"stream frame {result.frames_seen}: {error}"
                break
            for index, text in frame.items():
                texts[index] = texts.get(index, "") + text
            result.choice_finishes.update(choice_finishes(payload))
            result.finish_reason = parse_body(payload).finish_reason or result.finish_reason
    result.body = _read_so_far(raw)
    if result.error is None and (result.finish_reason is None or not set(result.choice_finishes) >= set(texts)):
        unfinished = sorted(set(texts) - set(result.choice_finishes))
        result.error = stream_cut_short(result) + (f" (choice(s) {unfinished} never finished)" if result.finish_reason else "")


def _absorb_frame(data: str, result: Completion, pieces: list[str], started: float) -> bool:
    """One SSE data frame into `result`; False when it is an error frame (reading stops)."""
    payload, error = parse_json_text(data)
    parsed = parse_body(payload) if error is None else None
    if error is not None or (parsed is not None and parsed.error is not None):
        result.error = f"stream frame {result.frames_seen}: {error or parsed.error}"  # type: ignore[union-attr]
        return False
    assert parsed is not None
    if parsed.text:
        pieces.append(parsed.text)
        result.chunks += 1
        result.chunk_times.append(time.monotonic() - started)
    result.finish_reason = parsed.finish_reason or result.finish_reason
    result.prompt_tokens = parsed.prompt_tokens if parsed.prompt_tokens is not None else result.prompt_tokens
    if parsed.completion_tokens is not None:
        result.completion_tokens = parsed.completion_tokens
    if parsed.logprobs:
        result.logprobs = (result.logprobs or []) + parsed.logprobs
    return True


def stream_cut_short(result: Completion) -> str:
    """What a stream that ended without a finish reason showed (pure; for the error message)."""
    ending = "then data: [DONE]" if result.saw_done else "then the connection closed"
    return (
        f"stream cut short: {result.frames_seen} data frame(s), {result.chunks} text chunk(s), "
        f"no choice carried a finish_reason, {ending}"
    )


def premature_length_finish(result: Completion, context_length: int | None) -> str | None:
    """sglang#33507: `finish_reason: "length"` with fewer completion tokens than max_tokens, while
    prompt + completion is still below the context length. None when consistent or not knowable
    (no usage reported)."""
    if result.finish_reason != "length" or result.completion_tokens is None or result.max_tokens is None:
        return None
    if result.completion_tokens >= result.max_tokens:
        return None
    if context_length is not None and result.prompt_tokens is not None:
        if result.prompt_tokens + result.completion_tokens >= context_length:
            return None  # it stopped at the context length: "length" is right
    where = f", prompt {result.prompt_tokens} tokens" if result.prompt_tokens is not None else ""
    context = f", context {context_length}" if context_length is not None else ""
    return (
        f"finish_reason 'length' after {result.completion_tokens} of max_tokens={result.max_tokens} "
        f"completion tokens{where}{context}: an aborted or truncated request reported as finished (sglang#33507)"
    )


def over_budget(result: Completion) -> str | None:
    """More completion tokens than max_tokens allowed, by the server's own usage: the budget was
    not enforced (or usage counts another request's tokens). None when consistent or not reported."""
    if result.completion_tokens is None or result.max_tokens is None or result.completion_tokens <= result.max_tokens:
        return None
    return (f"usage says {result.completion_tokens} completion tokens, more than max_tokens={result.max_tokens}: "
            "the budget was not enforced, or usage counts tokens that are not this answer's")  # fmt: skip


MAX_TOKEN_CHARS = 256
"""More characters than any one token of a real vocabulary decodes to (the longest are runs of
spaces or punctuation, and special tokens' names, well under this)."""


def clip_text_to_budget(result: Completion) -> str | None:
    """An answer with more text than max_tokens tokens can make carries text that is not its
    tokens' (another request's, or a server's own): its error, and its text clipped to that budget
    before anything keeps or compares it -- a candidate answering ~10 KB per request held the
    operator's event loop for 27 s in one comparison of answers, quadratic in their length, and
    16 MB answers took the operator to 5.4 GB (outside probe). None when within it."""
    if result.max_tokens is None or len(result.text) <= (budget := result.max_tokens * MAX_TOKEN_CHARS):
        return None
    error = (f"the answer's text is {len(result.text):,} characters for max_tokens={result.max_tokens}: more than "
             f"that many tokens make (at most {MAX_TOKEN_CHARS} characters each)")  # fmt: skip
    result.text = result.text[:budget]
    result.clipped = True
    return error


def streamed_over_budget(result: Completion) -> str | None:
    """A stream's own count, whatever usage says: every non-empty text chunk carries at least one
    token (engines send a chunk per token, or per few with a stream interval), so more such chunks
    than max_tokens is over budget, and usage below the chunk count is not this answer's (outside
    probe: a server that sent 24 tokens for max_tokens 8 and left usage out, or capped it at 8,
    passed). None when consistent."""
    if result.max_tokens is not None and result.chunks > result.max_tokens:
        return (f"the stream carried {result.chunks} text chunks, more than max_tokens={result.max_tokens} (each "
                "chunk is at least one token): the budget was not enforced")  # fmt: skip
    if result.completion_tokens is not None and result.completion_tokens < result.chunks:
        return (f"usage says {result.completion_tokens} completion tokens, fewer than the {result.chunks} text chunks "
                "the stream carried (each at least one token): usage is not this answer's")  # fmt: skip
    return None


def _read_json(raw: str, result: Completion) -> None:
    result.body = raw
    payload, error = parse_json_text(raw)
    if error is not None:
        result.error = error
        return
    parsed = parse_body(payload)
    result.text = parsed.text
    result.chunks = 1 if parsed.text else 0
    result.error = parsed.error
    result.finish_reason = parsed.finish_reason
    result.prompt_tokens = parsed.prompt_tokens
    result.completion_tokens = parsed.completion_tokens
    result.logprobs = parsed.logprobs


def _transport_error(exc: BaseException, timeout_seconds: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"timed out after {timeout_seconds:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _connect_error(exc)
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _connect_error(exc: aiohttp.ClientConnectorError) -> str:
    """No connection at all, in plain words on one line: `cannot connect to 127.0.0.1:9: connection
    refused` (aiohttp's own text named its class, `ssl:default` and the call that failed)."""
    cause = exc.os_error
    if isinstance(cause, ssl.SSLError):  # its errno is OpenSSL's (1), not an OS error's (a review)
        reason = f"TLS: {getattr(cause, 'verify_message', None) or cause.reason or str(cause)}"
    elif isinstance(cause, socket.gaierror) or not isinstance(cause.errno, int) or cause.errno <= 0:
        reason = cause.strerror or str(cause) or type(cause).__name__  # a name that does not resolve
    else:
        reason = os.strerror(cause.errno)  # its strerror is asyncio's "Connect call failed ('127.0.0.1', 9)"
    reason = reason[:1].lower() + reason[1:] if reason[1:2].islower() else reason
    host = f"[{exc.host}]" if ":" in (exc.host or "") else exc.host  # an IPv6 address
    return one_line(f"cannot connect to {host}:{exc.port}: {reason}")


async def get_text(
    session: aiohttp.ClientSession, url: str, timeout_seconds: float, limit: int | None = None
) -> tuple[int | None, str, str | None]:
    """GET any URL: (status, body read to at most `limit` bytes, transport error or unreadable answer)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as resp:
            return resp.status, await read_text(resp, limit), None
    except UnreadableAnswer as exc:
        return None, "", str(exc)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return None, "", _transport_error(exc, timeout_seconds)

