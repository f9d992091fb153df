"""P/D parity admission (sglang#19398): prefill and decode must agree on what their KV exchange
depends on, or decode reads bytes laid out for another model, dtype or page size.

sglang#19398: a prefill/decode KV-dtype mismatch silently corrupted KV. SGLang's own checksum does
not cover it either: `--disaggregation-enable-kv-checksum` admits "a prefill whose KV layout
differs (TP width, PP stage, page size, dtype) ... unverified with one warning" (sglang 0.5.23
`srt/arg_groups/fields/disagg.py`). So for disaggregated SGLang and vLLM specs the operator compares,
on the command lines it renders for prefill and decode (engine.extraArgs and the per-role
spec.roles.<role>.extraArgs included, last value winning as argparse does) and their images:

| setting | SGLang flag | vLLM flag |
|---|---|---|
| model | `--model-path` / `--model` | positional model / `--model` |
| model revision | `--revision` | `--revision` |
| KV dtype | `--kv-cache-dtype` | `--kv-cache-dtype` |
| page size | `--page-size` | `--block-size` |
| transfer backend | `--disaggregation-transfer-backend` | `--kv-transfer-config` `kv_connector` |
| KV checksum | `--disaggregation-enable-kv-checksum` | (none exists) |
| engine build | the container image (engine.image or spec.roles.<role>.image) | the same |

Pure: `mismatches(spec, plan)` renders through `render.ADAPTERS` (no I/O); the webhook and the
reconcile refuse a spec with any mismatch, naming both values.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvguard.operator.api import EngineKind, InferenceModelSpec, KVPlan
from kvguard.operator.render import ADAPTERS, Owner, RenderError, RoleContext, image_for, with_stand_in_source

ISSUE = "sglang#19398"


@dataclass(frozen=True)
class Mismatch:
    setting: str
    prefill: str
    decode: str
    fields: str  # where to change it

    def describe(self) -> str:
        return f"{self.setting}: prefill {self.prefill}, decode {self.decode}"


def last_value(command: Sequence[str], *flags: str) -> str | None:
    """The value of the last occurrence of any of `flags` (`--f v` or `--f=v`)."""
    value = None
    for i, arg in enumerate(command):
        for flag in flags:
            if arg == flag and i + 1 < len(command):
                value = command[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
    return value


def _present(command: Sequence[str], flag: str) -> str:
    return "on" if flag in command else "off"


def _vllm_model(command: Sequence[str]) -> str | None:
    explicit = last_value(command, "--model")
    positional = command[2] if len(command) > 2 and command[:2] == ["vllm", "serve"] else None
    return explicit or positional


def _vllm_connector(command: Sequence[str]) -> str | None:
    raw = last_value(command, "--kv-transfer-config")
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("kv_connector"))
    except (ValueError, AttributeError):
        return raw


Reader = Callable[[Sequence[str]], str | None]
_ARGS = "spec.engine.extraArgs / spec.roles.{prefill,decode}.extraArgs"
_SETTINGS: dict[EngineKind, list[tuple[str, Reader]]] = {
    EngineKind.SGLANG: [
        ("model", lambda c: last_value(c, "--model-path", "--model")),
        ("model revision", lambda c: last_value(c, "--revision")),
        ("KV dtype", lambda c: last_value(c, "--kv-cache-dtype")),
        ("page size", lambda c: last_value(c, "--page-size")),
        ("transfer backend", lambda c: last_value(c, "--disaggregation-transfer-backend")),
        ("KV checksum", lambda c: _present(c, "--disaggregation-enable-kv-checksum")),
    ],
    EngineKind.VLLM: [
        ("model", _vllm_model),
        ("model revision", lambda c: last_value(c, "--revision")),
        ("KV dtype", lambda c: last_value(c, "--kv-cache-dtype")),
        ("page size", lambda c: last_value(c, "--block-size")),
        ("transfer backend", _vllm_connector),
    ],
}


def _commands(spec: InferenceModelSpec, kv_plan: KVPlan) -> dict[str, list[str]]:
    owner = Owner(name="parity-check", namespace="parity-check", uid="parity-check")
    spec = with_stand_in_source(spec, "parity-check")  # the weights' location changes no flag the sides must share
    adapter = ADAPTERS[spec.engine.kind]
    return {role: adapter.command(RoleContext(spec, kv_plan, owner, "parity", role)) for role in ("prefill", "decode")}


def mismatches(spec: InferenceModelSpec, kv_plan: KVPlan) -> list[Mismatch]:
    """Every setting prefill and decode disagree on (empty for kvguard: it renders both from one spec)."""
    settings = _SETTINGS.get(spec.engine.kind)
    if settings is None:
        return []
    try:
        commands = _commands(spec, kv_plan)
    except RenderError:
        return []  # reported by the renderer's own check, with its field
    found = []
    for name, read in settings:
        prefill, decode = read(commands["prefill"]), read(commands["decode"])
        if prefill != decode:
            found.append(Mismatch(name, _shown(prefill), _shown(decode), _ARGS))
    images = {role: _image(spec, role) for role in ("prefill", "decode")}
    if images["prefill"] != images["decode"]:
        found.append(Mismatch("engine build (image)", images["prefill"], images["decode"], "spec.roles.{prefill,decode}.image"))
    return found


def _image(spec: InferenceModelSpec, role: str) -> str:
    try:
        return image_for(spec, role)  # type: ignore[arg-type]
    except RenderError:
        return "(none)"


def _shown(value: str | None) -> str:
    return "(engine default)" if value is None else value


def parity_problem(spec: InferenceModelSpec, kv_plan: KVPlan) -> str | None:
    """One message naming every mismatch and both values, or None when prefill and decode agree."""
    found = mismatches(spec, kv_plan)
    if not found:
        return None
    where = sorted({m.fields for m in found})
    return (
        f"prefill and decode must agree on what their KV exchange depends on ({ISSUE}): "
        + "; ".join(m.describe() for m in found)
        + f" (set them alike in {' and '.join(where)})"
    )
