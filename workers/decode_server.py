"""The decode worker: allocate destination pages first, receive and verify the KV, then generate.

Request life on this side (states of kvguard.workers.request.RequestState):
  ADMITTED -> PREALLOCATED (bootstrap sent: pages, nonce, epoch) -> RECEIVING (first chunk, after
  prefill OPENed with the router's ticket for exactly these pages and this nonce: S9) -> VERIFIED
  (transfer complete, checksums and HMACs good, every planned page written in its current
  generation: S3)
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
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.kv_pool import KVPool, Lease
from kvguard.workers.protocol import (
    Bootstrap,
    BootstrapEvent,
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    TokenEvent,
    TokenLogprob,
)
from kvguard.workers.request import EngineError, RequestOutput, RequestState
from kvguard.workers.serving import Job, WorkerRuntime, current_task, engine_error, parse_body
from kvguard.workers.transfer import (
    AbortCause,
    FirstToken,
    InboundTransfer,
    KVReceiver,
    Manifest,
    TransferConfig,
    WriteOutcome,
    abort_cause,
)

log = logging.getLogger("kvguard.decode")


@dataclass(frozen=True)
class _Plan:
    prompt: tuple[int, ...]
    kv_tokens: int
    verify_written: bool  # S3 check before the first token; off only under faults


@dataclass(eq=False)
class DecodeJob(Job):
    """One request on this decode worker, and the KV sink its transfer writes into (one object
    holds the request's lease, its transfer and the first token prefill sent)."""

    runtime: WorkerRuntime
    pool: KVPool
    plan: _Plan
    lease: Lease | None = None
    transfer: InboundTransfer | None = None
    first: FirstToken | None = None  # from the authenticated MANIFEST: token id and logprob data
    receiving: bool = False

    async def write_pages(self, page_ids: Sequence[int], generations: Sequence[int], payload: memoryview) -> WriteOutcome:
        if self.lease is None or self.lease.released:  # aborted meanwhile
            return WriteOutcome.UNKNOWN_REQUEST
        if not self.receiving:
            self.receiving = True
            self.runtime.engine.mark_receiving(self.request_id)
        data = self.pool.pages_from_bytes(payload)
        valid = self.pool.valid_tokens(self.lease, page_ids, self.plan.kv_tokens)
        result = self.pool.import_pages(self.lease, page_ids, generations, data, valid)
        return WriteOutcome.APPLIED if result.applied else WriteOutcome.STALE

    async def transfer_complete(self, manifest: Manifest) -> WriteOutcome:
        if manifest.first is None:  # prefill always samples it; decode cannot start without it
            raise ValueError("the manifest carries no first token")
        self.first = manifest.first
        return WriteOutcome.APPLIED


class DecodeServer:
    """The HTTP side of a decode worker and its transfer receiver."""

    def __init__(self, runtime: WorkerRuntime, keys: RevisionKeys, transfer: TransferConfig, advertise_host: str,
                 stream_interval: int = 1) -> None:
        self.runtime = runtime
        self.stream_interval = stream_interval
        self.pool = runtime.engine.engine.pool
        self.advertise_host = advertise_host
        self.receiver = KVReceiver(keys, runtime.transfer_metrics, self._transfer_of, transfer, runtime.faults)
        self.transfer_address: tuple[str, int] | None = None

    async def start(self, sock: socket.socket) -> None:
        _, bound = await self.receiver.start(sock=sock)
        self.transfer_address = (self.advertise_host, bound)

    async def close(self) -> None:
        await self.receiver.close()

    @property
    def epoch(self) -> int:
        return self.receiver.epoch

    def _transfer_of(self, request_id: str) -> InboundTransfer | None:
        job = self.runtime.jobs.get(request_id)
        return job.transfer if isinstance(job, DecodeJob) else None

    # -- HTTP --------------------------------------------------------------------------------
    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, GenerateRequest)
        job = DecodeJob(body.request_id, current_task(), self.runtime, self.pool, self._plan(body))
        self.runtime.jobs.claim(job)
        try:
            return await self._decode(request, body, job)
        finally:
            self.runtime.jobs.release(job)

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

    async def _decode(self, request: web.Request, body: GenerateRequest, job: DecodeJob) -> web.StreamResponse:
        engine, rid, plan = self.runtime.engine, body.request_id, job.plan
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
            transfer = self._expect(job, lease)
            await _send(response, BootstrapEvent(bootstrap=self._bootstrap(job, transfer)))
            outcome = await transfer.wait()
            if not outcome.ok:
                cause = abort_cause(outcome.reason)
                await _send(response, ErrorEvent(status=502, code=f"kv_transfer_{outcome.reason}", message=outcome.detail or "KV transfer failed"))
                return response
            cause = AbortCause.DECODE_ERROR
            assert job.first is not None
            await engine.start_decode(rid, job.first.token_id, require_written=plan.verify_written,
                                      first_logprob=first_logprob(job.first, body.sampling.logprobs))
            cause = await self._stream_tokens(response, stream, len(body.prompt_token_ids)) or ""
            return response
        except EngineError as err:  # e.g. S3: not every page written -- this request only
            await _send(response, ErrorEvent(status=err.status, code=err.code, message=err.message))
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            # The router went away (between two writes, or its connection closed and cancelled this
            # handler) or aborted the request (which cancels it too): not a decode failure, whatever
            # phase it came in. Counted as such, it would page on-call (KvguardAbortsHigh leaves
            # client disconnects out) and it would escape the no_abort_propagation fault. A router
            # abort names its cause (a transfer timeout, a prefill error): that is what is counted.
            cause = job.cancel_cause or AbortCause.CLIENT_DISCONNECT
            raise
        finally:
            if cause:
                await asyncio.shield(self._release(job, cause))

    def _expect(self, job: DecodeJob, lease: Lease) -> InboundTransfer:
        pages = self.pool.pages_for(job.plan.kv_tokens)
        job.lease = lease
        job.transfer = self.receiver.expect(job.request_id, lease.page_ids[:pages], lease.generations[:pages], job)
        return job.transfer

    def _bootstrap(self, job: DecodeJob, transfer: InboundTransfer) -> Bootstrap:
        assert self.transfer_address is not None
        page_ids, generations = transfer.tracker.order
        return Bootstrap(
            transfer_host=self.transfer_address[0],
            transfer_port=self.transfer_address[1],
            page_ids=page_ids,
            generations=generations,
            num_tokens=job.plan.kv_tokens,
            nonce=transfer.nonce.hex(),
            epoch=transfer.epoch,
        )

    async def _stream_tokens(self, response: web.StreamResponse, stream: RequestStream, prompt_tokens: int) -> str | None:
        """Forward the engine's outputs, everything that arrived since the last write in one write
        (one per engine step, fewer when this loop falls behind, or once per `stream_interval`
        tokens: see `StreamInterval`); returns an abort cause if the request did not finish."""
        interval = StreamInterval(self.stream_interval)
        sent = 0
        while batch := await stream.next_batch():
            if not interval.due(batch):
                continue
            data, sent, ended = step_events(interval.take(), prompt_tokens, sent)
            await response.write(data)
            if ended:
                return None  # finished, or the engine already ended the request and freed its pages
        return AbortCause.DECODE_ERROR

    async def _release(self, job: DecodeJob, cause: str) -> None:
        if cause == AbortCause.CLIENT_DISCONNECT and self.runtime.faults.no_abort_propagation:
            # FAULT (sglang#28651): the router went away and nobody tells this side; the request
            # keeps its pages until the process ends.
            log.warning("FAULT no_abort_propagation: leaving %s and its pages behind", job.request_id)
            return
        if job.transfer is not None:
            job.transfer.cancel(f"decode ended the request: {cause}")
        if await self.runtime.engine.abort(job.request_id, str(cause)):
            self.runtime.count_abort(cause)


class StreamInterval:
    """Which outputs go out now (vLLM's and SGLang's --stream-interval): the first token at once
    (TTFT is never traded), then whenever `every` tokens are held, and whatever ended the request
    with everything held before it. Pure; one per request."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._held: list[RequestOutput] = []
        self._held_tokens = 0
        self._first_sent = False

    def due(self, batch: Sequence[RequestOutput]) -> bool:
        """Hold `batch`; True when what is held should be sent now (then call `take`)."""
        self._held += batch
        self._held_tokens += sum(len(output.token_ids) for output in batch)
        if self._held[-1].finished or self._held_tokens >= self.every:
            return True
        return not self._first_sent and self._held_tokens > 0

    def take(self) -> list[RequestOutput]:
        held, self._held, self._held_tokens = self._held, [], 0
        self._first_sent = self._first_sent or any(output.token_ids for output in held)
        return held


def first_logprob(first: FirstToken, wanted: int | None) -> TokenLogprob | None:
    """The first token's logprobs as prefill computed them (from the manifest), when asked for."""
    if wanted is None or first.logprob is None:
        return None
    return TokenLogprob(token_id=first.token_id, logprob=first.logprob, top=first.top)


def step_events(batch: Sequence[RequestOutput], prompt_tokens: int, sent: int) -> tuple[bytes, int, bool]:
    """One request's consecutive outputs as NDJSON: their tokens as one TokenEvent, then the
    FinishEvent or ErrorEvent that ended it, if one did. Returns (bytes, completion tokens sent
    so far, whether the request ended)."""
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    end: BaseModel | None = None
    for output in batch:
        token_ids += output.token_ids
        text.append(output.text)
        if output.logprobs is not None:
            logprobs = (logprobs or []) + output.logprobs
        if output.state is RequestState.FINISHED:
            reason = "length" if output.finish_reason == "length" else "stop"
            end = FinishEvent(finish_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=sent + len(token_ids))
        elif output.error is not None:
            end = ErrorEvent(status=output.error.status, code=output.error.code, message=output.error.message)
    lines = []
    if token_ids:
        # Built without validation: every field comes from this worker's engine.
        event = TokenEvent.model_construct(token_ids=tuple(token_ids), text="".join(text),
                                           logprobs=tuple(logprobs) if logprobs is not None else None)
        lines.append(event.model_dump_json().encode())
    if end is not None:
        lines.append(end.model_dump_json().encode())
    return b"".join(line + b"\n" for line in lines), sent + len(token_ids), end is not None


async def _send(response: web.StreamResponse, event: BaseModel) -> None:
    await response.write(event.model_dump_json().encode() + b"\n")
