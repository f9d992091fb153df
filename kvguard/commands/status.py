"""kvguard status NAME: the rollout of one InferenceModel as a tree (also `kubectl kvguard status`).

Revisions (stable, target, history), the current traffic step and weight and each analysis result
when the status has them, the canary's verdict and failed probes, the continuous canary's last
run, and every engine pod's measured KV pool against the ratio (S7):
- on a cluster (KUBECONFIG, or in a pod its service account): the InferenceModel's status, where
  the operator's readiness gate records each pod's pool (`status.pools`);
- with --local --state-dir DIR: the state folder of `kvguard apply --local`, and every running
  worker of every revision scraped now (its /metrics) and judged against the revision's ratio;
  a worker kept out of rotation for its pool raises Degraded naming it (local:<port>, pid).
--watch redraws every --interval seconds until interrupted. Installed also as `kubectl-kvguard`,
so kubectl's plugin mechanism runs `kubectl kvguard status NAME`.
Exit codes: 0 shown, 1 cannot reach the cluster, 2 bad input, 3 no such model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_UNREACHABLE, EXIT_BAD_INPUT, EXIT_NOT_FOUND = 0, 1, 2, 3
MAX_INTERVAL_S = 86_400.0  # a day between redraws; beyond that (or inf, NaN) time.sleep raises


class NotFound(Exception):
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show an InferenceModel's rollout as a tree (pods' pools, canary, steps)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("name", help="metadata.name of the InferenceModel")
    parser.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's, else default)")
    parser.add_argument("--watch", "-w", action="store_true", help="redraw every --interval seconds until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between redraws (default 2)")
    parser.add_argument("--local", action="store_true", help="read the local backend's state folder instead of a cluster")
    parser.add_argument("--state-dir", type=Path, help="state folder (default: .kvguard/local/NAME)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.operator.api import model_name_problem, namespace_problem

    # No InferenceModel can have such a name or namespace: say so (bad input), not "not found".
    problem = model_name_problem(args.name) or (namespace_problem(args.namespace) if args.namespace is not None else None)
    if problem is not None:
        print(f"kvguard status: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 < args.interval <= MAX_INTERVAL_S:  # also NaN and inf (time.sleep raises on both)
        print(f"kvguard status: --interval must be > 0 and at most {MAX_INTERVAL_S:g} seconds", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.state_dir is not None and not args.local:
        print("kvguard status: --state-dir needs --local", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.state_dir is not None and args.state_dir.exists() and not args.state_dir.is_dir():
        print(f"kvguard status: --state-dir {args.state_dir} is not a folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        show = (_local_view(args.state_dir or Path(".kvguard/local") / args.name, args.name, args.namespace)
                if args.local else _cluster_view(args))
        while True:
            text = show()
            if args.watch and sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            print(text, flush=True)
            if not args.watch:
                return EXIT_OK
            time.sleep(args.interval)
            if not sys.stdout.isatty():
                print(flush=True)
    except NotFound as exc:
        print(f"kvguard status: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except BadState as exc:
        print(f"kvguard status: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return EXIT_OK
    except _Unreachable as exc:
        print(f"kvguard status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokenPipeError:  # `kvguard status NAME | head`: the reader has what it wanted
        _silence_stdout()
        return EXIT_OK


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Unreachable(Exception):
    pass


class BadState(Exception):
    """The local state folder cannot be read (bad input, exit 2)."""


def _cluster_view(args: argparse.Namespace) -> Any:
    from kvguard.operator.kube import Kube, KubeError, NoCluster, ObjectRef
    from kvguard.status_tree import render

    namespace = args.namespace or _context_namespace()
    try:
        kube = Kube(user_agent="kvguard-status")
    except NoCluster as exc:
        raise _Unreachable(f"{exc}; set KUBECONFIG or create ~/.kube/config") from None
    except Exception as exc:  # noqa: BLE001 - the kubernetes client raises YAML, key and type errors for a bad kubeconfig
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _Unreachable(f"no usable kubeconfig ({type(exc).__name__}: {reason}); check KUBECONFIG or ~/.kube/config") from None

    def show() -> str:
        try:
            body = kube.get(ObjectRef("InferenceModel", args.name, namespace))
        except KubeError as exc:
            raise _Unreachable(str(exc)) from exc
        if body is None:
            raise NotFound(f"InferenceModel {namespace}/{args.name} not found")
        status = body.get("status") or {}
        return render(args.name, namespace, status, _pools(status.get("pools")), steps=_step_count(body.get("spec")))

    return show


def _step_count(spec: Any) -> int | None:
    """How many traffic steps a (wire) spec has; None when it has none or is unreadable."""
    steps = ((spec or {}).get("rollout") or {}).get("steps") if isinstance(spec, dict) else None
    return len(steps) if isinstance(steps, list) and steps else None


def _context_namespace() -> str:
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return str((context or {}).get("context", {}).get("namespace") or "default")
    except Exception:  # noqa: BLE001 - no kubeconfig (in a pod, or tests): the default namespace
        return "default"


def _pools(raw: Any) -> list[Any]:
    from pydantic import ValidationError

    from kvguard.operator.pool_gate import PodPool

    pools = []
    for entry in raw or []:
        try:
            pools.append(PodPool.model_validate(entry))
        except ValidationError:
            continue  # written by another operator version: shown as far as it parses, never a crash
    return pools


def _local_view(state_dir: Path, name: str, namespace: str | None = None) -> Any:
    from kvguard.operator.backends.local import LocalBackendError, ProcessTable, StateStore
    from kvguard.operator.reconcile import with_pool_gate
    from kvguard.status_tree import render

    def show() -> str:
        if not (state_dir / "state.json").exists():
            raise NotFound(f"{state_dir} holds no local rollout (run `kvguard apply --local` first)")
        try:
            state = StateStore(state_dir).load()
        except LocalBackendError as exc:
            raise BadState(str(exc)) from None
        if state.model and state.model != name:
            raise NotFound(f"{state_dir} holds model {state.model}, not {name}")
        # `-n` names the model's namespace, as `kvguard apply` read it
        if state.held is not None and namespace is not None and state.held != f"{namespace}/{name}":
            raise NotFound(f"{state_dir} holds model {state.held}, not {namespace}/{name}")
        pools = asyncio.run(measure_local(state))
        # The one URL answers only while the splitter and the serving revision's router run: one
        # that is down is said, not shown as serving.
        processes = ProcessTable()
        splitter_down = state.splitter is not None and not processes.alive(state.splitter)
        # The recorded status with the Degraded condition this scrape calls for (reconcile's rule):
        # a worker restarted after `kvguard apply` returned is named at once, and cleared once back.
        status = with_pool_gate(state.status, pools, dt.datetime.now(dt.UTC), serving=state.serving,
                                front_door=_front_door(state, processes, splitter_down))  # fmt: skip
        notes = {rev: "scaled to zero" for rev, r in state.revisions.items() if r.scaled_to_zero}
        for rev, weight in state.weights.items():  # the splitter's table: who gets what share of the one URL
            share = f"{weight}% of traffic at {state.splitter.url}/v1" if state.splitter else f"{weight}% of traffic"
            if splitter_down:
                share += "; the splitter is not running: that URL refuses connections until the next apply"
            notes[rev] = f"{notes[rev]}; {share}" if rev in notes else share
        return render(name, f"{state.namespace or 'default'}, local", status, pools, serving=state.serving, notes=notes, steps=_step_count(state.spec))

    return show


def _front_door(state: Any, processes: Any, splitter_down: bool) -> str | None:
    """Why the model's URL does not answer now: its splitter or the serving revision's router down."""
    down = []
    if splitter_down:
        down.append(f"the splitter (port {state.splitter.port}, the model's URL) is not running")
    record = state.revisions.get(state.serving) if state.serving else None
    if record is not None and not record.scaled_to_zero and not processes.alive(record.front):
        down.append(f"revision {state.serving}'s router (port {record.front.port}) is not running")
    return "; ".join(down) + "; the next `kvguard apply` restarts it" if down else None


async def measure_local(state: Any) -> list[Any]:
    """Every running engine worker of every revision, scraped now and judged against its
    revision's ratio (S7), by the gate the local driver runs (backends/local_gate.py)."""
    from kvguard.operator.backends.local_gate import LocalPoolGate

    return await LocalPoolGate().pools(state)
