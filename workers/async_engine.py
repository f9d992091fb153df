"""Run an `Engine` on a background thread and use it from asyncio.

The engine is single-threaded; every call below is shipped to its thread as a command and
applied between steps, so submit/abort/start_decode are safe from any event loop. Outputs are
delivered to per-request `RequestStream`s, one hand-off per engine step and event loop (not one
per token: each `call_soon_threadsafe` wakes the loop through its self-pipe, and at 16 requests a
per-output hand-off was a tenth of a decode worker's time). Outputs a command produced (an abort,
the first token after `start_decode`, a decode request's pages) go out when the command returns,
without waiting for the next step. The pool's transfer hooks (`engine.pool.export_pages`,
`import_pages`) are thread-safe and may be called directly (e.g. via `asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol, TypeVar

from kvguard.workers.engine import Engine
from kvguard.workers.kv_pool import Lease
from kvguard.workers.request import (
    DuplicateRequestId,
    Request,
    RequestOutput,
    RequestState,
    SamplingParams,
    TokenLogprob,
)

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


class StepRelay(Protocol):
    """Where the outputs of streams forwarded to it go instead (decode's token channel): it is
    handed each output of an engine step, then told the step's outputs are all in (`flush`), so it
    can send them together."""

    def add(self, stream: RequestStream, output: RequestOutput) -> None: ...

    def flush(self) -> None: ...


class RequestStream:
    """One request's outputs, in order, on its consumer's event loop; ends after its final output
    (FINISHED, ABORTED, DONE, or TRANSFERRING on a prefill worker). Read one at a time
    (`async for`, `next_output`) or everything that has arrived at once (`next_batch`), or have
    them forwarded to a `StepRelay` (`forward_to`)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.relay: StepRelay | None = None
        self._outputs: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the final output was handed to the consumer

    def forward_to(self, relay: StepRelay) -> None:
        """From now on every output goes to `relay` (those not yet read first), not to a reader.
        On the consumer's loop."""
        self.relay = relay
        while self._outputs and not self._ended:
            output = self._outputs.popleft()
            self._ended = output.finished
            relay.add(self, output)
        relay.flush()

    def _push(self, output: RequestOutput) -> None:
        """On the consumer's loop (see `_deliver`)."""
        self._outputs.append(output)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._outputs:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        await self._wait()
        output = self._outputs.popleft()
        self._ended = output.finished
        return output

    async def next_output(self) -> RequestOutput:
        return await self.__anext__()

    async def next_batch(self) -> list[RequestOutput]:
        """Every output that has arrived (at least one), up to and including the final one; [] once
        the final output was read."""
        if self._ended:
            return []
        await self._wait()
        batch = []
        while self._outputs and not self._ended:
            output = self._outputs.popleft()
            self._ended = output.finished
            batch.append(output)
        return batch


def _log_failure(future: Future[Any]) -> None:
    if (exc := future.exception()) is not None:  # e.g. the request was aborted before it ran
        log.debug("posted engine command failed: %s", exc)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On a consumer loop: one engine step's outputs for the streams of that loop, each relay told
    once that the step's outputs are in."""
    relays: dict[int, StepRelay] = {}
    for stream, output in items:
        if stream.relay is None:
            stream._push(output)
        else:
            stream.relay.add(stream, output)
            relays[id(stream.relay)] = stream.relay
    for relay in relays.values():
        relay.flush()


class AsyncEngine:
    def __init__(self, engine: Engine, integrity_interval: float = 1.0, step_delay_s: float = 0.0) -> None:
        self.engine = engine
        self._step_delay_s = step_delay_s  # FAULT delay_step_ms: a generation paced, whatever the machine's speed
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._integrity_interval = integrity_interval
        self._checked_changes = -1  # the pool's `changes` when integrity last held
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

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn()` on the engine thread between steps; nobody waits for it (errors are logged)."""
        self.start()
        future: Future[Any] = Future()
        future.add_done_callback(_log_failure)
        self._commands.put((fn, future))

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
        # What the command produced (an abort, a first token, pages) goes out now, not a step later.
        self._dispatch(self.engine.drain_outputs())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug must not kill the worker: fail what is live, keep serving
            # (A failing forward pass never gets here: the engine isolates the requests that
            # fail it, Engine._run_isolating. This is a bug in the step's own bookkeeping.)
            log.exception("engine step failed outside a forward pass; aborting live requests")
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id, "engine_error")
            outputs = self.engine.drain_outputs()
        self._dispatch(outputs)
        if self._step_delay_s:
            self._pause(self._step_delay_s)

    def _pause(self, seconds: float) -> None:
        """FAULT delay_step_ms: no step for `seconds`; commands (an abort, a new request, the stop's
        own) still run meanwhile, so a paced engine answers, and stops, as soon as an unpaced one."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            try:
                fn, future = self._commands.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            self._execute(fn, future)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One hand-off per consumer loop for all of these outputs."""
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = output.request.sink if output.request is not None else None
            if isinstance(stream, RequestStream):
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass

    def _check_integrity(self) -> None:
        """While idle, at most once per interval, and only if the pool changed since it last held:
        on a default-sized pool (222k pages for the tiny model) each check is ~50 ms of Python, which
        an idle worker spent every second."""
        changes = self.engine.pool.changes  # read first: a change during the check is checked next time
        if changes == self._checked_changes:
            return
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            self.integrity_error = exc
            log.error("KV pool integrity check failed: %s", exc)
        else:
            self._checked_changes = changes

    # ----------------------------------------------------------------------------- requests

    async def _open(self, request_id: str, add: Callable[[], Request]) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def register() -> None:
            if request_id in self.engine.requests:
                raise DuplicateRequestId(f"request id {request_id!r} is already in use")
            add().sink = stream  # before any output of it can be dispatched (same thread)

        await self.call(register)
        return stream

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Colocated request. Raises `EngineError` at intake (S2: nothing allocated, no stream)."""
        return await self._open(request_id, lambda: self.engine.add_request(request_id, prompt_ids, params))

    async def open_prefill(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Prefill-only, admitted (raises `EngineError` at intake): its stream's one output is the
        TRANSFERRING one (first token, `lease` to export) or the ABORTED one. Call `release()`
        after exporting."""
        return await self._open(request_id, lambda: self.engine.add_prefill_request(request_id, prompt_ids, params))

    async def prefill(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestOutput:
        """`open_prefill`, then its output."""
        return await (await self.open_prefill(request_id, prompt_ids, params)).next_output()

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

    def mark_receiving(self, request_id: str) -> None:
        """The first KV chunk arrived (PREALLOCATED -> RECEIVING). Not awaited: the chunk's pages are
        imported meanwhile, and a request aborted in between refuses them by its lease (S5)."""
        self.post(lambda: self.engine.mark_receiving(request_id))

    async def start_decode(self, request_id: str, first_token: int, *, require_written: bool = True,
                           first_logprob: TokenLogprob | None = None) -> None:
        """S3 check then decode from `first_token` (with its logprobs as prefill computed them, when
        known); raises `KVNotWritten` (request failed) if not all written. The first token is on
        the request's stream when this returns."""
        await self.call(lambda: self.engine.start_decode(request_id, first_token, require_written=require_written,
                                                         first_logprob=first_logprob))

    async def release(self, request_id: str) -> None:
        await self.call(lambda: self.engine.release(request_id))

    async def abort(self, request_id: str, cause: str = "client") -> bool:
        return await self.call(lambda: self.engine.abort(request_id, cause))
