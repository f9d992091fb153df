"""Hugging Face `tokenizers` wrapper: encode, decode, incremental detokenization, chat template.

The chat template (`tokenizer_config.json` -> `chat_template`) is rendered with jinja2 in a
sandbox, as transformers does; jinja2 comes with torch, so it adds no dependency.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

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

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat `messages` ([{role, content}]) under the model's template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat prompt (the template places special tokens itself)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8
    sequences (byte-level tokens) until they decode cleanly."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""
