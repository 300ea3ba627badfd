"""Per-layer K/V buffers indexed by token slot (the one place that knows the KV layout)."""

from __future__ import annotations

import torch


class KVPool:
    """K and V buffers of shape ``[num_slots, kv_heads, head_dim]`` for every layer.

    Slot ``s`` of page ``p`` is ``p * page_size + offset``, so the buffers are page-major too.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.k_buffers = [
            torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v_buffers = [
            torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token's K and V take across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)
