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
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

from kvguard.workers.async_engine import RequestStream
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.kv_pool import KVPool, Lease
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import (
    Bootstrap,
    BootstrapEvent,
    ChannelOpened,
    ChannelRequest,
    DecodeRequest,
    ErrorEvent,
    HandoffEvent,
    TokenLogprob,
)
from kvguard.workers.request import EngineError
from kvguard.workers.serving import Job, WorkerRuntime, current_task, engine_error, parse_body
from kvguard.workers.stream_events import StreamInterval, step_events
from kvguard.workers.token_channel import MAX_CHANNELS, TokenChannel
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
        bounded = dataclasses.replace(transfer, max_pages=self.pool.num_pages)  # bounds what decode reads unverified
        self.receiver = KVReceiver(keys, runtime.transfer_metrics, self._transfer_of, bounded, runtime.faults)
        self.transfer_address: tuple[str, int] | None = None
        self.channels: dict[str, TokenChannel] = {}  # open token channels by the id this worker drew
        self._calls_to_cut = runtime.faults.cut_decode_calls

    async def start(self, sock: socket.socket) -> None:
        _, bound = await self.receiver.start(sock=sock)
        self.transfer_address = (self.advertise_host, bound)

    async def close(self) -> None:
        await self.receiver.close()

    async def close_channels(self) -> None:
        """At shutdown: every channel ends (its requests are aborted) rather than holding it open."""
        for channel in self.channels.values():
            channel.close(AbortCause.CLIENT_DISCONNECT)

    @property
    def epoch(self) -> int:
        return self.receiver.epoch

    def _transfer_of(self, request_id: str) -> InboundTransfer | None:
        job = self.runtime.jobs.get(request_id)
        return job.transfer if isinstance(job, DecodeJob) else None

    # -- HTTP --------------------------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``POST /internal/stream``: open a token channel and keep it until the router goes away
        (or this worker shuts down), which ends every request on it."""
        await parse_body(request, ChannelRequest)
        if len(self.channels) >= MAX_CHANNELS:
            raise OpenAIError(503, f"this decode worker has {MAX_CHANNELS} token channels open", code="too_many_channels")
        channel = TokenChannel(secrets.token_hex(16), self.stream_interval)
        self.channels[channel.id] = channel
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            await _send(response, ChannelOpened(channel=channel.id))
            await channel.serve(response.write)
            return response
        except ConnectionResetError:  # the router went away between two writes
            return response
        finally:
            del self.channels[channel.id]
            channel.close(AbortCause.CLIENT_DISCONNECT)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        if self._calls_to_cut > 0 and request.transport is not None:
            # FAULT: the call's connection drops unanswered, its body perhaps still in transit, as
            # when a worker's drain ends (or its pod dies) with the leg on its way.
            self._calls_to_cut -= 1
            log.warning("FAULT cut_decode_calls: dropping a decode call unanswered")
            request.transport.abort()
            raise web.HTTPServiceUnavailable()
        body = await parse_body(request, DecodeRequest)
        channel = None
        if body.channel is not None and (channel := self.channels.get(body.channel)) is None:
            raise OpenAIError(409, "no token channel of that id is open on this decode worker", code="unknown_channel")
        job = DecodeJob(body.request_id, current_task(), self.runtime, self.pool, self._plan(body))
        self.runtime.jobs.claim(job)
        try:
            return await self._decode(request, body, job, channel)
        finally:
            self.runtime.jobs.release(job)

    def _plan(self, body: DecodeRequest) -> _Plan:
        faults = self.runtime.faults
        prompt = body.prompt_token_ids
        if body.over_length and faults.unsafe_reject_path:
            # FAULT (the incident's decode): it trusts prefill's metadata -- one placeholder token
            # of KV -- and proceeds as if every page of the (truncated) prompt had been written.
            engine = self.runtime.engine.engine
            fit = min(engine.context_length, self.pool.capacity_tokens) - (body.sampling.max_tokens or 0)
            return _Plan(prompt[: max(1, fit)], kv_tokens=1, verify_written=False)
        return _Plan(prompt, len(prompt), verify_written=not faults.ignore_manifest)

    async def _decode(self, request: web.Request, body: DecodeRequest, job: DecodeJob,
                      channel: TokenChannel | None) -> web.StreamResponse:
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
                cause = abort_cause(outcome.reason, outcome.detail)
                await _send(response, ErrorEvent(status=502, code=f"kv_transfer_{outcome.reason}", message=outcome.detail or "KV transfer failed"))
                return response
            cause = AbortCause.DECODE_ERROR
            assert job.first is not None
            # On a channel, routed there before the first token can be output.
            ended = channel.attach(stream, len(body.prompt_token_ids)) if channel is not None else None
            await engine.start_decode(rid, job.first.token_id, require_written=plan.verify_written,
                                      first_logprob=first_logprob(job.first, body.sampling.logprobs))
            if ended is None:
                cause = await self._stream_tokens(response, stream, len(body.prompt_token_ids)) or ""
            else:
                await _send(response, HandoffEvent())
                cause = await ended
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
            if channel is not None:  # its abort, if any, is not news to the router
                channel.detach(rid)
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
            if not interval.due(batch, time.monotonic()):
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
            job.transfer.cancel(str(cause))  # the cause alone: prefill counts it (transfer.abort_cause)
        if await self.runtime.engine.abort(job.request_id, str(cause)):
            self.runtime.count_abort(cause)


def first_logprob(first: FirstToken, wanted: int | None) -> TokenLogprob | None:
    """The first token's logprobs as prefill computed them (from the manifest), when asked for."""
    if wanted is None or first.logprob is None:
        return None
    return TokenLogprob(token_id=first.token_id, logprob=first.logprob, top=first.top)


async def _send(response: web.StreamResponse, event: BaseModel) -> None:
    await response.write(event.model_dump_json().encode() + b"\n")
