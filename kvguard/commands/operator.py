"""`kvguard operator`: run the kopf operator (same as `kopf run -m kvguard.operator.handlers`).

HA: run several replicas. Every replica watches, keeps its caches warm and serves the admission
webhook; the one holding the coordination Lease (KVGUARD_LEASE_NAME in KVGUARD_LEASE_NAMESPACE /
POD_NAMESPACE) drives rollouts, and another takes over when it stops renewing (leader.py). kopf's
own peering is not used (it runs `--standalone`).

Scope: every namespace (the cluster-wide install, manifests/), or only those named by
`--namespace` (repeatable) or WATCH_NAMESPACES (comma-separated; the namespaced install,
manifests/namespaced/, whose RBAC covers exactly those namespaces).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

WATCH_NAMESPACES_ENV = "WATCH_NAMESPACES"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("operator", help="run the InferenceModel operator (kopf)")
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help=f"watch only these namespaces (default: ${WATCH_NAMESPACES_ENV}, else all)")  # fmt: skip
    parser.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(func=run)


def watched_namespaces(flags: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """--namespace values, else WATCH_NAMESPACES; empty means every namespace."""
    names = list(flags) or [n.strip() for n in environ.get(WATCH_NAMESPACES_ENV, "").split(",")]
    return [n for n in names if n]


def kopf_argv(namespaces: Sequence[str], liveness: str | None = None, verbose: bool = False) -> list[str]:
    argv = ["run", "-m", "kvguard.operator.handlers", "--standalone"]  # leader election is the Lease
    argv += [f"--namespace={ns}" for ns in namespaces] or ["--all-namespaces"]
    if liveness:
        argv.append(f"--liveness={liveness}")
    if verbose:
        argv.append("--verbose")
    return argv


def run(args: argparse.Namespace) -> int:
    import kopf.cli  # heavy: only when the command runs

    argv = kopf_argv(watched_namespaces(args.namespace, os.environ), args.liveness, args.verbose)
    try:
        kopf.cli.main(argv, standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
