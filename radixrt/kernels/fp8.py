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
