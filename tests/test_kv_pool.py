"""The tagged paged KV pool: allocation, tags (S1, S3, S5), transfer hooks, integrity."""

from __future__ import annotations

import os

import pytest
import torch
from engine_device import TEST_DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.workers.kv_pool import KVPool, StaleLeaseError

PAGE = 4


def make_pool(pages: int = 8, tags: bool = True) -> KVPool:
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=3, page_size=PAGE, num_pages=pages,
                  dtype=torch.float32, device=torch.device(TEST_DEVICE), tags=tags)


def write_tokens(pool: KVPool, lease, start: int, end: int, fill: float = 1.0) -> torch.Tensor:
    """What a forward pass does: write K/V into the slots, then stamp the pages touched."""
    slots = pool.slots(lease, start, end)
    pool.kv.view(2, 2, -1, 2, 3)[:, :, slots] = fill
    pages = sorted({p for p in range(start // PAGE, (end - 1) // PAGE + 1)})
    ids = lease.page_ids_t[pages]
    first = torch.tensor([max(start - p * PAGE, 0) for p in pages], device=pool.device)
    last = torch.tensor([min(end - p * PAGE, PAGE) for p in pages], device=pool.device)
    return pool.stamp_written(ids, lease.generations_t[pages], first, last)


def reads_ok(pool: KVPool, leases: list, read_tokens: list[int]) -> list[bool]:
    pages = [pool.pages_for(max(n, 1)) for n in read_tokens]
    width = max(pages)
    table = torch.tensor([list(lease.page_ids[:n]) + [0] * (width - n) for lease, n in zip(leases, pages)], device=pool.device)
    granted = torch.tensor([list(lease.generations[:n]) + [0] * (width - n) for lease, n in zip(leases, pages)], device=pool.device)
    return pool.verify_reads(table, granted, torch.tensor(pages, device=pool.device),
                             torch.tensor(read_tokens, device=pool.device)).tolist()


def test_allocate_returns_none_when_full_and_free_recycles() -> None:
    pool = make_pool(pages=4)
    a = pool.allocate("a", 3 * PAGE)
    assert a is not None and len(a.page_ids) == 3 and pool.used_tokens == 3 * PAGE
    assert pool.allocate("b", 2 * PAGE) is None  # no over-allocation
    assert pool.used_pages == 3
    assert pool.free(a) == 3 and pool.free(a) == 0  # idempotent
    b = pool.allocate("b", 4 * PAGE)
    assert b is not None and set(a.page_ids) <= set(b.page_ids)
    assert all(g > ga for p, g in zip(b.page_ids, b.generations) for pa, ga in zip(a.page_ids, a.generations) if p == pa)
    pool.check_integrity()


def test_s1_reads_need_pages_written_in_the_current_generation() -> None:
    pool = make_pool()
    a = pool.allocate("a", 10)
    assert reads_ok(pool, [a], [0]) == [True]  # nothing to read yet
    assert reads_ok(pool, [a], [6]) == [False]  # nothing written
    write_tokens(pool, a, 0, 6)
    assert reads_ok(pool, [a], [6]) == [True]
    assert reads_ok(pool, [a], [7]) == [False]  # slot 6 not written yet


def test_s1_stale_lease_is_identified_per_request_in_a_batch() -> None:
    pool = make_pool()
    a, b = pool.allocate("a", 8), pool.allocate("b", 8)
    write_tokens(pool, a, 0, 8)
    write_tokens(pool, b, 0, 8)
    pool.free(a)  # a bug elsewhere: a's pages go back while a still runs ...
    c = pool.allocate("c", 8)  # ... and are handed to c
    assert set(c.page_ids) == set(a.page_ids)
    write_tokens(pool, c, 0, 8, fill=9.0)
    assert reads_ok(pool, [a, b, c], [8, 8, 8]) == [False, True, True]


def test_s5_stamp_of_a_stale_lease_is_not_applied() -> None:
    pool = make_pool()
    a = pool.allocate("a", 8)
    pool.free(a)
    b = pool.allocate("b", 8)
    assert write_tokens(pool, a, 0, 8).tolist() == [False, False]  # late writer
    assert reads_ok(pool, [b], [8]) == [False]  # b's pages are not marked written by a's write


def test_written_tokens_grow_only_contiguously() -> None:
    pool = make_pool()
    a = pool.allocate("a", 8)
    write_tokens(pool, a, 2, 4)  # a gap at slots 0-1
    assert reads_ok(pool, [a], [1]) == [False]
    write_tokens(pool, a, 0, 2)
    assert reads_ok(pool, [a], [2]) == [True]
    assert reads_ok(pool, [a], [3]) == [False]  # the 2-4 write was not contiguous, so not counted


def test_export_import_round_trip_between_pools() -> None:
    src, dst = make_pool(), make_pool()
    a = src.allocate("r", 7)
    write_tokens(src, a, 0, 7)
    src.kv[:, :, list(a.page_ids)] = torch.randn(2, 2, 2, PAGE, 2, 3, device=src.device)
    data = src.export_pages(a)
    assert data.shape == (2, 2, 2, PAGE, 2, 3) and data.is_contiguous()
    d = dst.allocate("r", 7)
    assert not dst.lease_written(d, 7)  # S3 precondition fails before the transfer
    payload = data.cpu().numpy().tobytes()  # what crosses the wire
    assert len(payload) == 2 * dst.page_nbytes
    result = dst.import_pages(d, d.page_ids, d.generations, dst.pages_from_bytes(payload),
                              dst.valid_tokens(d, d.page_ids, 7))
    assert result.applied
    assert dst.lease_written(d, 7) and not dst.lease_written(d, 8)
    torch.testing.assert_close(dst.kv[:, :, list(d.page_ids)], src.kv[:, :, list(a.page_ids)])


def test_s5_import_for_a_stale_lease_is_dropped_and_counted() -> None:
    pool = make_pool(pages=2)
    a = pool.allocate("a", 8)
    data = torch.full((2, 2, 2, PAGE, 2, 3), 5.0, device=pool.device)
    pool.free(a)  # a aborted while its chunk was in flight
    b = pool.allocate("b", 8)
    before = pool.kv.clone()
    result = pool.import_pages(a, a.page_ids, a.generations, data)
    assert not result.applied and set(result.stale_pages) == set(a.page_ids)
    assert pool.stale_writes_dropped == 1
    # Bytes, not values: never-written memory (torch.empty, e.g. on CUDA) may hold NaN, unequal to itself.
    assert torch.equal(pool.kv.view(torch.uint8), before.view(torch.uint8))  # b's pages untouched
    # Right lease, wrong generation claimed by the sender: also dropped.
    wrong = pool.import_pages(b, b.page_ids, [g - 1 for g in b.generations], data)
    assert not wrong.applied and pool.stale_writes_dropped == 2
    # Pages not in the lease: dropped.
    assert not pool.import_pages(b, [b.page_ids[0]], [a.generations[0]], data[:1]).applied


def test_export_of_a_stale_lease_is_refused() -> None:
    pool = make_pool()
    a = pool.allocate("a", 8)
    pool.free(a)
    pool.allocate("b", 8)
    with pytest.raises(StaleLeaseError):  # it would export another request's KV
        pool.export_pages(a)


def test_tags_off_imports_unchecked() -> None:
    """The `no_tags` fault / benchmark baseline: no generation checks at all."""
    pool = make_pool(tags=False)
    a = pool.allocate("a", 8)
    pool.free(a)
    pool.allocate("b", 8)
    assert pool.import_pages(a, a.page_ids, a.generations, torch.ones(2, 2, 2, PAGE, 2, 3)).applied


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "abort", "write"]), st.integers(1, 40)), max_size=60))
def test_random_alloc_free_abort_sequences_keep_integrity(ops: list[tuple[str, int]]) -> None:
    pool = make_pool(pages=10)
    pool.kv[:, :, : pool.num_pages] = float("nan")  # what uninitialized storage may hold
    handed_out: set[int] = set()
    live: list = []
    for op, n in ops:
        if op == "alloc":
            lease = pool.allocate(f"r{n}", n)
            if lease is None:
                assert pool.pages_for(n) > pool.free_pages
            else:
                live.append(lease)
                # Every page is zero when handed out: no earlier owner's bytes, no garbage.
                assert not pool.kv[:, :, list(lease.page_ids)].any()
                handed_out.update(lease.page_ids)
                assert not pool.kv[:, :, sorted(handed_out) + [pool.scratch_page, pool.pad_page]].isnan().any()
        elif live and op in ("free", "abort"):
            lease = live.pop(n % len(live))
            pool.free(lease)
            if op == "abort":
                pool.free(lease)  # abort racing a normal finish: the second free is a no-op
        elif live and op == "write":
            lease = live[n % len(live)]
            write_tokens(pool, lease, 0, lease.num_tokens)
            assert reads_ok(pool, [lease], [lease.num_tokens]) == [True]
        pool.check_integrity()
        assert pool.used_pages == sum(len(lease.page_ids) for lease in live)
    for lease in live:
        pool.free(lease)
    pool.check_integrity()
    assert pool.used_pages == 0 and pool.free_pages == pool.num_pages


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux /proc")
def test_a_new_pool_commits_its_memory_as_pages_are_first_used() -> None:
    """Start-up does not zero (touch) the whole pool: a 512 MiB pool is resident only as far as it
    has been handed out (zeroing all of a default-sized CPU pool was 5 s of `kvguard serve`'s start)."""
    before = _resident_bytes()
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, num_pages=16384,
                  dtype=torch.float32, device=torch.device("cpu"))  # 32 KiB per page: 512 MiB
    assert pool.kv.numel() * pool.kv.element_size() > 512 << 20
    assert _resident_bytes() - before < 64 << 20
    lease = pool.allocate("a", 64 * 16)
    assert lease is not None and torch.count_nonzero(pool.kv[:, :, list(lease.page_ids)]) == 0
    assert _resident_bytes() - before < 64 << 20
