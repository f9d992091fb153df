"""The paged KV pool and its generation tags (S1, S3, S5).

One owner for page state. K/V of every layer live in one tensor
`kv[layers, 2, pages + 2, page_size, kv_heads, head_dim]`; the two extra pages are never allocated.
The scratch page takes the writes of a request whose lease failed verification, so a stale request
never touches another request's page (and no GPU->CPU sync is needed to drop them); nothing reads
it. The pad page is all zeros, always: batches read it where a shorter request's page table is
padded to the longest one's (masked slots, like every slot past a request's length).

A page is zeroed each time it is handed out (with tags off, only the first time: the incident's
engine, which the `no_tags` fault reproduces, left the previous owner's bytes). So a request's pages
hold its own K/V or zeros: never an earlier tenant's bytes, not even in slots it reads only masked
(attention multiplies those by 0, and 0 x NaN is NaN: one tenant's non-finite K/V would otherwise
poison the next owner of its pages), and not in the unwritten tail of a page that prefill sends.

Tags, per page, on the pool's device:
- `generation`: bumped on every allocation and every free. A lease is current while the
  generations it was granted still equal these.
- `written_generation` / `written_tokens`: the generation in which the page was last written and
  how many leading slots were written in it. A read of `n` slots is allowed only if the page is
  current for the lease, was written in the lease's generation, and has >= n slots written.

A request holds a `Lease` (page ids + granted generations). Frees of stale leases only release
pages the lease still owns; imports of stale leases are dropped and counted (S5).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class StaleLeaseError(Exception):
    """A lease is no longer current for (some of) its pages: its data must not be read or sent."""


@dataclass(eq=False)
class Lease:
    """Pages granted to one request. `page_ids[i]` holds token positions
    `[i * page_size, (i + 1) * page_size)`; `generations[i]` is the generation it was granted."""

    request_id: str
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    num_tokens: int
    serial: int
    page_ids_t: torch.Tensor = field(repr=False)
    generations_t: torch.Tensor = field(repr=False)
    released: bool = False


@dataclass(frozen=True)
class ImportResult:
    """Outcome of `KVPool.import_pages`: applied, or dropped because the lease is stale (S5)."""

    applied: bool
    stale_pages: tuple[int, ...] = ()
    reason: str = ""


class KVPool:
    """Paged K/V storage with generation tags. Thread-safe: the engine thread allocates, frees
    and writes through forward passes; a transfer thread may import/export pages concurrently."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        tags: bool = True,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype, self.device = page_size, num_pages, dtype, device
        self.tags = tags
        self.scratch_page, self.pad_page = num_pages, num_pages + 1
        shape = (num_layers, 2, num_pages + 2, page_size, num_kv_heads, head_dim)
        # Pages are zeroed when handed out (`_scrub`), not all at once here: zeroing the whole of a
        # default-sized CPU pool touched every byte of it (1.7 GB for the tiny model: 1.6 s per
        # worker, 5 s of `kvguard serve`'s start-up with both workers at it together), so the
        # memory is now committed as the pool is first used.
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv[:, :, num_pages:].zero_()
        self._fresh = 0  # pages [0, _fresh) have been zeroed; the free stack hands the others out in order
        # The three tag arrays share one [3, pages + 2] tensor, so a read check gathers all of a
        # batch's tags in one op. Rows: generation, written_generation, written_tokens.
        self._tags = torch.zeros(3, num_pages + 2, dtype=torch.int64, device=device)
        self.generation, self.written_generation, self.written_tokens = self._tags.unbind(0)
        self.written_generation.fill_(-1)
        self._page_starts = torch.arange(num_pages + 1, dtype=torch.int64, device=device) * page_size  # per lease column
        self._host_generation = [0] * num_pages
        self._owner: list[int | None] = [None] * num_pages  # lease serial
        # A stack: the most recently freed pages are handed out first, so reuse is immediate.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._leases: dict[int, Lease] = {}
        self._serials = itertools.count(1)
        self._lock = threading.RLock()
        self.stale_writes_dropped = 0
        self.stale_frees = 0
        # Bumped by every allocation, free, write stamp and import: what could break integrity.
        # An idle engine re-checks integrity only after it moved (`AsyncEngine._check_integrity`).
        self.changes = 0

    # ------------------------------------------------------------------------------- capacity

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_tokens(self) -> int:
        return self.used_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --------------------------------------------------------------------------- alloc / free

    def allocate(self, request_id: str, num_tokens: int) -> Lease | None:
        """Pages for `num_tokens` tokens, or None if the pool has not enough free pages now."""
        if num_tokens < 1:
            raise ValueError(f"allocate: num_tokens must be >= 1, got {num_tokens}")
        needed = self.pages_for(num_tokens)
        with self._lock:
            if needed > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(needed)]
            serial = next(self._serials)
            generations = []
            for page in pages:
                self._host_generation[page] += 1
                self._owner[page] = serial
                generations.append(self._host_generation[page])
            ids_t = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self._scrub(ids_t, max(pages))
            gens_t = torch.tensor(generations, dtype=torch.int64, device=self.device)
            self.generation[ids_t] = gens_t
            lease = Lease(request_id, tuple(pages), tuple(generations), num_tokens, serial, ids_t, gens_t)
            self._leases[serial] = lease
            self.changes += 1
            return lease

    def _scrub(self, ids_t: torch.Tensor, top: int) -> None:
        """Zero the pages being handed out (see the module doc); with tags off, only those never
        handed out before. Fresh pages leave the free stack in increasing order, below every freed
        one, so those are the range [_fresh, top]."""
        if self.tags:
            self.kv.index_fill_(2, ids_t, 0)
        elif top >= self._fresh:
            self.kv[:, :, self._fresh : top + 1].zero_()
        self._fresh = max(self._fresh, top + 1)

    def free(self, lease: Lease) -> int:
        """Release the pages the lease still owns; returns how many. Idempotent. Pages that were
        already taken from the lease (a bug elsewhere, or a test) stay with their new owner."""
        with self._lock:
            if lease.released:
                return 0
            lease.released = True
            self._leases.pop(lease.serial, None)
            owned = [p for p, g in zip(lease.page_ids, lease.generations)
                     if self._owner[p] == lease.serial and self._host_generation[p] == g]
            self.stale_frees += len(lease.page_ids) - len(owned)
            for page in owned:
                self._owner[page] = None
                self._host_generation[page] += 1  # a freed page is stale for every old lease
            if owned:
                ids_t = torch.tensor(owned, dtype=torch.int64, device=self.device)
                self.generation[ids_t] += 1
            self._free.extend(reversed(owned))
            self.changes += 1
            return len(owned)

    def is_current(self, lease: Lease) -> bool:
        """Host-side check: the lease still owns every page in its granted generation."""
        with self._lock:
            return not lease.released and all(
                self._owner[p] == lease.serial and self._host_generation[p] == g
                for p, g in zip(lease.page_ids, lease.generations)
            )

    # ---------------------------------------------------------------------- writes and reads

    def slots(self, lease: Lease, start: int, end: int) -> torch.Tensor:
        """Flat pool slots (`page * page_size + offset`) of token positions [start, end)."""
        positions = torch.arange(start, end, device=self.device)
        return lease.page_ids_t[positions // self.page_size] * self.page_size + positions % self.page_size

    def stamp_written(
        self, pages: torch.Tensor, generations: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record that slots [start, end) of `pages` were written for `generations` (S5: only
        where the generation is still current, and `mask`). `written_tokens` grows only when the
        write is contiguous with what was already written. Pages must be distinct. No host sync.
        Returns the per-page bool "applied"."""
        with self._lock:
            ok = self.generation[pages] == generations
            if mask is not None:
                ok &= mask
            target = torch.where(ok, pages, self.scratch_page)
            same_gen = self.written_generation[target] == generations
            have = torch.where(same_gen, self.written_tokens[target], 0)
            grown = torch.where(start <= have, torch.maximum(have, end), have)
            self.written_generation[target] = generations
            self.written_tokens[target] = grown
            self.changes += 1
            return ok

    def verify_reads(
        self, page_table: torch.Tensor, granted: torch.Tensor, num_pages: torch.Tensor | None, read_tokens: torch.Tensor
    ) -> torch.Tensor:
        """S1, one vectorised gather-and-compare for a whole batch.

        page_table / granted: [B, P] page ids and the generations the leases were granted;
        read_tokens[b]: token positions [0, n) request b reads. Padding beyond `num_pages[b]` is
        ignored; with `num_pages=None` the caller pads with (`pad_page`, 0) instead, which
        passes by construction (the pad page's generation is always 0 and no read position
        falls in a padding column) and saves the masking. Every page must be current for the lease;
        pages holding read positions must have been written in that generation up to the slots
        read. Returns bool [B]: request b may proceed.
        """
        width = page_table.shape[1]
        required = (read_tokens[:, None] - self._page_starts[:width]).clamp(0, self.page_size)
        tags = self._tags[:, page_table]  # [3, B, P]: generation, written generation, written tokens
        written = (tags[1] == granted) & (tags[2] >= required)
        page_ok = (tags[0] == granted) & (written | (required == 0))
        if num_pages is not None:
            page_ok |= self._page_starts[:width] >= num_pages[:, None] * self.page_size
        return page_ok.all(dim=1)

    def lease_written(self, lease: Lease, num_tokens: int) -> bool:
        """S3 precondition: every page holding positions [0, num_tokens) is current for the lease
        and was written in its current generation up to those slots. One host sync."""
        if num_tokens > lease.num_tokens or not self.is_current(lease):
            return False
        pages = self.pages_for(num_tokens)
        ok = self.verify_reads(
            lease.page_ids_t[None, :pages], lease.generations_t[None, :pages],
            torch.tensor([pages], device=self.device), torch.tensor([num_tokens], device=self.device),
        )
        return bool(ok.item())

    # ------------------------------------------------------------ disaggregated transfer hooks

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page in the export/import layout (all layers, K and V)."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def pages_from_bytes(self, payload: bytes | bytearray | memoryview) -> torch.Tensor:
        """Bytes as produced by `export_pages(...).cpu()` back into `[pages, layers, 2, page_size,
        kv_heads, head_dim]` (a copy; the buffer is not kept)."""
        if len(payload) % self.page_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes is not a whole number of {self.page_nbytes}-byte pages")
        flat = torch.frombuffer(bytearray(payload), dtype=self.dtype)
        return flat.view(-1, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def valid_tokens(self, lease: Lease, page_ids: Sequence[int], num_tokens: int) -> list[int]:
        """How many leading slots of each of `page_ids` hold positions < `num_tokens` in `lease`."""
        index = {page: i for i, page in enumerate(lease.page_ids)}
        return [max(0, min(self.page_size, num_tokens - index[p] * self.page_size)) for p in page_ids]

    def export_pages(self, lease: Lease, page_ids: Sequence[int] | None = None) -> torch.Tensor:
        """K/V bytes of (some of) the lease's pages as one contiguous tensor
        `[pages, layers, 2, page_size, kv_heads, head_dim]` on the pool's device. Refuses a stale
        lease: its pages may hold another request's data."""
        ids = list(lease.page_ids if page_ids is None else page_ids)
        with self._lock:
            if not self.is_current(lease) or not set(ids) <= set(lease.page_ids):
                raise StaleLeaseError(f"request {lease.request_id}: lease is not current for pages {ids}")
            ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
            return self.kv[:, :, ids_t].permute(2, 0, 1, 3, 4, 5).contiguous()

    def import_pages(
        self, lease: Lease, page_ids: Sequence[int], generations: Sequence[int], data: torch.Tensor,
        valid_tokens: Sequence[int] | None = None,
    ) -> ImportResult:
        """Write received K/V (`[pages, layers, 2, page_size, kv_heads, head_dim]`) into
        `page_ids` and stamp them written for `generations`, each page's first `valid_tokens[i]`
        slots (default: full pages). S5: applied only if every page belongs to this lease, was
        granted exactly that generation and is still current; otherwise nothing is written and
        the drop is counted. With tags off (benchmark / `no_tags` fault) it writes unchecked."""
        valid = list(valid_tokens) if valid_tokens is not None else [self.page_size] * len(page_ids)
        if not (len(page_ids) == len(generations) == len(valid) == data.shape[0]):
            raise ValueError("import_pages: page_ids, generations, valid_tokens and data disagree in length")
        expected = (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape[1:]) != expected:
            raise ValueError(f"import_pages: data shape {tuple(data.shape)} != [pages, *{expected}]")
        with self._lock:
            if self.tags:
                granted = dict(zip(lease.page_ids, lease.generations))
                stale = tuple(
                    p for p, g in zip(page_ids, generations)
                    if granted.get(p) != g or lease.released or self._owner[p] != lease.serial
                    or self._host_generation[p] != g
                )
                if stale:
                    self.stale_writes_dropped += 1
                    return ImportResult(False, stale, "lease is not current for these pages")
            ids_t = torch.tensor(list(page_ids), dtype=torch.int64, device=self.device)
            self.kv[:, :, ids_t] = data.to(device=self.device, dtype=self.dtype).permute(1, 2, 0, 3, 4, 5)
            if self.tags:
                self.stamp_written(
                    ids_t, torch.tensor(list(generations), dtype=torch.int64, device=self.device),
                    torch.zeros_like(ids_t), torch.tensor(valid, dtype=torch.int64, device=self.device),
                )
            self.changes += 1
            return ImportResult(True)

    # ------------------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """free + used == total, no page free and owned, no page owned twice, tags consistent
        with the host mirror. Raises AssertionError with the first inconsistency."""
        with self._lock:
            free = self._free
            assert len(set(free)) == len(free), "a page is on the free list twice"
            owned: dict[int, int] = {}
            for lease in self._leases.values():
                for page, gen in zip(lease.page_ids, lease.generations):
                    if self._owner[page] != lease.serial:
                        continue  # taken away from a stale lease; its new owner accounts for it
                    assert page not in owned, f"page {page} owned twice"
                    assert self._host_generation[page] == gen, f"page {page}: owner holds a stale generation"
                    owned[page] = lease.serial
            assert not set(free) & set(owned), "a page is both free and owned"
            assert len(free) + len(owned) == self.num_pages, (
                f"free {len(free)} + used {len(owned)} != total {self.num_pages}"
            )
            assert all(self._owner[p] is None for p in free), "a free page has an owner"
            device_gen = self.generation[: self.num_pages].tolist()
            assert device_gen == self._host_generation, "device generations diverged from the host mirror"

    def live_leases(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())
