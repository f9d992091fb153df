"""`kvguard worker --role prefill|decode|router`: one process of the disaggregated engine."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run one engine process: a prefill worker, a decode worker or the router",
        description="The transfer HMAC key is read from the environment variable KVGUARD_TRANSFER_KEY "
        "(hex or text; mounted from a Secret in Kubernetes). Test-only faults: KVGUARD_FAULTS.",
    )
    parser.add_argument("--role", required=True, choices=("prefill", "decode", "router"))
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--model-name", default=None, help="name served in the API (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, required=True, help="HTTP port (API, /metrics, /health)")
    engine = parser.add_argument_group("prefill and decode")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    engine.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--kv-pool-tokens", type=int, default=None, help="KV pool size; default: from memory")
    engine.add_argument("--kv-memory-fraction", type=float, default=0.85, help="share of device memory for weights + KV")
    engine.add_argument("--context-length", type=int, default=None)
    engine.add_argument("--page-size", type=int, default=16)
    engine.add_argument("--max-running-requests", type=int, default=64)
    transfer = parser.add_argument_group("KV transfer")
    transfer.add_argument("--transfer-port", type=int, default=0, help="decode: port receiving KV chunks")
    transfer.add_argument("--advertise-host", default=None, help="decode: address prefill connects to (pod IP)")
    transfer.add_argument("--max-transfer-batch", type=int, default=4 * 1024 * 1024, help="bytes in flight per prefill->decode pair (S6)")
    transfer.add_argument("--transfer-timeout", type=float, default=5.0, help="seconds a stalled transfer may wait (S4)")
    router = parser.add_argument_group("router")
    router.add_argument("--prefill", action="append", default=[], help="prefill worker base URL (repeatable)")
    router.add_argument("--decode", action="append", default=[], help="decode worker base URL (repeatable)")
    router.add_argument("--request-timeout", type=float, default=120.0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.workers.servers import run_worker

    return run_worker(args)
