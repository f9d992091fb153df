"""`kvguard serve`: router + prefill + decode on loopback for a single user."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run a router, a prefill and a decode worker on loopback",
        description="Start all three processes; print one JSON line with the API base URL and every "
        "/metrics URL, then logs; stop them all on SIGINT/SIGTERM.",
    )
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    parser.add_argument("--kv-pool-tokens", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--max-transfer-batch", type=int, default=4 * 1024 * 1024, help="bytes in flight per prefill->decode pair")
    parser.add_argument("--transfer-timeout", type=float, default=5.0, help="seconds a stalled KV transfer may wait")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.workers.launcher import LocalDeployment, LocalServeConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not (args.model / "config.json").is_file():
        print(f"kvguard serve: --model {args.model} has no config.json", file=sys.stderr)
        return 2
    deployment = LocalDeployment(
        LocalServeConfig(
            model_dir=args.model,
            port=args.port,
            kv_pool_tokens=args.kv_pool_tokens,
            context_length=args.context_length,
            page_size=args.page_size,
            device=args.device,
            max_transfer_batch=args.max_transfer_batch,
            transfer_timeout_s=args.transfer_timeout,
        )
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        deployment.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvguard serve: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"router": deployment.api_base, "metrics": deployment.metrics_urls}), flush=True)
    try:
        stop.wait()
    finally:
        deployment.stop()
    return 0
