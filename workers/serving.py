"""What the prefill and decode HTTP servers share: the engine on its thread, the process registry,
request bookkeeping, and the endpoints every worker has: the internal control API's
/internal/info, /internal/health and /internal/abort, and the metrics listener's /metrics and /health.

Every request a worker holds is one `Job` (its handler task and, on prefill and decode, the
request's state), registered in `Jobs`. An abort from the router cancels that task; the task's own
`finally` is the single place where the request's engine state and transfer are released (S4),
whatever ended it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from kvguard.workers.async_engine import AsyncEngine
from kvguard.workers.control_auth import new_instance_id
from kvguard.workers.faults import Faults
from kvguard.workers.openai_api import OpenAIError, error_middleware, validation_error
from kvguard.workers.protocol import AbortRequest, Role, WorkerInfo
from kvguard.workers.request import EngineError
from kvguard.workers.transfer import AbortCause, TransferMetrics

log = logging.getLogger("kvguard.worker")


@dataclass(eq=False)
class Job:
    """One request on this worker. The prefill and decode servers extend it with their state
    (the request's lease, stream and transfer live on its job, nowhere else)."""

    request_id: str
    task: asyncio.Task[object]
    cancel_cause: str | None = field(default=None, kw_only=True)
    """Why the router cancelled it (`/internal/abort`): the cause counted, rather than the
    cancellation's default reading, a client disconnect."""


@dataclass
class Jobs:
    """request id -> the job that owns it: the worker's one map of its requests. Duplicate ids
    are refused, never merged (the router's ids are unique; a duplicate is a bug or a replay)."""

    by_id: dict[str, Job] = field(default_factory=dict)
    _awaited: dict[str, asyncio.Event] = field(default_factory=dict)  # ids a caller waits to see claimed

    def claim(self, job: Job) -> None:
        if job.request_id in self.by_id:
            raise OpenAIError(409, f"request id {job.request_id!r} is already in flight here", code="duplicate_request_id")
        self.by_id[job.request_id] = job
        if (claimed := self._awaited.pop(job.request_id, None)) is not None:
            claimed.set()

    def get(self, request_id: str) -> Job | None:
        return self.by_id.get(request_id)

    async def claimed(self, request_id: str, timeout_s: float) -> Job | None:
        """The job for `request_id`, waiting up to `timeout_s` for it to be claimed: a second call
        for a request (prefill's ticket) may overtake the call that starts it on another
        connection. Only signed calls get here, and each waits at most `timeout_s`."""
        if (job := self.by_id.get(request_id)) is not None or timeout_s <= 0:
            return job
        claimed = self._awaited.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(claimed.wait(), timeout_s)
        except TimeoutError:
            return None
        finally:
            if self._awaited.get(request_id) is claimed and not claimed.is_set():
                del self._awaited[request_id]
        return self.by_id.get(request_id)

    def release(self, job: Job) -> None:
        if self.by_id.get(job.request_id) is job:
            del self.by_id[job.request_id]

    def cancel(self, request_id: str, cause: str | None = None) -> bool:
        job = self.by_id.get(request_id)
        if job is None or job.task.done():
            return False
        job.cancel_cause = cause
        job.task.cancel()
        return True


def current_task() -> asyncio.Task[object]:
    task = asyncio.current_task()
    assert task is not None
    return task


@dataclass
class WorkerRuntime:
    """One worker process: its engine, metrics registry, faults and in-flight requests."""

    role: Role
    model_name: str
    engine: AsyncEngine
    registry: CollectorRegistry
    transfer_metrics: TransferMetrics
    faults: Faults
    jobs: Jobs = field(default_factory=Jobs)
    instance: str = field(default_factory=new_instance_id)
    """Calls to this process must be signed for it (S9): a call captured on its way to another
    replica of the revision, which holds the same key, is refused here."""

    def info(self, transfer: tuple[str, int] | None = None) -> WorkerInfo:
        engine = self.engine.engine
        return WorkerInfo(
            role=self.role,
            model=self.model_name,
            context_length=engine.context_length,
            kv_pool_tokens=engine.pool.capacity_tokens,
            page_size=engine.pool.page_size,
            transfer_host=transfer[0] if transfer else None,
            transfer_port=transfer[1] if transfer else None,
            vocab_size=engine.args.vocab_size,
            instance=self.instance,
        )

    def healthy(self) -> web.Response:
        if self.engine.integrity_error is not None:
            return web.json_response({"status": "unhealthy", "reason": str(self.engine.integrity_error)}, status=503)
        return web.json_response({"status": "ok"})

    def internal_routes(self, app: web.Application, info: Callable[[], WorkerInfo]) -> None:
        """The internal control API (this revision's router only): info, health, abort."""

        async def health(_: web.Request) -> web.Response:
            return self.healthy()

        async def info_endpoint(_: web.Request) -> web.Response:
            return web.json_response(info().model_dump(mode="json"))

        async def abort(request: web.Request) -> web.Response:
            body = await parse_body(request, AbortRequest)
            if self.faults.no_abort_propagation:
                log.warning("FAULT no_abort_propagation: ignoring abort of %s", body.request_id)
                return web.json_response({"aborted": False})
            return web.json_response({"aborted": self.jobs.cancel(body.request_id, body.cause)})

        app.router.add_get("/internal/health", health)
        app.router.add_get("/internal/info", info_endpoint)
        app.router.add_post("/internal/abort", abort)

    def metrics_app(self) -> web.Application:
        """The read-only listener scrapers and probes reach: /metrics and /health, nothing else."""

        async def health(_: web.Request) -> web.Response:
            return self.healthy()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application(middlewares=[error_middleware])  # a 404 here is JSON too, as on the router's
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        return app

    def count_abort(self, cause: AbortCause | str) -> None:
        self.transfer_metrics.count_abort(cause)


M = TypeVar("M", bound=BaseModel)


async def parse_body(request: web.Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None
        raise validation_error(exc) from None


def engine_error(error: EngineError) -> OpenAIError:
    return OpenAIError(error.status, error.message, code=error.code, param=getattr(error, "param", None))
