"""What both kernels share: where a request's KV slots are (``KVIndex``), the slot lookup inside a
kernel, and the argument checks of the wrappers (shapes only: they never read a tensor's values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class KVIndex:
    """How position ``p`` of request ``b`` maps to a slot of the KV pool (slots are page-major).

    Paged (FlashInfer's layout, ``AttentionMetadata.kv_indptr``/``kv_indices``): ``indptr`` is
    ``[B+1]``, ``indices`` the flat page ids, and the slot is
    ``indices[indptr[b] + p // page_size] * page_size + p % page_size``.
    Slot table (``AttentionMetadata.slot_table``): ``indices`` is ``[B, W]`` with a unit inner stride
    (any row stride), ``indptr`` is None, ``page_size`` 1, and the slot is ``indices[b, p]``.
    Only the first ``seq_lens[b]`` positions of a request are ever looked up.
    """

    indices: torch.Tensor
    indptr: torch.Tensor | None
    page_size: int

    @classmethod
    def pages(cls, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int) -> KVIndex:
        if page_size < 1:
            raise ValueError(f"KVIndex: page_size must be >= 1, got {page_size}")
        if kv_indptr.dim() != 1 or kv_indices.dim() != 1:
            raise ValueError("KVIndex: kv_indptr and kv_indices must be 1-D")
        return cls(kv_indices, kv_indptr, page_size)

    @classmethod
    def slot_table(cls, table: torch.Tensor) -> KVIndex:
        if table.dim() != 2 or (table.shape[1] > 1 and table.stride(1) != 1):
            raise ValueError("KVIndex: a slot table must be 2-D with a unit inner stride")
        return cls(table, None, 1)

    @property
    def batch_size(self) -> int:
        return int(self.indices.shape[0]) if self.indptr is None else int(self.indptr.shape[0]) - 1

    def launch_args(self) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
        """``(indices, indptr, row_stride, use_indptr)`` as the kernels take them (``indptr`` is a
        placeholder pointer, never read, for a slot table)."""
        if self.indptr is None:
            return self.indices, self.indices, self.indices.stride(0), False
        return self.indices, self.indptr, 0, True


@triton.jit
def row_start(KvIndptr, b, row_stride, USE_INDPTR: tl.constexpr):
    """Offset into the index tensor where request ``b``'s entries begin."""
    if USE_INDPTR:
        start = tl.load(KvIndptr + b).to(tl.int64)
    else:
        start = b.to(tl.int64) * row_stride
    return start


@triton.jit
def lookup_slots(KvIndices, start, pos, mask, PAGE_SIZE: tl.constexpr):
    """Pool slots of positions ``pos`` (int64) of the request whose entries begin at ``start``;
    masked-off positions get slot 0 (the reserved padding slot)."""
    if PAGE_SIZE == 1:
        slot = tl.load(KvIndices + start + pos, mask=mask, other=0).to(tl.int64)
    else:
        page = tl.load(KvIndices + start + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
    return slot


@triton.jit
def mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with float32 accumulation (on float32 copies under the interpreter)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


def dot_options(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """``(input_precision, upcast)`` for ``tl.dot``: float32 uses exact ("ieee") products, not TF32;
    ``upcast`` is True under the interpreter (CPU tensors), whose ``tl.dot`` misreads bfloat16
    operands, so the kernels feed it float32 copies (bf16 x bf16 products are exact in float32, so the
    result matches a GPU's bf16 MMA with float32 accumulation)."""
    return ("ieee" if dtype == torch.float32 else "tf32"), device.type == "cpu"


def check_kv(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, who: str) -> tuple[int, int, int]:
    """``(H, KVH, D)`` after checking that q ``[*, H, D]`` fits the pool buffers ``[slots, KVH, D]``."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"{who}: q must be [tokens, H, D] with a unit inner stride, got {tuple(q.shape)}")
    _, H, D = q.shape
    if (
        k_buf.dim() != 3
        or v_buf.shape != k_buf.shape
        or not k_buf.is_contiguous()
        or not v_buf.is_contiguous()
    ):
        raise ValueError(f"{who}: k_buf and v_buf must be contiguous [num_slots, KVH, D] of one shape")
    KVH = int(k_buf.shape[1])
    if k_buf.shape[2] != D or KVH == 0 or H % KVH != 0:
        raise ValueError(f"{who}: k_buf {tuple(k_buf.shape)} does not fit q's H={H}, D={D}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{who}: q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k_buf.dtype != v_buf.dtype:
        raise ValueError(f"{who}: k_buf dtype {k_buf.dtype} differs from v_buf's {v_buf.dtype}")
    if k_buf.device != q.device or v_buf.device != q.device:
        raise ValueError(f"{who}: q, k_buf and v_buf must be on one device")
    return int(H), KVH, int(D)


def block_d(head_dim: int) -> int:
    """The head-dim block: a power of two, >= 16 (tl.dot's least K)."""
    return max(16, triton.next_power_of_2(head_dim))
