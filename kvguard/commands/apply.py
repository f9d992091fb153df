"""`kvguard apply -f model.yaml --local`: roll an InferenceModel out on this machine.

The same rollout state machine and canary suite as the operator, on the local backend: each
revision's router, prefill and decode run as processes on loopback, with their state (revisions,
ports, PIDs, the stable revision, the rollout status) in --state-dir. Running it again with a
changed spec rolls the new revision out beside the stable one; a change of replicas only (not part
of the revision) resizes the serving revision in place; running it again after an interruption
resumes the recorded rollout (S8). The stable revision keeps running after the command exits. Its
API base URL is printed (`serving:`): a splitter's, the same through every rollout, that carries
the weights of spec.rollout.steps (as the HTTPRoute does on a cluster). `--delete` stops everything. Every wait prints a line
with the time waited; each canary probe prints its row as it finishes; the canary's report is
saved as <state-dir>/revisions/<revision>/canary.json (printed as a table on a rollback).

Annotations in the manifest work as on a cluster: kvguard.io/pause, kvguard.io/retry,
kvguard.io/rollback-to.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from kvguard.interrupts import run_interruptible, stop_signals_as_one_interrupt

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_BLOCKED, EXIT_ROLLED_BACK, EXIT_PAUSED = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "the spec's revision serves (promoted, already serving, or resized in place)"),
    (EXIT_ERROR, "not carried out: still rolling after --timeout, or the spec's revision does not serve "
                 "(kvguard.io/rollback-to pins another, or it has no worker of a role in rotation: S7 keeps it out), "
                 "or nothing answers at the model's URL (its splitter is down or its port is taken: `not serving:`); "
                 "run it again to resume"),
    (EXIT_BAD_INPUT, "bad input (manifest, --policy, --namespace, --faults, a spec the local backend cannot run, a busy "
                     "state folder or one holding another model); nothing started"),
    (EXIT_BLOCKED, "blocked by the planner (its report is printed) or a policy; nothing of the new revision started"),
    (EXIT_ROLLED_BACK, "rolled back (readiness, a reported KV pool or the canary failed): the new revision is "
                       "stopped, the stable one (if any) serves unchanged; the probe table and the report's path are printed"),
    (EXIT_PAUSED, "paused by kvguard.io/pause: \"true\"; nothing changed"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM); started workers keep running and traffic stays split as it was, "
                       "with no analysis watching the candidate: run it again to resume (at the recorded step), or --delete"),
)
"""The one exit-code table: `--help` prints it, README.md carries the same rows (a test checks)."""


def exit_code_table(width: int = 100) -> str:
    """EXIT_CODES as `--help` shows them: one row per code, meanings wrapped under themselves."""
    rows = (textwrap.fill(meaning, width, initial_indent=f"  {code:>3}  ", subsequent_indent=" " * 7)
            for code, meaning in EXIT_CODES)  # fmt: skip
    return "exit status:\n" + "\n".join(rows)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "apply",
        help="roll an InferenceModel out locally (plan, canary, promote or roll back)",
        description=__doc__,
        epilog=exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-f", "--file", type=Path, help="InferenceModel manifest (YAML)")
    parser.add_argument("--local", action="store_true", help="run on this machine (the only backend of this command)")
    parser.add_argument("--state-dir", type=Path, help="state folder (default: .kvguard/local/<metadata.name>)")
    parser.add_argument("--models-root", type=Path, default=Path("."), help="folder standing in for the model volume: "
                        "weights are read from <models-root>/<spec.model.source.pvc.path> (default: .)")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, help="set spec.model.source to this local model folder")
    parser.add_argument("--policy", type=Path, action="append", default=[], metavar="FILE",
                        help="InferencePolicy YAML to enforce (repeatable; a file may hold several)")  # fmt: skip
    parser.add_argument("--namespace", default=None, help="the model's namespace, which the policies see (default: the "
                        "manifest's metadata.namespace, else default; one that disagrees with the manifest is refused)")  # fmt: skip
    parser.add_argument("--faults", default="", metavar="SPEC",
                        help="TEST/DEMO ONLY: KVGUARD_FAULTS for the new revision's processes")  # fmt: skip
    parser.add_argument("--timeout", type=_seconds, default=900.0, metavar="S", help="give up after S seconds (checked between reconcile passes: one that is starting workers ends first)")
    parser.add_argument("--delete", action="store_true", help="(needs --local) stop every process of the state folder and remove it (with an unreadable state.json: every kvguard worker logging into the folder; none found: nothing is removed); with -f, only a folder holding that model (else exit 2)")
    parser.set_defaults(func=run)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # NaN fails `> 0` too
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    if not args.local and args.delete:
        return _bad_input("--delete needs --local; on a cluster, `kubectl delete inferencemodel NAME`")
    if not args.local:
        return _bad_input("only --local is implemented here; on a cluster, `kubectl apply -f` the manifest")
    try:
        model = _load_model(args) if args.file else None
        policies = [p for path in args.policy for p in _load_policies(path)]
        if args.faults:
            _check_faults(args.faults)
    except ValueError as exc:
        return _bad_input(str(exc))
    if model is None and not (args.delete and args.state_dir):
        return _bad_input("-f is required (or --delete with --state-dir)")
    if model is not None:
        from kvguard.operator.api import effective_namespace

        try:  # a policy scoped to team-a was bypassed when the manifest's namespace was not read
            args.namespace = effective_namespace(model.metadata.namespace, args.namespace)
        except ValueError as exc:
            return _bad_input(str(exc))
    state_dir = args.state_dir or Path(".kvguard/local") / model.metadata.name  # type: ignore[union-attr]
    # Before the first line: a SIGTERM sent on seeing it (a supervisor, a test) must take the
    # Ctrl-C path, not kill the process (it did, under load).
    with stop_signals_as_one_interrupt():
        if args.delete:
            held = None if model is None else f"{args.namespace or 'default'}/{model.metadata.name}"
            return _delete_interruptible(state_dir, held)
        return _apply(args, model, policies, state_dir)


def _apply(args: argparse.Namespace, model: Any, policies: list[Any], state_dir: Path) -> int:
    from kvguard.operator.backends.local import FrontDoorDown, LocalBackend, LocalBackendError
    from kvguard.operator.backends.local_rollout import mark_interrupted, roll_out
    from kvguard.operator.planner import PlanInputError
    from kvguard.operator.rollout import RolloutState

    if args.faults:
        print(f"!!! FAULT INJECTION: the new revision's workers run with KVGUARD_FAULTS={args.faults} "
              "(test/demo only; never in production) !!!", file=sys.stderr, flush=True)  # fmt: skip
    probes = _ProbeRows(sys.stdout)
    try:
        print(f"kvguard apply --local: {model.metadata.name} (state: {state_dir})", flush=True)
        with LocalBackend(state_dir, models_root=args.models_root) as backend:
            try:
                result = run_interruptible(
                    lambda: roll_out(
                        backend, model.metadata.name, model.spec, policies=policies, namespace=args.namespace,
                        annotations=model.metadata.annotations, faults=args.faults,
                        say=lambda line: print(f"  {line}", flush=True), on_canary_progress=probes.on_event,
                        generation=model.metadata.generation, max_seconds=args.timeout,
                    )
                )  # fmt: skip
            except KeyboardInterrupt:
                mark_interrupted(backend)  # the status says nothing drives it now (`kvguard status`)
                raise
            except TimeoutError:
                mark_interrupted(backend, f"stopped at its --timeout of {args.timeout:g} s")
                raise
    except PlanInputError as exc:
        return _bad_input(*(f"{field}: {message}" for field, message in exc.problems))
    except FrontDoorDown as exc:  # mid-rollout, writing the split: as when the rollout rests, exit 1
        print(f"not serving: {exc}", flush=True)
        return EXIT_ERROR
    except LocalBackendError as exc:
        return _bad_input(str(exc))
    except TimeoutError as exc:
        print(f"kvguard apply: {exc}; run it again to resume", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("kvguard apply: interrupted; the state folder records where it stopped and started workers keep "
              "running (traffic stays split as it was, with nothing analysing the candidate): run it again to resume, "
              f"or `kvguard apply --local --delete --state-dir {state_dir}`", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    if result.state == RolloutState.BLOCKED and result.plan.verdict == "blocked":
        _print_plan(model.metadata.name, result.plan, args.file)
    _print_result(result, state_dir)
    return exit_code(result)


def exit_code(result: Any) -> int:
    """The exit status of a rollout that came to rest (EXIT_CODES)."""
    from kvguard.operator.rollout import RolloutState

    if result.front_door_problem is not None:
        return EXIT_ERROR  # nothing of ours answers at the printed URL, whatever the rollout's state
    if result.state == RolloutState.STABLE:
        return EXIT_OK if result.promoted and not result.roles_out_of_rotation else EXIT_ERROR
    codes = {RolloutState.BLOCKED: EXIT_BLOCKED, RolloutState.ROLLED_BACK: EXIT_ROLLED_BACK, RolloutState.PAUSED: EXIT_PAUSED}
    return codes.get(result.state, EXIT_ERROR)


def _print_result(result: Any, state_dir: Path) -> None:
    from kvguard.operator.canary.report import Verdict
    from kvguard.operator.rollout import RolloutState

    print(f"state: {result.state.value}  revision: {result.revision}  stable: {result.stable or '-'}")
    if result.status.message:
        print(f"message: {result.status.message}")
    # What the rollout says beside its state, e.g. a kvguard.io/rollback-to that names no kept
    # revision (the spec rolled out instead): it was only in `kvguard status` (an outside probe).
    progressing = next((c for c in result.status.conditions if c.type == "Progressing"), None)
    if progressing is not None and progressing.message and progressing.message != result.status.message:
        print(f"progressing: {progressing.message}")
    # A serving revision that an InferencePolicy no longer allows keeps serving (reported, not
    # killed), but the next rollout is blocked: say so here, not only in `kvguard status` (an
    # outside probe: apply printed "revision ... is serving" and exit 0 with nothing else).
    policy = next((c for c in result.status.conditions if c.type == "PolicyCompliant"), None)
    if (policy is not None and getattr(policy, "status", None) == "False" and policy.message
            and policy.message not in (result.status.message or "")):  # fmt: skip
        print(f"policy: not compliant (serving, but the next rollout is blocked): {policy.message}")
    if missing := result.roles_out_of_rotation:
        print(f"not serving: revision {result.revision} has no {' or '.join(missing)} worker in rotation (requests get 503); "
              "`kvguard status` names each worker and why")  # fmt: skip
    report_path = state_dir / "revisions" / result.revision / "canary.json"
    report = result.canary_reports.get(result.revision) or _read_report(report_path)
    if result.state == RolloutState.ROLLED_BACK:
        if report is None:
            print(f"canary: no report for {result.revision}: the rollout failed before the canary ran")
        elif report.verdict == Verdict.PASS:  # the rollback came later (analysis, readiness): the message says why
            print(f"canary of {result.revision}: PASS; the rollback came after it (message above)")
        else:
            from kvguard.commands.canary import print_probe_table

            print(f"canary of {result.revision}: {report.verdict.value.upper()} ({report.reason})")
            print_probe_table(report, sys.stdout, indent="  ", where_more="in the canary report")
    if report is not None:
        print(f"canary report: {report_path}")
    if result.front_door_problem is not None:
        print(f"not serving: {result.front_door_problem}", flush=True)
        print("serving: nothing", flush=True)
        return
    print(f"serving: {result.serving_url or 'nothing'}", flush=True)


def _print_plan(name: str, kv_plan: Any, manifest: Path) -> None:
    """The planner's whole report on a blocked spec: the numbers per role and complete fixes."""
    from kvguard.commands.plan import render_table

    print(f"plan (the same report: kvguard plan -f {manifest}):")
    for line in render_table(name, kv_plan).splitlines():
        print(f"  {line}".rstrip())
    sys.stdout.flush()


def _read_report(path: Path) -> Any:
    """A canary report an earlier (interrupted) run saved; None when there is none."""
    from kvguard.operator.canary.report import CanaryReport

    try:
        return CanaryReport.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


class _ProbeRows:
    """Each canary probe's row as it finishes, under one table header (as `kvguard canary`)."""

    def __init__(self, out: Any) -> None:
        self.out, self.started = out, False

    def on_event(self, event: Any) -> None:
        from kvguard.commands.canary import TABLE_HEADER, probe_row

        if event.kind != "finished" or event.result is None:
            return
        if not self.started:
            print(f"    {TABLE_HEADER}", file=self.out)
            self.started = True
        print(f"    {probe_row(event.result)}", file=self.out, flush=True)


def _delete_interruptible(state_dir: Path, model: str | None = None) -> int:
    try:
        return _delete(state_dir, model)
    except KeyboardInterrupt:
        print(f"kvguard apply --delete: interrupted; some of the folder's processes may still run and {state_dir} is "
              "kept: run it again to finish", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED


def _delete(state_dir: Path, model: str | None = None) -> int:
    """Stop every process of the folder and remove it; with -f, only when the folder holds that
    model (`namespace/name`): `--delete -f B.yaml` removed model A's folder (outside probe)."""
    from kvguard.operator.backends.local import LOCK_FILE, STATE_FILE, LocalBackend, LocalBackendError, UnreadableState

    if not state_dir.exists():
        print(f"kvguard apply --delete: {state_dir} does not exist; nothing to stop")
        return EXIT_OK
    if not state_dir.is_dir():
        return _bad_input(f"--state-dir {state_dir} is not a folder; nothing stopped or removed")
    # Only a folder kvguard drove is emptied: a mistyped --state-dir (the model folder, `.`) is
    # someone's data, and its unrecorded path would signal whatever logs into it (outside probe).
    if not any((state_dir / name).exists() for name in (STATE_FILE, LOCK_FILE)):
        return _bad_input(f"--state-dir {state_dir} is not a kvguard state folder (it holds neither {STATE_FILE} "
                          f"nor {LOCK_FILE}); nothing stopped or removed")  # fmt: skip
    state_dir = state_dir.resolve()  # `--state-dir .` is removed by its name, not as "."
    had_lock = (state_dir / LOCK_FILE).exists()
    try:
        with LocalBackend(state_dir) as backend:
            held = backend.state.held
            if model is not None and held is not None and held != model:
                return _bad_input(f"{state_dir} holds model {held}, not {model}: nothing stopped or removed")
            backend.stop_all()
        _stop_unrecorded(state_dir)  # a process the record lost (one a lost state.json left) stops too
    except UnreadableState as exc:
        # The record is gone, not the processes: stop what logs into the folder instead.
        try:
            stopped = _stop_unrecorded(state_dir)
        except LocalBackendError as busy:
            return _bad_input(str(busy))
        if not stopped:  # no kvguard process logs there either: nothing says the folder is kvguard's
            if not had_lock:  # taken here: left behind, it would pass the check above next time
                (state_dir / LOCK_FILE).unlink(missing_ok=True)
            return _bad_input(f"{exc.reason}; no kvguard worker logs into {state_dir} either, so it may not be a "
                              "kvguard state folder: nothing stopped or removed (remove it yourself if it is)")  # fmt: skip
        print(f"kvguard apply --delete: {exc}", file=sys.stderr)
        print(f"stopped {stopped} process(es) logging into {state_dir} (its state was unreadable) and removed it")
        shutil.rmtree(state_dir)
        return EXIT_OK
    except LocalBackendError as exc:
        return _bad_input(str(exc))
    shutil.rmtree(state_dir)
    print(f"stopped every process of {state_dir} and removed it")
    return EXIT_OK


def _stop_unrecorded(state_dir: Path) -> int:
    """SIGTERM, then SIGKILL, every process whose stdout is a log in `state_dir`, under its lock."""
    import os
    import signal
    import time

    from kvguard.operator.backends.local import ProcessTable, StateStore

    with StateStore(state_dir).locked():
        found = ProcessTable.logging_into(state_dir)
        running = list(found)
        for signum in (signal.SIGTERM, signal.SIGKILL):  # the kill only for what outlived the term
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + 10.0
            while (running := [p for p in running if _running(p)]) and time.monotonic() < deadline:
                time.sleep(0.05)
    return len(found)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a process ended but not yet reaped by its parent is gone for us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _bad_input(*lines: str) -> int:
    for line in lines:
        print(f"kvguard apply: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _load_model(args: argparse.Namespace) -> Any:
    """The manifest's InferenceModel (field-level errors as ValueError), with --model-dir applied."""
    from pydantic import ValidationError

    from kvguard.commands.plan import BadInput, _read_manifest
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.rollout import annotation_problems

    try:
        manifest = _read_manifest(args.file)
    except BadInput as exc:
        raise ValueError(str(exc)) from None
    if args.model_dir is not None and isinstance(manifest.get("spec"), dict):
        model = manifest["spec"].setdefault("model", {})
        if isinstance(model, dict):
            source = {"pvc": {"claimName": "local", "path": str(args.model_dir.resolve())}}
            revision = (model.get("source") or {}).get("revision") if isinstance(model.get("source"), dict) else None
            model["source"] = {**source, **({"revision": revision} if revision else {})}
    try:
        model = InferenceModel.model_validate(manifest)
    except ValidationError as exc:
        raise ValueError("; ".join(_describe(e) for e in exc.errors())) from None
    if problems := annotation_problems(model.metadata.annotations):  # as the admission webhook does
        raise ValueError("; ".join(problems))
    return model


def _load_policies(path: Path) -> list[Any]:
    from pydantic import ValidationError

    from kvguard.operator.api import InferencePolicy
    from kvguard.yaml_files import YAMLFileError, load_all

    try:
        docs = load_all(path)
    except YAMLFileError as exc:
        raise ValueError(f"--policy {exc}") from None
    from kvguard.operator.policy import rule_problems

    if not docs:
        raise ValueError(f"--policy {path}: holds no InferencePolicy")
    policies = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "InferencePolicy":
            raise ValueError(f"--policy {path}: every document must be an InferencePolicy")
        try:
            policy = InferencePolicy.model_validate(doc)
        except ValidationError as exc:
            raise ValueError(f"--policy {path}: " + "; ".join(_describe(e) for e in exc.errors())) from None
        if problems := rule_problems(policy.spec):
            raise ValueError(f"--policy {path}: " + "; ".join(problems))
        policies.append(policy)
    return policies


def _check_faults(spec: str) -> None:
    """Parse KVGUARD_FAULTS here (pure pydantic), so a typo fails before anything starts."""
    from kvguard.workers.faults import FaultSpecError, parse_faults

    try:
        parse_faults(spec)
    except FaultSpecError as exc:
        raise ValueError(f"--faults: {exc}") from None


def _describe(error: Any) -> str:
    from kvguard.operator.api import field_path
    from kvguard.workers.field_messages import field_line

    return field_line(field_path(error["loc"]), error)
