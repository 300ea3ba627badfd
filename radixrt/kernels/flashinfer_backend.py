"""The FlashInfer attention backend (CUDA): paged prefill/append and decode wrappers over the KV pool.

The batch metadata is already FlashInfer's layout (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
``kv_last_page_len``), so a forward plans one wrapper once (``init_forward_metadata``) and every layer
runs it. The KV pool's per-layer buffers ``[num_slots, kv_heads, head_dim]`` are page-major, so they
are FlashInfer's NHD paged cache ``[num_pages, page_size, kv_heads, head_dim]`` as a view, no copy.

- extend (cached prefix + new tokens, causal): ``BatchPrefillWithPagedKVCacheWrapper``;
- decode: ``BatchDecodeWithPagedKVCacheWrapper``, on tensor cores when a KV head serves 4 or more query
  heads (FlashInfer's advice for GQA);
- CUDA graphs: one decode wrapper per bucket built with ``use_cuda_graph=True`` on the graph runner's
  static index buffers, re-planned before each replay (planning itself is never captured);
- sliding window: FlashInfer's ``window_left`` counts the keys left of the query, so a window of ``w``
  tokens including the query is ``window_left = w - 1`` (the mask torch_native applies).

One workspace buffer per worker serves every wrapper. ``flashinfer`` is imported with this module, which
the backend registry imports only when this backend is chosen.
"""

from __future__ import annotations

from typing import Any

import flashinfer
import torch

from radixrt.kernels.base import AttentionBackend, AttentionMetadata, KVStore

WORKSPACE_BYTES = 256 << 20
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode runs on tensor cores


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged kernels; needs the KV pool on a CUDA device."""

    supports_cuda_graph = True

    def __init__(
        self,
        kv: KVStore,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, sliding_window)
        k0, _ = kv.get_kv_buffer(0)
        if k0.device.type != "cuda":
            raise ValueError(
                f"attention_backend 'flashinfer' needs the KV pool on a CUDA device, not {k0.device}"
            )
        self.device = k0.device
        self.kv_dtype = k0.dtype
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_GROUP
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._active: Any = self.decode  # the wrapper planned for the forward in flight

    def _plan_decode(
        self, wrapper: flashinfer.BatchDecodeWithPagedKVCacheWrapper, md: AttentionMetadata
    ) -> None:
        wrapper.plan(
            md.kv_indptr.to(torch.int32),
            md.kv_indices.to(torch.int32),
            md.kv_last_page_len.to(torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            md.page_size,
            pos_encoding_mode="NONE",
            window_left=self.window_left,
            q_data_type=self.kv_dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.scale,
        )

    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        if md.max_extend_len == 1:  # one new token per request
            self._plan_decode(self.decode, md)
            self._active = self.decode
            return
        self.prefill.plan(
            md.qo_indptr.to(torch.int32),
            md.kv_indptr.to(torch.int32),
            md.kv_indices.to(torch.int32),
            md.kv_last_page_len.to(torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            md.page_size,
            causal=True,
            sm_scale=self.scale,
            window_left=self.window_left,
            q_data_type=self.kv_dtype,
            kv_data_type=self.kv_dtype,
        )
        self._active = self.prefill

    def init_forward_metadata_capture(self, md: AttentionMetadata, bs: int) -> None:
        """A CUDA-graph decode wrapper for bucket ``bs`` on fixed int32 index buffers, planned once."""
        num_pages = int(md.kv_indices.shape[0])
        buffers = (
            torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            torch.zeros(num_pages, dtype=torch.int32, device=self.device),
            torch.ones(bs, dtype=torch.int32, device=self.device),
        )
        self._graph_buffers[bs] = buffers
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=buffers[0],
            paged_kv_indices_buffer=buffers[1],
            paged_kv_last_page_len_buffer=buffers[2],
        )
        self.graph_decode[bs] = wrapper
        self.init_forward_metadata_replay(md, bs)

    def init_forward_metadata_replay(self, md: AttentionMetadata, bs: int) -> None:
        # The static metadata's kv_indices buffer is longer than this batch's pages: plan reads the first
        # kv_indptr[-1] of them.
        wrapper = self.graph_decode[bs]
        self._plan_decode(wrapper, md)
        self._active = wrapper

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        self.kv.set_kv(layer_id, md.out_cache_loc, k, v)
        k_buf, v_buf = self.kv.get_kv_buffer(layer_id)
        ps = md.page_size
        paged = (
            k_buf.view(-1, ps, self.num_kv_heads, self.head_dim),
            v_buf.view(-1, ps, self.num_kv_heads, self.head_dim),
        )
        out: torch.Tensor = self._active.run(q.contiguous(), paged)
        return out
