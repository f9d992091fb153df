"""The prefill worker: compute a request's KV and send it, checked, into the pages decode granted.

Request life on this side (kvguard.workers.request.RequestState):
  ticket verified (else 403, nothing computed, no connection anywhere: S9) -> ADMITTED ->
  PREFILLING -> TRANSFERRING (first token sampled, pages kept while they are sent) -> DONE (decode
  verified everything; pages freed), and ABORTED from anywhere (router abort, router gone, prefill
  error, transfer failure), which frees the pages and tells decode (S4).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch
from aiohttp import web

from kvguard.workers.keys import RevisionKeys
from kvguard.workers.kv_pool import Lease
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import PrefillRequest, PrefillResult
from kvguard.workers.request import EngineError, RequestOutput, RequestState
from kvguard.workers.serving import Job, WorkerRuntime, current_task, engine_error, parse_body
from kvguard.workers.transfer import (
    AbortCause,
    FirstToken,
    KVChunk,
    KVSender,
    Ticket,
    TicketAuthority,
    TicketError,
    TransferConfig,
    TransferOutcome,
    abort_cause,
)

log = logging.getLogger("kvguard.prefill")

# Pages are grouped into chunks of about this size: per-frame costs vanish above ~256 KiB
# (bench/transfer.py), and the in-flight cap (S6) still bounds what is queued.
CHUNK_TARGET_BYTES = 512 * 1024
# The incident's placeholder for a "rejected" prompt (only used under the unsafe_reject_path fault).
PLACEHOLDER_TOKEN = 0


@dataclass(eq=False)
class PrefillJob(Job):
    """One request on this prefill worker: its verified ticket (where its KV may go)."""

    ticket: Ticket


def first_token_record(output: RequestOutput) -> FirstToken:
    """What decode continues from, in the authenticated manifest: the token prefill sampled and,
    when the request asked for logprobs, its log-probability data (decode cannot recompute it)."""
    head = output.logprobs[0] if output.logprobs else None
    if head is None:
        return FirstToken(output.token_ids[0])
    return FirstToken(head.token_id, head.logprob, tuple(head.top))


class PrefillServer:
    def __init__(self, runtime: WorkerRuntime, keys: RevisionKeys, transfer: TransferConfig) -> None:
        self.runtime = runtime
        self.pool = runtime.engine.engine.pool
        self.tickets = TicketAuthority(keys.ticket)
        self.sender = KVSender(keys, runtime.transfer_metrics, transfer, runtime.faults)
        self.chunk_pages = max(1, min(CHUNK_TARGET_BYTES, transfer.max_transfer_batch) // self.pool.page_nbytes)

    async def close(self) -> None:
        await self.sender.close()

    async def prefill(self, request: web.Request) -> web.Response:
        body = await parse_body(request, PrefillRequest)
        job = PrefillJob(body.request_id, current_task(), self._verified_ticket(body))
        self.runtime.jobs.claim(job)
        try:
            return await self._prefill(job, body)
        finally:
            self.runtime.jobs.release(job)

    def _verified_ticket(self, body: PrefillRequest) -> Ticket:
        """S9: the ticket the router issued for this very request, unexpired -- checked before any
        compute, and the only place prefill will ever send this request's KV."""
        try:
            ticket = self.tickets.verify_text(body.ticket)
        except TicketError as exc:
            self.runtime.transfer_metrics.ticket_rejections.labels(reason=exc.reason).inc()
            raise OpenAIError(403, f"transfer ticket refused: {exc}", code="invalid_ticket", param="ticket") from None
        if ticket.request_id != body.request_id:
            self.runtime.transfer_metrics.ticket_rejections.labels(reason="mismatch").inc()
            raise OpenAIError(403, "the transfer ticket is for another request", code="invalid_ticket", param="ticket")
        return ticket

    async def _prefill(self, job: PrefillJob, body: PrefillRequest) -> web.Response:
        engine, rid = self.runtime.engine, body.request_id
        prompt = body.prompt_token_ids
        if body.over_length and self.runtime.faults.unsafe_reject_path:
            # FAULT (the incident): the over-length prompt is "rejected" by swapping in a placeholder,
            # and its KV is still computed and sent.
            prompt = (PLACEHOLDER_TOKEN,)
        cause: str = AbortCause.CLIENT_DISCONNECT
        tell_decode = True  # until the sender owns the transfer: it sends its own ABORT on failure
        try:
            try:
                output = await engine.prefill(rid, prompt, body.sampling)
            except EngineError as err:  # S2 at this worker's intake: nothing allocated
                cause = AbortCause.PREFILL_ERROR
                raise engine_error(err) from None
            if output.state is not RequestState.TRANSFERRING:
                cause = AbortCause.PREFILL_ERROR
                error = output.error
                raise OpenAIError(500, error.message if error else "prefill failed", code=error.code if error else "prefill_failed")
            assert output.lease is not None
            tell_decode = False
            outcome = await self._send(job.ticket, output.lease, len(prompt), first_token_record(output))
            if not outcome.ok:
                cause = ""  # decode gave the verdict (or is unreachable): nothing to tell it
                self.runtime.count_abort(abort_cause(outcome.reason))
                await engine.abort(rid, str(outcome.reason))
                raise OpenAIError(502, f"KV transfer failed: {outcome.reason}: {outcome.detail}", code=f"kv_transfer_{outcome.reason}")
            await engine.release(rid)
            cause = ""
            result = PrefillResult(request_id=rid, chunks=outcome.chunks, bytes=outcome.bytes)
            return web.json_response(result.model_dump(mode="json"))
        finally:
            if cause:
                await asyncio.shield(self._abort(job.ticket, cause, tell_decode))

    async def _send(self, ticket: Ticket, lease: Lease, kv_tokens: int, first: FirstToken) -> TransferOutcome:
        pages = self.pool.pages_for(kv_tokens)
        if pages != len(ticket.page_ids) or kv_tokens != ticket.num_tokens:
            raise OpenAIError(
                500,
                f"decode planned {ticket.num_tokens} tokens in {len(ticket.page_ids)} pages, prefill has "
                f"{kv_tokens} tokens in {pages} pages (page sizes differ?)",
                code="kv_plan_mismatch",
            )
        chunks = self._chunks(lease, lease.page_ids[:pages], ticket.page_ids)
        return await self.sender.send(ticket, chunks, first)

    async def _chunks(self, lease: Lease, source: Sequence[int], destination: Sequence[int]) -> AsyncIterator[KVChunk]:
        for start in range(0, len(source), self.chunk_pages):
            end = start + self.chunk_pages
            pages = self.pool.export_pages(lease, source[start:end])  # refuses a stale lease (S5)
            payload = pages.reshape(-1).view(torch.uint8).cpu().numpy()
            yield KVChunk(destination[start:end], memoryview(payload))

    async def _abort(self, ticket: Ticket, cause: str, tell_decode: bool) -> None:
        """Free this side and tell decode (S4); the router tells decode too, so either suffices."""
        if await self.runtime.engine.abort(ticket.request_id, cause):
            self.runtime.count_abort(cause)
        if not tell_decode:
            return
        try:
            await self.sender.abort(ticket, cause)
        except (OSError, TimeoutError) as exc:
            log.warning("could not tell decode at %s to abort %s: %s", ticket.address, ticket.request_id, exc)
