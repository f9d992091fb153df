"""Receiver-side plan checking: pure logic (class D in pd-bug-classes: accounting mismatches)."""

from __future__ import annotations

from collections.abc import Sequence

from kvguard.workers.transfer.wire import ChunkHeader, Manifest


class PlanTracker:
    """What decode planned for one request versus what has arrived so far (S3).

    Chunks must carry only planned pages with their planned generations, each page once, with
    strictly increasing sequence numbers. The manifest must match what arrived, and what arrived
    must cover the whole plan: decode never reads a page this transfer did not write.
    """

    def __init__(self, page_ids: Sequence[int], generations: Sequence[int]) -> None:
        if len(page_ids) != len(generations):
            raise ValueError(f"{len(page_ids)} page ids but {len(generations)} generations")
        self.order = (tuple(page_ids), tuple(generations))  # what a ticket must name, in order
        self.plan: dict[int, int] = dict(zip(page_ids, generations))
        if len(self.plan) != len(page_ids):
            raise ValueError("planned page ids must be unique")
        self.written: dict[int, int] = {}
        self.chunks = 0
        self.bytes = 0
        self.last_seq = -1

    def is_plan(self, page_ids: Sequence[int], generations: Sequence[int]) -> bool:
        """A ticket names exactly these pages, in this order, with these generations."""
        return (tuple(page_ids), tuple(generations)) == self.order

    def check_chunk(self, chunk: ChunkHeader) -> str | None:
        """Why this chunk does not fit the plan, or None if it does."""
        if chunk.seq <= self.last_seq:
            return f"chunk seq {chunk.seq} repeats or precedes seq {self.last_seq}"
        if not chunk.page_ids:
            return "chunk carries no pages"
        seen: set[int] = set()
        for page, gen in zip(chunk.page_ids, chunk.generations):
            planned = self.plan.get(page)
            if planned is None:
                return f"page {page} is not in the plan"
            if gen != planned:
                return f"page {page} generation {gen} != planned generation {planned}"
            if page in self.written or page in seen:
                return f"page {page} written twice"
            seen.add(page)
        return None

    def record(self, chunk: ChunkHeader, nbytes: int) -> None:
        self.last_seq = chunk.seq
        self.chunks += 1
        self.bytes += nbytes
        self.written.update(zip(chunk.page_ids, chunk.generations))

    def check_manifest(self, manifest: Manifest) -> str | None:
        """Why the manifest disagrees with what arrived or with the plan, or None."""
        listed = dict(zip(manifest.page_ids, manifest.generations))
        if len(listed) != len(manifest.page_ids):
            return "manifest lists a page twice"
        if manifest.chunk_count != self.chunks:
            return f"manifest lists {manifest.chunk_count} chunks, {self.chunks} arrived"
        if manifest.total_bytes != self.bytes:
            return f"manifest lists {manifest.total_bytes} bytes, {self.bytes} arrived"
        if listed != self.written:
            missing = sorted(set(listed) - set(self.written))[:8]
            return f"manifest pages differ from pages received (missing e.g. {missing})"
        if self.written != self.plan:
            missing = sorted(set(self.plan) - set(self.written))[:8]
            return f"planned pages never written (e.g. {missing})"
        return None
