"""What the progressive-delivery scenarios (e2e/test_local_progressive.py) ask of a backend.

The scenarios (steps 10/50/100 with analysis, an abort at 10%, the incident's build caught before
the second step, rollback-to within the scale-down window) are written once against `Story`, and
run on the local backend always and on a real cluster when KUBECONFIG is set:

- `LocalStory`: worker processes on loopback driven in-process like `kvguard apply --local`; the
  clients' one URL is the splitter's (workers/splitter.py);
- `progressive_cluster.ClusterStory`: the operator in a real cluster drives the rollout; the
  clients' one URL is a Gateway's (Envoy Gateway, e2e/install/gateway), which the operator's
  HTTPRoute splits by the steps' weights.

Either way each answer is recorded with the revision that served it: every router names its
revision in `x-kvguard-revision` (the operator renders `--revision-id`, so does the local backend),
and the splitter sets the same header locally. `Traffic` records (revision, HTTP status) per request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import openai
import yaml
from harness import NAME
from harness_local import MAX_SECONDS, LocalHarness
from waiting import wait_for

from kvguard.operator.api import InferenceModel, InferenceModelStatus
from kvguard.operator.backends.local import LocalBackend
from kvguard.operator.backends.local_rollout import RolloutResult, roll_out
from kvguard.operator.rollout import RolloutState
from kvguard.workers.openai_api import REVISION_HEADER

REPO = Path(__file__).resolve().parent.parent
STEPS = [{"weight": 10, "pause": "1s"}, {"weight": 50, "pause": "1s"}, {"weight": 100}]
PROMPT = "The capital of France is"
SERVED_MODEL = "kvguard/tiny-random"  # examples/tiny-cpu.yaml spec.model.name
FORWARDED_FOR = ("X-Forwarded-For", "203.0.113.7")
"""Sent by every client, as a client behind a proxy chain arrives: the fail_proxied_requests fault
fails live traffic by this header (the canary's direct probes carry none), and sending it makes the
fault independent of whether a Gateway's configuration appends one (Envoy's does, the splitter too)."""


@dataclass(frozen=True)
class Event:
    reason: str
    message: str


@dataclass(frozen=True)
class Rolled:
    """Where one apply came to rest, with the model's events of that apply."""

    revision: str
    """The spec's revision (the candidate)."""
    state: RolloutState
    stable: str | None
    status: InferenceModelStatus
    events: tuple[Event, ...] = ()
    url: str | None = None
    """The clients' one URL (…/v1), the same through every rollout; None when nothing serves."""
    resized: bool = False
    canary_runs: int | None = None
    """Canary suites this apply ran, where the backend can count them (locally); None: unknown."""

    @property
    def promoted(self) -> bool:
        return self.state == RolloutState.STABLE and self.stable == self.revision

    def reasons(self, reason: str) -> list[str]:
        return [e.message for e in self.events if e.reason == reason]

    @property
    def canary_verdict(self) -> str | None:
        rollout = self.status.rollout
        return rollout.canary.verdict if rollout is not None and rollout.canary is not None else None

    @property
    def canary_ran(self) -> bool:
        """A canary suite ran on this apply's candidate. (A rollback goes through CanaryDeploying
        too, its pools measured again, but runs no suite and records no verdict.)"""
        if self.canary_runs is not None:
            return self.canary_runs > 0
        rollout = self.status.rollout
        return rollout is not None and rollout.canary is not None and rollout.canary.revision == rollout.revision


class Story(Protocol):
    """One model rolled through the scenarios on one backend, behind one URL."""

    kind: str
    """local or cluster."""
    log: list[str]

    def body(self, version: str, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The InferenceModel at engine `version`, with `steps` (default: straight to 100%)."""
        ...

    def apply(self, body: dict[str, Any], faults: str = "") -> Rolled: ...

    def url(self) -> str:
        """The clients' URL (…/v1)."""
        ...

    def stable(self) -> str: ...

    def weights(self) -> dict[str, int]:
        """revision -> percent of user traffic, as the splitter's table / the HTTPRoute says."""
        ...

    def workload_ids(self, revision: str) -> dict[str, str]:
        """What runs for the revision (local: worker -> PID; cluster: pod -> uid and restarts)."""
        ...

    def revision_stopped(self, revision: str) -> bool: ...

    def close(self) -> None: ...


def base_body(source: dict[str, Any], version: str, steps: list[dict[str, Any]] | None, parent_refs: list[dict[str, Any]],
              image: str | None = None) -> dict[str, Any]:  # fmt: skip
    body = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": NAME}
    spec = body["spec"]
    spec["model"]["source"] = source
    spec["engine"]["version"] = version
    if image:
        spec["engine"]["image"] = image
    spec["rollout"] = {
        "trafficRouter": "gatewayAPI",
        "gateway": {"parentRefs": parent_refs},
        "steps": steps or [{"weight": 100}],
        # Latency against stable is measured, with a bound no honest candidate on a shared
        # 2-core machine can break; errors and safety counters keep their strict defaults.
        "analysis": {"intervalSeconds": 1, "minRequests": 3, "ttft": {"maxRatioToStable": 1000}, "itl": {"maxRatioToStable": 1000}},
        "scaleDownDelaySeconds": 3600,  # the old revision stays up: rollback-to it is instant
    }
    return body


class Traffic:
    """Clients on the model's one URL while a rollout runs; who served each request, and how."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.answers: list[tuple[str | None, int]] = []
        """(revision that served it, HTTP status; 0 = no connection) per request, in order."""
        self.sent_at: list[float] = []
        """time.monotonic() when each answered request was sent, in the order of `answers`."""
        self.connection_errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120,
                               default_headers=dict([FORWARDED_FOR]))  # fmt: skip
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                raw = client.completions.with_raw_response.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
                raw.parse()
                answer = (raw.headers.get(REVISION_HEADER), raw.status_code)
            except openai.APIStatusError as exc:
                answer = (exc.response.headers.get(REVISION_HEADER), exc.status_code)
            except openai.APIConnectionError as exc:
                answer = (None, 0)
                self.connection_errors.append(repr(exc.__cause__ or exc))
            self.record(*answer, sent_at=sent)

    def record(self, revision: str | None, status: int, sent_at: float) -> None:
        with self._lock:
            self.answers.append((revision, status))
            self.sent_at.append(sent_at)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        wait_for(lambda: len(self.answers) >= 3, f"the first answers through {self.url}", MAX_SECONDS)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)

    def by(self, revision: str | None) -> list[int]:
        """HTTP statuses of the requests `revision` answered (None: no revision named, or no connection)."""
        with self._lock:
            return [status for served, status in self.answers if served == revision]

    def since(self, index: int) -> list[tuple[str | None, int]]:
        with self._lock:
            return list(self.answers[index:])

    def sent_since(self, moment: float) -> list[tuple[str | None, int]]:
        """Answers to the requests sent at or after `moment` (time.monotonic()). A request in flight
        when the traffic moved may be answered by either side, and after any number of newer
        requests; one sent after the move must be answered by where it moved to."""
        with self._lock:
            return [answer for answer, sent in zip(self.answers, self.sent_at) if sent >= moment]

    def served(self) -> dict[str | None, int]:
        """revision -> requests it answered."""
        with self._lock:
            counts: dict[str | None, int] = {}
            for revision, _ in self.answers:
                counts[revision] = counts.get(revision, 0) + 1
            return counts


@dataclass
class LocalStory:
    """`Story` on the local backend: one state folder, the splitter's URL."""

    harness: LocalHarness
    kind: str = "local"
    log: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.harness.log

    def body(self, version: str, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return base_body(self.harness.model_source(0), version, steps, [{"name": "not-used-locally"}])

    def apply(self, body: dict[str, Any], faults: str = "") -> Rolled:
        result = self.apply_result(body, faults)
        events = tuple(Event(e.reason, e.message) for e in result.events)
        return Rolled(result.revision, result.state, result.stable, result.status, events, result.serving_url, bool(result.resized),
                      canary_runs=len(result.canary_reports))  # fmt: skip

    def apply_result(self, body: dict[str, Any], faults: str = "") -> RolloutResult:
        model = InferenceModel.model_validate(body)
        with LocalBackend(self.harness.state_dir, models_root=self.harness.root) as backend:
            rolling = roll_out(backend, NAME, model.spec, faults=faults, annotations=model.metadata.annotations,
                               say=self.harness.log.append, max_seconds=MAX_SECONDS)  # fmt: skip
            return asyncio.run(rolling)

    def url(self) -> str:
        return f"http://127.0.0.1:{self.harness.state()['splitter']['port']}/v1"

    def stable(self) -> str:
        return str(self.harness.state()["status"]["revision"])

    def weights(self) -> dict[str, int]:
        return dict(self.harness.state()["weights"])

    def workload_ids(self, revision: str) -> dict[str, str]:
        return {w: str(p) for w, p in self.harness.pids(revision).items()}

    def revision_stopped(self, revision: str) -> bool:
        return self.harness.revision_stopped(revision)

    def close(self) -> None:
        self.harness.close()


__all__ = ["STEPS", "Event", "LocalStory", "Rolled", "Story", "Traffic", "base_body"]
