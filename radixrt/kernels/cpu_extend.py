"""A CPU extend (prefill) attention kernel that reads the paged KV pool in place: flash attention over each
request's cached prefix and new tokens, without a gathered K/V copy or a dense mask per layer.

The kernel is C (``radixrt/kernels/csrc/paged_extend.c``), compiled into one library with the decode kernel
by ``radixrt.kernels.cpu_decode`` (same cache, same ``available()``). Work items are (request, kv head, block
of new tokens): all query heads of a kv head share each K/V tile of 64 positions, read through the slot
table; scores and values are small register-blocked GEMMs with an online softmax; items run on
``torch.get_num_threads()`` OpenMP threads. fp32 runs in fp32 throughout; bf16 uses the AVX512-BF16 dot
product where the CPU has it, with the probabilities rounded to bf16 for ``P V`` as torch's bf16 flash
attention does (see the C file's header for the precision contract). Float8 pools (e4m3fn / e5m2, with
their per-channel K and per-head V scales) are widened exactly to fp32 as tiles are packed, then run in fp32.

Per layer of an extend forward::

    out = paged_extend_attention(q, k_buf, v_buf, slot_table, qo_indptr, seq_lens, scale, window)
"""

from __future__ import annotations

import torch

from radixrt.kernels import cpu_decode

__all__ = ["paged_extend_attention"]

_STATUS_ERRORS = {
    1: "qo_indptr / seq_lens: qo_indptr must be non-decreasing from >= 0 up to at most q.shape[0], and every "
    "request's new-token count at most its seq_len, itself at most slot_table.shape[1]",
    2: "slot_table: a slot among the first seq_lens[b] entries of a row is outside [0, k_buf.shape[0])",
}


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"paged_extend_attention: {name} {what}")


def _check_int_vector(name: str, t: object, n: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_cpu:
        raise _bad(name, f"must be a 1-D [{n}] CPU tensor")
    if t.dtype != torch.int64 or t.shape[0] != n or not t.is_contiguous():
        raise _bad(name, f"must be contiguous int64 of length {n}, got {t.dtype} {tuple(t.shape)}")


def _check(
    q: object,
    k_buf: object,
    v_buf: object,
    slot_table: object,
    qo_indptr: object,
    seq_lens: object,
    window: object,
    out: object,
) -> None:
    """Raise a ValueError naming the first bad argument (shapes, dtypes, layouts, devices)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_cpu:
        raise _bad("q", "must be a 3-D [T, H, D] CPU tensor")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise _bad("q", f"dtype must be bfloat16 or float32, got {q.dtype}")
    T, H, D = q.shape
    if q.stride(2) != 1 or (H > 1 and q.stride(1) != D) or (T > 1 and q.stride(0) < H * D):
        raise _bad("q", f"must have contiguous heads (strides (>= H*D, D, 1)), got strides {q.stride()}")
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        if not isinstance(buf, torch.Tensor) or buf.dim() != 3 or not buf.is_cpu:
            raise _bad(name, "must be a 3-D [num_slots, KVH, D] CPU tensor")
        if buf.dtype != q.dtype and buf.dtype not in cpu_decode.FP8_KINDS:
            raise _bad(name, f"dtype {buf.dtype} is neither q's {q.dtype} nor a float8 format")
        if not buf.is_contiguous():
            raise _bad(name, "must be contiguous")
    assert isinstance(k_buf, torch.Tensor) and isinstance(v_buf, torch.Tensor)
    if v_buf.dtype != k_buf.dtype:
        raise _bad("v_buf", f"dtype {v_buf.dtype} differs from k_buf's {k_buf.dtype}")
    _, KVH, Dk = k_buf.shape
    if Dk != D or KVH == 0 or H % KVH != 0:
        raise _bad("k_buf", f"shape {tuple(k_buf.shape)} does not fit q's [T={T}, H={H}, D={D}]")
    if v_buf.shape != k_buf.shape:
        raise _bad("v_buf", f"shape {tuple(v_buf.shape)} differs from k_buf's {tuple(k_buf.shape)}")
    if not isinstance(slot_table, torch.Tensor) or slot_table.dim() != 2 or not slot_table.is_cpu:
        raise _bad("slot_table", "must be a 2-D [B, max_seq_len] CPU tensor")
    B = slot_table.shape[0]
    if slot_table.dtype != torch.int64:
        raise _bad("slot_table", f"must be int64, got {slot_table.dtype}")
    if slot_table.shape[1] > 1 and slot_table.stride(1) != 1:
        raise _bad("slot_table", "must have a unit inner stride")
    _check_int_vector("qo_indptr", qo_indptr, B + 1)
    _check_int_vector("seq_lens", seq_lens, B)
    if window is not None and (not isinstance(window, int) or window < 0):
        raise _bad("window", f"must be None or an int >= 0, got {window!r}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != q.shape
        or out.dtype != q.dtype
        or not out.is_cpu
        or not out.is_contiguous()
    ):
        raise _bad("out", f"must be a contiguous [{T}, {H}, {D}] {q.dtype} CPU tensor")


def paged_extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slot_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its KV slots (cached prefix + new), read in place.

    Args:
        q: ``[T, H, D]`` bfloat16 or float32 CPU tensor, the new tokens of all requests (request ``b``'s at
            rows ``qo_indptr[b]:qo_indptr[b+1]``), with contiguous heads (strides ``(>= H*D, D, 1)``, so a
            row-strided view of a fused QKV projection works without a copy).
        k_buf, v_buf: one layer's ``[num_slots, KVH, D]`` contiguous pool buffers of ``q``'s dtype or both
            float8 (e4m3fn / e5m2, read as ``code * scale``; the new tokens' K/V already stored); ``H`` must
            be a multiple of ``KVH`` (query head ``h`` uses kv head ``h // (H // KVH)``).
        slot_table: ``[B, >= max(seq_lens)]`` int64 with a unit inner stride; the first ``seq_lens[b]``
            entries of row ``b`` are request ``b``'s slots in position order, the rest are not read.
        qo_indptr: ``[B + 1]`` contiguous int64, non-decreasing, ``qo_indptr[B] <= T``.
        seq_lens: ``[B]`` contiguous int64, prefix plus new tokens of each request: new token ``i`` of
            request ``b`` (``n_b`` new tokens) is at position ``seq_lens[b] - n_b + i`` and attends the
            positions up to its own.
        scale: the softmax scale of ``q . k``.
        window: sliding window: when positive, a token at position ``p`` attends only positions
            ``> p - window``.
        out: optional contiguous ``[T, H, D]`` tensor of ``q``'s dtype to write (not overlapping inputs);
            rows not covered by ``qo_indptr`` are left as they are.
        k_scale, v_scale: float8 buffers only, as for ``cpu_decode.paged_decode_attention``.

    Returns:
        ``[T, H, D]`` contiguous tensor of ``q``'s dtype (see the module docstring for bf16 precision).

    Raises:
        ValueError: naming the argument, for a wrong type, dtype, shape, layout or device, inconsistent
            ``qo_indptr`` / ``seq_lens``, or a slot out of range (these two are found by the kernel; ``out``
            is then unspecified).
        CpuDecodeUnavailable: when the C library cannot be built here.
        MemoryError: when the kernel's scratch allocation fails.
    """
    _check(q, k_buf, v_buf, slot_table, qo_indptr, seq_lens, window, out)
    assert isinstance(k_buf, torch.Tensor)
    lib = cpu_decode.kernels()
    extra: list[int] = []
    if k_buf.dtype in cpu_decode.FP8_KINDS:
        extra, _keep = cpu_decode.fp8_extra_args("paged_extend_attention", q, k_buf, k_scale, v_scale)
    elif k_scale is not None or v_scale is not None:
        raise _bad("k_scale / v_scale", "apply to float8 buffers only")
    fn = lib.extend_fp8 if extra else lib.extend[q.dtype]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    T, H, D = q.shape
    B = slot_table.shape[0]
    if B == 0 or T == 0 or H == 0 or D == 0:
        return out
    status = fn(
        q.data_ptr(),
        q.stride(0),
        T,
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        k_buf.shape[0],
        slot_table.data_ptr(),
        slot_table.stride(0),
        slot_table.shape[1],
        qo_indptr.data_ptr(),
        seq_lens.data_ptr(),
        B,
        H,
        k_buf.shape[1],
        D,
        float(scale),
        window or 0,
        out.data_ptr(),
        torch.get_num_threads(),
        *extra,
    )
    if status:
        if status == 3:
            raise MemoryError("paged_extend_attention: the kernel could not allocate its scratch memory")
        raise ValueError(f"paged_extend_attention: {_STATUS_ERRORS.get(status, f'kernel status {status}')}")
    return out
