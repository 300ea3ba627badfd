"""The host tier's memory: a KV pool of the device pool's layout and stored dtype, with its own pages.

On a GPU this is the classic L2 (host RAM behind HBM). On CPU both pools are RAM: the host pool is then a
second budget, lossless (same stored dtype, so a node loaded back is bitwise what was evicted) and lazily
committed (``torch.empty``: RAM is taken only as the tier fills).
"""

from __future__ import annotations

import torch

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.kv_pool import KVPool


class HostPool:
    """Host-pool buffers plus their page allocator; sizes in tokens (slot 0's page reserved as usual)."""

    def __init__(self, device_pool: KVPool, num_tokens: int, page_size: int) -> None:
        pages = max(num_tokens // page_size, 1)
        num_slots = (pages + 1) * page_size
        self.pool = KVPool(
            num_slots,
            device_pool.num_layers,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            device_pool.model_dtype,
            "cpu",
            store_dtype=device_pool.dtype,
            lazy=True,
        )
        self.allocator = TokenSlotAllocator(num_slots, page_size)

    @staticmethod
    def size_tokens(device_pool: KVPool, device_tokens: int, ratio: float, size_gb: float) -> int:
        """Host tokens for ``--hicache-size`` GB (when > 0) or ``--hicache-ratio`` x the device pool."""
        if size_gb > 0:
            per_token = KVPool.bytes_per_token(
                device_pool.num_layers, device_pool.num_kv_heads, device_pool.head_dim, device_pool.dtype
            )
            return int(size_gb * 2**30) // per_token
        return int(ratio * device_tokens)

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)
