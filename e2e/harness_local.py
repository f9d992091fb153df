"""`Harness` on the local backend: real worker processes on loopback, driven in-process through
`roll_out` as `kvguard apply --local` does, with the state folder as the record."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from harness import NAME, Applied, Result, Resumed, Serving, ask
from waiting import wait_for

from kvguard.operator.api import InferenceModel, InferenceModelStatus, InferencePolicy
from kvguard.operator.backends.local import LocalBackend
from kvguard.operator.backends.local_rollout import LOCAL_NAMESPACE, roll_out
from kvguard.operator.revision import revision_of

MAX_SECONDS = 600  # a rollout's deadline: about a minute on a quiet machine, several on a loaded one


class LocalHarness:
    namespace = LOCAL_NAMESPACE
    engine_image = None

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.log: list[str] = []

    @classmethod
    def with_tiny_models(cls, root: Path) -> LocalHarness:
        for seed in (0, 1):
            argv = [sys.executable, "-P", "-m", "kvguard", "model", "tiny", str(root / f"tiny-{seed}"), "--seed", str(seed)]
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=root)
        return cls(root)

    def model_source(self, seed: int) -> dict[str, Any]:
        # An absolute pvc.path is used as is locally; claimName names nothing here.
        return {"pvc": {"claimName": "models", "path": str(self.root / f"tiny-{seed}")}, "revision": f"seed-{seed}"}

    def apply(self, body: dict[str, Any], *, faults: str = "", policies: tuple[InferencePolicy, ...] = ()) -> Applied:
        model = InferenceModel.model_validate(body)
        with LocalBackend(self.state_dir, models_root=self.root) as backend:
            rolling = roll_out(backend, NAME, model.spec, faults=faults, policies=policies,
                               annotations=model.metadata.annotations, say=self.log.append, max_seconds=MAX_SECONDS)  # fmt: skip
            result = asyncio.run(rolling)
        outcome = Result(result.revision, result.state, result.stable, result.plan, result.status)
        return Applied(outcome, ask(result.serving_url) if result.serving_url else {})

    def current(self) -> Serving:
        revision = self.state()["status"]["revision"]
        api = f"http://127.0.0.1:{self.state()['revisions'][revision]['workers'][-1]['port']}/v1"  # the router
        return Serving(revision, {"api": api, **{w: str(p) for w, p in self.pids(revision).items()}}, ask(api))

    def serving(self) -> str | None:
        return self.state()["serving"]

    def revision_present(self, revision: str) -> bool:
        return revision in self.state()["revisions"]

    def revision_stopped(self, revision: str) -> bool:
        record = self.state()["revisions"].get(revision)
        return record is None or bool(record["scaled_to_zero"])

    def workload_ids(self, revision: str) -> dict[str, str]:
        if revision not in self.state()["revisions"]:
            return {}
        return {w: str(p) for w, p in self.pids(revision).items() if p}

    def interrupt_mid_rollout(self, body: dict[str, Any]) -> Resumed:
        """SIGKILL `kvguard apply` mid-canary: no cleanup, no last words, like an operator pod
        killed. The next `kvguard apply` adopts what the state folder records."""
        work = Path(tempfile.mkdtemp(dir=self.root))
        manifest = work / "model.yaml"
        manifest.write_text(yaml.safe_dump(body))
        candidate = revision_of(InferenceModel.model_validate(body).spec)
        argv = [sys.executable, "-P", "-m", "kvguard", "apply", "-f", str(manifest), "--local",
                "--state-dir", str(self.state_dir), "--models-root", str(self.root)]  # fmt: skip
        first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
        try:
            self._wait_for_canary(candidate)
            first.send_signal(signal.SIGKILL)
            first.wait(60)
        finally:
            if first.poll() is None:
                first.kill()
        stable, started = self.state()["status"]["revision"], self.workload_ids(candidate)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=MAX_SECONDS, cwd=work)
        assert second.returncode == 0, second.stdout + second.stderr
        return Resumed(candidate, stable, started, Result.of_status(InferenceModelStatus.model_validate(self.state()["status"])))

    def _wait_for_canary(self, candidate: str) -> None:
        def in_canary() -> bool:
            rollout = (self.state().get("status") or {}).get("rollout") or {}
            if rollout.get("revision") != candidate or rollout.get("state") not in ("CanaryDeploying", "CanaryVerifying"):
                return False
            started = self.workload_ids(candidate)  # the step is recorded before it is acted on: wait for the act
            workers = (self.state().get("revisions", {}).get(candidate) or {}).get("workers") or []
            return bool(workers) and len(started) == len(workers)

        # `kvguard apply` starts python, then the candidate's workers: a minute and more on a loaded machine.
        wait_for(in_canary, f"the rollout of {candidate} to reach CanaryDeploying", MAX_SECONDS, ignoring=(OSError, ValueError))

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "state.json").read_text())

    def pids(self, revision: str) -> dict[str, int | None]:
        return {w["name"]: w["pid"] for w in self.state()["revisions"][revision]["workers"]}

    def close(self) -> None:
        if self.state_dir.exists():
            with LocalBackend(self.state_dir) as backend:
                backend.stop_all()
