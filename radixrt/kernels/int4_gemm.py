"""radixrt's weight-only int4 GEMM for decode-sized batches on AVX512-BF16 CPUs, as the torch operator
``torch.ops.radixrt_int4.mm`` (C++: ``radixrt/kernels/csrc/int4_gemm.cpp``, which explains the arithmetic).

torch's ``_weight_int4pack_mm_for_cpu`` widens every 4-bit code to fp32 and multiplies with fp32 FMAs, so it
runs at ~300 GFLOP/s on 2 cores at any batch size and well below the memory bandwidth at batch 1. This kernel
turns codes into exact bf16 values with one OR and multiplies with ``vdpbf16ps``; a group's scale and zero
are applied once per group to fp32 partial sums, so the result equals an fp32 matmul by the dequantized
weight up to rounding order, as torch's kernel does. It is a registered torch operator (not a ctypes call),
so the compiled decode graphs call it without Python.

The library is compiled on first use with g++ against torch's headers (~20 s, with a log line) into
``radixrt.config.cache_dir.cache_dir() / "kernels"``, keyed by the source, compiler, flags, torch version and
CPU, and reused by later starts. ``unavailable_reason()`` says why it cannot run here (no AVX512-BF16, no
g++, a failed build); the quantized linears then keep torch's kernel and the worker logs that reason.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from radixrt.config.cache_dir import cache_dir
from radixrt.kernels.native_build import compile_atomically, cpu_signature

logger = logging.getLogger(__name__)

__all__ = ["Int4Packed", "U8Packed", "available", "int4_mm", "pack", "pack_u8", "u8_mm", "unavailable_reason"]

SOURCE = Path(__file__).parent / "csrc" / "int4_gemm.cpp"
COMPILER = "g++"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20")

_lock = threading.Lock()
_state: dict[str, str | bool] = {}


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (
        SOURCE.read_text(),
        version,
        " ".join(FLAGS),
        torch.__version__,
        platform.machine(),
        cpu_signature(),
    ):
        key.update(part.encode())
        key.update(b"\0")
    return cache_dir() / "kernels" / f"int4_gemm-{key.hexdigest()[:20]}.so"


def _build(cc: str, target: Path) -> None:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    proc = compile_atomically(lambda tmp: [cc, *FLAGS, abi, *includes, str(SOURCE), "-o", tmp, *libs], target)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _load() -> None:
    """Build (if not cached) and load the operator once; records the reason when it cannot run."""
    if "loaded" in _state or "error" in _state:
        return
    with _lock:
        if "loaded" in _state or "error" in _state:
            return
        if "avx512_bf16" not in cpu_signature().split():
            _state["error"] = "the CPU has no AVX512-BF16 (avx512_bf16)"
            return
        cc = shutil.which(COMPILER)
        if cc is None:
            _state["error"] = f"{COMPILER} is not on PATH"
            return
        try:
            path = _library_path(cc)
            if not path.is_file():
                logger.info("compiling radixrt's int4 GEMM kernel (first use here, ~20 s) into %s", path)
                t0 = time.perf_counter()
                _build(cc, path)
                logger.info("compiled the int4 GEMM kernel in %.1f s", time.perf_counter() - t0)
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _state["error"] = f"building or loading {SOURCE.name} failed: {exc}"
            return
        _register_fake()
        _state["loaded"] = True


def _register_fake() -> None:
    """Shapes for tracing (torch.compile): ``[M, N_pad]`` in x's dtype."""

    @torch.library.register_fake("radixrt_int4::mm")  # type: ignore[misc]
    def _fake(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[1] * 16))

    @torch.library.register_fake("radixrt_int4::mm_u8")  # type: ignore[misc]
    def _fake_u8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 16))


def available() -> bool:
    """Whether the kernel runs here (builds and loads it on the first call)."""
    _load()
    return "loaded" in _state


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    _load()
    err = _state.get("error")
    return None if err is None else str(err)


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


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Packed:
    """Pack ``w = sum_p (codes_p - 8) * scales_p + zeros_p`` (codes uint8 ``[P, N, K]`` in 0..15; scales and
    zeros ``[P, N, K / group_size]``, rounded to bf16) for :func:`int4_mm`. N is padded to 16 with zero
    weights."""
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
    sz = torch.stack([F.pad(scales.float(), (0, 0, 0, pad)), F.pad(zeros.float(), (0, 0, 0, pad))], -1)
    sz = sz.view(n_planes, nb, 16, k // group_size, 2).permute(0, 1, 3, 4, 2)  # [P, NB, G, 2, 16]
    return Int4Packed(packed, sz.to(torch.bfloat16).contiguous(), group_size, n)


def int4_mm(x: torch.Tensor, w: Int4Packed) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) times the packed weight: ``[M, out_features]`` bf16."""
    y = torch.ops.radixrt_int4.mm(x, w.codes, w.sz, w.group_size)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features].contiguous()


class U8Packed(Int4Packed):
    """One linear's 8-bit codes in the layout of ``radixrt_int4::mm_u8`` (the same fields as
    :class:`Int4Packed`): ``codes`` uint8 ``[N/16, K/2, 32]`` and ``sz`` float32 ``[N/16, K/G, 2, 16]`` (per
    group, the 16 columns' scales, then ``zero - 136 * scale``), for ``out_features`` of the padded N."""


def pack_u8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> U8Packed:
    """Pack ``w = (codes - 136) * scales + zeros`` (codes ``[N, K]`` in 0..255; scales and zeros
    ``[N, K / group_size]``, float32) for :func:`u8_mm`. ``zero - 136 * scale`` is formed in float32 here,
    as the int4 kernel forms it in registers. N is padded to 16 with zero weights."""
    n, k = codes.shape
    if k % 2 or k % group_size or group_size % 16:
        raise ValueError(f"u8 kernel: K={k} must be a multiple of group_size={group_size}, itself of 16")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"u8 kernel: scales/zeros {tuple(scales.shape)} != {(n, k // group_size)}")
    pad = (-n) % 16
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, pad), value=136)
    nb = (n + pad) // 16
    pairs = c.view(nb, 16, k // 2, 2).permute(0, 2, 1, 3)  # [NB, K/2, 16 columns, 2 k]
    s = F.pad(scales.float(), (0, 0, 0, pad))
    zb = F.pad(zeros.float(), (0, 0, 0, pad)) - 136.0 * s
    sz = torch.stack([s, zb], -1).view(nb, 16, k // group_size, 2).permute(0, 2, 3, 1)  # [NB, G, 2, 16]
    return U8Packed(pairs.reshape(nb, k // 2, 32).contiguous(), sz.contiguous(), group_size, n)


def u8_mm(x: torch.Tensor, w: U8Packed) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) times the packed 8-bit weight: ``[M, out_features]`` bf16."""
    y = torch.ops.radixrt_int4.mm_u8(x, w.codes, w.sz, w.group_size)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features].contiguous()
