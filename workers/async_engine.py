"""Run an `Engine` on a background thread and use it from asyncio.

The engine is single-threaded; every call below is shipped to its thread as a command and
applied between steps, so submit/abort/start_decode are safe from any event loop. Outputs are
delivered to per-request `RequestStream`s. The pool's transfer hooks (`engine.pool.export_pages`,
`import_pages`) are thread-safe and may be called directly (e.g. via `asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from kvguard.workers.engine import Engine
from kvguard.workers.kv_pool import Lease
from kvguard.workers.request import EngineError, RequestOutput, RequestState, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
T = TypeVar("T")


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a command's future unless its awaiter gave up (cancelled) -- never raise here:
    an exception on the engine thread would stop the engine."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class RequestStream:
    """Async iterator over one request's outputs; ends after its final output (FINISHED,
    ABORTED, DONE, or TRANSFERRING on a prefill worker)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._ended = False

    def _put_threadsafe(self, output: RequestOutput) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        output = await self._queue.get()
        self._ended = output.finished
        return output

    async def next_output(self) -> RequestOutput:
        return await self.__anext__()


class AsyncEngine:
    def __init__(self, engine: Engine, integrity_interval: float = 1.0) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the engine thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._integrity_interval = integrity_interval
        self.integrity_error: AssertionError | None = None

    # ------------------------------------------------------------------------ thread control

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvguard-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Abort everything still live, then stop the thread."""
        if self._thread is None:
            return
        await self.call(lambda: [self.engine.abort(rid, "shutdown") for rid in list(self.engine.requests)])
        self._stop.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the engine thread between steps and return its result (or raise)."""
        self.start()
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._stop.is_set():
            self._drain_commands()
            if self.engine.has_work():
                self._step()
                continue
            if time.monotonic() - last_check > self._integrity_interval:
                last_check = time.monotonic()
                self._check_integrity()
            try:
                fn, future = self._commands.get(timeout=0.05)
            except queue.Empty:
                continue
            self._execute(fn, future)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            self._execute(fn, future)

    def _execute(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        # The command runs even if its awaiter was cancelled meanwhile: its effect (a request
        # added, an abort) must happen in order with the commands queued after it.
        try:
            result = fn()
        except BaseException as exc:  # delivered to the awaiting coroutine
            _settle(future, exc=exc)
        else:
            _settle(future, result=result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug must not kill the worker: fail what is live, keep serving
            log.exception("engine step failed; aborting live requests")
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id, "engine_error")
            outputs = self.engine.drain_outputs()
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put_threadsafe(output)
            if output.finished:
                del self._streams[output.request_id]

    def _check_integrity(self) -> None:
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            self.integrity_error = exc
            log.error("KV pool integrity check failed: %s", exc)

    # ----------------------------------------------------------------------------- requests

    async def _open(self, request_id: str, add: Callable[[], Any]) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def register() -> None:
            if request_id in self._streams:
                from kvguard.workers.request import DuplicateRequestId
                raise DuplicateRequestId(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            try:
                add()
            except EngineError:
                del self._streams[request_id]
                raise

        await self.call(register)
        return stream

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Colocated request. Raises `EngineError` at intake (S2: nothing allocated, no stream)."""
        return await self._open(request_id, lambda: self.engine.add_request(request_id, prompt_ids, params))

    async def prefill(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestOutput:
        """Prefill-only: waits for pages and the prefill; returns the TRANSFERRING output (first
        token, `lease` to export) or the ABORTED one. Call `release()` after exporting."""
        stream = await self._open(request_id, lambda: self.engine.add_prefill_request(request_id, prompt_ids, params))
        return await stream.next_output()

    async def preallocate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> tuple[Lease | None, RequestStream]:
        """Decode-only: waits until destination pages are allocated (PREALLOCATED). Returns the
        lease (None if aborted while waiting) and the stream that will carry the tokens after
        `start_decode()`."""
        stream = await self._open(request_id, lambda: self.engine.add_decode_request(request_id, prompt_ids, params))
        first = await stream.next_output()
        if first.state != RequestState.PREALLOCATED:
            return None, stream
        return first.lease, stream

    async def mark_receiving(self, request_id: str) -> None:
        await self.call(lambda: self.engine.mark_receiving(request_id))

    async def start_decode(self, request_id: str, first_token: int, *, require_written: bool = True,
                           first_logprob: TokenLogprob | None = None) -> None:
        """S3 check then decode from `first_token` (with its logprobs as prefill computed them, when
        known); raises `KVNotWritten` (request failed) if not all written."""
        await self.call(lambda: self.engine.start_decode(request_id, first_token, require_written=require_written,
                                                         first_logprob=first_logprob))

    async def release(self, request_id: str) -> None:
        await self.call(lambda: self.engine.release(request_id))

    async def abort(self, request_id: str, cause: str = "client") -> bool:
        return await self.call(lambda: self.engine.abort(request_id, cause))
