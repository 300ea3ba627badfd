"""GGUF-quantized weights mapped onto the CPU int4 / int8 kernels of :mod:`radixrt.layers.quant_linear`.

Input: the raw block bytes of one weight as the ``gguf`` package gives them (uint8 ``[out, row_bytes]``,
e.g. ``gguf.quants.quantize(w_f32, qtype)`` or a ``GGUFReader`` tensor's ``data``), the ggml type and the
logical shape ``(out, in)``. Block formats are decoded with integer ops straight into int4 codes plus
per-32-column fp32 scale/zero, never through a float32 weight, where the kernel can hold them:

============================  ==========================================================  =====================
ggml type                      layout (all int4 layouts: group 32, ``w = fma(q-8, s, z)``)  exact? (fp32 compute)
============================  ==========================================================  =====================
F32, F16, BF16                 :class:`DenseLinear` (``F.linear``)                           exact
Q4_0  (w = d*(q-8))            :class:`Int4Linear`, 1 plane: s = d, z = 0                    exact
Q4_1  (w = d*q + m)            1 plane: s = d, z = m + 8d                                   exact [1]
Q4_K  (w = d*sc*q - dmin*mn)   1 plane per 32-col sub-block: s = d*sc, z = 8s - dmin*mn     exact [1]
Q5_0, Q5_1, Q5_K               2 planes, code = 16*hi + lo: hi: s' = 16s, z' = 128s;       exact [1]
                               lo: s, z = 8s + m  (Q5_0: z = -8s)
Q8_0  (w = d*q, q int8)        2 planes on code q + 128: hi: 16d, z' = 8d; lo: d, z = 0      exact (bitwise)
Q2_K, Q3_K, Q6_K, IQ*, TQ*,    ``gguf.quants.dequantize`` -> float32 -> :class:`Int8Linear`  lossy [2]
MXFP4                          (symmetric per-row int8 requantization)
anything else (Q8_K, ...)      ValueError
============================  ==========================================================  =====================

[1] ``z`` is computed in float64 and rounded once to fp32; when that rounding is exact (it is for real
weights, where ``m ~ -8d``) the kernel's fma reproduces ``gguf.quants.dequantize`` bit for bit, otherwise
within 1 fp32 ulp of ``z``. Two planes are summed after the two matmuls (exact in real arithmetic).
[2] Q6_K's 16-column sub-blocks (and the other formats' codebooks) have no exact int4/int8 layout; per-row
int8 adds at most ``rowmax / 254`` (+ bf16 rounding of the row scale) per element.

bf16 compute: the kernels take scales in the activation dtype, so fp16 ``d`` / ``m`` become bf16 (8-bit
mantissa): every int4 layout is then lossy by up to ~2^-9 of ``|s*(q-8)| + |z|`` per element. Only bf16
is vectorised on x86, so that is the fast path; fp32 compute is the exact (slow) one.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType

from radixrt.layers.quant_linear import DenseLinear, Int4Linear, Int8Linear, QuantLinearBase

_DENSE = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_INT4_DIRECT = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K)
_INT4_TWO_PLANES = (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.Q8_0)
_DEQUANT_NAMES = (
    "Q2_K", "Q3_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
_DEQUANT = tuple(GGMLType[n] for n in _DEQUANT_NAMES if n in GGMLType.__members__)

#: Every ggml type :func:`gguf_linear` accepts, in table order.
SUPPORTED_GGML_TYPES: tuple[GGMLType, ...] = _DENSE + _INT4_DIRECT + _INT4_TWO_PLANES + _DEQUANT
_CODE_BITS = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q4_K: 4, GGMLType.Q8_0: 8}
_CODE_BITS.update({GGMLType.Q5_0: 5, GGMLType.Q5_1: 5, GGMLType.Q5_K: 5})
_GROUP = 32


def parse_ggml_type(ggml_type: GGMLType | int | str) -> GGMLType:
    """A ggml type from an enum member, its integer value or its (case-insensitive) name."""
    t: GGMLType | None
    try:
        if isinstance(ggml_type, str):
            t = GGMLType[ggml_type.upper()]
        else:
            t = GGMLType(ggml_type)
    except (KeyError, ValueError):
        t = None
    if t is None or t not in SUPPORTED_GGML_TYPES:
        name = t.name if t is not None else repr(ggml_type)
        supported = ", ".join(x.name for x in SUPPORTED_GGML_TYPES)
        raise ValueError(f"unsupported GGUF type {name}; supported: {supported}")
    return t


def _raw_rows(raw: np.ndarray | torch.Tensor, qtype: GGMLType, shape: tuple[int, int]) -> np.ndarray:
    """The raw bytes as a contiguous uint8 ``[out, row_bytes]`` array, checked against the shape."""
    out_f, in_f = shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if in_f % block:
        raise ValueError(f"in_features {in_f} is not a multiple of the {qtype.name} block size {block}")
    arr = (
        raw.detach().cpu().contiguous().numpy()
        if isinstance(raw, torch.Tensor)
        else np.ascontiguousarray(raw)
    )
    flat = arr.reshape(-1).view(np.uint8)
    row_bytes = in_f // block * type_size
    if flat.size != out_f * row_bytes:
        raise ValueError(
            f"{qtype.name} weight of shape {shape} needs {out_f * row_bytes} bytes, got {flat.size} (array {arr.shape})"
        )
    return flat.reshape(out_f, row_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields ``[..., 2]`` uint8 -> float32 ``[...]``."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]`` codes: low nibbles first, then high nibbles (ggml order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., n/8]`` bytes as ``[..., n]`` little-endian bits."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], n)


def _k_scale_min(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K packed 6-bit sub-block scales and mins: ``[..., 12]`` -> two ``[..., 8]`` float32."""
    d, m, md = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def _decode(blk: torch.Tensor, qtype: GGMLType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks ``[out, nb, type_size]`` -> ``(codes uint8 [out, G, 32], s [out, G], m [out, G])``, ``w = s*code + m``."""
    n, nb = blk.shape[:2]
    if qtype == GGMLType.Q4_0:
        d = _f16(blk[..., 0:2])
        return _nibbles(blk[..., 2:]), d, -8.0 * d
    if qtype == GGMLType.Q4_1:
        return _nibbles(blk[..., 4:]), _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
    if qtype == GGMLType.Q8_0:
        d = _f16(blk[..., 0:2])
        codes = (blk[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return codes, d, -128.0 * d
    if qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
        off = 2 if qtype == GGMLType.Q5_0 else 4
        d = _f16(blk[..., 0:2])
        codes = _nibbles(blk[..., off + 4 :]) | (_bits(blk[..., off : off + 4], 32) << 4)
        return codes, d, (-16.0 * d if qtype == GGMLType.Q5_0 else _f16(blk[..., 2:4]))
    # K-quants: super-blocks of 256 = 8 sub-blocks of 32
    d, dmin = _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None]
    sc, mn = _k_scale_min(blk[..., 4:16])
    qs = blk[..., -128:].reshape(n, nb, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, nb, 8, 32)
    if qtype == GGMLType.Q5_K:
        hbits = (blk[..., 16:48][:, :, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        codes = codes | (hbits << 4)
    return codes.reshape(n, nb * 8, 32), (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)


def _int4_planes(
    codes: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w = s*code + m`` (``bits``-bit codes) as Int4Linear planes ``(codes [P, out, in], scales, zeros)``.

    Up to 4 bits: one plane, ``(code - 8) * s + (8s + m)``. 5 or 8 bits: ``code = 16*hi + lo`` and
    ``w = [(hi - 8) * 16s + zh] + [(lo - 8) * s + (136s + m - zh)]``. ``zh`` is a power-of-two multiple of
    ``s`` (so bf16 rounding of the scales keeps ``zh / s`` exact): 8s centres 8-bit hi nibbles (Q8_0's lo
    zero is then exactly 0), 128s makes the 5-bit hi plane ``16s * hi`` (Q5_0's lo zero is then -8s).
    bf16 rounds each plane's output separately, so the planes should not carry large opposite offsets.
    """
    n = codes.shape[0]
    s64, m64 = s.double(), m.double()
    if bits <= 4:
        return codes.reshape(1, n, -1), s[None], (8.0 * s64 + m64).float()[None]
    hi, lo = (codes >> 4).reshape(n, -1), (codes & 15).reshape(n, -1)
    zh = (8.0 if bits == 8 else 128.0) * s64
    zl = 136.0 * s64 + m64 - zh
    return torch.stack([hi, lo]), torch.stack([16.0 * s, s]), torch.stack([zh.float(), zl.float()])


def gguf_linear(
    raw: np.ndarray | torch.Tensor,
    ggml_type: GGMLType | int | str,
    shape: tuple[int, int],
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> QuantLinearBase:
    """A linear module for one GGUF weight: raw blocks, ggml type and logical shape ``(out, in)``.

    See the module docstring for the layout chosen per type. Raises ``ValueError`` for an unsupported
    type or a size mismatch.
    """
    qtype = parse_ggml_type(ggml_type)
    out_f, in_f = int(shape[0]), int(shape[1])
    rows = _raw_rows(raw, qtype, (out_f, in_f))
    if qtype in _DENSE or qtype in _DEQUANT:
        w = torch.from_numpy(np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32)).reshape(
            out_f, in_f
        )
        if qtype in _DENSE:
            return DenseLinear(w, bias, compute_dtype)
        return Int8Linear.from_float(w, bias, compute_dtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blk = torch.from_numpy(rows.copy()).reshape(out_f, in_f // block, type_size)
    codes, s, m = _decode(blk, qtype)
    planes = _int4_planes(codes, s, m, bits=_CODE_BITS[qtype])
    return Int4Linear(*planes, group_size=_GROUP, bias=bias, compute_dtype=compute_dtype)


def gguf_linear_from_float(
    weight: torch.Tensor,
    ggml_type: GGMLType | int | str,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> QuantLinearBase:
    """Quantize a float weight with ``gguf.quants.quantize`` (the reference numpy quantizer) and map it.

    ``gguf`` 0.19 quantizes F32/F16/BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (and TQ*/MXFP4), not the K-quants.
    """
    qtype = parse_ggml_type(ggml_type)
    w = weight.detach().float().cpu().numpy()
    try:
        raw = gguf.quants.quantize(w, qtype)
    except (NotImplementedError, gguf.quants.QuantError) as e:
        raise ValueError(f"gguf cannot quantize to {qtype.name}: {e}") from e
    return gguf_linear(raw, qtype, (w.shape[0], w.shape[1]), bias, compute_dtype)
