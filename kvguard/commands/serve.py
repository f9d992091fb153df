"""`kvguard serve`: router + prefill + decode on loopback for a single user."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_SMALL_POOL = 3  # refused, as `kvguard plan` blocks: the pool is below the ratio


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from kvguard.workers.args import worker_default as D

    parser = subparsers.add_parser(
        "serve",
        help="run a router, a prefill and a decode worker on loopback",
        description="Start all three processes; print one JSON line with the API base URL (router), every "
        "/metrics URL (metrics: role -> URL) and the internal control APIs (internal: role -> base URL), then "
        "logs; stop them all on SIGINT/SIGTERM/SIGHUP (and the workers stop themselves if serve is killed). Every port defaults to a free one. Exit 1: a worker failed to "
        "start; 2: bad flags or a port in use; 3: the KV pool is below 2x the context (see --allow-small-pool).",
    )
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--model-name", default=None, help="name served in the API (default: the model folder's name)")
    parser.add_argument("--port", type=port_number, default=0, help="router port: the OpenAI API")
    parser.add_argument("--metrics-port", type=port_number, default=0, help="the router's /metrics")
    parser.add_argument("--prefill-port", type=port_number, default=0, help="prefill's internal control API")
    parser.add_argument("--prefill-metrics-port", type=port_number, default=0, help="prefill's /metrics")
    parser.add_argument("--decode-port", type=port_number, default=0, help="decode's internal control API")
    parser.add_argument("--decode-metrics-port", type=port_number, default=0, help="decode's /metrics")
    parser.add_argument("--transfer-port", type=port_number, default=0, help="decode's KV transfer listener")
    parser.add_argument("--kv-pool-tokens", type=_positive, default=None, help="KV pool size (default: from memory)")
    parser.add_argument("--context-length", type=_positive, default=None, help="served context (default: the model's)")
    parser.add_argument("--allow-small-pool", action="store_true",
                        help="serve even if the KV pool is below 2x the context length (unsafe; logged loudly)")
    # Every default is the workers' own (WorkerArgs), so serve and `kvguard worker` cannot disagree.
    parser.add_argument("--page-size", type=_positive, default=D("page_size"), help=f"tokens per KV page; default {D('page_size')}")
    parser.add_argument("--device", default=D("device"), help="auto (CUDA when present; the default), cpu, cuda or cuda:N")
    parser.add_argument("--max-transfer-batch", type=_positive, default=D("max_transfer_batch"),
                        help=f"bytes in flight per prefill->decode pair; default {D('max_transfer_batch')}")
    parser.add_argument("--transfer-timeout", type=float, default=D("transfer_timeout"),
                        help=f"seconds a stalled KV transfer may wait; default {D('transfer_timeout'):g}")
    parser.add_argument("--request-timeout", type=float, default=D("request_timeout"),
                        help=f"seconds a request may wait for its next token, the first included (504); default {D('request_timeout'):g}")
    parser.add_argument("--max-inflight-choices", type=_positive, default=D("max_inflight_choices"),
                        help="generations the router runs at once (n counts each); more wait in the router, "
                        f"holding no KV, within --request-timeout; default {D('max_inflight_choices')}")
    parser.add_argument("--transfer-encryption", choices=("none", "aes-gcm"), default=D("transfer_encryption"),
                        help="KV payloads between prefill and decode: integrity only (none, the default), or AES-GCM encrypted")
    parser.add_argument("--stream-interval", type=_stream_interval, default=D("stream_interval"),
                        help="tokens per streamed event after the first (which always goes at once), or fewer once "
                        f"one has waited 1 s; default {D('stream_interval')}")
    parser.add_argument("--token-channel", choices=("on", "off"), default=D("token_channel"),
                        help="on (default): decode's tokens reach the router on one stream for all requests, one write "
                        "per engine step; off: a stream per request")
    parser.set_defaults(func=run)


def port_number(text: str) -> int:
    """argparse type of a TCP port flag (serve's and splitter's)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0..65535 (0: a free one), got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _stream_interval(text: str) -> int:
    from kvguard.workers.protocol import MAX_EVENT_TOKENS

    value = int(text)
    if not 1 <= value <= MAX_EVENT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_EVENT_TOKENS}, got {value}")
    return value


def _model_folder_problem(folder: Path) -> str | None:
    """Why --model is not a model folder, or None (a mistyped path is "does not exist", not a
    folder missing its config.json). Said here, as bad input (exit 2): found by the three workers,
    a config.json that is not JSON, or no weights, was a worker failing to start (exit 1), each
    worker printing it (a new user's report). The fields themselves are the workers' to judge."""
    if not folder.exists():
        return "does not exist"
    if not folder.is_dir():
        return "is not a folder"
    config = folder / "config.json"
    if not config.is_file():
        return "has no config.json"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))  # as the workers read it (and Hugging Face)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"has a config.json that is not JSON ({exc})"
    except OSError as exc:
        return f"has a config.json that cannot be read ({exc.strerror})"
    if not isinstance(parsed, dict):
        return f"has a config.json that is not a JSON object (a {type(parsed).__name__})"
    return _weights_problem(folder)


def _weights_problem(folder: Path) -> str | None:
    """Why the folder's weights cannot load, as the engine finds them (`model._read_state_dict`):
    the files model.safetensors.index.json names (a half-downloaded snapshot names some that are
    not there: a review), else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None if any(folder.glob("*.safetensors")) else "has no *.safetensors weights (nor a model.safetensors.index.json naming them)"
    try:
        named = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, OSError) as exc:
        return f"has a model.safetensors.index.json that is not an index of weights ({type(exc).__name__}: {exc})"
    if not named or not all(isinstance(name, str) and name for name in named):
        return "has a model.safetensors.index.json whose weight_map names no file, or not by name"
    missing = sorted({name for name in named if not (folder / name).is_file()})
    return f"lacks {len(missing)} weight file(s) its index names, e.g. {missing[0]}" if missing else None


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvguard.workers.args import flag_errors
    from kvguard.workers.launcher import LocalDeployment, LocalServeConfig, SmallPoolError, StartStopped

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (problem := _model_folder_problem(args.model)) is not None:
        print(f"kvguard serve: --model {args.model} {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        deployment = LocalDeployment(
            LocalServeConfig(
                model_dir=args.model,
                model_name=args.model_name,
                port=args.port,
                metrics_port=args.metrics_port,
                prefill_port=args.prefill_port,
                prefill_metrics_port=args.prefill_metrics_port,
                decode_port=args.decode_port,
                decode_metrics_port=args.decode_metrics_port,
                transfer_port=args.transfer_port,
                kv_pool_tokens=args.kv_pool_tokens,
                context_length=args.context_length,
                allow_small_pool=args.allow_small_pool,
                page_size=args.page_size,
                device=args.device,
                max_transfer_batch=args.max_transfer_batch,
                transfer_timeout_s=args.transfer_timeout,
                transfer_encryption=args.transfer_encryption,
                stream_interval=args.stream_interval,
                token_channel=args.token_channel == "on",
                request_timeout_s=args.request_timeout,
                max_inflight_choices=args.max_inflight_choices,
            )
        )
    except SmallPoolError as exc:
        print(f"kvguard serve: refusing to start: {exc}", file=sys.stderr)
        return EXIT_SMALL_POOL
    except ValidationError as exc:  # a flag the workers' own argument model refuses
        for line in flag_errors(exc):
            print(f"kvguard serve: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, ValueError) as exc:
        print(f"kvguard serve: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(signum, lambda *_: stop.set())
    try:
        deployment.start(stop=stop)
    except StartStopped:  # told to stop while starting: no "ready" line for a server that is not serving
        print("kvguard serve: stopped during start-up", file=sys.stderr)
        return 0
    except SmallPoolError as exc:
        print(f"kvguard serve: refusing to serve: {exc}", file=sys.stderr)
        return EXIT_SMALL_POOL
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvguard serve: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps({"router": deployment.api_base, "metrics": deployment.metrics_urls,
                      "internal": deployment.internal_urls}), flush=True)  # fmt: skip
    try:
        stop.wait()
    finally:
        deployment.stop()
    return 0
