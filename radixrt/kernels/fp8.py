"""The float8 KV codec: storing K/V as torch's float8 dtypes and widening them back for attention.

The KV pool (`radixrt.mem_cache.kv_pool`) quantizes what it stores; attention backends dequantize what
they gather. Both live here, below the pool and the backends, so neither imports the other.
"""

from __future__ import annotations

import torch


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the float8 formats the KV pool can store."""
    return dtype in (torch.float8_e5m2, torch.float8_e4m3fn)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x / scale`` (``scale`` per head ``[KVH]`` or per channel ``[KVH, D]``, for ``x [T, KVH, D]``) cast
    to ``dtype``, saturating instead of overflowing to inf / NaN."""
    fmax = torch.finfo(dtype).max
    if scale is None:
        y = x.float()
    else:
        y = x.float() / (scale if scale.dim() == 2 else scale[:, None])
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """Float8 ``x`` widened to float32, exactly, by moving its bits into a float16: e5m2 is the top byte of
    a float16; e4m3's magnitude bits placed under the float16 exponent give the value / 256 (subnormals
    included). torch's own float8 -> wider casts are scalar loops on CPU, several times slower."""
    u = x.view(torch.uint8).to(torch.int16)
    if x.dtype == torch.float8_e5m2:
        return (u << 8).view(torch.float16).float()
    assert x.dtype == torch.float8_e4m3fn, x.dtype
    return (((u & 0x7F) << 7) | ((u & 0x80) << 8)).view(torch.float16).float() * 256.0


def store_e4m3(
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor,
    k_offset: torch.Tensor,
    v_scale: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
) -> bool:
    """Store ``quantize_fp8(k - k_offset, e4m3, k_scale)`` and ``quantize_fp8(v, e4m3, v_scale)`` (``k``, ``v``
    ``[T, KVH, D]`` bf16 or f32; ``k_scale``, ``k_offset`` ``[KVH, D]``, ``v_scale`` ``[KVH]`` float32) at slots
    ``loc`` of the e4m3 buffers ``[num_slots, KVH, D]`` with the C library; False (nothing stored) where it
    does not apply: not all on the CPU, another dtype or layout, or no C library here."""
    from radixrt.kernels import cpu_decode  # NOTE: deferred: loading the library compiles it on first use

    T, KVH, D = k.shape
    if not (
        k.is_cpu
        and k_buf.is_cpu
        and k.dtype in (torch.bfloat16, torch.float32)
        and v.dtype == k.dtype
        and v.shape == k.shape
        and k.stride()[1:] == (D, 1)
        and v.stride()[1:] == (D, 1)
        and k_buf.dtype == torch.float8_e4m3fn
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
        and loc.dtype == torch.int64
        and loc.is_contiguous()
        and loc.shape == (T,)
        and cpu_decode.available()
    ):
        return False
    ks, ko, vs = (t.float().contiguous() for t in (k_scale, k_offset, v_scale))
    status = cpu_decode.kernels().store_e4m3(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        int(k.dtype == torch.bfloat16),
        T,
        KVH,
        D,
        ks.data_ptr(),
        ko.data_ptr(),
        vs.data_ptr(),
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        loc.data_ptr(),
        k_buf.shape[0],
    )
    if status:
        raise IndexError("store_e4m3: a slot of loc is outside the pool")
    return True
