"""What the rollout scenarios (e2e/test_local_rollouts.py) ask of a backend, and what they get back.

Two harnesses implement `Harness`: `harness_local.LocalHarness` (worker processes on loopback,
driven in-process like `kvguard apply --local`) and `harness_cluster.ClusterHarness` (a real
cluster: the operator drives the rollout, the harness patches the InferenceModel and reads its
status). The scenarios only see the types below, so one assertion means the same on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvguard.operator.api import InferenceModelStatus, InferencePolicy, KVPlan
from kvguard.operator.rollout import RolloutState, RolloutStatus

NAME = "e2e-tiny"
PROMPTS = ("The capital of France is", "1, 2, 3, 4,")


@dataclass(frozen=True)
class Result:
    """Where a rollout came to rest, as the model's status records it."""

    revision: str
    """The candidate: the revision of the applied spec (on a cluster, faults included)."""
    state: RolloutState
    stable: str | None
    plan: KVPlan | None
    status: InferenceModelStatus

    @property
    def promoted(self) -> bool:
        return self.state == RolloutState.STABLE and self.stable == self.revision

    @property
    def rollout(self) -> RolloutStatus:
        assert self.status.rollout is not None, "the status has no rollout record"
        return self.status.rollout

    @classmethod
    def of_status(cls, status: InferenceModelStatus) -> Result:
        assert status.rollout is not None and status.target_revision, f"no rollout recorded: {status.message}"
        return cls(status.target_revision, status.rollout.state, status.revision, status.plan, status)


@dataclass(frozen=True)
class Rejected:
    """The API server refused the change at admission (cluster only: the validating webhook)."""

    code: int
    message: str


@dataclass(frozen=True)
class Applied:
    """One apply: the rollout's resting result, or the admission refusal; plus what users get then."""

    outcome: Result | Rejected
    answers: dict[str, str] = field(default_factory=dict)
    """Greedy completions of PROMPTS from the model's serving endpoint (empty when nothing serves)."""

    @property
    def result(self) -> Result:
        if isinstance(self.outcome, Rejected):
            raise AssertionError(f"the change was refused at admission (HTTP {self.outcome.code}): {self.outcome.message}")
        return self.outcome

    @property
    def rejected(self) -> Rejected | None:
        return self.outcome if isinstance(self.outcome, Rejected) else None


@dataclass(frozen=True)
class Serving:
    """What serves right now. S8 compares two of these: equal means the stable was not touched."""

    revision: str | None
    workloads: dict[str, str]
    """Identity of the stable revision's running workloads (local: worker PIDs and the router URL;
    cluster: Deployment uids and generations, pod uids and restart counts)."""
    answers: dict[str, str]


@dataclass(frozen=True)
class Resumed:
    """A rollout interrupted mid-canary, then resumed to where it rests."""

    candidate: str
    stable_when_interrupted: str | None
    started: dict[str, str]
    """`workload_ids(candidate)` at the interruption."""
    result: Result


class Harness(Protocol):
    namespace: str
    """Where the model lives (what an InferencePolicy's `namespaces` must name to apply to it)."""
    engine_image: str | None
    """spec.engine.image to deploy (None: the engine's default)."""
    log: list[str]
    """Progress lines, for failure messages."""

    def model_source(self, seed: int) -> dict[str, Any]:
        """spec.model.source of the tiny model written with `--seed <seed>`."""
        ...

    def apply(self, body: dict[str, Any], *, faults: str = "", policies: tuple[InferencePolicy, ...] = ()) -> Applied:
        """Apply the InferenceModel `body` (with KVGUARD_FAULTS for its revision, under
        `policies`) and wait until its rollout rests."""
        ...

    def current(self) -> Serving: ...

    def serving(self) -> str | None:
        """The revision user traffic goes to."""
        ...

    def revision_present(self, revision: str) -> bool:
        """Any workload of the revision exists, running or scaled to zero."""
        ...

    def revision_stopped(self, revision: str) -> bool:
        """No workload of the revision runs (absent, or kept at zero replicas)."""
        ...

    def workload_ids(self, revision: str) -> dict[str, str]:
        """Identity of what runs for the revision (local: worker -> PID; cluster: object -> uid)."""
        ...

    def interrupt_mid_rollout(self, body: dict[str, Any]) -> Resumed:
        """Start rolling `body` out, kill the driver (local: `kvguard apply`; cluster: the operator
        pods) once the candidate is in CanaryDeploying/CanaryVerifying, and let a new one resume."""
        ...

    def close(self) -> None: ...


def ask(api_base: str) -> dict[str, str]:
    """Greedy completions of PROMPTS through the official openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=api_base, api_key="none", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    return {
        p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, seed=1).choices[0].text for p in PROMPTS
    }
