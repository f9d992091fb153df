"""The prefill worker: compute a request's KV and send it, checked, into the pages decode granted.

Request life on this side (kvguard.workers.request.RequestState):
  ADMITTED -> PREFILLING -> TRANSFERRING (first token sampled, pages kept while they are sent) ->
  DONE (decode verified everything; pages freed), and ABORTED from anywhere (router abort, router
  gone, prefill error, refused ticket, transfer failure), which frees the pages and tells decode
  (S4).

The router starts this leg together with decode's, so the KV is computed while decode allocates
its pages; the transfer ticket follows in `POST /internal/ticket` once decode's bootstrap reached
the router. Computing needs only the router's signed call (S9: no one else can make this worker
compute); sending needs the verified ticket: until it is here, nothing is sent and no connection
is opened, and a refused ticket (403) ends the request. A request that carries its ticket has it
verified before anything is computed.

Computing ahead of the ticket is bounded (`EarlyBudget`): requests without a ticket hold at most
the pool less one full context. Without that bound the two pools deadlock (found by the model,
formal/README.md): prefill's pages held by requests waiting for decode's pages, decode's held by
requests waiting for prefill to compute them. A request past the budget waits for its ticket
first, as before the overlap.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
from aiohttp import web

from kvguard.workers.args import DEFAULT_BOOTSTRAP_TIMEOUT_S
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.kv_pool import Lease, StaleLeaseError
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import PrefillRequest, PrefillResult, TicketDelivery
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


@dataclass
class EarlyBudget:
    """Pages, and running slots, that requests still without a ticket may hold on this worker. The
    rest (at least one full context of pages, and one of the engine's max_running slots) is always
    left to requests that have one, and those always make progress -- decode holds their pages --
    so neither side can end up waiting on the other.

    Both bounds are needed: a burst of 1,000 one-page requests filled all 64 running slots of
    prefill with requests decode had not admitted, while decode's 64 held pages for requests
    prefill could no longer admit, well within the page bound: every request then waited until
    its timeout."""

    limit_pages: int
    limit_requests: int
    held_pages: int = 0
    held_requests: int = 0

    def take(self, pages: int) -> bool:
        if self.held_pages + pages > self.limit_pages or self.held_requests + 1 > self.limit_requests:
            return False
        self.held_pages += pages
        self.held_requests += 1
        return True

    def give(self, pages: int) -> None:
        self.held_pages -= pages
        self.held_requests -= 1


@dataclass(eq=False)
class PrefillJob(Job):
    """One request on this prefill worker and its ticket (where its KV may go), once verified:
    given with the request, or delivered while the KV is computed."""

    arrival: asyncio.Future[Ticket] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    deadline: float = math.inf  # event-loop time by which the ticket must have come (--bootstrap-timeout)

    @property
    def ticket(self) -> Ticket | None:
        done = self.arrival.done() and not self.arrival.cancelled() and self.arrival.exception() is None
        return self.arrival.result() if done else None

    def deliver(self, ticket: Ticket) -> None:
        if self.arrival.done():
            raise OpenAIError(409, "this request already has its ticket", code="duplicate_ticket", param="ticket")
        self.arrival.set_result(ticket)

    def refuse(self, error: OpenAIError) -> None:
        """A ticket the router sent for this request was refused: the request ends with that error."""
        if not self.arrival.done():
            self.arrival.set_exception(error)


def first_token_record(output: RequestOutput) -> FirstToken:
    """What decode continues from, in the authenticated manifest: the token prefill sampled and,
    when the request asked for logprobs, its log-probability data (decode cannot recompute it)."""
    head = output.logprobs[0] if output.logprobs else None
    if head is None:
        return FirstToken(output.token_ids[0])
    return FirstToken(head.token_id, head.logprob, tuple(head.top))


class PrefillServer:
    def __init__(self, runtime: WorkerRuntime, keys: RevisionKeys, transfer: TransferConfig,
                 bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S) -> None:
        self.runtime = runtime
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.pool = runtime.engine.engine.pool
        self.tickets = TicketAuthority(keys.ticket)
        self.sender = KVSender(keys, runtime.transfer_metrics, transfer, runtime.faults)
        self.chunk_pages = max(1, min(CHUNK_TARGET_BYTES, transfer.max_transfer_batch) // self.pool.page_nbytes)
        if self.pool.page_nbytes > transfer.max_transfer_batch:
            # KV moves in whole pages: the sender lets one chunk above the cap through when nothing
            # else is in flight (sender.ByteCredit), so in effect the cap is one page (S6 bound).
            log.warning("one KV page is %d bytes, more than --max-transfer-batch %d: at most one page is in flight "
                        "per prefill->decode pair (S6 in effect bounds bytes in flight by one page)",
                        self.pool.page_nbytes, transfer.max_transfer_batch)  # fmt: skip
        engine = runtime.engine.engine
        self.early = EarlyBudget(limit_pages=max(0, self.pool.num_pages - self.pool.pages_for(engine.context_length)),
                                 limit_requests=engine.config.max_running_requests - 1)  # fmt: skip

    async def close(self) -> None:
        await self.sender.close()

    async def prefill(self, request: web.Request) -> web.Response:
        body = await parse_body(request, PrefillRequest)
        job = PrefillJob(body.request_id, current_task(), deadline=asyncio.get_running_loop().time() + self.bootstrap_timeout_s)
        if body.ticket is not None:
            job.deliver(self._verified_ticket(body.request_id, body.ticket))
        self.runtime.jobs.claim(job)
        try:
            return await self._prefill(job, body)
        finally:
            self.runtime.jobs.release(job)

    async def ticket(self, request: web.Request) -> web.Response:
        """The ticket for a request this worker computes (or is about to: the two calls travel on
        different connections, so this one may arrive first and waits for its job, at most until
        the ticket expires)."""
        body = await parse_body(request, TicketDelivery)
        try:
            ticket = self._verified_ticket(body.request_id, body.ticket)
        except OpenAIError as err:
            job = self.runtime.jobs.get(body.request_id)
            if isinstance(job, PrefillJob):
                job.refuse(err)
            raise
        job = await self.runtime.jobs.claimed(body.request_id, ticket.expires_at_ms / 1000 - time.time())
        if not isinstance(job, PrefillJob):
            raise OpenAIError(404, f"no request {body.request_id!r} is in flight here", code="unknown_request")
        job.deliver(ticket)
        return web.json_response({"accepted": True})

    def _verified_ticket(self, request_id: str, text: str) -> Ticket:
        """S9: the ticket the router issued for this very request, unexpired -- the only place
        prefill will ever send this request's KV."""
        try:
            ticket = self.tickets.verify_text(text)
        except TicketError as exc:
            self.runtime.transfer_metrics.ticket_rejections.labels(reason=exc.reason).inc()
            raise OpenAIError(403, f"transfer ticket refused: {exc}", code="invalid_ticket", param="ticket") from None
        if ticket.request_id != request_id:
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
        # Why the request ends, counted in kvguard_aborts_total: a failure the branches below do not
        # name is prefill's own (e.g. `_send`'s kv_plan_mismatch); a client disconnect is only ever a
        # cancellation (the `except` below). It started as CLIENT_DISCONNECT, so such a failure was
        # counted as one, which the paging alerts leave out.
        cause: str = AbortCause.PREFILL_ERROR
        tell_decode = True  # until the sender owns the transfer: it sends its own ABORT on failure
        offered = False  # the engine saw the request (it counts its own aborts and rejections from then on)
        early = self.pool.pages_for(len(prompt)) if job.ticket is None else 0
        if early and not self.early.take(early):
            early = 0
        try:
            if not early:  # it carried its ticket, or there is no room to compute ahead (EarlyBudget)
                try:
                    await self._ticket_of(job)
                except OpenAIError as err:
                    cause = _ticket_failure(err)
                    raise
            if delay_ms := self.runtime.faults.delay_prefill_ms:  # FAULT: a prompt that takes long to compute
                await asyncio.sleep(delay_ms / 1000)
            try:
                offered = True
                output = await engine.prefill(rid, prompt, body.sampling)
            except EngineError as err:  # S2 at this worker's intake: nothing allocated
                cause = AbortCause.PREFILL_ERROR
                raise engine_error(err) from None
            if output.state is not RequestState.TRANSFERRING:
                cause = AbortCause.PREFILL_ERROR
                error = output.error
                raise OpenAIError(500, error.message if error else "prefill failed", code=error.code if error else "prefill_failed")
            assert output.lease is not None
            try:
                ticket = await self._ticket_of(job)  # S9: nothing is sent, nowhere connected, before it
            except OpenAIError as err:
                cause = _ticket_failure(err)
                raise
            if early:
                self.early.give(early)
                early = 0
            self._check_plan(ticket, len(prompt))  # before the sender owns the transfer: decode is told (S4)
            tell_decode = False
            try:
                outcome = await self._send(ticket, output.lease, first_token_record(output))
            except StaleLeaseError:  # S5: the engine freed the pages (a failed step) while they were exported
                cause = AbortCause.STALE_LEASE
                raise
            if not outcome.ok:
                cause = ""  # decode gave the verdict (or is unreachable): nothing to tell it
                self.runtime.count_abort(abort_cause(outcome.reason, outcome.detail))
                await engine.abort(rid, str(outcome.reason))
                # The detail names decode's address and configuration: for the operator's log, not
                # for the client this error reaches through the router.
                log.warning("request %s: KV transfer failed: %s: %s", rid, outcome.reason, outcome.detail)
                raise OpenAIError(502, f"KV transfer failed: {outcome.reason}", code=f"kv_transfer_{outcome.reason}")
            await engine.release(rid)
            cause = ""
            if delay_ms := self.runtime.faults.delay_prefill_reply_ms:  # FAULT: hangs once decode has the KV
                await asyncio.sleep(delay_ms / 1000)
            result = PrefillResult(request_id=rid, chunks=outcome.chunks, bytes=outcome.bytes)
            return web.json_response(result.model_dump(mode="json"))
        except asyncio.CancelledError:
            # The router aborted the request (naming why) or went away (a client disconnect).
            cause = job.cancel_cause or AbortCause.CLIENT_DISCONNECT
            raise
        finally:
            if early:
                self.early.give(early)
            if cause:
                await asyncio.shield(self._abort(rid, job.ticket, cause, tell_decode, offered))

    async def _ticket_of(self, job: PrefillJob) -> Ticket:
        """The request's verified ticket, once the router delivered it; raises the refusal (403)
        if the router's ticket was refused, and 504 `bootstrap_timeout` if none came before the
        job's deadline (a router that hangs without closing its call: the pages are freed, S4).
        A cancellation (router abort, router gone) ends only this wait, not the future a late
        delivery would find."""
        remaining = job.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(job.arrival), max(0.0, remaining))
        except TimeoutError:
            if job.arrival.done():  # delivered (or refused) at the last moment: that answer stands
                return job.arrival.result()
            raise OpenAIError(504, f"no transfer ticket within {self.bootstrap_timeout_s:g} s of the request "
                              "(decode's pages never came)", code="bootstrap_timeout") from None

    def _check_plan(self, ticket: Ticket, kv_tokens: int) -> None:
        """Decode planned the pages this KV fills (its bootstrap, in the ticket): anything else is a
        500 kv_plan_mismatch, prefill's own failure. Checked before the sender opens, so the abort
        that follows tells decode at once (S4) rather than leaving it to the router."""
        pages = self.pool.pages_for(kv_tokens)
        if pages != len(ticket.page_ids) or kv_tokens != ticket.num_tokens:
            raise OpenAIError(
                500,
                f"decode planned {ticket.num_tokens} tokens in {len(ticket.page_ids)} pages, prefill has "
                f"{kv_tokens} tokens in {pages} pages (page sizes differ?)",
                code="kv_plan_mismatch",
            )

    async def _send(self, ticket: Ticket, lease: Lease, first: FirstToken) -> TransferOutcome:
        pages = len(ticket.page_ids)  # as many as prefill's own (_check_plan)
        chunks = self._chunks(lease, lease.page_ids[:pages], ticket.page_ids)
        return await self.sender.send(ticket, chunks, first)

    async def _chunks(self, lease: Lease, source: Sequence[int], destination: Sequence[int]) -> AsyncIterator[KVChunk]:
        for start in range(0, len(source), self.chunk_pages):
            end = start + self.chunk_pages
            pages = self.pool.export_pages(lease, source[start:end])  # refuses a stale lease (S5)
            payload = pages.reshape(-1).view(torch.uint8).cpu().numpy()
            yield KVChunk(destination[start:end], payload.data)

    async def _abort(self, request_id: str, ticket: Ticket | None, cause: str, tell_decode: bool, offered: bool) -> None:
        """Free this side and tell decode (S4); the router tells decode too, so either suffices
        (and is the only one to, before the ticket says where decode is). Counted once: here when
        the engine never saw the request (aborted while it waited for its ticket or a slot), else
        only if the engine still held it (one it rejected at intake is a rejection, not an abort)."""
        if await self.runtime.engine.abort(request_id, cause) or not offered:
            self.runtime.count_abort(cause)
        if not tell_decode or ticket is None:
            return
        try:
            await self.sender.abort(ticket, cause)
        except (OSError, TimeoutError) as exc:
            log.warning("could not tell decode at %s to abort %s: %s", ticket.address, ticket.request_id, exc)


def _ticket_failure(error: OpenAIError) -> AbortCause:
    """The abort cause of a request whose ticket never came (timed out) or was refused."""
    return AbortCause.BOOTSTRAP_TIMEOUT if error.code == "bootstrap_timeout" else AbortCause.PREFILL_ERROR
