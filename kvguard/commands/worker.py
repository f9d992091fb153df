"""`kvguard worker --role prefill|decode|router`: one process of the disaggregated engine."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from kvguard.workers.args import add_arguments

    parser = subparsers.add_parser(
        "worker",
        help="run one engine process: a prefill worker, a decode worker or the router",
        description="Every role (router included) reads the revision key from the environment variable "
        "KVGUARD_TRANSFER_KEY (hex or text, 16+ bytes; mounted from a Secret in Kubernetes): it authenticates "
        "internal calls, transfer tickets and KV frames (docs/threat-model.md). Test-only faults: KVGUARD_FAULTS.",
        # `--kv-pool 5` must not quietly mean --kv-pool-tokens: a worker's command line says exactly what it runs.
        allow_abbrev=False,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvguard.workers.args import flag_errors, from_namespace
    from kvguard.workers.servers import run_worker

    try:
        worker_args = from_namespace(args)
    except ValidationError as exc:
        print(f"kvguard worker: {flag_errors(exc)[0]}", file=sys.stderr)
        return 2
    return run_worker(worker_args)
