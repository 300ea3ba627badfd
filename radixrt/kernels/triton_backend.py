"""The Triton attention backend: paged decode and ragged extend kernels over the KV pool in place.

The real target is CUDA tensors; CPU tensors work only under Triton's interpreter (set
``TRITON_INTERPRET=1`` before triton is first imported), which is how CPU CI checks these kernels
against ``torch_native``. Importing this module imports triton: ``radixrt.kernels.base.get_backend_class``
turns a missing triton into ``ValueError("attention_backend 'triton' is not available here: ...")``.
"""

from __future__ import annotations

import torch

from radixrt.kernels.base import AttentionBackend, AttentionMetadata, ForwardMode, KVStore
from radixrt.kernels.triton import (
    DecodeWorkspace,
    KVIndex,
    alloc_decode_workspace,
    decode_attention_fwd,
    extend_attention_fwd,
)


class TritonBackend(AttentionBackend):
    """Decode (one new token per request) runs the split-K decode kernel, everything else the extend
    kernel; both find K/V through the metadata's page table (``kv_indptr``/``kv_indices``,
    ``page_size``) or, with ``use_slot_table``, through its token ``slot_table``.

    ``max_kv_splits`` bounds the KV splits of one decode request and ``min_split_len`` is the fewest
    positions worth a split of their own; ``block_m``/``block_n`` override the kernels' tile sizes.

    CUDA-graph capture of decode: ``init_forward_metadata`` (not captured) builds the ``KVIndex`` and
    reserves the split-K workspace, which only grows, so its address is stable for a batch size; the
    per-layer ``forward`` (captured) does ``set_kv`` and one ``decode_attention_fwd`` call with no host
    synchronization. A capturing runner keeps the metadata tensors at fixed addresses itself and
    fixes ``max_kv_splits`` for the capture.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv: KVStore,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        *,
        max_kv_splits: int = 8,
        min_split_len: int = 256,
        use_slot_table: bool = False,
        block_m: int | None = None,
        block_n: int | None = None,
    ) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, sliding_window)
        if num_heads % num_kv_heads:
            raise ValueError(f"TritonBackend: num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        self.use_slot_table = use_slot_table
        self.block_m = block_m
        self.block_n = block_n
        self._workspace: DecodeWorkspace | None = None
        self._retired: list[DecodeWorkspace] = []
        self._index: KVIndex | None = None

    def workspace(self, batch_size: int, device: torch.device) -> DecodeWorkspace:
        """The split-K scratch for ``batch_size`` requests (grown, never shrunk; sliced views)."""
        ws = self._workspace
        if ws is None or ws.partial_out.shape[0] < batch_size or ws.partial_out.device != device:
            if ws is not None:
                # NOTE: a captured CUDA graph may still read the old buffers: keep them alive.
                self._retired.append(ws)
            ws = alloc_decode_workspace(batch_size, self.num_heads, self.head_dim, self.max_kv_splits, device)
            self._workspace = ws
        return DecodeWorkspace(ws.partial_out[:batch_size], ws.partial_lse[:batch_size])

    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        if self.use_slot_table:
            self._index = KVIndex.slot_table(md.slot_table)
        else:
            self._index = KVIndex.pages(md.kv_indptr, md.kv_indices, md.page_size)
        if md.max_extend_len == 1 and self.max_kv_splits > 1:
            self.workspace(md.batch_size, md.seq_lens.device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        assert self._index is not None, "TritonBackend.forward before init_forward_metadata"
        self.kv.set_kv(layer_id, md.out_cache_loc, k, v)
        k_buf, v_buf = self.kv.get_kv_buffer(layer_id)
        B = md.batch_size
        decode = md.mode == ForwardMode.DECODE or md.max_extend_len == 1
        if decode and q.shape[0] == B:
            return decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                self._index,
                md.seq_lens,
                self.scale,
                self.sliding_window,
                max_kv_splits=self.max_kv_splits,
                min_split_len=self.min_split_len,
                workspace=self.workspace(B, q.device) if self.max_kv_splits > 1 else None,
                block_n=self.block_n or 64,
            )
        return extend_attention_fwd(
            q,
            k_buf,
            v_buf,
            self._index,
            md.qo_indptr,
            md.prefix_lens,
            md.max_extend_len,
            self.scale,
            self.sliding_window,
            block_m=self.block_m,
            block_n=self.block_n,
        )
