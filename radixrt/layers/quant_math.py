"""Weight quantization arithmetic shared by the quantized linear modules (`quant_linear`): int8 per-row and
int4 per-group codes with their scales, and the int8 x int8 product with activations rounded at run time."""

from __future__ import annotations

import torch


def _to_bf16_grid(t: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bfloat16 value but keep float32 (bf16 values are exact in fp32 and fp16-safe)."""
    return t.to(torch.bfloat16).float()


def _fused_int8_ops() -> bool:
    from radixrt.kernels import int4_gemm

    return int4_gemm.available()


def quantize_int8_symmetric(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` as int8 codes ``[out, in]`` and float32 scales ``[out]``: ``w ~ codes * scale``,
    scale = row absmax / 127 (a zero row gets scale 1 and zero codes)."""
    w = _check_float_weight(weight)
    amax = w.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return codes, scale


def w8a8_linear(x: torch.Tensor, w8_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x [M, in]`` times an int8 weight, with ``x`` rounded to int8 per row at run time (absmax / 127):
    ``(round(x / sx) @ w8_t) * sx * w_scale`` in ``x.dtype``. ``w8_t`` is ``[in, out]`` (the transposed view
    of :func:`quantize_int8_symmetric`'s codes), ``w_scale`` float32 ``[out]``. The int32 accumulation is exact;
    the error is the two roundings' (each at most half a code step per element)."""
    if x.dtype == torch.bfloat16 and _fused_int8_ops():
        # the same arithmetic in two fused C passes (radixrt/kernels/csrc/int4_gemm.cpp)
        xq, sx = torch.ops.radixrt_int4.quant_rows(x.contiguous())
        return torch.ops.radixrt_int4.dequant_rows(torch._int_mm(xq, w8_t), sx, w_scale)
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xf / sx).to(torch.int8)
    return (torch._int_mm(xq, w8_t).float() * sx * w_scale).to(x.dtype)


def _check_float_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a floating [out, in] weight, got {weight.dtype} {tuple(weight.shape)}")
    return weight.detach().float()


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization: ``(q int8 [out, in], scales float32 [out])``.

    ``scale = absmax / 127`` rounded to the nearest bf16 value (1 for all-zero rows);
    ``q = clamp(round(w / scale), -127, 127)``.
    """
    w = _check_float_weight(weight)
    absmax = w.abs().amax(dim=1)
    scales = _to_bf16_grid(torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)))
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


def quantize_int4_groupwise(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group: ``(codes uint8 [out, in], scales [out, G], zeros [out, G])``, G = in/group.

    Dequantizes as ``(q - 8) * scale + zero``: ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``,
    both rounded to bf16 before the codes ``q = clamp(round((w - zero) / scale) + 8, 0, 15)`` are chosen.
    """
    w = _check_float_weight(weight)
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the int4 group size {group_size}")
    g = w.reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = _to_bf16_grid((hi - lo) / 15.0)
    zeros = _to_bf16_grid(torch.where(scales > 0, lo + 8.0 * scales, lo))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - zeros[..., None]) / safe[..., None]) + 8.0
    q = torch.where(scales[..., None] > 0, q, torch.full_like(q, 8.0))
    codes = torch.clamp(q, 0, 15).to(torch.uint8).reshape(out_f, in_f)
    return codes, scales, zeros
