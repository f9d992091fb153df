"""`kvguard worker`: build one process -- prefill, decode or router -- from its flags and run it."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvguard.workers.faults import Faults, FaultSpecError, active_faults
from kvguard.workers.protocol import Role

log = logging.getLogger("kvguard.worker")

TRANSFER_KEY_ENV = "KVGUARD_TRANSFER_KEY"


def transfer_key() -> bytes:
    """The deployment's shared HMAC key (S3). Hex when it parses as hex, else the raw text."""
    value = os.environ.get(TRANSFER_KEY_ENV, "")
    if len(value) < 16:
        raise ValueError(f"{TRANSFER_KEY_ENV} must hold the deployment's transfer key (16+ characters)")
    try:
        return bytes.fromhex(value)
    except ValueError:
        return value.encode()


def run_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(name)s %(levelname)s %(message)s")
    try:
        faults = active_faults()
        app = build_router(args, faults) if args.role == "router" else build_engine_worker(args, faults)
    except (ValueError, FaultSpecError, OSError) as exc:
        print(f"kvguard worker: {exc}", file=sys.stderr)
        return 2
    # handler_cancellation: a client (or router) that goes away cancels its handler, which is
    # how a disconnect reaches the request's cleanup (S4).
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None)
    return 0


def build_router(args: argparse.Namespace, faults: Faults) -> web.Application:
    from kvguard.workers.router import Router, RouterConfig
    from kvguard.workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(args.model)
    if tokenizer is None:
        raise ValueError(f"--model {args.model} has no tokenizer.json; the router needs it to count tokens")
    config = RouterConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        model_name=args.model_name or args.model.name,
        request_timeout_s=args.request_timeout,
        propagate_aborts=not faults.no_abort_propagation,
        unsafe_reject_path=faults.unsafe_reject_path,
    )
    return Router(config, tokenizer).app()


def build_engine_worker(args: argparse.Namespace, faults: Faults) -> web.Application:
    from kvguard.workers.async_engine import AsyncEngine
    from kvguard.workers.config import EngineConfig
    from kvguard.workers.decode_server import DecodeServer
    from kvguard.workers.engine import Engine
    from kvguard.workers.openai_api import error_middleware
    from kvguard.workers.prefill_server import PrefillServer
    from kvguard.workers.serving import WorkerRuntime
    from kvguard.workers.transfer import TransferConfig, TransferMetrics

    key = transfer_key()
    registry = CollectorRegistry()
    config = EngineConfig(
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_pool_tokens=args.kv_pool_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        tags=not faults.no_tags,
    )
    engine = AsyncEngine(Engine(config, registry))
    runtime = WorkerRuntime(
        role=Role(args.role),
        model_name=args.model_name or args.model.name,
        engine=engine,
        registry=registry,
        transfer_metrics=TransferMetrics.create(registry),
        faults=faults,
    )
    transfer = TransferConfig(max_transfer_batch=args.max_transfer_batch, stall_timeout_s=args.transfer_timeout)
    app = web.Application(middlewares=[error_middleware], client_max_size=256 * 1024 * 1024)
    if runtime.role is Role.DECODE:
        decode = DecodeServer(runtime, key, transfer, advertise_host=args.advertise_host or args.host)
        runtime.routes(app, lambda: runtime.info(decode.transfer_address))
        app.router.add_post("/internal/decode", decode.decode)

        async def start_receiver(_: web.Application) -> None:
            await decode.start(args.host, args.transfer_port)
            log.info("decode worker: KV transfer port %s", decode.transfer_address)

        app.on_startup.append(start_receiver)
        app.on_cleanup.append(lambda _: decode.close())
    else:
        prefill = PrefillServer(runtime, key, transfer)
        runtime.routes(app, runtime.info)
        app.router.add_post("/internal/prefill", prefill.prefill)
        app.on_cleanup.append(lambda _: prefill.close())

    async def start_engine(_: web.Application) -> None:
        engine.start()
        log.info(
            "%s worker ready: KV pool %d tokens, context %d tokens, faults: %s",
            args.role, engine.engine.pool.capacity_tokens, engine.engine.context_length, faults.to_spec() or "none",
        )

    app.on_startup.append(start_engine)
    app.on_shutdown.append(lambda _: engine.stop())
    return app
