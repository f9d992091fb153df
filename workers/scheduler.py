"""Continuous batching: a FIFO waiting queue, page allocation at admission, the running batch.

Every page a request can ever need (prompt + max_tokens; prompt only on a prefill worker) is
allocated when it is admitted, so a running request never waits for memory and the pool can
never deadlock: when the head of the queue does not fit, it and everyone behind it wait until
pages are freed (FIFO, no starvation, no over-allocation).
"""

from __future__ import annotations

from collections import deque

from kvguard.workers.kv_pool import KVPool
from kvguard.workers.request import Request, RequestMode, RequestState


class Scheduler:
    def __init__(self, pool: KVPool, max_running: int, max_prefill_tokens: int) -> None:
        self.pool = pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # DECODING, in the order they joined
        self.holding: dict[str, Request] = {}  # every request that holds a lease

    def add(self, request: Request) -> None:
        """Queue an ADMITTED request for pages."""
        self.waiting.append(request)

    def pages_needed(self, request: Request) -> int:
        tokens = len(request.prompt_ids) if request.mode == RequestMode.PREFILL_ONLY else request.max_total_tokens
        return self.pool.pages_for(tokens)

    def admit(self) -> tuple[list[Request], list[Request]]:
        """Give pages to waiting requests in FIFO order while they fit. Returns (to prefill now,
        newly PREALLOCATED decode-only requests)."""
        prefill: list[Request] = []
        preallocated: list[Request] = []
        prefill_tokens = 0
        while self.waiting and len(self.holding) < self.max_running:
            request = self.waiting[0]
            computes = request.mode != RequestMode.DECODE_ONLY
            if computes and prefill and prefill_tokens + len(request.prompt_ids) > self.max_prefill_tokens:
                break
            if not self._allocate_head():
                break
            if computes:
                request.move_to(RequestState.PREFILLING)
                prefill.append(request)
                prefill_tokens += len(request.prompt_ids)
            else:
                request.move_to(RequestState.PREALLOCATED)
                preallocated.append(request)
        return prefill, preallocated

    def admit_decode_only(self) -> list[Request]:
        """Pages now, outside a step, for the decode-only requests at the head of the queue (FIFO
        kept): they compute nothing, so waiting for the next step would only delay the bootstrap."""
        preallocated: list[Request] = []
        while self.waiting and self.waiting[0].mode == RequestMode.DECODE_ONLY and len(self.holding) < self.max_running:
            request = self.waiting[0]
            if not self._allocate_head():
                break
            request.move_to(RequestState.PREALLOCATED)
            preallocated.append(request)
        return preallocated

    def _allocate_head(self) -> bool:
        request = self.waiting[0]
        tokens = len(request.prompt_ids) if request.mode == RequestMode.PREFILL_ONLY else request.max_total_tokens
        lease = self.pool.allocate(request.request_id, tokens)
        if lease is None:
            return False
        self.waiting.popleft()
        request.lease = lease
        self.holding[request.request_id] = request
        return True

    def start_running(self, request: Request) -> None:
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Drop the request from every queue and free its pages (idempotent)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.holding.pop(request.request_id, None)
        if request.lease is not None:
            self.pool.free(request.lease)

    def has_work(self) -> bool:
        """True while a step can make progress (a waiting request may fit, or a batch runs)."""
        return bool(self.running) or (bool(self.waiting) and self._head_fits())

    def _head_fits(self) -> bool:
        head = self.waiting[0]
        return len(self.holding) < self.max_running and self.pages_needed(head) <= self.pool.free_pages
