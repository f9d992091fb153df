"""A request's life in the engine, its sampling parameters, and the typed errors it can end with.

Lifecycle (docs/architecture.md). Intake: RECEIVED -> ADMITTED | REJECTED (S2: rejected before any page is
allocated). Then, depending on where the request runs:
- colocated (one engine):  ADMITTED -> PREFILLING -> DECODING -> FINISHED
- prefill worker:          ADMITTED -> PREFILLING -> TRANSFERRING -> DONE
- decode worker:           ADMITTED -> PREALLOCATED -> RECEIVING -> VERIFIED -> DECODING -> FINISHED
ABORTED is reachable from every non-terminal state and always releases the request's pages.
ADMITTED requests wait in the queue until their pages are allocated (PREFILLING / PREALLOCATED).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvguard.workers.protocol import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

    from kvguard.workers.kv_pool import Lease
    from kvguard.workers.sampling import LogitsState
    from kvguard.workers.stops import StopMatcher
    from kvguard.workers.tokenizer import IncrementalDetokenizer

__all__ = ["SamplingParams", "TokenLogprob"]  # re-exported: the engine's callers import them from here


class RequestState(enum.Enum):
    RECEIVED = "received"
    ADMITTED = "admitted"
    REJECTED = "rejected"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DONE = "done"
    PREALLOCATED = "preallocated"
    RECEIVING = "receiving"
    VERIFIED = "verified"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


S = RequestState
TERMINAL = frozenset({S.REJECTED, S.DONE, S.FINISHED, S.ABORTED})
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.RECEIVED: frozenset({S.ADMITTED, S.REJECTED}),
    S.ADMITTED: frozenset({S.PREFILLING, S.PREALLOCATED}),
    S.PREFILLING: frozenset({S.DECODING, S.TRANSFERRING, S.FINISHED}),
    S.TRANSFERRING: frozenset({S.DONE}),
    S.PREALLOCATED: frozenset({S.RECEIVING, S.VERIFIED}),
    S.RECEIVING: frozenset({S.VERIFIED}),
    S.VERIFIED: frozenset({S.DECODING, S.FINISHED}),
    S.DECODING: frozenset({S.FINISHED}),
}


class RequestMode(enum.Enum):
    """Which part of the lifecycle this engine runs for the request."""

    COLOCATED = "colocated"
    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"


# ------------------------------------------------------------------------------------ errors


class EngineError(Exception):
    """An error that ends one request. `code` is the OpenAI error code; `status` the HTTP status."""

    code = "internal_error"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    code = "invalid_value"  # what OpenAI answers for a value out of range (an id outside the vocabulary)
    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DuplicateRequestId(InvalidRequest):
    code = "duplicate_request_id"


class ContextLengthExceeded(EngineError):
    """S2: the request can never fit. `limit_kind` is `context_length` or `kv_pool`."""

    code = "context_length_exceeded"
    status = 400

    def __init__(self, *, prompt_tokens: int, max_tokens: int, limit: int, limit_kind: str) -> None:
        self.prompt_tokens, self.max_tokens, self.limit, self.limit_kind = prompt_tokens, max_tokens, limit, limit_kind
        what = "context length" if limit_kind == "context_length" else "KV pool capacity"
        super().__init__(
            f"This model's maximum {what} is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion."
        )


class TagViolation(EngineError):
    """S1: the request would read a KV page not written for it in the page's current generation."""

    code = "kv_tag_violation"
    status = 500


class KVNotWritten(EngineError):
    """S3: decode was asked to start although not every page it will read was written."""

    code = "kv_transfer_incomplete"
    status = 500


class StepFailed(EngineError):
    """The forward pass failed with this request in it, and again with it alone: it ends, the
    requests it shared the pass with do not (`Engine._run_isolating`)."""

    code = "engine_error"
    status = 500

    @classmethod
    def of(cls, exc: BaseException) -> StepFailed:
        return cls(f"the engine failed on this request ({type(exc).__name__})")


class RequestAborted(EngineError):
    code = "aborted"
    status = 499

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(f"request aborted: {cause}")


# ----------------------------------------------------------------------------------- request


@dataclass
class RequestOutput:
    """What happened to one request in one engine step: new tokens/text, a state change, the end."""

    request_id: str
    state: RequestState
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" on FINISHED
    error: EngineError | None = None  # set on ABORTED
    lease: Lease | None = None  # set on PREALLOCATED (where prefill must write) and TRANSFERRING (what to export)
    request: Request | None = field(default=None, repr=False, compare=False)  # whose output this is

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL or self.state == S.TRANSFERRING


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    mode: RequestMode = RequestMode.COLOCATED
    state: RequestState = RequestState.RECEIVED
    output_ids: list[int] = field(default_factory=list)
    emitted: list[str] = field(default_factory=list)  # text released so far (never a stop string)
    lease: Lease | None = None
    finish_reason: str | None = None
    error: EngineError | None = None
    generator: torch.Generator | None = None
    seed: int = 0  # the sampling seed (params.seed, or drawn from the engine's seed when None)
    end_token_ids: frozenset[int] = frozenset()  # tokens that finish it: stop_token_ids, and EOS unless ignore_eos
    logits_state: LogitsState | None = None  # penalty counts and bias, when the params change logits
    detokenizer: IncrementalDetokenizer | None = None
    stops: StopMatcher | None = None
    # The consumer's handle for this request's outputs (AsyncEngine: its RequestStream), so a step's
    # outputs reach their consumers without a second request-id map beside `Engine.requests`.
    sink: Any = field(default=None, repr=False)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def move_to(self, state: RequestState) -> None:
        """Transition; ABORTED from any non-terminal state, others only as TRANSITIONS allows."""
        allowed = state == S.ABORTED and self.state not in TERMINAL
        if not allowed and state not in TRANSITIONS.get(self.state, ()):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.state.name} -> {state.name}")
        self.state = state

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V exist or are being computed: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """The completion budget; None in the params is resolved at the engine's intake."""
        assert self.params.max_tokens is not None, "max_tokens is resolved at intake"
        return self.params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    @property
    def output_text(self) -> str:
        return "".join(self.emitted)
