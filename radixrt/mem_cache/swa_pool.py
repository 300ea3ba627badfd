"""The sliding-window-aware KV memory: two slot spaces, one for the global layers and one for the local ones.

Gemma 3 attends over a window of ``W`` tokens in its local (sliding-window) layers and over the whole prefix in
its global layers. With ``--enable-swa-cache`` the local layers' K/V live in a pool of their own, smaller than
the global layers' one, and the local K/V of a token that left every window is freed while its global K/V stays.

- The *full* slot space is the one every other part of the runtime sees: a request's ReqToTokenPool row, the
  RadixCache's node values and the metadata of a forward hold full slots, and the global layers' pool is
  indexed by them.
- The *swa* slot space indexes the local layers' pool. Both are paged with the same page size; ``full_to_swa``
  maps each full page to its swa page, 0 (the reserved padding page) when the page has no local K/V (never
  had, or freed). The local layers' attention reads the forward's metadata through this map
  (`radixrt.kernels.layer_windows.SlotMappedBackend`), so a freed page reads the padding page, which the
  window masks anyway.

`SWAAllocator` allocates, frees and maps pages in both spaces; `LayerGroupKV` routes each layer's K/V to its
pool. SGLang's ``SWAKVPool`` / ``SWATokenToKVPoolAllocator`` have the same semantics.
"""

from __future__ import annotations

import torch

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.kv_pool import KVPool


class SWAAllocator:
    """Full-slot allocator whose every page also holds a page of the local layers' pool until freed.

    The interface is `TokenSlotAllocator`'s (sizes in full-pool tokens), so the request path and the tree
    use it unchanged; ``free`` releases the swa page of each full page it frees, ``free_swa`` only the swa
    page (the token left the window). ``swa_*`` sizes count the local layers' pool.
    """

    def __init__(self, full_slots: int, swa_slots: int, page_size: int = 1) -> None:
        self.full = TokenSlotAllocator(full_slots, page_size)
        self.swa = TokenSlotAllocator(swa_slots, page_size)
        self.page_size = page_size
        self.full_to_swa = torch.zeros(self.full.num_pages, dtype=torch.int64)

    @property
    def total_slots(self) -> int:
        """Usable slots of the full (global layers') pool."""
        return self.full.total_slots

    @property
    def swa_total_slots(self) -> int:
        """Usable slots of the local layers' pool."""
        return self.swa.total_slots

    def available_size(self) -> int:
        """Free full slots."""
        return self.full.available_size()

    def swa_available_size(self) -> int:
        """Free slots of the local layers' pool."""
        return self.swa.available_size()

    def mapped_swa_slots(self) -> int:
        """Local-pool slots held by some full page (what is not free there)."""
        return int((self.full_to_swa != 0).sum()) * self.page_size

    def clear(self) -> None:
        """Free every page of both spaces."""
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` full slots on fresh pages, each page with a fresh swa page; None (allocating
        nothing) when either pool is short."""
        slots = self.full.alloc(num_tokens)
        if slots is None or slots.numel() == 0:
            return slots
        pages = slots[:: self.page_size] // self.page_size
        swa_pages = self.swa.alloc_pages(pages.numel())
        if swa_pages is None:
            self.full.free(slots)
            return None
        self.full_to_swa[pages] = torch.tensor(swa_pages, dtype=torch.int64)
        return slots

    def alloc_extend(self, last_slot: int, cur_len: int, num_tokens: int) -> torch.Tensor | None:
        """As `TokenSlotAllocator.alloc_extend`: the tail of the last page first (already mapped)."""
        ps = self.page_size
        if ps == 1 or cur_len % ps == 0:
            return self.alloc(num_tokens)
        room = ps - cur_len % ps
        head = torch.arange(last_slot + 1, last_slot + 1 + min(room, num_tokens), dtype=torch.int64)
        if num_tokens <= room:
            return head
        rest = self.alloc(num_tokens - room)
        return None if rest is None else torch.cat([head, rest])

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages of ``slots`` in both spaces (callers free whole pages)."""
        if slots.numel() == 0:
            return
        self.free_swa(slots)
        self.full.free(slots)

    def free_swa(self, slots: torch.Tensor) -> int:
        """Free the swa pages of the pages of ``slots`` (their local K/V is no longer needed); the full
        pages stay. Returns the local-pool slots freed (pages already without one count 0)."""
        if slots.numel() == 0:
            return 0
        pages = torch.unique(slots // self.page_size)
        swa_pages = self.full_to_swa[pages]
        held = swa_pages[swa_pages != 0]
        if held.numel():
            self.swa.free(held * self.page_size)  # page ids -> their first slots
            self.full_to_swa[pages] = 0
        return held.numel() * self.page_size

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand the swa pages of ``src``'s pages to ``dst``'s pages (same count, page-aligned, in order;
        ``dst`` has none): the tree takes a request's freshly computed local K/V for a node it holds."""
        ps = self.page_size
        sp, dp = src[::ps] // ps, dst[::ps] // ps
        assert bool((self.full_to_swa[dp] == 0).all()) and bool((self.full_to_swa[sp] != 0).all())
        self.full_to_swa[dp] = self.full_to_swa[sp]
        self.full_to_swa[sp] = 0

    def has_swa(self, slots: torch.Tensor) -> bool:
        """Whether every page of ``slots`` holds a swa page."""
        return bool((self.full_to_swa[slots // self.page_size] != 0).all())

    def lacks_swa(self, slots: torch.Tensor) -> bool:
        """Whether no page of ``slots`` holds a swa page."""
        return bool((self.full_to_swa[slots // self.page_size] == 0).all())


class LayerGroupKV:
    """The `KVStore` of a model whose local layers live in ``swa`` and global layers in ``full``: layer
    ``i`` is layer ``index[i]`` of its group's pool. Local layers get swa slots (the attention backend of
    the local window maps them), global layers full slots."""

    def __init__(self, full: KVPool, swa: KVPool, is_local: list[bool]) -> None:
        self.full, self.swa = full, swa
        counters = {False: 0, True: 0}
        self.index: list[tuple[KVPool, int]] = []
        for local in is_local:
            self.index.append((swa if local else full, counters[local]))
            counters[local] += 1
        assert counters[True] == swa.num_layers and counters[False] == full.num_layers

    @property
    def size_bytes(self) -> int:
        return self.full.size_bytes + self.swa.size_bytes

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, i = self.index[layer_id]
        return pool.get_kv_buffer(i)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool, i = self.index[layer_id]
        pool.set_kv(i, loc, k, v)
