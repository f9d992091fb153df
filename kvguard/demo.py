"""`kvguard demo`: the whole story on a laptop, in four steps, with real processes.

1. `kvguard plan` on the incident's configuration: blocked, with the numbers and the fix.
2. A local rollout of the tiny model (the same state machine and canary suite as the operator):
   plan passes, workers report their pools, canary passes, promoted; the official `openai` client
   shows it serving. The tiny model has random weights, so its answers are gibberish by design:
   the demo is about what reaches users safely, not about what a model knows.
3. A "new engine build" carrying the incident's bug (KVGUARD_FAULTS=unsafe_reject_path,no_tags on
   the new revision's processes only): the canary catches it, the rollout is rolled back, and the
   stable revision still answers with the same greedy outputs as before (S8).
4. A summary table; exit 0 only when every step behaved as described.

Everything runs in a temporary folder and every process is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvguard.interrupts import run_interruptible, stop_signals_as_one_interrupt

FAULTY_BUILD = "unsafe_reject_path,no_tags"
PROMPTS = ("The capital of France is", "Once upon a time,", "1, 2, 3, 4,")
MAX_TOKENS = 12
HEARTBEAT_S = 5.0
"""Seconds of silence after which a wait in progress is mentioned again (as WaitReporter.every)."""
DURATION = "about 40 s on 2 CPU cores (measured), longer on a busy machine"
"""What the demo takes (kvguard.commands.demo.DEMO_SECONDS), said in its first line."""


@dataclass
class StepResult:
    name: str
    expected: str
    observed: str
    ok: bool
    seconds: float


@dataclass
class Demo:
    """Runs the steps in order, printing as it goes; `results` feeds the summary table."""

    examples: Path
    out: Any = sys.stdout
    results: list[StepResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def say(self, line: str = "") -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {line}" if line else "", file=self.out, flush=True)

    def header(self, text: str) -> None:
        print(f"\n=== {text}", file=self.out, flush=True)

    def record(self, name: str, expected: str, observed: str, ok: bool, began: float) -> bool:
        self.results.append(StepResult(name, expected, observed, ok, time.monotonic() - began))
        self.say(("OK: " if ok else "UNEXPECTED: ") + observed)
        return ok

    # --- step 1 ------------------------------------------------------------------------------------
    def plan_incident(self) -> bool:
        from kvguard.cli import build_parser
        from kvguard.commands.plan import EXIT_BLOCKED
        from kvguard.commands.plan import run as plan_run

        self.header("1. kvguard plan -f examples/incident.yaml  (the 2026 incident's configuration)")
        began = time.monotonic()
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = plan_run(build_parser().parse_args(["plan", "-f", str(self.examples / "incident.yaml")]))
        print(buffer.getvalue().rstrip(), file=self.out, flush=True)
        return self.record("plan the incident", "blocked, with numbers and fixes", f"kvguard plan exit {code} "
                           f"({'blocked' if code == EXIT_BLOCKED else 'not blocked'})", code == EXIT_BLOCKED, began)  # fmt: skip

    # --- steps 2 and 3 -----------------------------------------------------------------------------
    def tiny_spec(self, model_dir: Path, engine_version: str | None = None) -> Any:
        from kvguard.operator.api import InferenceModel

        body = yaml.safe_load((self.examples / "tiny-cpu.yaml").read_text())
        body["spec"]["model"]["source"] = {"pvc": {"claimName": "local", "path": str(model_dir)}}
        if engine_version:
            body["spec"]["engine"]["version"] = engine_version
        return InferenceModel.model_validate(body)

    def roll_out(self, backend: Any, model: Any, faults: str = "") -> Any:
        from kvguard.operator.backends.local_rollout import roll_out
        from kvguard.operator.canary.report import one_line

        def on_probe(event: Any) -> None:
            if event.kind == "finished" and event.result is not None:
                r = event.result  # (a cut reason ends in "...": it was cut mid-word without a mark)
                self.say(f"    canary {r.name.value:<16} {r.status.value:<7} {one_line(r.reason, 110)}")

        return run_interruptible(
            lambda: roll_out(backend, model.metadata.name, model.spec, faults=faults, say=lambda s: self.say("  " + s),
                     on_canary_progress=on_probe, max_seconds=300)  # fmt: skip
        )

    def first_rollout(self, backend: Any, model_dir: Path) -> tuple[bool, dict[str, str]]:
        self.header("2. kvguard apply --local: the tiny model on this machine (router + prefill + decode processes)")
        began = time.monotonic()
        model = self.tiny_spec(model_dir)
        result = self.roll_out(backend, model)
        for worker in result.status.rollout.workers if result.status.rollout else []:
            self.say(f"  {worker.worker} reports a KV pool of {worker.pool_tokens:,.0f} tokens = "
                     f"{worker.ratio:.2f}x context {worker.context_length:,} (from its /metrics)")  # fmt: skip
        outputs: dict[str, str] = {}
        if result.promoted and result.serving_url:
            self.say(f"  serving at {result.serving_url}; asking it through the openai client (random weights: the "
                     "answers are gibberish by design; step 3 checks they stay exactly the same):")  # fmt: skip
            outputs = ask(result.serving_url, model.spec.model.name)
            for prompt, text in outputs.items():
                self.say(f"    {prompt!r} -> {text!r}")
        ok = result.promoted and len(outputs) == len(PROMPTS)
        observed = f"{result.state.value}, revision {result.stable}, {len(outputs)} answers via openai"
        self.record("first rollout", "plan passes, pools reported, canary passes, promoted, serving", observed, ok, began)
        self.stable, self.stable_url = result.stable, result.serving_url
        return ok, outputs

    def faulty_rollout(self, backend: Any, model_dir: Path, before: dict[str, str]) -> bool:
        from kvguard.operator.canary.report import one_line

        self.header(f"3. a new engine build carrying the incident's bug (KVGUARD_FAULTS={FAULTY_BUILD} on its processes only)")
        began = time.monotonic()
        model = self.tiny_spec(model_dir, engine_version="0.2.0-incident-build")
        result = self.roll_out(backend, model, faults=FAULTY_BUILD)
        report = result.canary_reports.get(result.revision)
        if report is not None:
            self.say(f"  canary verdict on {result.revision}: {report.verdict.value} ({report.reason})")
            for probe in report.probes:
                if probe.status.value == "fail":
                    self.say(f"    {probe.name.value}: {one_line(probe.reason, 160)}")
                    for evidence in probe.evidence[:1]:
                        self.say(f"      evidence: {_evidence_line(evidence)}")
        after = ask(result.serving_url, model.spec.model.name) if result.serving_url else {}
        unchanged = bool(after) and after == before
        self.say(f"  stable revision {result.stable} at {result.serving_url}: "
                 + ("same greedy outputs as before" if unchanged else f"outputs changed: {after}"))  # fmt: skip
        caught = report is not None and report.verdict.value == "fail"
        ok = (caught and result.state.value == "RolledBack" and result.stable == self.stable
              and result.serving_url == self.stable_url and unchanged)  # fmt: skip
        observed = f"{result.state.value}; canary {report.verdict.value if report else 'did not run'}; stable {result.stable} unchanged: {unchanged}"
        return self.record("incident build", "canary fails, rolled back, stable unchanged", observed, ok, began)

    def summary(self) -> None:
        self.header("4. summary")
        rows = [("step", "expected", "observed", "time", "ok")]
        rows += [(r.name, r.expected, r.observed, f"{r.seconds:.1f}s", "yes" if r.ok else "NO") for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=self.out)
        total = time.monotonic() - self.started
        verdict = "every step behaved as described" if self.all_ok else "SOME STEP DID NOT BEHAVE AS DESCRIBED"
        print(f"\n{verdict} ({total:.0f} s)", file=self.out, flush=True)

    @property
    def all_ok(self) -> bool:
        return len(self.results) == 3 and all(r.ok for r in self.results)

    stable: str | None = None
    stable_url: str | None = None


def _evidence_line(evidence: Any) -> str:
    """One line an engineer can act on: for an accepted over-length request, what it generated."""
    import json

    if evidence.kind != "http":
        return str(evidence.model_dump(exclude={"kind"}))[:160]
    try:
        body = json.loads(evidence.body)
        choice = body["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        usage = body.get("usage") or {}
        return (f"{evidence.request} -> HTTP {evidence.status} with {text!r} generated for a "
                f"{usage.get('prompt_tokens', '?')}-token prompt: tokens computed from KV the request never wrote")  # fmt: skip
    except (ValueError, KeyError, IndexError, TypeError):
        return f"{evidence.request} -> HTTP {evidence.status}: {evidence.body[:120]}"


def ask(api_base: str, model: str) -> dict[str, str]:
    """Greedy completions through the official openai client (the demo's users)."""
    from openai import OpenAI

    client = OpenAI(base_url=api_base, api_key="not-needed", max_retries=0, timeout=30)
    answers = {}
    for prompt in PROMPTS:
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, seed=1)
        answers[prompt] = completion.choices[0].text
    return answers


def write_tiny_model(folder: Path, say: Callable[[str], None]) -> Path:
    """`kvguard model tiny` in a subprocess (it imports torch; this module must not): seconds on a
    quiet machine, tens on a busy one, so a line every HEARTBEAT_S while it runs."""
    argv = [sys.executable, "-P", "-m", "kvguard", "model", "tiny", str(folder)]
    began = time.monotonic()
    # Its own session: a terminal's Ctrl-C reaches only the demo, whose cleanup below stops the
    # child, instead of also printing the child's KeyboardInterrupt traceback (from inside torch).
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd=folder.parent, start_new_session=True)  # noqa: S603 - our own argv
    try:
        while True:
            try:
                code = child.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                say(f"  ... still writing the tiny model ({time.monotonic() - began:.0f} s; its process imports torch first)")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if code != 0:
        raise subprocess.CalledProcessError(code, argv)
    say(f"  tiny model written in {time.monotonic() - began:.1f} s")
    return folder


def run_demo(examples: Path, keep: bool = False) -> int:
    # The first signal takes the Ctrl-C path; its cleanup (stopping every process) is not cut short.
    with stop_signals_as_one_interrupt():
        return _run_demo(examples, keep)


def _run_demo(examples: Path, keep: bool) -> int:
    from kvguard.operator.backends.local import LocalBackend

    demo = Demo(examples)
    work = Path(tempfile.mkdtemp(prefix="kvguard-demo-"))
    backend = LocalBackend(work / "state", models_root=work)
    try:
        print(f"kvguard demo: {DURATION}; every wait prints a line; everything runs under {work} and stops on exit",
              flush=True)  # fmt: skip
        demo.plan_incident()
        demo.say("writing the tiny model (kvguard model tiny): random weights, so it answers gibberish by design")
        model_dir = write_tiny_model(work / "tiny-model", demo.say)
        with backend:
            ok, outputs = demo.first_rollout(backend, model_dir)
            if ok:
                demo.faulty_rollout(backend, model_dir, outputs)
            backend.stop_all()
        demo.summary()
    except KeyboardInterrupt:
        print("\nkvguard demo: interrupted; stopping every process it started", file=sys.stderr, flush=True)
        return 130
    finally:
        with contextlib.suppress(Exception):
            backend.stop_all()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if demo.all_ok else 1
