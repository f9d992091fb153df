"""The engine: model + tagged KV pool + scheduler, stepped by one thread.

Three ways to run a request (see `request.py` for the lifecycle):
- colocated: `add_request` -> `step()` until FINISHED;
- prefill worker: `add_prefill_request` -> after its prefill step the request is TRANSFERRING
  with its first token sampled and its pages kept; export them with `pool.export_pages(lease)`,
  then `release()`;
- decode worker: `add_decode_request` -> a step allocates pages for prompt + max_tokens
  (PREALLOCATED, `request.lease` tells prefill where to write) -> `pool.import_pages(...)`
  -> `start_decode(request_id, first_token)` checks that every page it will read was written in
  its current generation (S3) -> DECODING.

Every step verifies the leases of the whole batch in one gather-and-compare before attention
reads (S1): a request whose lease is stale has its writes redirected to the scratch page, its
output discarded, and fails alone with `TagViolation`; the rest of the batch continues.
Not thread-safe: drive it from one thread (see `async_engine.py`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvguard.workers import device as dev
from kvguard.workers.config import EngineConfig
from kvguard.workers.kv_pool import KVPool
from kvguard.workers.metrics import EngineMetrics
from kvguard.workers.model import AttentionBatch, CausalLM, ModelArgs, generation_eos_ids, length_groups, load_model
from kvguard.workers.request import (
    TERMINAL,
    ContextLengthExceeded,
    DuplicateRequestId,
    EngineError,
    InvalidRequest,
    KVNotWritten,
    Request,
    RequestAborted,
    RequestMode,
    RequestOutput,
    RequestState,
    SamplingParams,
    StepFailed,
    TagViolation,
    TokenLogprob,
)
from kvguard.workers.sampling import Sampled, sample
from kvguard.workers.scheduler import Scheduler
from kvguard.workers.stops import StopMatcher
from kvguard.workers.tokenizer import IncrementalDetokenizer, Tokenizer

S = RequestState
log = logging.getLogger("kvguard.engine")
GROUP_OVERHEAD_ELEMENTS = 32768


@dataclass(frozen=True)
class Picks:
    """What one forward pass decided, on the host (the step's single host sync): per row the
    sampled token, whether its lease held (S1), and the logprob record of the rows that asked."""

    tokens: list[int]
    ok: list[bool]
    logprobs: dict[int, TokenLogprob]

    @classmethod
    def of(cls, sampled: Sampled, ok: torch.Tensor | None) -> Picks:
        tokens = sampled.tokens
        if ok is None:
            token_list, ok_list = tokens.tolist(), [True] * tokens.shape[0]
        else:
            token_list, ok_list = torch.stack((tokens, ok.to(tokens.dtype))).tolist()
        return cls(token_list, [bool(fine) for fine in ok_list], sampled.logprob_records(token_list))


def plan_pool_pages(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device, weight_bytes: int) -> int:
    """KV pool pages: `kv_pool_tokens` if given, else SGLang's rule
    `(free_after_weights - total * (1 - fraction)) / bytes_per_token`, rounded down to pages.
    On CUDA the weights are already loaded (free is measured after them); on CPU they are
    subtracted from the configured budget.

    Engines sharing one GPU (`kvguard serve` runs prefill and decode on it) each take their
    `device_share` of it: weights + KV within `total * fraction * share`, leaving their share of
    the headroom free. SGLang's rule alone lets the first engine up take the whole fraction, and
    the second, finding nothing left, fails to start; with shares neither depends on which
    measured first."""
    if config.kv_pool_tokens is not None:
        return config.kv_pool_tokens // config.page_size
    free, total = dev.memory_info(device, config.cpu_memory_bytes)
    if device.type == "cpu":  # a configured budget per process: no device to share
        budget = free - weight_bytes - total * (1 - config.kv_memory_fraction)
    else:
        share = config.device_share
        budget = min(total * config.kv_memory_fraction * share - weight_bytes, free - total * (1 - config.kv_memory_fraction) * share)
    pages = int(budget // (args.kv_bytes_per_token(dtype) * config.page_size))
    if pages < 1:
        raise ValueError(f"no memory left for a KV pool: budget {budget:.0f} bytes after weights")
    return pages


@dataclass
class StepInputs:
    """Host-side inputs of one forward pass, built in plain Python before anything touches the
    device: rows are the prefill requests (whole prompt each), then the decode requests (one token
    each, at the position after their last one)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat pool slot of each token's K/V
    scratch_slots: list[int] = field(default_factory=list)  # where it goes instead if the lease is stale (S1)
    cu_seqlens: list[int] = field(default_factory=lambda: [0])  # prefill rows' token bounds
    sample_rows: list[int] = field(default_factory=list)  # hidden row to sample each request from
    row_tokens: list[int] = field(default_factory=list)
    row_pages: list[int] = field(default_factory=list)  # lease pages each row must still hold
    read_tokens: list[int] = field(default_factory=list)  # positions each row reads (0: writes only)
    stamp_pages: list[int] = field(default_factory=list)  # S5: what this pass writes, per page
    stamp_generations: list[int] = field(default_factory=list)
    stamp_start: list[int] = field(default_factory=list)
    stamp_end: list[int] = field(default_factory=list)
    stamp_counts: list[int] = field(default_factory=list)  # stamp entries per row

    @classmethod
    def build(cls, prefill: Sequence[Request], decode: Sequence[Request], page_size: int, scratch_page: int) -> StepInputs:
        step = cls()
        for request in prefill:
            step._add_prompt(request, page_size)
        for request in decode:
            step._add_decode_token(request, page_size)
        step.scratch_slots = [scratch_page * page_size + p % page_size for p in step.positions]
        return step

    def token_columns(self) -> list[list[int]]:
        return [self.input_ids, self.positions, self.slots, self.scratch_slots]

    def row_columns(self) -> list[list[int]]:
        return [self.row_pages, self.read_tokens, self.row_tokens, self.sample_rows]

    def stamp_columns(self) -> list[list[int]]:
        return [self.stamp_pages, self.stamp_generations, self.stamp_start, self.stamp_end]

    def _add_prompt(self, request: Request, ps: int) -> None:
        lease, n = request.lease, len(request.prompt_ids)
        assert lease is not None
        pages = -(-n // ps)
        self.input_ids += request.prompt_ids
        self.positions += range(n)
        self.slots += [lease.page_ids[p // ps] * ps + p % ps for p in range(n)]
        self.cu_seqlens.append(self.cu_seqlens[-1] + n)
        self.sample_rows.append(self.cu_seqlens[-1] - 1)
        self.row_tokens.append(n)
        self.row_pages.append(pages)
        self.read_tokens.append(0)
        self.stamp_pages += lease.page_ids[:pages]
        self.stamp_generations += lease.generations[:pages]
        self.stamp_start += [0] * pages
        self.stamp_end += [min(ps, n - i * ps) for i in range(pages)]
        self.stamp_counts.append(pages)

    def _add_decode_token(self, request: Request, ps: int) -> None:
        lease, position = request.lease, request.num_tokens - 1  # the last sampled token's position
        assert lease is not None
        page, offset = position // ps, position % ps
        self.sample_rows.append(len(self.input_ids))
        self.input_ids.append(request.output_ids[-1])
        self.positions.append(position)
        self.slots.append(lease.page_ids[page] * ps + offset)
        self.row_tokens.append(1)
        self.row_pages.append(page + 1)
        self.read_tokens.append(position)
        self.stamp_pages.append(lease.page_ids[page])
        self.stamp_generations.append(lease.generations[page])
        self.stamp_start.append(offset)
        self.stamp_end.append(offset + 1)
        self.stamp_counts.append(1)


class Engine:
    def __init__(self, config: EngineConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.device = dev.resolve_device(config.device)
        self.args = ModelArgs.from_dir(config.model_dir)
        generation_eos = generation_eos_ids(config.model_dir)  # read before the weights: a bad file fails fast
        self.dtype = (dev.default_dtype(self.device, self.args.torch_dtype)
                      if config.dtype == "auto" else dev.resolve_dtype(config.dtype))
        max_len = self.args.max_position_embeddings
        if config.context_length is not None and config.context_length > max_len:
            raise ValueError(f"context_length {config.context_length} exceeds the model's maximum {max_len}")
        self.context_length = config.context_length or max_len
        window = self.args.sliding_window
        if window is not None and self.context_length > window:  # beyond it, full attention differs from the model's
            raise ValueError(f"config.json sliding_window {window}: sliding-window attention is not implemented; "
                             f"serve a context of at most {window} tokens (context_length), not {self.context_length}")
        dev.seed_everything(config.seed)
        self.model: CausalLM = load_model(config.model_dir, self.device, self.dtype)
        self.model.init_rope(self.context_length, self.device)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        pages = plan_pool_pages(config, self.args, self.dtype, self.device, weight_bytes)
        self.pool = KVPool(
            num_layers=self.args.num_layers, num_kv_heads=self.args.num_kv_heads, head_dim=self.args.head_dim,
            page_size=config.page_size, num_pages=pages, dtype=self.dtype, device=self.device, tags=config.tags,
        )
        self.scheduler = Scheduler(self.pool, config.max_running_requests, config.max_prefill_tokens)
        self.metrics = EngineMetrics(registry)
        self.metrics.pool_capacity_tokens.set(self.pool.capacity_tokens)
        self.metrics.context_length_tokens.set(self.context_length)
        self.metrics.pool_used_tokens.set_function(lambda: self.pool.used_tokens)
        # Read when scraped, like the pool: an idle worker (released after its transfer, or waiting
        # because the head of the queue does not fit) does not step, so a value set per step goes stale.
        self.metrics.running_requests.set_function(lambda: len(self.scheduler.holding))
        self.metrics.waiting_requests.set_function(lambda: len(self.scheduler.waiting))
        eos = set(self.args.eos_token_ids) | set(generation_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}  # every request not yet in a terminal state
        self._pending: list[RequestOutput] = []
        self._seeds = random.Random(config.seed)
        # A decode attention group's fixed cost (gather + attention calls) is about that of
        # gathering GROUP_OVERHEAD_ELEMENTS K/V elements (measured on CPU, tiny and 25M models).
        self._group_overhead_pages = GROUP_OVERHEAD_ELEMENTS / (
            config.page_size * self.args.num_kv_heads * self.args.head_dim)

    # ----------------------------------------------------------------------------- intake (S2)

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Colocated request: prefill then decode here. Raises `EngineError` (nothing allocated)."""
        return self._intake(request_id, prompt_ids, params, RequestMode.COLOCATED)

    def add_prefill_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Prefill-only request: ends TRANSFERRING with its first token and pages kept; `release()` it."""
        return self._intake(request_id, prompt_ids, params, RequestMode.PREFILL_ONLY)

    def add_decode_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Decode-only request: its destination pages are allocated now if they fit and nothing waits
        ahead of it, else by a later step; either way a PREALLOCATED output tells where they are."""
        request = self._intake(request_id, prompt_ids, params, RequestMode.DECODE_ONLY)
        self._pending += [self._preallocated(r) for r in self.scheduler.admit_decode_only()]
        return request

    def check_fits(self, prompt_tokens: int, max_tokens: int, mode: RequestMode = RequestMode.COLOCATED) -> None:
        """S2: raise `ContextLengthExceeded` if such a request can never run here."""
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthExceeded(prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                        limit=self.context_length, limit_kind="context_length")
        stored = prompt_tokens if mode == RequestMode.PREFILL_ONLY else prompt_tokens + max_tokens
        if self.pool.pages_for(stored) > self.pool.num_pages:
            raise ContextLengthExceeded(prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                        limit=self.pool.capacity_tokens, limit_kind="kv_pool")

    def _intake(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, mode: RequestMode) -> Request:
        if params.max_tokens is None:  # OpenAI's default: the rest of the context
            params = params.model_copy(update={"max_tokens": max(1, self.context_length - len(prompt_ids))})
        request = Request(request_id, list(prompt_ids), params, mode)
        try:
            if request_id in self.requests:
                raise DuplicateRequestId(f"request id {request_id!r} is already in use")
            if not request.prompt_ids:
                raise InvalidRequest("prompt: must contain at least one token", param="prompt")
            if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.args.vocab_size:
                raise InvalidRequest(f"prompt: token ids must be in [0, {self.args.vocab_size})", param="prompt")
            self._check_token_ids(params)
            self.check_fits(len(request.prompt_ids), request.max_tokens, mode)
        except EngineError as error:
            request.move_to(S.REJECTED)
            self.metrics.rejected.labels(reason=error.code).inc()
            self.metrics.requests.labels(outcome="rejected").inc()
            raise
        request.move_to(S.ADMITTED)
        self._prepare_sampling(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.args.vocab_size
        for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise InvalidRequest(f"{param}: token ids must be in [0, {vocab})", param=param)

    def _prepare_sampling(self, request: Request) -> None:
        """Per-request sampling and text state (each bounded by the request's own limits)."""
        params = request.params
        request.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request.generator = dev.make_generator(self.device, request.seed & 0x7FFFFFFFFFFFFFFF)
        request.end_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids)
            request.stops = StopMatcher(params.stop)

    # ------------------------------------------------------------------------ lifecycle control

    def abort(self, request_id: str, cause: str = "client") -> bool:
        """End a request in any state, freeing everything it holds (S4). False if unknown/ended."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._fail_now(request, RequestAborted(cause), outcome="aborted")
        return True

    def release(self, request_id: str) -> None:
        """Prefill worker: the KV has been exported; TRANSFERRING -> DONE, pages freed."""
        request = self._get(request_id, S.TRANSFERRING)
        request.move_to(S.DONE)
        self._retire(request, outcome="finished")

    def mark_receiving(self, request_id: str) -> None:
        """Decode worker: the first KV chunk arrived (PREALLOCATED -> RECEIVING)."""
        self._get(request_id, S.PREALLOCATED).move_to(S.RECEIVING)

    def start_decode(self, request_id: str, first_token: int, *, require_written: bool = True,
                     first_logprob: TokenLogprob | None = None) -> None:
        """Decode worker: all KV is in. S3: unless `require_written` is False (only the
        `unsafe_reject_path` fault passes False), every page holding the prompt must have been
        written in its current generation, else the request fails with `KVNotWritten` (raised).
        The first token is emitted by the next `step()`; decoding continues from it. Its logprobs were
        computed where it was sampled (prefill): `first_logprob`, when known here."""
        request = self._get(request_id, S.PREALLOCATED, S.RECEIVING)
        assert request.lease is not None
        if not 0 <= first_token < self.args.vocab_size:
            error: EngineError = InvalidRequest(f"first token {first_token} is out of range")
            self._fail_now(request, error, outcome="failed")
            raise error
        if require_written and self.pool.tags and not self.pool.lease_written(request.lease, len(request.prompt_ids)):
            error = KVNotWritten(f"request {request_id}: not every prompt page was written by this transfer")
            self._fail_now(request, error, outcome="failed")
            raise error
        request.move_to(S.VERIFIED)
        if request.params.logprobs is not None and first_logprob is None:
            first_logprob = TokenLogprob(token_id=first_token, logprob=None)
        self._pending.append(self._on_token(request, first_token, first_logprob))

    @staticmethod
    def _preallocated(request: Request) -> RequestOutput:
        return RequestOutput(request.request_id, request.state, lease=request.lease, request=request)

    def _get(self, request_id: str, *states: RequestState) -> Request:
        request = self.requests.get(request_id)
        if request is None or request.state not in states:
            have = "unknown" if request is None else request.state.name
            raise InvalidRequest(f"request {request_id!r} is {have}, expected {'/'.join(s.name for s in states)}")
        return request

    # ------------------------------------------------------------------------------- stepping

    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Admit what fits, then run one forward pass over the newly admitted prompts and one token
        of every decoding request together. Returns what happened."""
        outputs, self._pending = self._pending, []
        prefill, preallocated = self.scheduler.admit()
        outputs += [self._preallocated(r) for r in preallocated]
        # Longest first: decode attention groups rows of similar length (model.length_groups).
        decode = sorted(self.scheduler.running, key=lambda r: r.num_tokens, reverse=True)
        if prefill or decode:
            outputs += self._run_isolating(prefill, decode)
            if prefill:
                self.metrics.step_prompts.observe(len(prefill))
            if decode:
                self.metrics.step_decodes.observe(len(decode))
        return outputs

    def _run_isolating(self, prefill: list[Request], decode: list[Request]) -> list[RequestOutput]:
        """One forward pass and its outputs. When the pass raises, the same requests run again in
        two halves, recursively, so that only a request whose pass fails on its own ends
        (`StepFailed`): one tenant's input that trips a bug, or a batch too large for the device,
        does not end everyone's request. A failed pass leaves nothing a retry could trip over: a
        page is stamped written (S5) only after the pass wrote it, so no read of a half-written
        page passes S1 and a retry writes the same K/V again; and no request's state has changed
        yet (`_collect` runs once, after a pass that returned). At most 2B - 1 passes for
        B requests, and only on failure. A retried request samples what it would have: sampling is
        seeded per token index (`sampling.token_seed`)."""
        try:
            picks = self._run_batch(prefill, decode)
        except Exception as exc:
            requests = prefill + decode
            if len(requests) == 1:
                log.exception("forward pass failed for request %s alone; it ends", requests[0].request_id)
                return [self._end_with_error(requests[0], StepFailed.of(exc), outcome="failed")]
            log.warning("forward pass of %d requests failed (%s: %s); retrying in halves", len(requests),
                        type(exc).__name__, exc)
            half = len(requests) // 2  # of `prefill + decode`, each half keeping that order
            cut = max(0, half - len(prefill))
            outputs = self._run_isolating(prefill[:half], decode[:cut])
            return outputs + self._run_isolating(prefill[half:], decode[cut:])
        return self._collect(prefill + decode, picks)

    def _run_batch(self, prefill: list[Request], decode: list[Request]) -> Picks:
        """One forward pass: prompts first (causal within each), then decode tokens (paged reads).
        Decode requests do not wait while others prefill: on a Python-bound model a separate
        prefill pass costs about as much as a decode step, once per admitted request. Changes no
        request's state: `_collect` applies what it picked."""
        step = StepInputs.build(prefill, decode, self.pool.page_size, self.pool.scratch_page)
        requests = prefill + decode
        # Host lists go to the device in three transfers: per token, per row, per stamp.
        input_ids, positions, slots, scratch_slots = self._tensor(step.token_columns())
        row_pages, read_tokens, row_tokens, sample_rows = self._tensor(step.row_columns())
        table, granted = self._lease_tables(requests, step.row_pages, generations=self.pool.tags)
        ok = None
        if granted is not None:
            # S1 (reads of decode rows) and S5 (writes of every row), one gather-and-compare.
            ok = self.pool.verify_reads(table, granted, None, read_tokens)
            slots = torch.where(ok.repeat_interleave(row_tokens) if prefill else ok, slots, scratch_slots)
        batch = AttentionBatch(slots, cu_seqlens=step.cu_seqlens if prefill else None)
        if decode:
            decode_pages = step.row_pages[len(prefill):]
            batch.page_table = table[len(prefill):, : decode_pages[0]]
            batch.seq_lens = read_tokens[len(prefill):] + 1
            batch.decode_groups = length_groups(decode_pages, self._group_overhead_pages)
        hidden = self.model(input_ids, positions, batch, self.pool.kv)
        last = hidden[sample_rows] if prefill else hidden  # decode rows are one token each
        sampled = sample(self.model.logits(last), requests)
        if ok is not None:
            self._stamp(step, ok, bool(prefill))
        picks = Picks.of(sampled, ok)
        if prefill:
            self.metrics.prompt_tokens.inc(step.cu_seqlens[-1])
        return picks

    def _tensor(self, ints: list[Any]) -> torch.Tensor:
        """int64 on the engine's device, from a list of ints or (equally long) nested lists of them."""
        return torch.tensor(ints, dtype=torch.int64, device=self.device)

    def _stamp(self, step: StepInputs, ok: torch.Tensor, has_prompts: bool) -> None:
        """S5: record what this pass wrote, where each row's lease was still current."""
        pages, generations, start, end = self._tensor(step.stamp_columns())
        mask = ok.repeat_interleave(self._tensor(step.stamp_counts)) if has_prompts else ok  # decode: 1 per row
        self.pool.stamp_written(pages, generations, start, end, mask)

    def _lease_tables(self, requests: list[Request], pages: list[int], generations: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, P] page ids and (if asked) granted generations, padded with (pad page, 0): such
        padding passes `verify_reads` by construction and decode attention masks it."""
        width, pad = max(pages), self.pool.pad_page
        leases = [r.lease for r in requests]
        ids = [list(lease.page_ids[:n]) + [pad] * (width - n) for lease, n in zip(leases, pages)]  # type: ignore[union-attr]
        if not generations:
            return self._tensor(ids), None
        gens = [list(lease.generations[:n]) + [0] * (width - n) for lease, n in zip(leases, pages)]  # type: ignore[union-attr]
        table, granted = self._tensor([ids, gens])
        return table, granted

    def _collect(self, requests: list[Request], picks: Picks) -> list[RequestOutput]:
        """Apply one pass's picks to its requests, in row order. A request whose bookkeeping
        raises (a bug on its token: the detokenizer, a stop string) ends alone, like a failed
        pass."""
        outputs = []
        for row, request in enumerate(requests):
            try:
                outputs.append(self._apply(request, picks.tokens[row], picks.ok[row], picks.logprobs.get(row)))
            except Exception as exc:
                log.exception("request %s failed on its token", request.request_id)
                if self.requests.get(request.request_id) is request:  # not already retired
                    outputs.append(self._end_with_error(request, StepFailed.of(exc), outcome="failed"))
        return outputs

    def _apply(self, request: Request, token: int, fine: bool, logprob: TokenLogprob | None) -> RequestOutput:
        if not fine:
            self.metrics.tag_violations.inc()
            error = TagViolation(f"request {request.request_id}: KV page lease is stale (S1); request failed")
            return self._end_with_error(request, error, outcome="failed")
        if request.state == S.PREFILLING and request.mode == RequestMode.PREFILL_ONLY:
            request.move_to(S.TRANSFERRING)
            request.output_ids.append(token)
            request.first_token_time = time.monotonic()
            record = [logprob] if logprob is not None else None
            return RequestOutput(request.request_id, request.state, [token], lease=request.lease, logprobs=record,
                                 request=request)
        return self._on_token(request, token, logprob)

    # ------------------------------------------------------------------- tokens and finishing

    def _on_token(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
        elif request.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - request.last_token_time)
        request.last_token_time = now
        request.output_ids.append(token)
        self.metrics.generation_tokens.inc()
        reason = self._finish_reason(request, token)
        # A token that ends the request (EOS, stop_token_ids) is generated and counted, but its own
        # text is not output (vLLM's meaning, without include_stop_str_in_output).
        text, stopped = self._text_delta(request, None if reason == "stop" else token, final=reason is not None)
        reason = "stop" if stopped else reason
        records = [logprob] if logprob is not None else None
        if reason is None:
            if request.state != S.DECODING:
                request.move_to(S.DECODING)
                self.scheduler.start_running(request)
            return RequestOutput(request.request_id, request.state, [token], text, logprobs=records, request=request)
        request.finish_reason = reason
        request.move_to(S.FINISHED)
        self._retire(request, outcome="finished")
        return RequestOutput(request.request_id, request.state, [token], text, logprobs=records, finish_reason=reason,
                             request=request)

    def _finish_reason(self, request: Request, token: int) -> str | None:
        if token in request.end_token_ids and len(request.output_ids) > request.params.min_tokens:
            return "stop"
        if len(request.output_ids) >= request.max_tokens:
            return "length"
        return None

    def _text_delta(self, request: Request, token: int | None, final: bool) -> tuple[str, bool]:
        """New text to emit and whether a stop string ended the request (`token` None: the request
        ended on a stop token, whose text is not output). Text that could be the start of a stop
        string is held back until it is known not to be one (workers/stops.py: linear in the text
        generated, whatever the stop strings)."""
        if request.detokenizer is None or request.stops is None:
            return "", False
        armed = len(request.output_ids) > request.params.min_tokens
        piece = request.detokenizer.finish() if token is None else request.detokenizer.push(token, final=final)
        text = request.stops.feed(piece, armed=armed, final=final)
        if text:
            request.emitted.append(text)
        return text, request.stops.stopped

    def _end_with_error(self, request: Request, error: EngineError, outcome: str) -> RequestOutput:
        request.error = error
        request.finish_reason = None
        request.move_to(S.ABORTED)
        self._retire(request, outcome=outcome)
        return RequestOutput(request.request_id, S.ABORTED, error=error, request=request)

    def _fail_now(self, request: Request, error: EngineError, outcome: str) -> None:
        """End a request outside a step; its ABORTED output goes out with the next step."""
        self._pending.append(self._end_with_error(request, error, outcome))

    def _retire(self, request: Request, outcome: str) -> None:
        """Terminal state reached: free pages, forget per-request state, count the outcome."""
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self.metrics.requests.labels(outcome=outcome).inc()

    # ------------------------------------------------------------------------------ helpers

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
        """Run prompts to completion (tests, benchmarks). Returns the finished requests in order;
        raises if one cannot finish: its pages are held by requests that take no step (a decode
        request awaiting its KV), where it returned it unfinished (an outside probe)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        base = f"gen-{time.monotonic_ns()}"
        requests = [self.add_request(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        while self.has_work():
            self.step()
        ended = TERMINAL | {RequestState.TRANSFERRING}  # a prefill request ends handing its KV over
        if stuck := [r.request_id for r in requests if r.state not in ended]:
            for request_id in stuck:  # not left queued, to run for nobody once the pool frees
                self.abort(request_id, "generate gave up")
            raise RuntimeError(f"generate: {len(stuck)} request(s) cannot finish ({stuck[0]}, ...): the pool is held by "
                               "requests that take no step")  # fmt: skip
        return requests

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, failures) without running a step."""
        outputs, self._pending = self._pending, []
        return outputs

    def check_integrity(self) -> None:
        """Pool integrity plus: every page-holding request is known and non-terminal."""
        self.pool.check_integrity()
        for request_id, request in self.scheduler.holding.items():
            assert self.requests.get(request_id) is request, f"{request_id} holds pages but is not live"
        assert len(self.pool.live_leases()) == len(self.scheduler.holding), "a lease has no live request"
