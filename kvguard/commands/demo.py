"""`kvguard demo`: plan the incident (blocked), roll the tiny model out locally (canary passes,
promoted), then roll out a build carrying the incident's bug (canary catches it, rolled back, the
stable revision unchanged). About 40 s on 2 CPU cores (measured; longer on a busy machine), with a
line for every wait; exit 0 when every step behaved as described. The tiny model has random
weights: its answers are gibberish by design. Every process it starts is stopped on exit, Ctrl-C
included."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The demo reads the repository's example manifests (incident.yaml, tiny-cpu.yaml).
DEMO_SECONDS = 40
"""The demo's duration on 2 CPU cores, as README.md, --help and the demo's first line state it."""
DEFAULT_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="the whole story in about 40 s: blocked plan, canary-gated rollout, caught incident build",
        description=__doc__,
    )
    parser.add_argument("--examples", type=Path, default=DEFAULT_EXAMPLES, help="folder with incident.yaml and tiny-cpu.yaml")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, state, canary reports)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.demo import run_demo

    missing = [n for n in ("incident.yaml", "tiny-cpu.yaml") if not (args.examples / n).is_file()]
    if missing:
        print(f"kvguard demo: {args.examples} lacks {', '.join(missing)} (use --examples DIR)", file=sys.stderr)
        return 2
    return run_demo(args.examples, keep=args.keep)
