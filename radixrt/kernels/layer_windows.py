"""Attention whose sliding window differs by layer (Gemma 3: local layers with a window, global ones without).

Every backend takes one window for all layers, so the per-layer case is one backend instance per distinct
window, sharing the KV pool: each plans the forward's metadata once (its own mask or window for the C
kernels), and each layer's attention goes to its window's instance. The C decode / extend kernels and the
GPU kernels all take a window, so local layers stay on the fast paths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixrt.kernels.base import AttentionBackend, AttentionMetadata, KVStore


class LayerWindowBackend(AttentionBackend):
    """Routes layer ``i`` to the backend of window ``windows[i]`` (None: full attention)."""

    def __init__(self, by_window: dict[int | None, AttentionBackend], windows: list[int | None]) -> None:
        first = next(iter(by_window.values()))
        super().__init__(first.kv, first.num_heads, first.num_kv_heads, first.head_dim, first.scale, None)
        self.by_window = by_window
        self.of_layer = [by_window[w] for w in windows]
        self.supports_cuda_graph = all(b.supports_cuda_graph for b in by_window.values())

    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        for b in self.by_window.values():
            b.init_forward_metadata(md)

    def init_forward_metadata_capture(self, md: AttentionMetadata, bs: int) -> None:
        for b in self.by_window.values():
            b.init_forward_metadata_capture(md, bs)

    def init_forward_metadata_replay(self, md: AttentionMetadata, bs: int) -> None:
        for b in self.by_window.values():
            b.init_forward_metadata_replay(md, bs)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        return self.of_layer[layer_id].forward(q, k, v, layer_id, md)


def build_backend(
    make: Callable[..., AttentionBackend],
    kv: KVStore,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    windows: list[int | None],
) -> AttentionBackend:
    """One backend when every layer has the same window, else a `LayerWindowBackend` over one per window."""
    distinct = list(dict.fromkeys(windows))
    if len(distinct) == 1:
        return make(kv, num_heads, num_kv_heads, head_dim, scale, distinct[0])
    by_window = {w: make(kv, num_heads, num_kv_heads, head_dim, scale, w) for w in distinct}
    return LayerWindowBackend(by_window, windows)
