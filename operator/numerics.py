"""Comparing two revisions' output fingerprints (`revision.numerics_of`): which spec fields differ,
and whether the model itself changed. Pure, and apart from `revision` so that the rollout state
machine can use it without importing the API models (which embed the rollout's status).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHTS_PART = "weights"
"""The part of the fingerprint that names the model itself: a change there is another model."""
_PART_FIELDS = {  # fingerprint part -> the spec field a person changes (for messages)
    WEIGHTS_PART: "spec.model",
    "quantization": "spec.weights",
    "kvCacheDtype": "spec.kvCacheDtype",
    "device": "spec.hardware.device",
    "engine": "spec.engine.kind",
    "sharding": "spec.roles.*.{tensorParallel,pipelineParallel,expertParallel,dataParallelAttention}",
}


def parse_numerics(fingerprint: str | None) -> dict[str, str] | None:
    """`numerics_of`'s parts back, or None for an unknown or older (opaque hash) fingerprint."""
    if not fingerprint or "=" not in fingerprint:
        return None
    return dict(part.split("=", 1) for part in fingerprint.split(";") if "=" in part)


@dataclass(frozen=True)
class NumericsChange:
    """How a candidate's numerics differ from the baseline's."""

    fields: tuple[str, ...]
    """The spec fields that changed, for people (e.g. `spec.kvCacheDtype: auto -> fp8`)."""
    other_model: bool
    """The model itself changed (or cannot be told apart): the baseline's outputs are no reference."""
    opaque: bool = False
    """It cannot be told apart: one fingerprint is an older operator's opaque hash. The baseline may
    still serve the same model, so the isolation probe keeps judging by it (rollout._run_canary)."""


def numerics_change(candidate: str | None, baseline: str | None) -> NumericsChange | None:
    """None when the fingerprints match or either is unknown (then outputs must match exactly)."""
    if candidate is None or baseline is None or candidate == baseline:
        return None
    new, old = parse_numerics(candidate), parse_numerics(baseline)
    if new is None or old is None:  # an opaque fingerprint from before the parts existed
        return NumericsChange(("the output fingerprint (recorded by an older operator)",), other_model=True, opaque=True)
    fields = []
    for part in sorted(new.keys() | old.keys()):
        if new.get(part) != old.get(part):
            field = _PART_FIELDS.get(part, part)
            hashed = part in (WEIGHTS_PART, "quantization", "sharding")
            fields.append(field if hashed else f"{field}: {old.get(part)} -> {new.get(part)}")
    return NumericsChange(tuple(fields), other_model=new.get(WEIGHTS_PART) != old.get(WEIGHTS_PART))


