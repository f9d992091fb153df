"""Admission and the waiting queue: S2 rejection before allocation, waiting on a full pool, FIFO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_device import TEST_DEVICE
from pydantic import ValidationError

from kvguard.workers.config import EngineConfig
from kvguard.workers.engine import Engine
from kvguard.workers.kv_pool import KVPool
from kvguard.workers.request import (
    ContextLengthExceeded,
    DuplicateRequestId,
    InvalidRequest,
    Request,
    RequestMode,
    RequestState,
    SamplingParams,
)
from kvguard.workers.scheduler import Scheduler


def engine(model_dir: Path, **kw) -> Engine:
    return Engine(EngineConfig(model_dir, device=TEST_DEVICE, **{"kv_pool_tokens": 256, "context_length": 128, **kw}))


def test_s2_over_context_length_is_rejected_before_any_allocation(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    with pytest.raises(ContextLengthExceeded) as info:
        e.add_request("long", list(range(100)), SamplingParams(max_tokens=29))
    err = info.value
    assert (err.code, err.status, err.prompt_tokens, err.max_tokens, err.limit, err.limit_kind) == (
        "context_length_exceeded", 400, 100, 29, 128, "context_length")
    assert "128" in err.message and "129" in err.message
    assert e.pool.used_pages == 0 and not e.requests and not e.has_work()
    e.add_request("fits", list(range(100)), SamplingParams(max_tokens=28))  # exactly the limit is fine


def test_s2_over_pool_capacity_is_rejected_before_any_allocation(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir, kv_pool_tokens=64, context_length=1024)
    with pytest.raises(ContextLengthExceeded) as info:
        e.add_request("big", list(range(50)), SamplingParams(max_tokens=20))
    assert info.value.limit_kind == "kv_pool" and info.value.limit == 64
    assert e.pool.used_pages == 0
    # A prefill worker stores only the prompt, so it accepts what its pool can prefill.
    e.add_prefill_request("p", list(range(50)), SamplingParams(max_tokens=20))


def test_bad_requests_get_field_errors(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    with pytest.raises(InvalidRequest, match="prompt"):
        e.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="token ids"):
        e.add_request("oov", [1, 999], SamplingParams())
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)  # one pydantic type from the wire to the engine
    e.add_request("dup", [1, 2], SamplingParams())
    with pytest.raises(DuplicateRequestId):
        e.add_request("dup", [1, 2], SamplingParams())


def _request(rid: str, prompt: int, max_tokens: int) -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens))
    r.move_to(RequestState.ADMITTED)
    return r


def test_full_pool_waits_fifo_without_over_allocation() -> None:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, num_pages=6,
                  dtype=torch.float32, device=torch.device("cpu"))
    s = Scheduler(pool, max_running=8, max_prefill_tokens=1000)
    a, b, c = _request("a", 8, 4), _request("b", 12, 4), _request("c", 1, 1)
    for r in (a, b, c):
        s.add(r)
    prefill, _ = s.admit()
    assert prefill == [a]  # b needs 4 pages, 3 are free; c waits behind b (FIFO, no starvation of b)
    assert pool.free_pages == 3 and list(s.waiting) == [b, c] and not s.has_work()
    s.remove(a)
    assert s.has_work()
    assert s.admit()[0] == [b, c]
    pool.check_integrity()


def test_max_running_and_decode_only_preallocation() -> None:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, num_pages=16,
                  dtype=torch.float32, device=torch.device("cpu"))
    s = Scheduler(pool, max_running=2, max_prefill_tokens=1000)
    d = _request("d", 5, 3)
    d.mode = RequestMode.DECODE_ONLY
    p = _request("p", 9, 100)
    p.mode = RequestMode.PREFILL_ONLY
    x = _request("x", 2, 2)
    for r in (d, p, x):
        s.add(r)
    prefill, preallocated = s.admit()
    assert preallocated == [d] and d.state == RequestState.PREALLOCATED and len(d.lease.page_ids) == 2
    assert prefill == [p] and len(p.lease.page_ids) == 3  # prefill-only: prompt pages only
    assert list(s.waiting) == [x]  # max_running reached


def test_engine_full_pool_requests_wait_and_all_finish(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir, kv_pool_tokens=64, page_size=16)
    tok = e.tokenizer
    prompts = [tok.encode(f"request number {i}") for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    solo = [e.generate([p], params)[0].output_ids for p in prompts]
    requests = [e.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    peak = 0
    while e.has_work():
        e.step()
        peak = max(peak, e.pool.used_pages)
        e.check_integrity()
    assert peak <= e.pool.num_pages
    assert [r.output_ids for r in requests] == solo
    assert e.pool.used_pages == 0


def test_decode_only_pages_outside_a_step_keep_fifo_and_max_running() -> None:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, num_pages=16,
                  dtype=torch.float32, device=torch.device("cpu"))
    s = Scheduler(pool, max_running=2, max_prefill_tokens=1000)
    first = _request("first", 5, 3)
    first.mode = RequestMode.DECODE_ONLY
    s.add(first)
    assert s.admit_decode_only() == [first] and first.state == RequestState.PREALLOCATED
    colocated, behind = _request("colocated", 2, 2), _request("behind", 5, 3)
    behind.mode = RequestMode.DECODE_ONLY
    s.add(colocated), s.add(behind)
    assert s.admit_decode_only() == []  # a computing request is ahead: no jumping the queue
    assert list(s.waiting) == [colocated, behind] and behind.lease is None
    prefill, preallocated = s.admit()
    assert prefill == [colocated] and preallocated == []  # max_running 2 reached
    assert list(s.waiting) == [behind]
    assert s.admit_decode_only() == [] and behind.lease is None  # now at the head, but max_running holds


def test_engine_grants_decode_pages_at_intake(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    request = e.add_decode_request("d", [1, 2, 3], SamplingParams(max_tokens=4))
    [out] = e.drain_outputs()  # no step needed: decode-only requests compute nothing to get pages
    assert out.state == RequestState.PREALLOCATED and out.lease is request.lease is not None
    assert out.request is request
