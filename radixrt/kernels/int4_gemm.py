"""radixrt's weight-only int4 GEMMs for decode-sized batches, as torch operators: ``torch.ops.radixrt_int4.mm``
/ ``mm_u8`` for bf16 activations on AVX512-BF16 CPUs (C++: ``csrc/int4_gemm.cpp``, which explains the
arithmetic) and ``torch.ops.radixrt_int4_f32.mm`` / ``mm_u8`` for float32 activations on AVX2 + FMA CPUs
(``csrc/int4_gemm_f32.cpp``). Both read the same packed codes (:func:`pack`, :func:`pack_u8`).

torch's ``_weight_int4pack_mm_for_cpu`` widens every 4-bit code to fp32 and multiplies with fp32 FMAs, so in
bf16 it runs at ~300 GFLOP/s on 2 cores at any batch size and well below the memory bandwidth at batch 1; for
float32 activations it is a scalar loop (10-70x slower). The bf16 kernel turns codes into exact bf16 values
with one OR and multiplies with ``vdpbf16ps``; the float32 kernel widens codes exactly to fp32 and multiplies
with FMAs. In both a group's scale and zero are applied once per group to fp32 partial sums, so the result
equals an fp32 matmul by the dequantized weight up to rounding order, as torch's kernel does. They are
registered torch operators (not ctypes calls), so the compiled decode graphs call them without Python.

On a CPU with AMX (Sapphire Rapids and later) the bf16 kernel runs batches of at least
`AMX_MIN_ROWS_DEFAULT` rows on AMX tiles (``csrc/int4_gemm_amx.h``: the same arithmetic, the dot of a group on
one ``tdpbf16ps``): at 8 and 16 rows one decode step's GEMMs take 4.4 and 5.1 ms instead of 11.4 and 21.5
on 2 cores, below the dense bf16 weights' 8.2 and 9.5 (``python -m benchmarks.int4_gemm``, docs/cpu.md); at
1-2 rows the AVX512-BF16 path is as fast or faster. ``RADIXRT_INT4_AMX_MIN_ROWS`` sets the threshold (0: never).

Each library is compiled on first use with g++ against torch's headers (~20 s, with a log line) into
``radixrt.config.cache_dir.cache_dir() / "kernels"``, keyed by the source, compiler, flags, torch version and
CPU, and reused by later starts. ``unavailable_reason(dtype)`` says why one cannot run here (a missing CPU
feature, no g++, a failed build); the quantized linears then keep torch's kernel (bf16) or a dense copy
(float32) and the worker logs that reason.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from radixrt.kernels.torch_op_build import TorchOpLibrary

logger = logging.getLogger(__name__)

__all__ = [
    "Int4Packed",
    "U8Packed",
    "amx_min_rows",
    "available",
    "int4_mm",
    "pack",
    "pack_u8",
    "u8_mm",
    "unavailable_reason",
]

CSRC = Path(__file__).parent / "csrc"
AMX_ENV = "RADIXRT_INT4_AMX_MIN_ROWS"
AMX_MIN_ROWS_DEFAULT = 3


def _on_load_bf16() -> None:
    _register_fake("radixrt_int4")
    _configure_amx()


_BF16 = TorchOpLibrary(
    CSRC / "int4_gemm.cpp",
    ("avx512_bf16",),
    "int4 GEMM kernel (bf16)",
    _on_load_bf16,
    (CSRC / "int4_gemm_amx.h",),
)
_F32 = TorchOpLibrary(
    CSRC / "int4_gemm_f32.cpp",
    ("avx2", "fma"),
    "int4 GEMM kernel (float32)",
    lambda: _register_fake("radixrt_int4_f32"),
)
SOURCE = _BF16.source


def _register_fake(namespace: str) -> None:
    """Shapes for tracing (torch.compile): ``[M, N_pad]`` in x's dtype."""

    @torch.library.register_fake(f"{namespace}::mm")  # type: ignore[misc]
    def _fake(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[1] * 16))

    @torch.library.register_fake(f"{namespace}::mm_u8")  # type: ignore[misc]
    def _fake_u8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 16))

    if namespace == "radixrt_int4_f32":

        @torch.library.register_fake(f"{namespace}::mm_q8")  # type: ignore[misc]
        def _fake_q8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
            return x.new_empty((x.shape[0], codes.shape[1] * 16))


def _configure_amx() -> None:
    """Set the bf16 kernel's AMX row threshold from `AMX_ENV` (default `AMX_MIN_ROWS_DEFAULT`) and log it."""
    raw = os.environ.get(AMX_ENV, str(AMX_MIN_ROWS_DEFAULT))
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{AMX_ENV}: must be a whole number of rows (0: never), got {raw!r}") from None
    if rows < 0:
        raise ValueError(f"{AMX_ENV}: must be >= 0 (0: never), got {rows}")
    active = int(torch.ops.radixrt_int4.amx_rows(rows))
    if active > 0:
        logger.info("int4 kernel: batches of %d rows or more run on AMX tiles", active)
    elif active < 0 and torch.cpu._is_amx_tile_supported():
        logger.warning("int4 kernel: the CPU has AMX, but this build or process cannot use its tiles")


def amx_min_rows() -> int | None:
    """The batch rows from which the bf16 kernel runs on AMX tiles, or None where it never does (no AMX,
    the kernel unavailable, or `AMX_ENV` = 0)."""
    if not available(torch.bfloat16):
        return None
    rows = int(torch.ops.radixrt_int4.amx_rows(-1))
    return rows if rows > 0 else None


def _library(dtype: torch.dtype) -> TorchOpLibrary:
    if dtype == torch.bfloat16:
        return _BF16
    if dtype == torch.float32:
        return _F32
    raise ValueError(f"radixrt's int4 kernels compute in bfloat16 or float32, not {dtype}")


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel for ``dtype`` activations runs here (builds and loads it on the first call)."""
    return _library(dtype).reason() is None


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel for ``dtype`` activations cannot run here, or None when it can."""
    return _library(dtype).reason()


class Int4Packed:
    """One int4 linear's weights in the kernel's layout: ``codes`` uint8 ``[P, N/16, K/4, 32]`` and ``sz`` bf16
    ``[P, N/16, K/G, 2, 16]`` (per group, the 16 columns' scales then zeros), for ``out_features`` of the
    padded N."""

    def __init__(self, codes: torch.Tensor, sz: torch.Tensor, group_size: int, out: int) -> None:
        self.codes, self.sz = codes, sz
        self.group_size = group_size
        self.out_features = out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.sz))


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Int4Packed:
    """Pack ``w = sum_p (codes_p - 8) * scales_p + zeros_p`` (codes uint8 ``[P, N, K]`` in 0..15; scales and
    zeros ``[P, N, K / group_size]``) for :func:`int4_mm` with ``dtype`` activations. N is padded to 16 with
    zero weights. bf16: scales and zeros rounded to bf16 (the values torch's bf16 kernel uses); float32: the
    scales and ``zero - 8 * scale`` in float32."""
    n_planes, n, k = codes.shape
    if k % 4 or k % group_size or group_size % 16:
        raise ValueError(f"int4 kernel: K={k} must be a multiple of group_size={group_size}, itself of 16")
    if scales.shape != (n_planes, n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(
            f"int4 kernel: scales/zeros {tuple(scales.shape)} != {(n_planes, n, k // group_size)}"
        )
    pad = (-n) % 16
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, pad), value=8)
    nb = (n + pad) // 16
    quads = c.view(n_planes, nb, 16, k // 4, 4).permute(0, 1, 3, 2, 4)  # [P, NB, K/4, 16 columns, 4 k]
    packed = (quads[..., 0:2] | (quads[..., 2:4] << 4)).reshape(n_planes, nb, k // 4, 32).contiguous()
    s, z = F.pad(scales.float(), (0, 0, 0, pad)), F.pad(zeros.float(), (0, 0, 0, pad))
    if dtype == torch.float32:
        z = z - 8.0 * s
    elif dtype != torch.bfloat16:
        raise ValueError(f"int4 kernel: activations are bfloat16 or float32, not {dtype}")
    sz = torch.stack([s, z], -1)
    sz = sz.view(n_planes, nb, 16, k // group_size, 2).permute(0, 1, 3, 4, 2)  # [P, NB, G, 2, 16]
    return Int4Packed(packed, sz.to(dtype).contiguous(), group_size, n)


def int4_mm(x: torch.Tensor, w: Int4Packed) -> torch.Tensor:
    """``x [M, K]`` (contiguous; bf16 or float32, as ``w`` was packed for) times the packed weight:
    ``[M, out_features]`` in x's dtype."""
    ops = torch.ops.radixrt_int4 if x.dtype == torch.bfloat16 else torch.ops.radixrt_int4_f32
    y = ops.mm(x, w.codes, w.sz, w.group_size)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features].contiguous()


class U8Packed(Int4Packed):
    """One linear's 8-bit codes in the layout of ``radixrt_int4::mm_u8`` (the same fields as
    :class:`Int4Packed`): ``codes`` uint8 ``[N/16, K/2, 32]`` and ``sz`` ``[N/16, K/G, 2, 16]``, per group the 16
    columns' scales, then either ``zero - 136 * scale`` in float32 or (bf16 kernels, when every scale and zero
    is a bf16 value) the zeros in bfloat16, for ``out_features`` of the padded N."""


def pack_u8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> U8Packed:
    """Pack ``w = (codes - 136) * scales + zeros`` (codes ``[N, K]`` in 0..255; scales and zeros
    ``[N, K / group_size]``, float32) for :func:`u8_mm` with ``dtype`` activations.

    Scales and zeros are kept in bfloat16 when ``dtype`` is bfloat16 and all of them are bf16 values (a bf16
    model's are): 4 bytes a group instead of 8, which decode reads from memory every step (the LM head's
    scales are 1/8 of its bytes at float32); the kernel forms ``zero - 136 * scale`` in float32 as the float32
    layout stores it, so the two layouts give the same result bit for bit. Otherwise ``zero - 136 * scale`` is
    formed in float32 here. N is padded to 16 with zero weights."""
    n, k = codes.shape
    if k % 2 or k % group_size or group_size % 16:
        raise ValueError(f"u8 kernel: K={k} must be a multiple of group_size={group_size}, itself of 16")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"u8 kernel: scales/zeros {tuple(scales.shape)} != {(n, k // group_size)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"u8 kernel: activations are bfloat16 or float32, not {dtype}")
    pad = (-n) % 16
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, pad), value=136)
    nb = (n + pad) // 16
    pairs = c.view(nb, 16, k // 2, 2).permute(0, 2, 1, 3)  # [NB, K/2, 16 columns, 2 k]
    s = F.pad(scales.float(), (0, 0, 0, pad))
    z = F.pad(zeros.float(), (0, 0, 0, pad))
    bf16 = dtype == torch.bfloat16 and all(torch.equal(t.bfloat16().float(), t) for t in (s, z))
    sz = torch.stack([s, z] if bf16 else [s, z - 136.0 * s], -1)
    sz = sz.view(nb, 16, k // group_size, 2).permute(0, 2, 3, 1)  # [NB, G, 2, 16]
    sz = sz.bfloat16() if bf16 else sz
    return U8Packed(pairs.reshape(nb, k // 2, 32).contiguous(), sz.contiguous(), group_size, n)


def u8_mm(x: torch.Tensor, w: U8Packed) -> torch.Tensor:
    """``x [M, K]`` (contiguous; bf16 or float32) times the packed 8-bit weight: ``[M, out_features]`` in x's
    dtype (one layout serves both kernels)."""
    ops = torch.ops.radixrt_int4 if x.dtype == torch.bfloat16 else torch.ops.radixrt_int4_f32
    y = ops.mm_u8(x, w.codes, w.sz, w.group_size)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features].contiguous()
