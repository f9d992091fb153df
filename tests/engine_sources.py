"""Reading SGLang's and vLLM's own release code, to check what kvguard assumes about them (test
support; holds no tests, and no code of theirs is committed).

The wheels come from PyPI with `pip download --no-deps --only-binary :all:` into a cache outside
the repository (`~/.cache/kvguard-engines`, or KVGUARD_ENGINE_CACHE), and are read in place with
`zipfile` and `ast`: nothing of theirs is imported or executed (their argument parsers pull in
torch, CUDA kernels and dozens of packages, so the definitions are parsed instead).

What is extracted, per release:
- CLI flags: SGLang 0.5.2x declares server arguments as annotated fields (`name: A[T, "help"]` or
  `A[T, Arg(cli_name=..., aliases=[...])]`, `srt/arg_groups/fields/*.py`) registered as
  `--name-with-dashes` plus aliases by `add_cli_args_from_dataclass`, and a few explicit
  `parser.add_argument("--flag")` calls (`srt/server_args.py`). vLLM registers string literals with
  `add_argument` (`engine/arg_utils.py`, `entrypoints/common/cli_args.py`) and derives the
  frontend's flags from `FrontendArgs` fields.
- choices of a field (an `Arg(choices=[...])` literal, a module-level list it names, or a `Literal`);
- Prometheus metric names (`name="sglang:..."`/`"vllm:..."` given to a metric constructor);
- HTTP routes (`@app.get("/path")` and friends).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

SUPPORTED: dict[str, tuple[str, ...]] = {"sglang": ("0.5.22", "0.5.23"), "vllm": ("0.33.0",)}
"""The releases kvguard's adapters and canary mappings are verified against (docs/engines.md)."""
HEAVY = {"vllm"}  # wheels of hundreds of MB: downloaded only by `make verify-engines`
DOWNLOAD_TIMEOUT_S = 600


def cache_dir() -> Path:
    return Path(os.environ.get("KVGUARD_ENGINE_CACHE") or Path.home() / ".cache" / "kvguard-engines")


def cached_wheel(engine: str, version: str) -> Path | None:
    found = sorted(cache_dir().glob(f"{engine}-{version}-*.whl"))
    return found[0] if found else None


def fetch_wheel(engine: str, version: str) -> tuple[Path | None, str]:
    """The cached wheel, downloading it when missing: (path, '') or (None, why not)."""
    wheel = cached_wheel(engine, version)
    if wheel is not None:
        return wheel, ""
    cache_dir().mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           f"{engine}=={version}", "-d", str(cache_dir())]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"pip download {engine}=={version} took over {DOWNLOAD_TIMEOUT_S} s (offline?)"
    wheel = cached_wheel(engine, version)
    if wheel is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"pip download {engine}=={version} failed (offline?): {tail[0]}"
    return wheel, ""


@dataclass(frozen=True)
class Flag:
    name: str
    where: str  # "file:line"


class EngineSource:
    """One release's Python sources, read from its wheel."""

    def __init__(self, engine: str, version: str, wheel: Path) -> None:
        self.engine, self.version, self.wheel = engine, version, wheel
        self._zip = zipfile.ZipFile(wheel)

    def files(self, prefix: str, suffix: str = ".py") -> list[str]:
        return sorted(n for n in self._zip.namelist() if n.startswith(prefix) and n.endswith(suffix))

    def text(self, path: str) -> str:
        return self._zip.read(path).decode("utf-8")

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.text(path), filename=path)

    def has(self, path: str) -> bool:
        return path in self._zip.namelist()

    # --- flags -----------------------------------------------------------------------------
    @cached_property
    def flags(self) -> dict[str, Flag]:
        if self.engine == "sglang":
            return sglang_flags(self)
        return vllm_flags(self)

    # --- metrics and routes ----------------------------------------------------------------
    def metric_names(self, prefix: str) -> dict[str, str]:
        """Every `name="<prefix>..."` keyword (or first positional string) of a call, by file:line."""
        found: dict[str, str] = {}
        for path in self.files(self.engine + "/"):
            source = self.text(path)
            if prefix not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                values = _call_names(node) if isinstance(node, ast.Call) else _name_assignment(node)
                for value in values:
                    if value.startswith(prefix):
                        found.setdefault(value, f"{path}:{node.lineno}")
        return found

    def routes(self, *under: str) -> dict[str, str]:
        """Paths of `@x.get/post/api_route("/path")` decorators and `Mount("/path")` calls in the
        files under the given prefixes (a folder, or one file)."""
        found: dict[str, str] = {}
        for path in [p for prefix in under for p in self.files(prefix)]:
            source = self.text(path)
            if "@" not in source and "Mount(" not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                    value = node.args[0].value
                    if name in {"get", "post", "api_route", "Mount", "mount", "add_route"} and isinstance(value, str) and value.startswith("/"):
                        found.setdefault(value, f"{path}:{node.lineno}")
        return found

    def class_fields(self, path: str, class_name: str) -> dict[str, ast.AnnAssign]:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                return {
                    item.target.id: item for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }  # fmt: skip
        raise KeyError(f"{class_name} not in {path}")

    def class_fields_enum(self, path: str, class_name: str) -> list[str]:
        """Member names of an Enum class (`NAME = value` in its body)."""
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                return [t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets if isinstance(t, ast.Name)]
        raise KeyError(f"{class_name} not in {path}")

    def dict_keys(self, path: str) -> set[str]:
        """String keys of every dict literal in a file."""
        return {k.value for d in ast.walk(self.tree(path)) if isinstance(d, ast.Dict) for k in d.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)}  # fmt: skip

    def module_list(self, path: str, name: str) -> list[str]:
        """A module-level `NAME = [...]` or `NAME = Literal[...]` of string constants."""
        for node in self.tree(path).body:
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            if name in targets and isinstance(node, ast.Assign):
                return _string_constants(node.value)
        raise KeyError(f"{name} not in {path}")


def _call_names(node: ast.Call) -> list[str]:
    values = [kw.value.value for kw in node.keywords if kw.arg == "name" and isinstance(kw.value, ast.Constant)]
    if node.args and isinstance(node.args[0], ast.Constant):
        values.append(node.args[0].value)
    return [v for v in values if isinstance(v, str)]


def _name_assignment(node: ast.AST) -> list[str]:
    """`name = "vllm:..."` (vLLM picks an info metric's name before constructing it)."""
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        if any(isinstance(t, ast.Name) and t.id == "name" for t in node.targets):
            return [node.value.value]
    return []


def _string_constants(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


# --- SGLang ---------------------------------------------------------------------------------

def _annotated_arg(annotation: ast.expr) -> tuple[ast.expr | None, ast.expr | None] | None:
    """(type, metadata) of `A[T, meta]` / `Annotated[T, meta]`; None for a plain annotation."""
    if not isinstance(annotation, ast.Subscript):
        return None
    base = annotation.value
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    if name not in {"A", "Annotated"} or not isinstance(annotation.slice, ast.Tuple):
        return None
    parts = annotation.slice.elts
    return (parts[0] if parts else None), (parts[1] if len(parts) > 1 else None)


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def sglang_field_flags(src: EngineSource, path: str) -> dict[str, Flag]:
    """Flags of every annotated field in one `arg_groups/fields` module (see the module doc)."""
    flags: dict[str, Flag] = {}
    for node in ast.walk(src.tree(path)):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parsed = _annotated_arg(node.annotation)
        if parsed is None or parsed[1] is None:
            continue
        meta, names = parsed[1], []
        cli_name = "--" + node.target.id.replace("_", "-")
        if isinstance(meta, ast.Call):
            no_cli = _keyword(meta, "no_cli")
            if isinstance(no_cli, ast.Constant) and no_cli.value is True:
                continue
            explicit = _keyword(meta, "cli_name")
            if isinstance(explicit, ast.Constant):
                cli_name = str(explicit.value)
            aliases = _keyword(meta, "aliases")
            names += _string_constants(aliases) if aliases is not None else []
        for flag in [cli_name, *names]:
            flags.setdefault(flag, Flag(flag, f"{path}:{node.lineno}"))
    return flags


def add_argument_flags(src: EngineSource, path: str) -> dict[str, Flag]:
    """String literals starting with '-' passed positionally to any `add_argument(...)` call."""
    flags: dict[str, Flag] = {}
    for node in ast.walk(src.tree(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                    flags.setdefault(arg.value, Flag(arg.value, f"{path}:{node.lineno}"))
    return flags


def sglang_flags(src: EngineSource) -> dict[str, Flag]:
    flags: dict[str, Flag] = {}
    for path in src.files("sglang/srt/arg_groups/fields/"):
        flags.update(sglang_field_flags(src, path))
    flags.update(add_argument_flags(src, "sglang/srt/server_args.py"))
    return flags


def sglang_field(src: EngineSource, name: str) -> tuple[str, ast.AnnAssign]:
    """(file, definition) of one server-argument field."""
    for path in src.files("sglang/srt/arg_groups/fields/"):
        for node in ast.walk(src.tree(path)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return path, node
    raise KeyError(f"sglang {src.version}: no server argument {name}")


def sglang_choices(src: EngineSource, name: str) -> list[str]:
    """The allowed values of a field: Arg(choices=[...] or a list constant it names) or Literal[...]."""
    path, node = sglang_field(src, name)
    parsed = _annotated_arg(node.annotation)
    assert parsed is not None, f"{name} is not an annotated argument"
    kind, meta = parsed
    if isinstance(meta, ast.Call):
        choices = _keyword(meta, "choices")
        if isinstance(choices, ast.List):
            return _string_constants(choices)
        if isinstance(choices, ast.Name):
            return src.module_list("sglang/srt/arg_groups/choices.py", choices.id)
    if isinstance(kind, ast.Subscript) and "Literal" in ast.unparse(kind.value):
        return _string_constants(kind.slice)
    raise KeyError(f"sglang {src.version}: {name} ({path}) has no fixed choices")


def sglang_metric_labels(src: EngineSource) -> set[str]:
    """Keys of the `labels = {...}` dict the scheduler's metrics collector is built with, plus the
    ones added with `labels["x"] = ...` (`srt/observability/metrics_collector.py`)."""
    labels: set[str] = set()
    for node in ast.walk(src.tree("sglang/srt/observability/metrics_collector.py")):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "labels" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                labels |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == "labels":
                    if isinstance(target.slice, ast.Constant):
                        labels.add(target.slice.value)
    return labels


def dict_keys_returned(src: EngineSource, path: str, function: str) -> set[str]:
    """String keys of the dict literals inside one function (what it returns or builds)."""
    for node in ast.walk(src.tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function:
            return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
    raise KeyError(f"{function} not in {path}")


# --- vLLM -----------------------------------------------------------------------------------

def vllm_flags(src: EngineSource) -> dict[str, Flag]:
    flags: dict[str, Flag] = {}
    for path in ("vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py"):
        flags.update(add_argument_flags(src, path))
    path = "vllm/entrypoints/common/cli_args.py"
    for cls in ("BaseFrontendArgs", "FrontendArgs"):
        for name, node in src.class_fields(path, cls).items():
            flag = "--" + name.replace("_", "-")
            flags.setdefault(flag, Flag(flag, f"{path}:{node.lineno}"))
    return flags


def vllm_literal(src: EngineSource, path: str, name: str) -> list[str]:
    return src.module_list(path, name)


def version_of(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])
