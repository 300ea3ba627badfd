"""Token-slot allocator over the KV buffers.

Slots are token positions in the per-layer K/V buffers. Slots are handed out in pages of
``page_size`` tokens; page 0 (slots ``0 .. page_size-1``) is reserved as the padding target, so a
slot index of 0 never belongs to a real token.
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV pages; every public size is counted in tokens (slots)."""

    def __init__(self, num_slots: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 2 * page_size:
            raise ValueError(f"max_total_tokens too small: {num_slots} slots for page_size {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size  # page 0 reserved
        self.device = torch.device(device)
        self.clear()

    @property
    def total_slots(self) -> int:
        """Usable slots (the reserved padding page excluded)."""
        return (self.num_pages - 1) * self.page_size

    def clear(self) -> None:
        """Return every page to the free list."""
        self._free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return len(self._free_pages) * self.page_size

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Pop ``num_pages`` pages, or return None (allocating nothing) when not enough are free."""
        if num_pages > len(self._free_pages):
            return None
        if num_pages == 0:
            return []
        out = self._free_pages[-num_pages:]
        del self._free_pages[-num_pages:]
        out.reverse()
        return out

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots starting on fresh pages (None when out of memory)."""
        ps = self.page_size
        pages = self.alloc_pages((num_tokens + ps - 1) // ps)
        if pages is None:
            return None
        if ps == 1:
            return torch.tensor(pages, dtype=torch.int64)
        base = torch.tensor(pages, dtype=torch.int64).repeat_interleave(ps) * ps
        offs = torch.arange(ps, dtype=torch.int64).repeat(len(pages))
        return (base + offs)[:num_tokens]

    def alloc_extend(self, last_slot: int, cur_len: int, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots for a sequence of ``cur_len`` tokens whose last slot is ``last_slot``.

        With pages, the tail of the last partially filled page is used first.
        """
        ps = self.page_size
        if ps == 1 or cur_len % ps == 0:
            return self.alloc(num_tokens)
        room = ps - cur_len % ps
        head = torch.arange(last_slot + 1, last_slot + 1 + min(room, num_tokens), dtype=torch.int64)
        if num_tokens <= room:
            return head
        rest = self.alloc(num_tokens - room)
        if rest is None:
            return None
        return torch.cat([head, rest])

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages of ``slots``. With pages, a slot frees its whole page: callers free whole pages."""
        if slots.numel() == 0:
            return
        # NOTE: pushed in descending order, so the next allocation pops them back ascending: a run of
        # consecutive slots is what the attention kernels read fastest, and what a decode batch's shared
        # prefix must be for the cascade to read it as one view (radixrt.kernels.cpu_cascade).
        if self.page_size == 1:
            self._free_pages.extend(sorted(slots.tolist(), reverse=True))
        else:
            self._free_pages.extend(reversed(torch.unique(slots // self.page_size).tolist()))
