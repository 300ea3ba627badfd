"""Paged decode attention: one query token per request over that request's KV, read from the pool in place.

Two kernels. The partial kernel runs one program per (request, kv head, head block, KV split): it
attends the query heads that share one kv head (GQA: their ``q . k`` is one ``tl.dot``) over its split
of the request's positions with an online softmax, and writes the normalized partial output and its
log-sum-exp (base 2). The merge kernel combines a request's splits by their log-sum-exp. How many
splits a request uses is decided on the device from its own length (``cdiv(n, min_split_len)``,
at most ``max_kv_splits``), so short requests do not pay for splitting and nothing is read back to
the host. With ``max_kv_splits == 1`` the partial kernel writes the output itself and no merge runs.

CUDA-graph capture: ``decode_attention_fwd`` never synchronizes with the host; its grid depends only on
``q.shape``, the pool's kv-head count and ``max_kv_splits``; every length and index is read on the
device. A captured call replays correctly when the index tensors, ``seq_lens``, ``out`` and the
``workspace`` keep their addresses (allocate them once, copy each step's values into them; a paged
``kv_indices`` buffer may be longer than the step needs: only entries a request's length reaches are
read).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixrt.kernels.triton.common import KVIndex, block_d, check_kv, dot_options, lookup_slots, mm, row_start

# Query heads of one kv head handled by one program: tl.dot needs >= 16 rows, padded heads are masked.
MIN_BLOCK_H = 16
MAX_BLOCK_H = 64


class DecodeWorkspace(NamedTuple):
    """Split-K scratch: partial outputs ``[B, H, S, D]`` and their log-sum-exps ``[B, H, S]`` (float32)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def alloc_decode_workspace(
    batch_size: int, num_heads: int, head_dim: int, max_kv_splits: int, device: torch.device | str
) -> DecodeWorkspace:
    """Scratch for ``decode_attention`` of up to ``batch_size`` requests (a larger one may be passed)."""
    return DecodeWorkspace(
        torch.empty(batch_size, num_heads, max_kv_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_heads, max_kv_splits, dtype=torch.float32, device=device),
    )


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    Out,
    PartOut,
    PartLse,
    KvIndices,
    KvIndptr,
    SeqLens,
    row_stride,
    num_heads,
    scale_log2,
    window,
    min_split_len,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    NUM_HBLK: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_INDPTR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_HBLK
    hblk = tl.program_id(1) % NUM_HBLK
    split = tl.program_id(2)
    dtype = Q.dtype.element_ty

    offs_g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D

    seq_len = tl.load(SeqLens + b).to(tl.int64)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    n = seq_len - lo
    # This request's own split count and split length (a whole number of blocks).
    splits = tl.minimum(tl.maximum((n + min_split_len - 1) // min_split_len, 1), MAX_SPLITS)
    chunk = ((n + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)  # empty for splits past this request's count
    rs = row_start(KvIndptr, b, row_stride, USE_INDPTR)

    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_ok = pos < end
        slot = lookup_slots(KvIndices, rs, pos, n_ok, PAGE_SIZE)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        s = mm(q, tl.trans(k.to(dtype)), PRECISION, UPCAST) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + mm(p.to(dtype), v.to(dtype), PRECISION, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or request) gives zeros
    if MAX_SPLITS == 1:
        o_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(dtype), mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (b.to(tl.int64) * num_heads + heads) * MAX_SPLITS + split  # [BLOCK_H]
        tl.store(PartOut + part[:, None] * HEAD_D + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + part, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    PartOut,
    PartLse,
    Out,
    num_heads,
    stride_ob,
    stride_oh,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < MAX_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    part = (b.to(tl.int64) * num_heads + h) * MAX_SPLITS + offs_s
    lse = tl.load(PartLse + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    o = tl.load(
        PartOut + part[:, None] * HEAD_D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    index: KVIndex,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_kv_splits: int = 8,
    min_split_len: int = 256,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` of each request's single query over its KV slots.

    Args:
        q: ``[B, H, D]`` query of each request's new token (heads contiguous; any row stride).
        k_buf, v_buf: one layer's pool buffers ``[num_slots, KVH, D]``; ``H % KVH == 0`` (query head
            ``h`` reads kv head ``h // (H // KVH)``); the new tokens' K/V must already be stored.
        index: where each request's slots are (``KVIndex.pages`` or ``KVIndex.slot_table``).
        seq_lens: ``[B]`` positions each request attends over, its new token included (0 -> zeros).
        scale: softmax scale of ``q . k``.
        sliding_window: when positive, only each request's last ``sliding_window`` positions.
        max_kv_splits: the most KV splits per request (the grid's third dimension; fixed per capture).
        min_split_len: a request is split in ``cdiv(len, min_split_len)`` pieces, at most
            ``max_kv_splits`` (computed on the device).
        out: optional ``[B, H, D]`` output of ``q``'s dtype.
        workspace: scratch from ``alloc_decode_workspace`` for at least ``B`` requests, ``H`` heads,
            ``max_kv_splits`` splits; allocated here when omitted (unused when ``max_kv_splits == 1``).
        block_n: KV positions per loop step (a power of two >= 16).

    Returns ``out`` (or a new ``[B, H, D]`` tensor), computed with float32 softmax and accumulation.
    """
    H, KVH, D = check_kv(q, k_buf, v_buf, "decode_attention")
    B = int(q.shape[0])
    if index.batch_size != B or seq_lens.shape != (B,):
        raise ValueError(f"decode_attention: index and seq_lens must describe the {B} requests of q")
    if max_kv_splits < 1 or min_split_len < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError("decode_attention: max_kv_splits, min_split_len >= 1; block_n a power of two >= 16")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"decode_attention: out must be {tuple(q.shape)} {q.dtype} with a unit inner stride")
    if B == 0:
        return out
    if max_kv_splits > 1:
        if workspace is None:
            workspace = alloc_decode_workspace(B, H, D, max_kv_splits, q.device)
        po, pl = workspace
        if po.shape[1:] != (H, max_kv_splits, D) or po.shape[0] < B or pl.shape[1:] != (H, max_kv_splits):
            raise ValueError(
                "decode_attention: workspace does not fit (batch, heads, max_kv_splits, head_dim)"
            )
        if not (po.is_contiguous() and pl.is_contiguous() and pl.shape[0] >= B):
            raise ValueError("decode_attention: workspace tensors must be contiguous")
    else:
        po = pl = out  # placeholders, never touched
    group = H // KVH
    block_h = min(max(MIN_BLOCK_H, triton.next_power_of_2(group)), MAX_BLOCK_H)
    num_hblk = triton.cdiv(group, block_h)
    precision, upcast = dot_options(q.dtype, q.device)
    indices, indptr, row_stride, use_indptr = index.launch_args()
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    _decode_partial_kernel[(B, KVH * num_hblk, max_kv_splits)](
        q,
        k_buf,
        v_buf,
        out,
        po,
        pl,
        indices,
        indptr,
        seq_lens,
        row_stride,
        H,
        scale * math.log2(math.e),
        window,
        min_split_len,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        NUM_HBLK=num_hblk,
        HEAD_D=D,
        BLOCK_D=block_d(D),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        MAX_SPLITS=max_kv_splits,
        PAGE_SIZE=index.page_size,
        USE_INDPTR=use_indptr,
        HAS_WINDOW=window > 0,
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=num_warps,
        num_stages=2,
    )
    if max_kv_splits > 1:
        _decode_merge_kernel[(B, H)](
            po,
            pl,
            out,
            H,
            out.stride(0),
            out.stride(1),
            HEAD_D=D,
            BLOCK_D=block_d(D),
            MAX_SPLITS=max_kv_splits,
            BLOCK_S=triton.next_power_of_2(max_kv_splits),
            num_warps=num_warps,
        )
    return out
