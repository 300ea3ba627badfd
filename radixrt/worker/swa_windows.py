"""The running requests' side of the sliding-window cache (``--enable-swa-cache``), composed by `KVManager`.

Per running request (by its ReqToTokenPool row) it tracks which of its tokens lost their local-layer K/V, frees
the local K/V that left the request's window before every allocation, makes room in the local layers' pool,
and checks that pool's accounting: ``free + evictable + protected + in-use == total``.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.mem_cache.req_to_token import ReqToTokenPool
from radixrt.mem_cache.swa_pool import SWAAllocator
from radixrt.mem_cache.swa_radix_cache import SWARadixCache
from radixrt.worker.req import Req


@dataclass(slots=True)
class SWARow:
    """A running request's window bookkeeping: its own tokens below ``freed_to`` have no local K/V."""

    freed_to: int = 0


class SWAWindows:
    """Local-layer K/V of running requests over an `SWAAllocator` and its `SWARadixCache`.

    ``recomputed_tokens`` counts prompt tokens (first admissions only) whose global K/V was cached but that are
    computed again because the local K/V of their window was not.
    """

    def __init__(self, allocator: SWAAllocator, tree: SWARadixCache, req_pool: ReqToTokenPool) -> None:
        self.allocator, self.tree, self.req_pool = allocator, tree, req_pool
        self.page_size = allocator.page_size
        self.rows: dict[int, SWARow] = {}
        self.recomputed_tokens = 0

    def available(self) -> int:
        """Local-pool slots obtainable now: free plus evictable."""
        return self.allocator.swa_available_size() + self.tree.swa_evictable_size()

    def make_room(self, need: int) -> None:
        """Evict local K/V from the tree until ``need`` local slots are free (or nothing more goes)."""
        short = need - self.allocator.swa_available_size()
        if short > 0:
            self.tree.evict_swa(short)

    def on_admit(self, row: int, lost: int, first_admission: bool) -> None:
        """``row``'s request was admitted; its match stopped ``lost`` tokens before the global layers' end."""
        if first_admission:
            self.recomputed_tokens += lost
        self.rows[row] = SWARow()

    def freed_to(self, row: int) -> int:
        return self.rows[row].freed_to

    def on_release(self, row: int) -> None:
        self.rows.pop(row, None)

    def free_out_of_window(self, req: Req) -> None:
        """Free the local K/V of ``req``'s own pages that no later token attends to (below its page-aligned
        length less ``window - 1``, so its page-aligned prefix stays matchable). What it inserted into the tree
        is the tree's to evict (`SWARadixCache.evict_swa`)."""
        if req.req_pool_idx is None:
            return
        ps, row = self.page_size, req.req_pool_idx
        st = self.rows[row]
        end = (req.kv_len // ps * ps - self.tree.keep) // ps * ps
        start = max(req.cached_len, st.freed_to)
        if end > start:
            self.allocator.free_swa(self.req_pool.req_to_token[row, start:end])
            st.freed_to = end

    def owned_slots(self, req: Req) -> int:
        """Local-pool slots held by ``req`` outside the tree (its own pages still in its window)."""
        if req.req_pool_idx is None:
            return 0
        ps = self.page_size
        start = max(req.cached_len, self.rows[req.req_pool_idx].freed_to)
        return max((req.kv_len + ps - 1) // ps * ps - start, 0)

    def check(self, live: list[Req], unpinned_idle: bool) -> None:
        """The tree's integrity, then the local layers' pool: ``free + evictable + protected + in-use ==
        total``, every held page mapped once; at idle without pins nothing locked or tracked."""
        tree, swa = self.tree, self.allocator
        tree.check_integrity()
        free, total = swa.swa_available_size(), swa.swa_total_slots
        evictable, protected = tree.swa_evictable_size(), tree.swa_protected_size()
        in_use = sum(self.owned_slots(r) for r in live)
        assert free + evictable + protected + in_use == total, (
            f"local KV leak: free {free} + evictable {evictable} + protected {protected} + in-use {in_use} "
            f"!= {total}"
        )
        assert swa.mapped_swa_slots() == total - free, "a local page is free and mapped, or held and unmapped"
        if unpinned_idle:
            assert protected == 0, f"{protected} tokens' local K/V still locked at idle"
            assert not self.rows, f"rows {sorted(self.rows)} still tracked at idle"
