"""Reading the YAML files users hand the CLI (manifests, policies, canary specs), strictly.

PyYAML's safe loader keeps the last of two equal keys in a mapping without a word: a manifest with
`contextLength` twice is planned on a value its author may not have meant. Here a repeated key is
an error naming both lines, and every error is one line naming the file, line and column (PyYAML's
own text spans several lines and calls the input "<unicode string>").
"""

from __future__ import annotations

import errno
import io
import sys
from pathlib import Path
from typing import Any, BinaryIO

import yaml


class YAMLFileError(ValueError):
    """A file that is not the YAML it should be; the message is one line naming where."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue  # `<<: *defaults` (a merge key): defaults the mapping's own keys override, not repeats
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error says so
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeats the one on line {first.start_mark.line + 1}", key_node.start_mark
                )
            seen[key] = key_node
        self.flatten_mapping(node)  # the merge keys' pairs first, so the mapping's own win
        return super().construct_mapping(node, deep=deep)

    def construct_sexagesimal_as_text(self, node: yaml.ScalarNode) -> Any:
        """YAML 1.1 reads `17:04` as the base-60 number 1024; the API server's YAML reader (and
        YAML 1.2) reads the string it looks like. So here: the field then refuses a string."""
        if ":" in str(node.value):
            return self.construct_scalar(node)
        return super().construct_yaml_int(node) if node.tag.endswith(":int") else super().construct_yaml_float(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_sexagesimal_as_text)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_sexagesimal_as_text)


MAX_FILE_BYTES = 16 * 1024 * 1024
"""The most a YAML file handed to the CLI may hold: ten times what the API server takes in one
request (3 MiB), hundreds of models. `-f /dev/zero` read 4 GB before this (outside probe)."""


def load_all(path: Path) -> list[Any]:
    """Every non-empty document of the file (`-`: standard input). Raises YAMLFileError (one line) for a file that cannot
    be read, is larger than MAX_FILE_BYTES, is not UTF-8, is not YAML, repeats a key, or nests too deeply."""
    try:
        text = (_read_stdin() if str(path) == "-" else _read_capped(path)).decode("utf-8")  # `-f -`, as kubectl reads it
    except OSError as exc:
        raise YAMLFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise YAMLFileError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except _TooLarge:
        raise YAMLFileError(f"{path} is larger than {MAX_FILE_BYTES // 2**20} MiB") from None
    try:
        return [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as exc:
        raise YAMLFileError(f"{path} is not valid YAML{_where(exc)}: {_what(exc)}") from None
    except yaml.YAMLError as exc:
        raise YAMLFileError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise YAMLFileError(f"{path}: YAML nested too deeply") from None


class _TooLarge(Exception):
    pass


def _read_capped(path: Path) -> bytes:
    with path.open("rb") as file:
        return _capped(file)


def _capped(stream: BinaryIO) -> bytes:
    data = bytes(stream.read(MAX_FILE_BYTES + 1))
    if len(data) > MAX_FILE_BYTES:
        raise _TooLarge
    return data


def _read_stdin() -> bytes:
    """Standard input's bytes (decoded as UTF-8 strictly by the caller): the text layer decodes
    with surrogateescape here, which turned bad bytes into PyYAML's "special characters are not
    allowed" rather than the file's "not UTF-8" (outside probe). A closed stdin (`<&-`) is a
    file that cannot be read."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # closed (sys.stdin is None), or replaced by a text-only stream (a test's)
        if sys.stdin is None:
            raise OSError(errno.EBADF, "standard input is closed")
        return _capped(io.BytesIO(sys.stdin.read(MAX_FILE_BYTES + 1).encode()))
    return _capped(stream)


def _where(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _what(exc: yaml.MarkedYAMLError) -> str:
    parts = [exc.context, exc.problem]
    return " ".join(" ".join(p.split()) for p in parts if p) or "not valid YAML"
