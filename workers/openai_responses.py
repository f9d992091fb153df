"""The response bodies of the OpenAI-compatible API, whole and as SSE chunks, with logprobs.

Shapes follow OpenAI's schema: a completion choice has `text`, `logprobs` (null or `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and `finish_reason`; a chat choice has
`message: {role, content, refusal}`, `logprobs` (null or `{content: [{token, logprob, bytes,
top_logprobs}], refusal}`) and `finish_reason`. A token that is only part of a UTF-8 character is
shown as OpenAI shows it, `bytes:\\xe2\\x80`; chat logprobs carry its exact `bytes` too.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypedDict

from pydantic import BaseModel, Field

from kvguard.workers.openai_api import sse
from kvguard.workers.protocol import TokenLogprob

# Stands for the text in the one frame built per choice (ResponseBuilder.text_chunk_sse); only
# that frame is searched for it, never a model's text.
_SPLICE = "\x00kvguard-text\x00"
_SPLICE_JSON = json.dumps(_SPLICE).encode()

FinishReason = Literal["stop", "length"]


class Vocabulary(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def text_bytes(self, token_id: int) -> bytes: ...


def token_string(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# ----------------------------------------------------------------------------------- shapes


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# Chat logprobs are plain data, typed but never validated nor dumped by pydantic: one entry per
# token and alternative (16 choices x 1,000 tokens x 20 alternatives is 340,000), models of them
# took seconds of the router's loop to build and dump (outside probe). They go into the dumped body.
class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None  # a ChatLogprobs, put into the dumped body by ResponseBuilder (plain data)
    finish_reason: FinishReason


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None  # as ChatChoice's
    finish_reason: FinishReason | None


class _Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class Completion(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvguard"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------- logprobs


class LogprobShaper:
    """One choice's logprobs in OpenAI's shapes. Keeps the running text offset, counted in
    characters of the decoded token bytes (an incremental UTF-8 decoder: linear in the text); a
    special token the text leaves out (EOS under ignore_eos) is listed but adds no characters."""

    def __init__(self, vocab: Vocabulary, start_offset: int = 0) -> None:
        self.vocab = vocab
        self.offset = start_offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def completion(self, records: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for record in records:
            raw = self.vocab.token_bytes(record.token_id)
            token = token_string(raw)
            out.tokens.append(token)
            out.token_logprobs.append(record.logprob)
            # OpenAI: "the logprob of the sampled token is always returned", so up to N + 1 entries
            top = {token_string(self.vocab.token_bytes(t)): lp for t, lp in record.top}
            if record.logprob is not None:
                top.setdefault(token, record.logprob)
            out.top_logprobs.append(top)
            text = self.vocab.text_bytes(record.token_id)
            self.offset += self._abandoned_before(text)
            out.text_offset.append(self.offset)
            self.offset += len(self._utf8.decode(text))  # as the text has it
        return out

    def _abandoned_before(self, text: bytes) -> int:
        """The U+FFFD characters that an earlier token's unfinished UTF-8 bytes become, in front of
        this token's text, when this token does not continue them: they are that token's text, so
        this one starts after them (an outside probe: a stray byte, then '*', both at offset 4,
        while '*' was at 5). Taken off the count this token's decode adds."""
        pending, flag = self._utf8.getstate()
        if not pending or not text:
            return 0
        try:  # the pending bytes are a valid start of a character: does this token's first byte go on with it?
            codecs.getincrementaldecoder("utf-8")().decode(pending + text[:1])
            return 0
        except UnicodeDecodeError:
            pass
        abandoned = len(pending.decode("utf-8", errors="replace"))
        self._utf8.setstate((b"", flag))  # those characters are counted here, not in this token's decode
        return abandoned

    def chat(self, records: Sequence[TokenLogprob]) -> ChatLogprobs:
        token_bytes = self.vocab.token_bytes
        content: list[ChatTokenLogprob] = []
        for record in records:
            raw = token_bytes(record.token_id)
            top: list[TopLogprob] = [{"token": token_string(b), "logprob": lp, "bytes": list(b)}
                                     for b, lp in ((token_bytes(t), lp) for t, lp in record.top)]  # fmt: skip
            content.append({"token": token_string(raw), "logprob": record.logprob, "bytes": list(raw), "top_logprobs": top})
        return {"content": content, "refusal": None}


# ---------------------------------------------------------------------------------- builders


@dataclass
class ChoiceResult:
    """One finished choice of a whole (non-streamed) response."""

    index: int
    text: str
    finish_reason: FinishReason
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


class ResponseBuilder:
    """Shapes one request's choices as a completion or a chat completion, whole or as SSE chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, vocab: Vocabulary, *, logprobs: bool,
                 echo: Sequence[str] = (), include_usage: bool = False) -> None:
        self.request_id, self.model, self.chat, self.vocab = request_id, model, chat, vocab
        self.logprobs = logprobs
        # stream_options.include_usage: OpenAI sends `"usage": null` on every chunk but the last.
        self._chunk_exclude: set[str] = set() if include_usage else {"usage"}
        self.echo = list(echo)  # per choice: the prompt text shown before the completion
        self.created = int(time.time())
        self._shapers: dict[int, LogprobShaper] = {}
        self._text_frames: dict[int, tuple[bytes, bytes]] = {}  # per choice: a text chunk's SSE bytes around its text

    def _envelope(self) -> dict[str, object]:
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def _echo(self, index: int) -> str:
        return self.echo[index] if index < len(self.echo) else ""

    def _shaper(self, index: int) -> LogprobShaper:
        if index not in self._shapers:
            self._shapers[index] = LogprobShaper(self.vocab, start_offset=len(self._echo(index)))
        return self._shapers[index]

    def whole(self, choices: Sequence[ChoiceResult], prompt_tokens: int) -> dict[str, object]:
        body = self._whole_head(choices, prompt_tokens)
        body["choices"] = [self._whole_choice(c) for c in sorted(choices, key=lambda c: c.index)]
        return body

    def whole_json(self, choices: Sequence[ChoiceResult], prompt_tokens: int, encode: Callable[[object], str]) -> str:
        """`whole`'s JSON text (as `encode` writes it), a choice built and encoded at a time. A
        whole answer of logprobs is about a million small dicts and lists (n: 16, top_logprobs:
        20, 1,000 tokens each); built at once, every full collection of the garbage collector
        walked them all holding the GIL, 0.1-0.4 s each, and every tenant's event loop stopped
        (an outside probe). One choice's objects at a time are a sixteenth of that, freed at once."""
        encoded = [encode(self._whole_choice(c)) for c in sorted(choices, key=lambda c: c.index)]
        head = encode({**self._whole_head(choices, prompt_tokens), "choices": []})
        # The one top-level key: inside a JSON string a quote is escaped, so this text is that key.
        cut = head.index('"choices": []') + len('"choices": [')
        return "".join((head[:cut], ", ".join(encoded), head[cut:]))

    def _whole_head(self, choices: Sequence[ChoiceResult], prompt_tokens: int) -> dict[str, object]:
        """The whole answer's fields but its choices, in their order."""
        usage = Usage.of(prompt_tokens, sum(c.completion_tokens for c in choices))
        kind = ChatCompletion if self.chat else Completion
        return kind(**self._envelope(), choices=[], usage=usage).model_dump(mode="json")

    def _whole_choice(self, c: ChoiceResult) -> dict[str, object]:
        if self.chat:
            dumped = ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason
                                ).model_dump(mode="json")  # fmt: skip
            if self.logprobs:
                dumped["logprobs"] = self._shaper(c.index).chat(c.logprobs)
            return dumped
        return CompletionChoice(index=c.index, text=self._echo(c.index) + c.text, finish_reason=c.finish_reason,
                                logprobs=self._shaper(c.index).completion(c.logprobs) if self.logprobs else None,
                                ).model_dump(mode="json")  # fmt: skip

    def chunk(self, index: int, text: str, records: Sequence[TokenLogprob] = (), finish_reason: FinishReason | None = None,
              first: bool = False) -> dict[str, object]:
        """One SSE chunk of choice `index`. `first`: its first chunk, which for completions carries
        the echoed prompt before the text (chat's role went out in `opening_sse`)."""
        if self.chat:  # (its role went out in the stream's opening)
            delta = ChatDelta(content=text if text or not finish_reason else None)
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
            body = ChatCompletionChunk(**self._envelope(), choices=[choice]).model_dump(mode="json", exclude=self._chunk_exclude)
            body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
            if self.logprobs and records:
                body["choices"][0]["logprobs"] = self._shaper(index).chat(records)
            return body
        shown = (self._echo(index) if first else "") + text
        completion_logprobs = self._shaper(index).completion(records) if self.logprobs and records else None
        choice_c = CompletionChoice(index=index, text=shown, logprobs=completion_logprobs, finish_reason=finish_reason)
        return Completion(**self._envelope(), choices=[choice_c]).model_dump(mode="json", exclude=self._chunk_exclude)

    def opening_sse(self, indices: Sequence[int]) -> bytes:
        """A chat stream's first events: a chunk per choice, in index order, carrying only the
        role and empty content, before any token (as OpenAI and vLLM open one). The official
        client's stream helper builds a choice's snapshot from the first chunk it hears of it
        and finds it by position: choices first heard out of order (whichever's first token came
        first) raised IndexError there, and logprobs in a choice's first chunk were counted twice
        (an outside probe). Completions streams have no opening."""
        if not self.chat:
            return b""
        frames = []
        for index in sorted(indices):
            choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""), finish_reason=None)
            body = ChatCompletionChunk(**self._envelope(), choices=[choice]).model_dump(mode="json", exclude=self._chunk_exclude)
            body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            frames.append(sse(body))
        return b"".join(frames)

    def text_chunk_sse(self, index: int, text: str, records: Sequence[TokenLogprob] = (), first: bool = False) -> bytes:
        """`sse(chunk(index, text, records, first=first))`, byte for byte. Every chunk after a
        choice's first one that carries only text differs from the others in its text alone, so
        it is spliced into the choice's frame instead of building and dumping the models anew (the
        router writes one per decode step per request).

        b"" (nothing to send) for a chunk that would carry nothing: no text (a token that ended
        partway through a UTF-8 character: its bytes go out with the character's last token), no
        logprobs, no echo. OpenAI sends empty content only in a chat stream's opening chunk."""
        if not text and not (self.logprobs and records) and not (first and not self.chat and self._echo(index)):
            return b""
        if (first and not self.chat) or (self.logprobs and records):  # (a chat chunk's `first` changes nothing)
            return sse(self.chunk(index, text, records, first=first))
        frame = self._text_frames.get(index)
        if frame is None:
            whole = sse(self.chunk(index, _SPLICE))
            at = whole.index(_SPLICE_JSON)
            frame = self._text_frames[index] = (whole[:at], whole[at + len(_SPLICE_JSON):])
        return frame[0] + json.dumps(text).encode() + frame[1]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
        usage = Usage.of(prompt_tokens, completion_tokens).model_dump()
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        # system_fingerprint as every other chunk has it (null), in the same place (_Envelope's fields)
        return {**self._envelope(), "system_fingerprint": None, "object": kind, "choices": [], "usage": usage}
