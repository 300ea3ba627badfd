"""Attention whose sliding window differs by layer (Gemma 3: local layers with a window, global ones without).

Every backend takes one window for all layers, so the per-layer case is one backend instance per distinct
window, sharing the KV pool: each plans the forward's metadata once (its own mask or window for the C
kernels), and each layer's attention goes to its window's instance. The C decode / extend kernels and the
GPU kernels all take a window, so local layers stay on the fast paths.

With the sliding-window cache (``--enable-swa-cache``) the local layers' K/V live in a second slot space;
`SlotMappedBackend` gives their backend the forward's metadata translated through the full -> local page map.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

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

    def verify_kernels(self) -> list[str]:
        names = [b.verify_kernels() for b in self.by_window.values()]
        return [n for n in names[0] if all(n in other for other in names)]

    def use_verify_kernel(self, name: str) -> None:
        for b in self.by_window.values():
            b.use_verify_kernel(name)


class SlotMappedBackend(AttentionBackend):
    """``inner`` over a second slot space: every slot of the forward's metadata is read through
    ``page_map`` (full page -> page of the second space, a tensor its owner updates in place; 0 maps to the
    reserved padding page, which the window masks). Not capturable in CUDA graphs."""

    def __init__(self, inner: AttentionBackend, page_map: torch.Tensor) -> None:
        super().__init__(
            inner.kv, inner.num_heads, inner.num_kv_heads, inner.head_dim, inner.scale, inner.sliding_window
        )
        self.inner = inner
        self.page_map = page_map
        self._md: AttentionMetadata | None = None

    def _translate(self, md: AttentionMetadata) -> AttentionMetadata:
        ps, pm = md.page_size, self.page_map.to(md.seq_lens.device)

        def slots(t: torch.Tensor) -> torch.Tensor:
            return pm[t // ps] * ps + t % ps if ps > 1 else pm[t]

        return replace(
            md,
            kv_indices=pm[md.kv_indices],
            out_cache_loc=slots(md.out_cache_loc),
            slot_table=slots(md.slot_table),
        )

    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        self._md = self._translate(md)
        self.inner.init_forward_metadata(self._md)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        assert self._md is not None, "forward before init_forward_metadata"
        return self.inner.forward(q, k, v, layer_id, self._md)

    def verify_kernels(self) -> list[str]:
        return self.inner.verify_kernels()

    def use_verify_kernel(self, name: str) -> None:
        self.inner.use_verify_kernel(name)


def build_backend(
    make: Callable[..., AttentionBackend],
    kv: KVStore,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    windows: list[int | None],
    page_map: torch.Tensor | None = None,
) -> AttentionBackend:
    """One backend when every layer has the same window, else a `LayerWindowBackend` over one per window.
    With ``page_map`` the windowed layers' backends read their slots through it (`SlotMappedBackend`)."""
    distinct = list(dict.fromkeys(windows))
    if len(distinct) == 1 and page_map is None:
        return make(kv, num_heads, num_kv_heads, head_dim, scale, distinct[0])
    by_window = {w: make(kv, num_heads, num_kv_heads, head_dim, scale, w) for w in distinct}
    if page_map is not None:
        by_window = {w: b if w is None else SlotMappedBackend(b, page_map) for w, b in by_window.items()}
    return LayerWindowBackend(by_window, windows)
