"""`kvguard operator`: run the kopf operator (same as `kopf run -m kvguard.operator.handlers`).

Peering gives HA: every replica runs with a random priority unless --priority is given, so exactly
one is active and another takes over when it disappears (kopf freezes lower-priority peers).
"""

from __future__ import annotations

import argparse
import random
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("operator", help="run the InferenceModel operator (kopf)")
    parser.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces")
    parser.add_argument("--standalone", action="store_true", help="no peering (single replica, local runs)")
    parser.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    parser.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf.cli  # heavy: only when the command runs

    argv = ["run", "-m", "kvguard.operator.handlers"]
    argv += [f"--namespace={ns}" for ns in args.namespace] or ["--all-namespaces"]
    if args.standalone:
        argv.append("--standalone")
    else:
        argv += ["--peering=kvguard", f"--priority={args.priority if args.priority is not None else random.randint(1, 10_000)}"]
    if args.liveness:
        argv.append(f"--liveness={args.liveness}")
    if args.verbose:
        argv.append("--verbose")
    try:
        kopf.cli.main(argv, standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
