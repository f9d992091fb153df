"""How decode turns a request's engine outputs into the events the router reads: which outputs go
out now (`StreamInterval`) and their NDJSON (`step_events`), on the request's own stream or, wrapped
with its id, on a token channel (workers/token_channel.py). Pure."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel

from kvguard.workers.protocol import ErrorEvent, FinishEvent, TokenEvent, TokenLogprob
from kvguard.workers.request import RequestOutput, RequestState

MAX_HOLD_S = 1.0
"""The longest decode holds tokens for an interval before sending them anyway: the router's
--request-timeout bounds the wait between two events, so a healthy but slow generation (N tokens
taking longer than that timeout) must still send at least one event per this long."""


class StreamInterval:
    """Which outputs go out now (vLLM's and SGLang's --stream-interval): the first token at once
    (TTFT is never traded), then whenever `every` tokens are held or the oldest held has waited
    `max_hold_s`, and whatever ended the request with everything held before it. Pure (the caller
    gives the time); one per request."""

    def __init__(self, every: int, max_hold_s: float = MAX_HOLD_S) -> None:
        self.every = every
        self.max_hold_s = max_hold_s
        self._held: list[RequestOutput] = []
        self._held_tokens = 0
        self._held_since = 0.0  # when the oldest held token came
        self._first_sent = False

    def due(self, batch: Sequence[RequestOutput], now: float) -> bool:
        """Hold `batch` (arrived at monotonic time `now`); True when what is held should be sent
        now (then call `take`)."""
        tokens = sum(len(output.token_ids) for output in batch)
        if self._held_tokens == 0 and tokens:
            self._held_since = now
        self._held += batch
        self._held_tokens += tokens
        if self._held[-1].finished or self._held_tokens >= self.every:
            return True
        if self._held_tokens > 0 and now - self._held_since >= self.max_hold_s:
            return True
        return not self._first_sent and self._held_tokens > 0

    def take(self) -> list[RequestOutput]:
        held, self._held, self._held_tokens = self._held, [], 0
        self._first_sent = self._first_sent or any(output.token_ids for output in held)
        return held


def step_events(batch: Sequence[RequestOutput], prompt_tokens: int, sent: int,
                channel_request: str | None = None) -> tuple[bytes, int, bool]:
    """One request's consecutive outputs as NDJSON: their tokens as one TokenEvent, then the
    FinishEvent or ErrorEvent that ended it, if one did -- each line wrapped in a ChannelEvent for
    `channel_request` when it goes on a token channel. Returns (bytes, completion tokens sent so
    far, whether the request ended)."""
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    end: BaseModel | None = None
    for output in batch:
        token_ids += output.token_ids
        text.append(output.text)
        if output.logprobs is not None:
            logprobs = (logprobs or []) + output.logprobs
        if output.state is RequestState.FINISHED:
            reason = "length" if output.finish_reason == "length" else "stop"
            end = FinishEvent(finish_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=sent + len(token_ids))
        elif output.error is not None:
            end = ErrorEvent(status=output.error.status, code=output.error.code, message=output.error.message)
        elif output.finished:  # no engine path ends a decode request otherwise; the router must hear it ended
            end = ErrorEvent(status=502, code="decode_failed", message="decode ended the request without finishing it")
    lines = []
    if token_ids:
        # Built without validation: every field comes from this worker's engine.
        event = TokenEvent.model_construct(token_ids=tuple(token_ids), text="".join(text),
                                           logprobs=tuple(logprobs) if logprobs is not None else None)
        lines.append(event.model_dump_json().encode())
    if end is not None:
        lines.append(end.model_dump_json().encode())
    if channel_request is not None:
        # The envelope by hand around the event's own JSON: equal to ChannelEvent's, without a
        # second model per event on this hot path (the test checks it parses as one).
        head = b'{"request_id":' + json.dumps(channel_request).encode() + b',"event":'
        lines = [head + line + b"}" for line in lines]
    return b"".join(line + b"\n" for line in lines), sent + len(token_ids), end is not None
