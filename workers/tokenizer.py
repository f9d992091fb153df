"""Hugging Face `tokenizers` wrapper: encode, decode, incremental detokenization, chat template.

The chat template (`tokenizer_config.json` -> `chat_template`) is rendered with jinja2 in a
sandbox, as transformers does; jinja2 comes with torch, so it adds no dependency.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        # What transformers' apply_chat_template passes a template besides the messages: every
        # special token the config names (a template may write `pad_token` or `unk_token`).
        self._template_tokens: dict[str, str | list[str]] = {key: _token_text(config.get(key)) or "" for key in _SPECIAL_TOKEN_KEYS}
        self._template_tokens["additional_special_tokens"] = [
            text for text in map(_token_text, config.get("additional_special_tokens") or []) if text
        ]  # fmt: skip
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special = frozenset(i for i, t in added.items() if t.special)  # decode() leaves them out of text
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> Tokenizer | None:
        """The folder's tokenizer, or None if it has no `tokenizer.json`."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(HFTokenizer.from_file(str(path)), config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs report them; a byte-level token may be part of
        a UTF-8 character). Empty for an id the tokenizer does not know."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._lookup_bytes(token_id)
        return cached

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to a completion's text: none for a special token (EOS sampled
        under ignore_eos), which `decode` leaves out of the text though logprobs name it."""
        return b"" if token_id in self._special else self.token_bytes(token_id)

    def _lookup_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        if match := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode()  # sentencepiece's word-start marker

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest text any one token covers, in UTF-8 bytes: a prompt longer than
        context_length times this cannot fit the context, so it is refused before tokenizing."""
        return max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1) or 1

    def render_chat(self, messages: list[dict[str, str]], options: ChatTemplateOptions | None = None) -> str:
        """The prompt text for chat `messages` ([{role, content}]) under the model's template."""
        options = options or ChatTemplateOptions()
        # The request's variables first, so that the server's own names win (the request model
        # refuses those names already: openai_requests.RESERVED_TEMPLATE_NAMES).
        variables = {
            **options.variables, **self._template_tokens, "messages": messages,
            "add_generation_prompt": options.add_generation_prompt,
        }  # fmt: skip
        if options.max_chars is None:
            return self._chat_template.render(variables)
        return _joined_within(self._chat_template.generate(variables), options.max_chars)

    @cached_property
    def _chat_template(self) -> Any:
        """The chat template, compiled once (it was compiled again for every chat request)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment transformers renders templates in (chat_template_utils): loop controls
        # and its {% generation %} block (a template using either was a 400 for every chat), a
        # tojson that neither escapes HTML nor sorts keys (jinja's turned '<' into '\u003c': the
        # model got another prompt, outside probe), raise_exception, to refuse a conversation in
        # the template's own words, and strftime_now for today's date.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_block()])  # fmt: skip
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_template_error, strftime_now=_strftime_now)
        return env.from_string(self.chat_template)

    def encode_chat(self, messages: list[dict[str, str]], options: ChatTemplateOptions | None = None) -> list[int]:
        """Token ids of the rendered chat prompt (the template places special tokens itself)."""
        return self.encode(self.render_chat(messages, options), add_special_tokens=False)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """What a chat request sets of its template's rendering (vLLM's extensions): whether the
    template opens the assistant's turn, and variables a template reads (Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    variables: Mapping[str, Any] = field(default_factory=dict)
    max_chars: int | None = None
    """Rendering stops with PromptTooLong past this many characters (None: no bound). The request's
    variables are rendered as the template writes them, not as sent: Llama 3.1's template writes
    its `custom_tools` with tojson(indent=4), and 0.3 MB of nested lists became 52 MB of prompt
    text, rendered and then tokenized before the context refused it (a review)."""


class PromptTooLong(ValueError):
    """The rendered chat prompt passed `ChatTemplateOptions.max_chars`: it cannot fit the context."""

    def __init__(self, at_least: int, max_chars: int) -> None:
        super().__init__(f"the rendered prompt is over {max_chars} characters")
        self.at_least, self.max_chars = at_least, max_chars


def _joined_within(pieces: Iterator[str], max_chars: int) -> str:
    """The template's output pieces joined, or PromptTooLong once they pass `max_chars` (the rest is
    never rendered)."""
    kept, total = [], 0
    for piece in pieces:
        total += len(piece)
        if total > max_chars:
            raise PromptTooLong(total, max_chars)
        kept.append(piece)
    return "".join(kept)


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _generation_block() -> type:
    """transformers' {% generation %}...{% endgeneration %} (it marks the assistant's tokens for
    training masks): rendered as its body, as transformers renders it when nothing is tracked."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.parser import Parser

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


def _raise_template_error(message: str) -> NoReturn:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        return value.get("content")
    return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}

# A UTF-8 character is at most 4 bytes: a slice of more tokens than this that still ends mid-character
# is a run of tokens that each end mid-character (byte-level vocabularies split CJK so), released a
# character at a time from then on (`IncrementalDetokenizer`).
MAX_HELD_TOKENS = 8
PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
# The longest slice decoded again on each token during such a run: per-token work stays bounded.
# Only past this many tokens in a row, each ending mid-character, does U+FFFD reach the output.
MAX_WINDOW_TOKENS = 256


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8
    sequences (byte-level tokens) until they decode cleanly, as vLLM does, with each token's work
    bounded whatever the model generates: the slice decoded again on each token is the last
    release's tokens (context) and those since. Past MAX_HELD_TOKENS tokens without a clean end,
    the complete characters go out and the incomplete tail stays held, so text straddling every
    token boundary comes out right (outside probe: releasing the tail as U+FFFD lost a valid
    character for good, and stop strings across it were missed); past MAX_WINDOW_TOKENS such
    tokens the tail is released as the tokenizer decodes it. The last token (`final`) releases
    whatever is held, as the tokenizer decodes it (U+FFFD for bytes that never completed a
    character): the text of a finished completion is the decode of its tokens, as in vLLM."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        # The prompt's last tokens are the first slice's context, as vLLM seeds its detokenizer: a
        # decoder that strips the text's leading space (SentencePiece's Strip, Metaspace) then
        # keeps the first generated token's (' hello', not 'hello': outside probe), as the decode
        # of prompt and completion together has it. Their text is the prompt's, never output.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS - 2 :]) if prompt_ids else []
        self._read = len(self._ids)  # the text of ids[prefix:read] has gone out, but its last `_withheld` characters
        self._prefix = max(self._read - PROMPT_CONTEXT_TOKENS, 0)  # the decoded slice starts here
        self._withheld = 0

    def finish(self) -> str:
        """What is held, released as the tokenizer decodes it, without a new token: the request
        ended on a token whose own text is not part of the output (a stop token, as in vLLM)."""
        return self._release(force=True)

    def push(self, token_id: int, final: bool = False) -> str:
        self._ids.append(token_id)
        return self._release(force=final)

    def _release(self, force: bool) -> str:
        """The text the ids not yet output add, once it decodes cleanly or `force` (the last
        token); past MAX_HELD_TOKENS its complete characters; else nothing yet."""
        sent = len(self._tok.decode(self._ids[self._prefix : self._read])) - self._withheld
        new_text = self._tok.decode(self._ids[self._prefix :])
        window = len(self._ids) - self._prefix
        clean = not new_text.endswith("\ufffd")
        if force or (clean and (len(new_text) > sent or window > MAX_HELD_TOKENS)) or window > MAX_WINDOW_TOKENS:
            self._prefix, self._read, self._withheld = self._read, len(self._ids), 0
            return new_text[sent:]
        if window > MAX_HELD_TOKENS:  # the slice stays where it starts: the held tail completes in it
            # Never back past what went out (text sent may itself end in U+FFFD: a real one, or a
            # context token that began mid-character), or it would go out twice (review).
            ready = max(len(new_text.rstrip("\ufffd")), sent)
            self._read, self._withheld = len(self._ids), len(new_text) - ready
            return new_text[sent:ready]
        return ""
