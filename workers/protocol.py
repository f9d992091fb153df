"""Messages between the router and the prefill/decode workers (HTTP + JSON on the cluster network).

One request through the disaggregated engine, as the router drives it (docs/architecture.md). Every
call carries the router's ``X-Kvguard-Auth`` header (workers/control_auth.py); the request id is the
router's own unguessable internal id, never a client's:

1. router -> decode   ``POST /internal/decode`` with a :class:`GenerateRequest`. Decode runs its own
   intake check (S2), allocates the destination pages (PREALLOCATED), draws the transfer nonce and
   answers with a stream of newline-delimited JSON events: first a :class:`BootstrapEvent` (where
   and into which pages prefill must write, the nonce, decode's boot epoch), then, once every page
   was received and verified (S3), :class:`TokenEvent` s and one :class:`FinishEvent` -- or an
   :class:`ErrorEvent` at any point.
2. router -> prefill  ``POST /internal/prefill`` with a :class:`PrefillRequest`, sent together with
   step 1 (SGLang's router sends both at once too; its prefill then waits for decode's allocation
   before computing), so prefill computes while decode allocates, within its early budget
   (workers/prefill_server.py). Prefill runs its own intake check (S2) and computes the KV; it
   sends nothing and connects nowhere until it holds a verified transfer ticket (S9). Then it sends the KV where the ticket says over the checked
   transfer channel and answers with a :class:`PrefillResult`.
3. router -> prefill  ``POST /internal/ticket`` with a :class:`TicketDelivery` once decode's bootstrap
   arrived: the transfer ticket the router issued from it (workers/transfer/tickets.py). Prefill
   verifies it (403 ``invalid_ticket`` otherwise, and the request fails) and hands it to the
   request's job. A :class:`PrefillRequest` may instead carry the ticket itself (then prefill
   verifies it before computing anything, the pre-overlap protocol; tests use it).
4. router -> decode   ``POST /internal/stream`` (:class:`ChannelRequest`), once per router and decode
   worker, kept open: decode's token channel. Its first line is a :class:`ChannelOpened` naming the
   channel (an id decode drew); a :class:`DecodeRequest` that names it gets, after its bootstrap,
   every later event on the channel instead of its own stream, as :class:`ChannelEvent` lines --
   one write per engine step for every request on the channel, not one per request (issue 14). The
   request's own stream stays open until it ends: closing it still aborts it (S4), and a channel
   that closes ends every request on it on both sides.
5. router -> both     ``POST /internal/abort`` with an :class:`AbortRequest` whenever either leg
   fails or the client goes away (S4). Aborting an unknown or finished id is a no-op.

Every worker also serves ``GET /internal/info`` (:class:`WorkerInfo`) and ``GET /internal/health``;
``/metrics`` and ``/health`` are on its separate metrics listener. The router uses the info to
reject at intake what no worker on the path can hold.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


# Limits every worker enforces again (the router refuses past them first, naming the parameter):
# matching stays linear in the text generated (workers/stops.py), and what one request can make the
# engine thread do per token is bounded by these, not by what the client sent.
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs maximum)
MAX_LOGIT_BIAS = 1024  # entries
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


class SamplingParams(_Message):
    """How to pick a request's tokens: the one type from the router's wire into the engine.

    Defaults are OpenAI's (temperature 1, top_p 1, no penalties, no bias); top_k, min_p, min_tokens,
    repetition_penalty, stop_token_ids and ignore_eos are vLLM's extensions with vLLM's defaults.
    temperature 0 (or below SAMPLING_EPS) is greedy. `max_tokens` None means the rest of the context (the engine resolves it
    at intake; the router always sends a number). A seed makes sampling reproducible whatever else
    shares the batch and whether prefill and decode ran in one engine or two (workers/sampling.py).
    `logprobs` N: report each token's log-probability and the N most likely alternatives.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: tuple[StopString, ...] = Field((), max_length=MAX_STOP_STRINGS)
    stop_token_ids: tuple[TokenId, ...] = Field((), max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: tuple[tuple[TokenId, Bias], ...] = Field((), max_length=MAX_LOGIT_BIAS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        """Below SAMPLING_EPS, temperature is greedy (as in vLLM): dividing logits by 1e-239 would
        overflow to inf and make the distribution NaN."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before picking (then even greedy needs the full row)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


class TokenLogprob(_Message):
    """One generated token's log-probability under the model (raw logits, before temperature,
    penalties and bias -- vLLM's default) and its most likely alternatives, best first."""

    token_id: int
    logprob: float | None  # None: not known on this worker (decode's first token; see the router)
    top: tuple[tuple[int, float], ...] = ()


class GenerateRequest(_Message):
    request_id: str = Field(min_length=1, max_length=128, description="the router's internal id")
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    # An over-length request that the router let through only because the unsafe_reject_path fault
    # is on; healthy workers reject it like any other over-length request.
    over_length: bool = False


ChannelId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class DecodeRequest(GenerateRequest):
    """What the router sends decode: the request and, when it reads decode's token channel, which
    one (None: every event on this request's own stream)."""

    channel: ChannelId | None = None


class ChannelRequest(_Message):
    """Opens a token channel (``POST /internal/stream``); it carries nothing yet."""


class ChannelOpened(_Message):
    event: Literal["channel"] = "channel"
    channel: ChannelId


class Bootstrap(_Message):
    """Decode's grant for one request: where prefill must write, the pages and generations it
    allocated (S3, S5), and what the router binds into the ticket (S9)."""

    transfer_host: str = Field(min_length=1, max_length=253)
    transfer_port: int = Field(gt=0, lt=65536)
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    num_tokens: int = Field(ge=0, description="tokens of KV decode expects to receive")
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$", description="decode's fresh transfer nonce for this request")
    epoch: int = Field(ge=0, lt=1 << 64, description="decode's boot epoch")


# A ticket for a 1M-token context at page size 2 is ~8.4 MB, base64 ~11.2 MB.
MAX_TICKET_TEXT = 12 << 20


TicketText = Annotated[str, Field(min_length=1, max_length=MAX_TICKET_TEXT, description="the router's transfer ticket (base64url)")]


class PrefillRequest(GenerateRequest):
    ticket: TicketText | None = None  # None: it follows in a TicketDelivery


class TicketDelivery(_Message):
    """The ticket for a prefill that is already computing (step 3 above)."""

    request_id: str = Field(min_length=1, max_length=128)
    ticket: TicketText


class PrefillResult(_Message):
    request_id: str
    chunks: int
    bytes: int


class AbortRequest(_Message):
    request_id: str
    cause: str = Field("client_disconnect", max_length=64, pattern=r"^[a-z0-9_]+$")  # a metric label value


class BootstrapEvent(_Message):
    event: Literal["bootstrap"] = "bootstrap"
    bootstrap: Bootstrap


MAX_EVENT_TOKENS = 1024
"""The most tokens one token event carries: --stream-interval's bound. Outputs merged because an end
fell behind are split at it (token_channel.py, channel_reader.coalesce), so a line stays far below
the router's MAX_LINE_BYTES (1024 tokens with 20 logprob alternatives each is well under 1 MiB)."""


class TokenEvent(_Message):
    event: Literal["token"] = "token"
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asked


class FinishEvent(_Message):
    event: Literal["finish"] = "finish"
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int


class ErrorEvent(_Message):
    """A request-scoped failure. `status` is the HTTP status the client should see."""

    event: Literal["error"] = "error"
    status: int = 500
    code: str
    message: str


class HandoffEvent(_Message):
    """On a request's own stream: every later event of it comes on the token channel it named."""

    event: Literal["handoff"] = "handoff"


DecodeEvent = Annotated[
    BootstrapEvent | TokenEvent | FinishEvent | ErrorEvent | HandoffEvent, Field(discriminator="event")
]
DECODE_EVENT = TypeAdapter(DecodeEvent)

ChannelPayload = Annotated[TokenEvent | FinishEvent | ErrorEvent, Field(discriminator="event")]


class ChannelEvent(_Message):
    """One request's event on a token channel."""

    request_id: str
    event: ChannelPayload


CHANNEL_EVENT = TypeAdapter(ChannelEvent)


class WorkerInfo(_Message):
    role: Role
    model: str
    context_length: int
    kv_pool_tokens: int
    page_size: int
    transfer_host: str | None = None
    transfer_port: int | None = None
    vocab_size: int | None = None  # token ids the model knows; the router refuses others before any work
    instance: str | None = None  # this process's random id: the router signs its calls for it (workers/control_auth.py)
