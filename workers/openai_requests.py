"""The request bodies of /v1/completions and /v1/chat/completions, as strict as OpenAI's schema.

Every parameter of OpenAI's completions and chat completions APIs, and the vLLM extensions clients
commonly send, is either implemented or refused with a 400 naming it; nothing is silently ignored.
An unknown parameter is refused as OpenAI refuses it ("Unrecognized request argument supplied").
Types are strict, as the schema has them: `"stream": "yes"`, `"max_tokens": "5"` or `true` are 400s,
and `model` is required and not empty (OpenAI: "you must provide a model parameter"). The table of what is
implemented and what is refused is in docs/openai-api.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from kvguard.workers.tokenizer import ChatTemplateOptions

MAX_MESSAGES = 4096  # a conversation longer than this is refused: each message is template work, even empty
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's schema for the completions API
MAX_CHAT_TOP_LOGPROBS = 20
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical ASCII decimal: "03" and "٣" would alias "3"
MAX_TEMPLATE_KWARGS = 32
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# What the server passes the chat template itself (tokenizer.render_chat), and the names vLLM's
# own arguments take: chat_template_kwargs may not shadow them.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now",
    # jinja's own globals and loop variable: shadowed, a template using them breaks (a review)
    "range", "dict", "namespace", "cycler", "joiner", "lipsum", "loop",
})  # fmt: skip
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_TEMPLATE_KWARGS_DEPTH = 8
"""A template may write a variable far larger than it was sent (tojson with indent: 0.3 MB of
nested lists became 52 MB of prompt, a review); template switches and tool lists are small and flat."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default (OpenAI, vLLM, SGLang); chat's is the rest of the context

# fail_fast: the first bad id names the field; a million bad ones must not each be itemized.
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(fail_fast=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's extension: known, refused when asked for


class PromptCacheOptions(_Strict):
    """A caching hint (accepted, changes no output): `mode` as OpenAI's schema has it; `ttl` a
    lifetime such as OpenAI's one value today, 30m."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Annotated[str, Field(pattern=r"^[1-9][0-9]{0,3}[mh]$")] | None = None


def _wrong_type(message: str) -> PydanticCustomError:
    """A value of the wrong JSON type: its error kind ends in `_type`, so the 400's code is
    `invalid_type` (openai_api._validation_code), as OpenAI answers it; a plain ValueError is
    `invalid_value`, which is for a value of the right type that is not allowed."""
    return PydanticCustomError("json_type", "{message}", {"message": message})


def _too_many(what: str, limit: int, got: int) -> PydanticCustomError:
    """An array (or an object's entries) over its length limit: `array_above_max_length`, as
    pydantic's own max_length errors and OpenAI's answer for a too-long array."""
    return PydanticCustomError("array_above_max_length", "at most {limit} {what}, got {got}",
                               {"limit": limit, "what": what, "got": got})  # fmt: skip


def _refuse(param: str, why: str) -> OpenAIError:
    return OpenAIError(400, f"{param} is not supported by this server: {why}", code="unsupported_parameter", param=param)


# param -> (the values that ask for nothing, why anything else is refused)
Refusal = tuple[Callable[[Any], bool], str]


def _unset(value: Any) -> bool:
    return value is None


def _is(*asking_nothing: object) -> Callable[[Any], bool]:
    """Fine when unset or one of `asking_nothing` (compared by type too: `1` is not `True`)."""
    return lambda value: value is None or any(type(value) is type(v) and value == v for v in asking_nothing)


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


# vLLM's extensions that this server does not implement, or implements only as vLLM's default:
# accepted with the value that asks for nothing (clients send vLLM's defaults explicitly, and were
# refused as unknown: an outside probe), refused naming them otherwise.
VLLM_REFUSED: dict[str, Refusal] = {
    "skip_special_tokens": (_is(True), "special tokens' text is always left out of the output"),
    "include_stop_str_in_output": (_is(False), "the text ends before the stop string"),
    "truncate_prompt_tokens": (_unset, "prompts are refused, not truncated, when they do not fit"),
    "prompt_logprobs": (_unset, "the prompt's logprobs are not computed"),
    "priority": (_is(0), "requests are served in arrival order"),
    "return_tokens_as_token_ids": (_is(False), "logprobs name tokens by their text"),
    "return_token_ids": (_is(False), "answers carry text, not token ids"),
    "use_beam_search": (_is(False), "beam search is not implemented"),
    "length_penalty": (_is(1.0), "beam search is not implemented"),
    "allowed_token_ids": (_unset, "not implemented: use logit_bias"),
    "bad_words": (lambda v: not v, "not implemented: use logit_bias"),
    "logits_processors": (_unset, "custom logits processors are not implemented"),
    **{name: (_unset, "structured outputs are not implemented") for name in (
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern")},
    "kv_transfer_params": (_unset, "the router runs prefill and decode itself"),
    "mm_processor_kwargs": (_unset, "the model reads text only"),
    "vllm_xargs": (_unset, "no extra engine arguments are read"),
}


class _Request(_Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1)  # at most the router's max_choices (prompts x n), which it says
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user label for abuse tracking: accepted, changes no output
    # vLLM's extensions, with vLLM's meaning
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: TokenIds | None = None
    # vLLM's extensions accepted with their defaults only (VLLM_REFUSED); typed as vLLM types them.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None  # either: it matters only when special tokens are output
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    priority: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    logits_processors: JsonValue = None
    structured_outputs: JsonValue = None
    guided_json: JsonValue = None
    guided_regex: JsonValue = None
    guided_choice: JsonValue = None
    guided_grammar: JsonValue = None
    guided_decoding_backend: JsonValue = None
    guided_whitespace_pattern: JsonValue = None
    kv_transfer_params: JsonValue = None
    mm_processor_kwargs: JsonValue = None
    vllm_xargs: JsonValue = None
    cache_salt: str | None = None  # vLLM's prefix-cache salt: accepted, no KV is shared between requests here
    # vLLM's request id: accepted and not used, never the router's id for the request (S9).
    request_id: str | None = Field(None, max_length=128)

    REFUSED: ClassVar[dict[str, Refusal]] = {}  # per endpoint: known parameters this server does not implement

    @field_validator("model")
    @classmethod
    def _model_given(cls, model: str) -> str:
        """`"model": ""` names no model: a 400 saying one is required (OpenAI's answer), not a 404
        for a model called ''."""
        if not model:
            raise PydanticCustomError("model_empty", "you must provide a model parameter")
        return model

    @field_validator("stop", mode="plain")
    @classmethod
    def _stops(cls, stop: Any) -> str | list[str] | None:
        if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        ):
            raise _wrong_type("must be a string or a list of strings")
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise _too_many("stop sequences", MAX_STOP_STRINGS, len(stops))
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence is at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise _too_many("entries", MAX_LOGIT_BIAS, len(bias))
        for key, value in bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**31:
                raise ValueError(f"keys are token ids (decimal strings without leading zeros), got {key[:40]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias values are in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise _too_many("stop token ids", MAX_STOP_TOKEN_IDS, len(ids))
        return ids

    # -- after validation ---------------------------------------------------------------------
    def check_supported(self) -> None:
        """400 naming the first parameter that asks for something this server does not do."""
        for param, (fine, why) in self.REFUSED.items():
            if not fine(getattr(self, param)):
                raise _refuse(param, why)
        if self.stream_options is not None:
            if not self.stream:
                raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
            if self.stream_options.include_obfuscation:
                raise _refuse("stream_options.include_obfuscation", "stream chunks are not padded")
            if self.stream_options.continuous_usage_stats:
                raise _refuse("stream_options.continuous_usage_stats", "usage comes once, in the last chunk (include_usage)")
        budget = self.completion_budget()
        if self.min_tokens and budget is not None and self.min_tokens > budget:  # vLLM refuses it too
            raise OpenAIError(400, f"min_tokens ({self.min_tokens}) must be at most {self.budget_param()} ({budget})",
                              param="min_tokens", code="invalid_value")  # fmt: skip

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def completion_budget(self) -> int | None:
        """max_tokens as asked; None means the rest of the context (chat's default in OpenAI and vLLM)."""
        return self.max_tokens

    def budget_param(self) -> str:
        """The parameter `completion_budget` came from, for messages."""
        return "max_tokens"

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token the client wants with logprobs; None: no logprobs."""
        return None

    def sampling(self) -> SamplingParams:
        """The engine's parameters (max_tokens left to the router's intake, seed to each choice)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=self.completion_budget(),
            min_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),  # vLLM: -1 (or 0) disables top-k
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            logprobs=self.logprobs_wanted(),
        )


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Request):
    prompt: JsonValue
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)  # only = n (below)
    suffix: str | None = None

    add_special_tokens: bool | None = None  # vLLM: the tokenizer's BOS before a text prompt (default true)
    response_format: JsonValue = None  # vLLM's completions take it too
    prompt_embeds: JsonValue = None  # vLLM: embeddings in place of a prompt

    REFUSED: ClassVar[dict[str, Refusal]] = {
        "suffix": (lambda v: not v, "insertion (fill-in-the-middle) is not implemented"),
        **VLLM_REFUSED,
        "response_format": (_text_format, "only {\"type\": \"text\"}: JSON mode and structured outputs are not implemented"),
        "prompt_embeds": (_unset, "prompts are text or token ids"),
    }

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, prompt: Any) -> PromptInput:
        """A string, a token-id list, or a batch of either (OpenAI's four shapes), each non-empty."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list):
            raise _wrong_type("must be a string, a list of strings, a list of token ids or a list of token-id lists")
        if not prompt:
            raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_token_id(t) for t in prompt):
            return prompt
        if all(isinstance(p, list) for p in prompt):
            for i, ids in enumerate(prompt):
                if not ids:
                    raise ValueError(f"prompt {i} is an empty token list")
                if not all(_is_token_id(t) for t in ids):
                    if not all(type(t) is int for t in ids):
                        raise _wrong_type(f"prompt {i}: token ids are integers")
                    raise ValueError(f"prompt {i}: token ids are integers in [0, 2**31)")
            return prompt
        if all(type(t) is int for t in prompt):  # the right type, out of range
            raise ValueError("token ids are integers in [0, 2**31)")
        raise _wrong_type("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise _refuse("best_of", "ranking best_of candidates is not implemented; use n")
        if self.echo and self.logprobs is not None:
            raise _refuse("echo", "echo with logprobs needs the prompt's logprobs, which are not computed")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        assert isinstance(prompt, list)
        if all(isinstance(p, str | list) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def completion_budget(self) -> int | None:
        """max_tokens as asked, else 16: OpenAI's legacy completions default (vLLM's and SGLang's too).
        It used to be the rest of the context, as chat's: a client that left max_tokens out got
        thousands of tokens per choice where every other server gives 16."""
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS


def _depth(value: JsonValue) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**31


MessageRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Strict):
    role: MessageRole
    content: JsonValue = None
    name: str | None = None
    tool_calls: JsonValue = None
    tool_call_id: JsonValue = None
    function_call: JsonValue = None
    refusal: JsonValue = None
    audio: JsonValue = None
    annotations: JsonValue = None  # response-only (url citations); the official client's model_dump() sends it as null

    @field_validator("role", mode="before")
    @classmethod
    def _role_is_a_string(cls, role: Any) -> Any:
        """`"role": 5` is a type error (invalid_type); a string that is no role is invalid_value."""
        if not isinstance(role, str):
            raise _wrong_type("must be a string")
        if role not in get_args(MessageRole):  # pydantic's own message listed 'tool' and 'function' as
            # choices, which are then refused (unsupported_parameter): name the roles served
            raise PydanticCustomError("literal_error", "must be 'system', 'developer', 'user' or 'assistant' "
                                      "('tool' and 'function' turns need tool calling, which is not implemented)")
        return role

    @field_validator("content", mode="plain")
    @classmethod
    def _text_only(cls, content: Any) -> str | list[dict[str, str]] | None:
        """A string, or a list of text parts (the only kind of part this model reads). None is
        left to `_messages_supported`: an assistant turn with tool_calls has null content, and the
        tool calls are what to name."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise _wrong_type("must be a string or a list of content parts")
        if not content:
            raise PydanticCustomError("empty_array", "empty array: expected at least one content part")
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _wrong_type(f"part {i} must be an object with a string type")
            if part["type"] != "text":  # a feature this server lacks (images, audio), named as such
                raise PydanticCustomError("unsupported_parameter", "part {i} is of type {kind}: only text parts are supported",
                                          {"i": i, "kind": repr(part["type"][:40])})  # fmt: skip
            if "text" in part and not isinstance(part["text"], str):
                raise _wrong_type(f"part {i}: text must be a string")
            # cache_control: a caching hint (Anthropic's, sent through LiteLLM-style clients) that
            # changes no output, accepted as prompt_cache_key is.
            if set(part) - {"cache_control"} != {"type", "text"}:
                raise ValueError(f"part {i}: a text part is {{\"type\": \"text\", \"text\": string}}")
        return content

    def text(self) -> str:
        if self.content is None:  # an assistant turn without content (OpenAI's schema allows it): rendered empty
            return ""
        if isinstance(self.content, str):
            return self.content
        assert isinstance(self.content, list)
        # One text, its parts a line apart: vLLM's rendering of text parts for string templates.
        return "\n".join(str(part["text"]) for part in self.content if isinstance(part, dict))

    def template_bytes(self) -> int:
        """The UTF-8 size of the text the template sees from this message: its content and its
        name, which a template may render too (outside probe: a 7 MB name was tokenized on the
        router's loop for 28 s before the context check refused it)."""
        return len(self.text().encode()) + (len(self.name.encode()) if self.name is not None else 0)

    def template_fields(self) -> dict[str, str]:
        """What the chat template sees. `developer` is OpenAI's newer name for `system`."""
        fields = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            fields["name"] = self.name
        return fields


def _messages_supported(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.role in ("tool", "function"):
            raise _refuse(f"messages[{i}].role", "tools and function calling are not implemented")
        for field in ("tool_calls", "tool_call_id", "function_call", "audio", "refusal"):
            # `tool_calls: []` is no tool call (clients replaying a conversation send it; vLLM accepts it)
            if getattr(message, field) not in (None, [] if field == "tool_calls" else None):
                raise _refuse(f"messages[{i}].{field}", "only text messages are supported")
        if message.annotations not in (None, []):  # an assistant turn passed back as the client dumps it has null
            raise _refuse(f"messages[{i}].annotations", "annotations (url citations) are response-only and not read back")
        if message.content is None and message.role != "assistant":  # an assistant's may be null (vLLM: empty)
            raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content", code="missing_required_parameter")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: JsonValue = None
    # Typed as OpenAI's schema has them, so a wrong type is a 400 invalid_type and the refusals
    # below see only well-typed values (`"tools": 0` passed `not v` once).
    tools: list[JsonValue] | None = None
    tool_choice: JsonValue = None  # a string or an object (`_string_or_object`)
    functions: list[JsonValue] | None = None
    function_call: JsonValue = None  # a string or an object
    parallel_tool_calls: StrictBool | None = None  # strict: "no" is a type error, not False
    audio: JsonValue = None
    modalities: JsonValue = None
    prediction: JsonValue = None
    reasoning_effort: JsonValue = None
    web_search_options: JsonValue = None
    verbosity: JsonValue = None
    store: bool | None = None
    metadata: JsonValue = None
    service_tier: JsonValue = None
    prompt_cache_key: str | None = None  # a caching hint: accepted, changes no output
    # Caching hints too (the openai client sends them when a user sets them), typed as OpenAI's schema.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None  # an end-user label, like `user`
    moderation: JsonValue = None  # asks the server to score or block content: refused, never silently skipped
    # vLLM's chat extensions. The template's own switches are implemented (add_generation_prompt,
    # chat_template_kwargs such as Qwen3's enable_thinking); the rest only with vLLM's default.
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, JsonValue] | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # vLLM: false for chat (the template places them)
    chat_template: str | None = None
    documents: JsonValue = None
    echo: bool | None = None
    structural_tag: JsonValue = None
    include_reasoning: bool | None = None  # either: this server has no reasoning parser, so nothing to include or leave out

    @field_validator("messages")
    @classmethod
    def _at_least_one(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:  # OpenAI's code for it (pydantic's min_length said array_below_min_length)
            raise PydanticCustomError("empty_array", "empty array: expected at least one message")
        return messages

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        """Variables for the model's chat template: named as a template names them, never one the
        server sets itself (the messages, the generation prompt switch, special tokens, helpers)."""
        if kwargs is None:
            return None
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise _too_many("chat template variables", MAX_TEMPLATE_KWARGS, len(kwargs))
        for name in kwargs:
            if not _TEMPLATE_NAME.fullmatch(name):
                raise ValueError(f"{name[:64]!r} is not a template variable name (letters, digits, _; at most 64)")
            if name in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"{name!r} is set by the server, not by chat_template_kwargs")
        if len(json.dumps(kwargs, ensure_ascii=False).encode()) > MAX_TEMPLATE_KWARGS_BYTES:  # UTF-8, not \u escapes
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON")
        if _depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
            raise ValueError(f"nested at most {MAX_TEMPLATE_KWARGS_DEPTH} deep")
        return kwargs

    @field_validator("tool_choice", "function_call", mode="plain")
    @classmethod
    def _string_or_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | dict):
            raise PydanticCustomError("string_or_object_type", "must be a string or an object")
        return value

    REFUSED: ClassVar[dict[str, Refusal]] = {
        "response_format": (_text_format, "only {\"type\": \"text\"}: JSON mode and structured outputs are not implemented"),
        "tools": (lambda v: not v, "tools and function calling are not implemented"),
        "tool_choice": (lambda v: v in (None, "none"), "tools and function calling are not implemented"),
        "functions": (lambda v: not v, "tools and function calling are not implemented"),
        "function_call": (lambda v: v in (None, "none"), "tools and function calling are not implemented"),
        # false asks for nothing (no tools, so no parallel calls); clients such as LangChain send it.
        "parallel_tool_calls": (lambda v: v in (None, False), "tools and function calling are not implemented"),
        "audio": (_unset, "audio output is not implemented"),
        "modalities": (lambda v: v in (None, ["text"]), "only text output"),
        "prediction": (_unset, "predicted outputs are not implemented"),
        "reasoning_effort": (_unset, "this is not a reasoning model"),
        "web_search_options": (_unset, "web search is not implemented"),
        "verbosity": (_unset, "not implemented"),
        "store": (lambda v: v in (None, False), "completions are not stored"),
        "metadata": (_unset, "completions are not stored"),
        "service_tier": (lambda v: v in (None, "auto", "default"), "there is one service tier"),
        "moderation": (_unset, "moderation is not implemented"),
        **VLLM_REFUSED,
        "continue_final_message": (_is(False), "the reply starts a new assistant turn"),
        "add_special_tokens": (_is(False), "the chat template places the special tokens"),
        "chat_template": (_unset, "the model's own chat template is used"),
        "documents": (_unset, "the model's own chat template is used, without documents"),
        "echo": (_is(False), "the reply does not repeat the conversation"),
        "structural_tag": (_unset, "structured outputs are not implemented"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        _messages_supported(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")

    def completion_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def budget_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [m.template_fields() for m in self.messages]

    def template_variables_bytes(self) -> int:
        """The size of chat_template_kwargs, which a template may render: work to count when
        deciding whether to render off the event loop."""
        return len(json.dumps(self.chat_template_kwargs)) if self.chat_template_kwargs else 0

    def template_options(self) -> ChatTemplateOptions:
        return ChatTemplateOptions(
            add_generation_prompt=self.add_generation_prompt is not False, variables=self.chat_template_kwargs or {}
        )


APIRequest = CompletionRequest | ChatCompletionRequest


def request_too_large(param: str, size: int, limit: int, context_length: int) -> OpenAIError:
    """Refused before tokenizing: no text this long can fit the context."""
    return OpenAIError(
        400,
        f"{param}: {size} bytes of text, more than the {limit} bytes that can fit this model's context of "
        f"{context_length} tokens. Please reduce the length of the {param}.",
        code="context_length_exceeded",
        param=param,
    )

