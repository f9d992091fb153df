"""The decode worker: allocate destination pages first, receive and verify the KV, then generate.

Request life on this side (states of kvguard.workers.request.RequestState):
  ADMITTED -> PREALLOCATED (bootstrap sent) -> RECEIVING (first chunk) -> VERIFIED (transfer
  complete, checksums and HMACs good, every planned page written in its current generation: S3)
  -> DECODING -> FINISHED, and ABORTED from anywhere (router abort, router gone, transfer failure or
  timeout, decode error), which always frees the pages (S4).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

from kvguard.workers.async_engine import RequestStream
from kvguard.workers.kv_pool import Lease
from kvguard.workers.protocol import (
    Bootstrap,
    BootstrapEvent,
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    TokenEvent,
)
from kvguard.workers.request import EngineError, RequestState
from kvguard.workers.serving import WorkerRuntime, engine_error, parse_body
from kvguard.workers.transfer import (
    AbortCause,
    KVReceiver,
    Manifest,
    TransferConfig,
    TransferHandle,
    WriteOutcome,
    abort_cause,
)

log = logging.getLogger("kvguard.decode")


@dataclass
class _Job:
    """What the KV sink needs to know about a request whose KV is on its way."""

    lease: Lease
    kv_tokens: int  # prompt tokens whose KV prefill sends
    receiving: bool = False
    first_token: int = -1


@dataclass(frozen=True)
class _Plan:
    prompt: tuple[int, ...]
    kv_tokens: int
    verify_written: bool  # S3 check before the first token; off only under faults


class DecodeServer:
    """The HTTP side of a decode worker, and the KV sink its transfer receiver writes into."""

    def __init__(self, runtime: WorkerRuntime, key: bytes, transfer: TransferConfig, advertise_host: str) -> None:
        self.runtime = runtime
        self.pool = runtime.engine.engine.pool
        self.advertise_host = advertise_host
        self.jobs: dict[str, _Job] = {}
        self.receiver = KVReceiver(self, key, runtime.transfer_metrics, transfer, runtime.faults)
        self.transfer_address: tuple[str, int] | None = None

    async def start(self, sock: socket.socket) -> None:
        _, bound = await self.receiver.start(sock=sock)
        self.transfer_address = (self.advertise_host, bound)

    async def close(self) -> None:
        await self.receiver.close()

    # -- KVSink ------------------------------------------------------------------------------
    async def write_pages(
        self, request_id: str, page_ids: Sequence[int], generations: Sequence[int], payload: memoryview
    ) -> WriteOutcome:
        job = self.jobs.get(request_id)
        if job is None:
            return WriteOutcome.UNKNOWN_REQUEST
        if not job.receiving:
            job.receiving = True
            try:
                await self.runtime.engine.mark_receiving(request_id)
            except EngineError:  # aborted meanwhile
                return WriteOutcome.UNKNOWN_REQUEST
        data = self.pool.pages_from_bytes(payload)
        valid = self.pool.valid_tokens(job.lease, page_ids, job.kv_tokens)
        result = self.pool.import_pages(job.lease, page_ids, generations, data, valid)
        return WriteOutcome.APPLIED if result.applied else WriteOutcome.STALE

    async def transfer_complete(self, request_id: str, manifest: Manifest) -> WriteOutcome:
        job = self.jobs.get(request_id)
        if job is None:
            return WriteOutcome.UNKNOWN_REQUEST
        job.first_token = manifest.first_token
        return WriteOutcome.APPLIED

    # -- HTTP --------------------------------------------------------------------------------
    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, GenerateRequest)
        self.runtime.tasks.claim(body.request_id)
        try:
            return await self._decode(request, body)
        finally:
            self.runtime.tasks.release(body.request_id)

    def _plan(self, body: GenerateRequest) -> _Plan:
        faults = self.runtime.faults
        prompt = body.prompt_token_ids
        if body.over_length and faults.unsafe_reject_path:
            # FAULT (the incident's decode): it trusts prefill's metadata -- one placeholder token
            # of KV -- and proceeds as if every page of the (truncated) prompt had been written.
            engine = self.runtime.engine.engine
            fit = min(engine.context_length, self.pool.capacity_tokens) - (body.sampling.max_tokens or 0)
            return _Plan(prompt[: max(1, fit)], kv_tokens=1, verify_written=False)
        return _Plan(prompt, len(prompt), verify_written=not faults.ignore_manifest)

    async def _decode(self, request: web.Request, body: GenerateRequest) -> web.StreamResponse:
        engine, rid = self.runtime.engine, body.request_id
        plan = self._plan(body)
        handle: TransferHandle | None = None
        # Until the request ends normally, any exit -- including a cancellation while it still
        # waits for pages -- must abort it here, or it would hold its pages forever (S4).
        cause: str = AbortCause.CLIENT_DISCONNECT
        try:
            try:
                lease, stream = await engine.preallocate(rid, plan.prompt, body.sampling)
            except EngineError as err:  # S2: rejected at intake, nothing allocated
                cause = ""
                raise engine_error(err) from None
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            if lease is None:
                cause = ""
                await _send(response, ErrorEvent(status=503, code="aborted", message="aborted before pages were allocated"))
                return response
            handle = self._expect(rid, lease, plan)
            await _send(response, BootstrapEvent(bootstrap=self._bootstrap(lease, plan)))
            outcome = await handle.wait()
            if not outcome.ok:
                cause = abort_cause(outcome.reason)
                await _send(response, ErrorEvent(status=502, code=f"kv_transfer_{outcome.reason}", message=outcome.detail or "KV transfer failed"))
                return response
            cause = AbortCause.DECODE_ERROR
            await engine.start_decode(rid, self.jobs[rid].first_token, require_written=plan.verify_written)
            cause = await self._stream_tokens(response, stream, len(body.prompt_token_ids)) or ""
            return response
        except EngineError as err:  # e.g. S3: not every page written -- this request only
            await _send(response, ErrorEvent(status=err.status, code=err.code, message=err.message))
            return response
        except ConnectionResetError:  # the router went away between two writes
            cause = AbortCause.CLIENT_DISCONNECT
            raise
        finally:
            self.jobs.pop(rid, None)
            if cause:
                await asyncio.shield(self._release(rid, handle, cause))

    def _expect(self, rid: str, lease: Lease, plan: _Plan) -> TransferHandle:
        pages = self.pool.pages_for(plan.kv_tokens)
        self.jobs[rid] = _Job(lease, plan.kv_tokens)
        return self.receiver.expect(rid, lease.page_ids[:pages], lease.generations[:pages])

    def _bootstrap(self, lease: Lease, plan: _Plan) -> Bootstrap:
        assert self.transfer_address is not None
        pages = self.pool.pages_for(plan.kv_tokens)
        return Bootstrap(
            transfer_host=self.transfer_address[0],
            transfer_port=self.transfer_address[1],
            page_ids=lease.page_ids[:pages],
            generations=lease.generations[:pages],
            num_tokens=plan.kv_tokens,
        )

    async def _stream_tokens(self, response: web.StreamResponse, stream: RequestStream, prompt_tokens: int) -> str | None:
        """Forward the engine's outputs; returns an abort cause if the request did not finish."""
        completion_tokens = 0
        async for output in stream:
            if output.token_ids:
                completion_tokens += len(output.token_ids)
                logprobs = tuple(output.logprobs) if output.logprobs is not None else None
                await _send(response, TokenEvent(token_ids=tuple(output.token_ids), text=output.text, logprobs=logprobs))
            if output.state is RequestState.FINISHED:
                reason = "length" if output.finish_reason == "length" else "stop"
                await _send(response, FinishEvent(finish_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
                return None
            if output.error is not None:
                await _send(response, ErrorEvent(status=output.error.status, code=output.error.code, message=output.error.message))
                return None  # the engine already ended the request and freed its pages
        return AbortCause.DECODE_ERROR

    async def _release(self, rid: str, handle: TransferHandle | None, cause: str) -> None:
        if cause == AbortCause.CLIENT_DISCONNECT and self.runtime.faults.no_abort_propagation:
            # FAULT (sglang#28651): the router went away and nobody tells this side; the request
            # keeps its pages until the process ends.
            log.warning("FAULT no_abort_propagation: leaving %s and its pages behind", rid)
            return
        if handle is not None:
            handle.cancel(f"decode ended the request: {cause}")
        if await self.runtime.engine.abort(rid, str(cause)):
            self.runtime.count_abort(cause)


async def _send(response: web.StreamResponse, event: BaseModel) -> None:
    await response.write(event.model_dump_json().encode() + b"\n")
