"""Ragged extend (prefill) attention: each request's new tokens attend causally over its cached prefix
plus themselves, all read from the KV pool through the request's ``KVIndex``.

One program per (request, query head, block of ``BLOCK_M`` new tokens): ``q k^T`` and ``p v`` are
``tl.dot`` tiles; an online softmax runs over the KV positions the block can see, from 0 (or the
sliding window's start for the block's first token) to the block's last token. GQA maps query head
``h`` to kv head ``h // (H // KVH)``. The new tokens' K/V must already be in the pool (the backend
stores them first), so the prefix and the new tokens are one range of positions.

Not meant for CUDA-graph capture: the grid's third dimension follows ``max_extend_len``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixrt.kernels.triton.common import KVIndex, block_d, check_kv, dot_options, lookup_slots, mm, row_start


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    KvIndices,
    KvIndptr,
    QoIndptr,
    PrefixLens,
    row_stride,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_INDPTR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    kvh = h // GROUP
    dtype = Q.dtype.element_ty

    q_start = tl.load(QoIndptr + b).to(tl.int64)
    ext_len = tl.load(QoIndptr + b + 1).to(tl.int64) - q_start
    prefix = tl.load(PrefixLens + b).to(tl.int64)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < ext_len
    q_pos = prefix + offs_m  # absolute position of each query token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    qo_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0
    )

    # KV positions this block sees: [lo, hi); empty when the block is past the request's new tokens.
    first = prefix + mblk * BLOCK_M
    hi = tl.minimum(prefix + ext_len, first + BLOCK_M)
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    else:
        lo = first * 0
    hi = tl.where(mblk * BLOCK_M < ext_len, hi, lo)
    rs = row_start(KvIndptr, b, row_stride, USE_INDPTR)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_ok = pos < hi
        slot = lookup_slots(KvIndices, rs, pos, n_ok, PAGE_SIZE)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        s = mm(q, tl.trans(k.to(dtype)), PRECISION, UPCAST) * scale_log2
        visible = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees nothing in this block (window, padding) keeps exp2(-inf) = 0, never NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + mm(p.to(dtype), v.to(dtype), PRECISION, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(dtype), mask=qo_mask)


def default_blocks(head_dim: int) -> tuple[int, int]:
    """``(block_m, block_n)`` for a head dim: smaller tiles for wide heads keep registers in check."""
    return (64, 64) if head_dim <= 128 else (32, 32)


def extend_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    index: KVIndex,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Causal attention of the ragged new tokens ``q`` ``[T, H, D]`` over each request's pool KV.

    Args:
        q: new tokens' queries, request after request (``qo_indptr`` ``[B+1]`` gives the offsets).
        k_buf, v_buf: one layer's pool buffers ``[num_slots, KVH, D]``, holding the prefix and the new
            tokens' K/V already (``H % KVH == 0``).
        index: where each request's slots are, positions ``0 .. prefix_lens[b] + extend_len[b] - 1``.
        prefix_lens: ``[B]`` cached positions before each request's new tokens.
        max_extend_len: the largest extend length (sizes the grid; a larger value only wastes programs).
        scale: softmax scale; sliding_window: when positive, token at position ``p`` sees
            ``(p - sliding_window, p]``.
        out: optional ``[T, H, D]`` output of ``q``'s dtype; block_m, block_n: tile sizes (powers of
            two >= 16; default by head dim).
    """
    H, KVH, D = check_kv(q, k_buf, v_buf, "extend_attention")
    B = int(prefix_lens.shape[0])
    if index.batch_size != B or qo_indptr.shape != (B + 1,):
        raise ValueError(f"extend_attention: index, qo_indptr and prefix_lens must describe {B} requests")
    dm, dn = default_blocks(D)
    bm, bn = block_m or dm, block_n or dn
    for blk in (bm, bn):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"extend_attention: block sizes must be powers of two >= 16, got {blk}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"extend_attention: out must be {tuple(q.shape)} {q.dtype} with a unit inner stride")
    if B == 0 or q.shape[0] == 0 or max_extend_len <= 0:
        return out
    precision, upcast = dot_options(q.dtype, q.device)
    indices, indptr, row_stride, use_indptr = index.launch_args()
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    _extend_kernel[(B, H, triton.cdiv(max_extend_len, bm))](
        q,
        k_buf,
        v_buf,
        out,
        indices,
        indptr,
        qo_indptr,
        prefix_lens,
        row_stride,
        scale * math.log2(math.e),
        window,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=H // KVH,
        HEAD_D=D,
        BLOCK_D=block_d(D),
        BLOCK_M=bm,
        BLOCK_N=bn,
        PAGE_SIZE=index.page_size,
        USE_INDPTR=use_indptr,
        HAS_WINDOW=window > 0,
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
