"""The prefill worker: compute a request's KV and send it, checked, into the pages decode granted.

Request life on this side (kvguard.workers.request.RequestState):
  ADMITTED -> PREFILLING -> TRANSFERRING (first token sampled, pages kept while they are sent)
  -> DONE (decode verified everything; pages freed), and ABORTED from anywhere (router abort,
  router gone, prefill error, transfer failure), which frees the pages and tells decode (S4).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import torch
from aiohttp import web

from kvguard.workers.kv_pool import Lease
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import PrefillRequest, PrefillResult
from kvguard.workers.request import EngineError, RequestState
from kvguard.workers.serving import WorkerRuntime, engine_error, parse_body
from kvguard.workers.transfer import AbortCause, KVChunk, KVSender, TransferConfig, TransferOutcome, abort_cause

log = logging.getLogger("kvguard.prefill")

# Pages are grouped into chunks of about this size: per-frame costs vanish above ~256 KiB
# (bench/transfer.py), and the in-flight cap (S6) still bounds what is queued.
CHUNK_TARGET_BYTES = 512 * 1024
# The incident's placeholder for a "rejected" prompt (only used under the unsafe_reject_path fault).
PLACEHOLDER_TOKEN = 0


class PrefillServer:
    def __init__(self, runtime: WorkerRuntime, key: bytes, transfer: TransferConfig) -> None:
        self.runtime = runtime
        self.pool = runtime.engine.engine.pool
        self.sender = KVSender(key, runtime.transfer_metrics, transfer, runtime.faults)
        self.chunk_pages = max(1, min(CHUNK_TARGET_BYTES, transfer.max_transfer_batch) // self.pool.page_nbytes)

    async def close(self) -> None:
        await self.sender.close()

    async def prefill(self, request: web.Request) -> web.Response:
        body = await parse_body(request, PrefillRequest)
        self.runtime.tasks.claim(body.request_id)
        try:
            return await self._prefill(body)
        finally:
            self.runtime.tasks.release(body.request_id)

    async def _prefill(self, body: PrefillRequest) -> web.Response:
        engine, rid = self.runtime.engine, body.request_id
        dest = (body.bootstrap.transfer_host, body.bootstrap.transfer_port)
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
            outcome = await self._send(body, output.lease, len(prompt), output.token_ids[0], dest)
            if not outcome.ok:
                cause = ""  # decode gave the verdict (or is unreachable): nothing to tell it
                self.runtime.count_abort(abort_cause(outcome.reason))
                await engine.abort(rid, str(outcome.reason))
                raise OpenAIError(502, f"KV transfer failed: {outcome.reason}: {outcome.detail}", code=f"kv_transfer_{outcome.reason}")
            await engine.release(rid)
            cause = ""
            # TODO(manifest first-token record): the first token's logprobs go to the router in the
            # result for now; once the manifest carries them, send them there (KVSender.send) instead.
            first = output.logprobs[0] if output.logprobs else None
            result = PrefillResult(request_id=rid, chunks=outcome.chunks, bytes=outcome.bytes, first_token=first)
            return web.json_response(result.model_dump(mode="json"))
        finally:
            if cause:
                await asyncio.shield(self._abort(rid, dest, cause, tell_decode))

    async def _send(
        self, body: PrefillRequest, lease: Lease, kv_tokens: int, first_token: int, dest: tuple[str, int]
    ) -> TransferOutcome:
        bootstrap = body.bootstrap
        pages = self.pool.pages_for(kv_tokens)
        if pages != len(bootstrap.page_ids) or kv_tokens != bootstrap.num_tokens:
            raise OpenAIError(
                500,
                f"decode planned {bootstrap.num_tokens} tokens in {len(bootstrap.page_ids)} pages, prefill has "
                f"{kv_tokens} tokens in {pages} pages (page sizes differ?)",
                code="kv_plan_mismatch",
            )
        chunks = self._chunks(lease, lease.page_ids[:pages], bootstrap.page_ids)
        return await self.sender.send(body.request_id, dest, bootstrap.page_ids, bootstrap.generations, chunks, first_token=first_token)

    async def _chunks(self, lease: Lease, source: Sequence[int], destination: Sequence[int]) -> AsyncIterator[KVChunk]:
        for start in range(0, len(source), self.chunk_pages):
            end = start + self.chunk_pages
            pages = self.pool.export_pages(lease, source[start:end])  # refuses a stale lease (S5)
            payload = pages.reshape(-1).view(torch.uint8).cpu().numpy()
            yield KVChunk(destination[start:end], memoryview(payload))

    async def _abort(self, rid: str, dest: tuple[str, int], cause: str, tell_decode: bool) -> None:
        """Free this side and tell decode (S4); the router tells decode too, so either suffices."""
        if await self.runtime.engine.abort(rid, cause):
            self.runtime.count_abort(cause)
        if not tell_decode:
            return
        try:
            await self.sender.abort(rid, dest, cause)
        except (OSError, TimeoutError) as exc:
            log.warning("could not tell decode at %s to abort %s: %s", dest, rid, exc)
