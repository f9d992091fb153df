"""Status conditions following the Kubernetes API conventions.

A condition is `type`, `status` ("True" | "False" | "Unknown"), a CamelCase `reason`, a human
`message`, `lastTransitionTime` (changes only when `status` changes) and `observedGeneration`.
Pure: no kopf, no kubernetes client. Time is passed in so that reconcile stays deterministic.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ConditionStatus = Literal["True", "False", "Unknown"]

# Condition types (docs/architecture.md, The operator). CanaryPassed and PolicyCompliant are set by the
# rollout/policy layer of the next issue; they are declared here so that every writer uses one name.
KV_POOL_SUFFICIENT = "KVPoolSufficient"
POLICY_COMPLIANT = "PolicyCompliant"
CANARY_PASSED = "CanaryPassed"
PROGRESSING = "Progressing"
READY = "Ready"
DEGRADED = "Degraded"
CONDITION_TYPES: tuple[str, ...] = (
    KV_POOL_SUFFICIENT,
    POLICY_COMPLIANT,
    CANARY_PASSED,
    PROGRESSING,
    READY,
    DEGRADED,
)

# Kubernetes caps condition messages at 32768 characters; stay well below it.
MAX_MESSAGE = 4096


class Condition(BaseModel):
    """One entry of `status.conditions` (metav1.Condition)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    type: str = Field(description="Condition type, e.g. KVPoolSufficient.", max_length=316)
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase machine-readable reason.",
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(default="", description="Human-readable details.", max_length=32768)
    last_transition_time: str = Field(
        alias="lastTransitionTime",
        description="RFC 3339 time of the last change of status.",
    )
    observed_generation: int | None = Field(
        default=None,
        alias="observedGeneration",
        ge=0,
        description="metadata.generation this condition was computed from.",
    )


def rfc3339(moment: dt.datetime) -> str:
    """Kubernetes time format: UTC, second precision, trailing Z."""
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: dt.datetime,
    generation: int | None,
) -> Condition:
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=rfc3339(now),
        observed_generation=generation,
    )


def set_condition(existing: Iterable[Condition], new: Condition) -> list[Condition]:
    """Replace the condition of `new.type`, keeping its transition time when status is unchanged."""
    result: list[Condition] = []
    replaced = False
    for cond in existing:
        if cond.type != new.type:
            result.append(cond)
            continue
        replaced = True
        if cond.status == new.status:
            new = new.model_copy(update={"last_transition_time": cond.last_transition_time})
        result.append(new)
    if not replaced:
        result.append(new)
    return sorted(result, key=_type_order)


def observed_at(conditions: Iterable[Condition], generation: int | None) -> list[Condition]:
    """Every condition stamped with `generation`: a pass judges the whole spec of that generation,
    so a condition it left as it was holds for it. Left with an older one, it reads as out of date
    to tools that check each condition's observedGeneration against metadata.generation, as
    metav1.Condition defines it (outside probe: Degraded said generation 1 through a whole rollout
    of generation 2). Status and transition time are unchanged."""
    if generation is None:
        return list(conditions)
    return [c if c.observed_generation == generation else c.model_copy(update={"observed_generation": generation})
            for c in conditions]  # fmt: skip


def find_condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def _type_order(cond: Condition) -> int:
    try:
        return CONDITION_TYPES.index(cond.type)
    except ValueError:
        return len(CONDITION_TYPES)
