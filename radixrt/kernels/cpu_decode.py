"""A CPU decode-attention kernel that reads the paged KV pool in place (no gathered K/V copy per layer), and
the build of the C library it shares with the extend kernel (``radixrt.kernels.cpu_extend``).

The kernel is C (``radixrt/kernels/csrc/paged_decode.c``: GNU C vector extensions plus OpenMP; single pass with
online softmax; all query heads of a request per pass so each K/V slot record is streamed once; long
contexts split across threads). The library (``SOURCES``: decode and extend, with their shared header) is
compiled on first use with ``gcc -O3 -march=native -fopenmp -shared -fPIC`` into
``radixrt.config.cache_dir.cache_dir() / "kernels"``, under a name keyed by the source texts, the compiler
version, the flags and the host CPU, and loaded with ctypes. ``available()`` says whether that worked and
``unavailable_reason()`` why not.

Per layer of a decode step::

    out = paged_decode_attention(q, k_buf, v_buf, slot_table, seq_lens, scale, window=sliding_window)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.config.cache_dir import cache_dir
from radixrt.kernels.native_build import compile_atomically, cpu_signature

logger = logging.getLogger(__name__)

__all__ = [
    "CpuDecodeUnavailable",
    "Kernels",
    "available",
    "kernels",
    "library_path",
    "load_library",
    "paged_decode_attention",
    "unavailable_reason",
]

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_decode.c"
# Compiled together into one library; HEADERS only enter the cache key (the sources include them).
SOURCES = (SOURCE, CSRC / "paged_extend.c", CSRC / "kv_store_fp8.c")
HEADERS = tuple(
    CSRC / name for name in ("paged_simd.h", "paged_extend.h", "paged_extend_f32.h", "paged_extend_bf16.h")
)
COMPILER = "gcc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

# The C signature of both variants: q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride,
# table_width, seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads -> status.
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, ctypes.c_float, _I64, _P]
_ARGTYPES.append(ctypes.c_int)
_SYMBOLS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
# The float8 variants take four more: q_bf16 (the query / output dtype), kv_kind (FP8_KINDS), k_scale, v_scale.
_FP8_EXTRA = [ctypes.c_int, ctypes.c_int, _P, _P]
FP8_KINDS = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # KV_E4M3, KV_E5M2 of paged_simd.h
# paged_decode_prefixed takes three more: q_bf16, prefix_out, prefix_lse (radixrt.kernels.cpu_cascade).
_PREFIX_EXTRA = [ctypes.c_int, _P, _P]
# store_kv_e4m3: k, k_stride, v, v_stride, src_bf16, T, KVH, D, k_scale, k_offset, v_scale, k_buf, v_buf, slots,
# num_slots -> status (kv_store_fp8.c).
_STORE_ARGTYPES = [_P, _I64, _P, _I64, ctypes.c_int, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64]
# The extend kernels: q, q_stride, num_tokens, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
# qo_indptr, seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads -> status.
_EXTEND_ARGTYPES = [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64]
_EXTEND_ARGTYPES += [ctypes.c_float, _I64, _P, ctypes.c_int]
_EXTEND_SYMBOLS = {torch.bfloat16: "paged_extend_bf16", torch.float32: "paged_extend_f32"}
_STATUS_ERRORS = {
    1: "seq_lens: every entry must be in [0, slot_table.shape[1]]",
    2: "slot_table: a slot among the first seq_lens[b] entries of a row is outside [0, k_buf.shape[0])",
}

Kernel = Callable[..., int]


class CpuDecodeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no gcc, a compile error, a load error)."""


@dataclass(frozen=True)
class Kernels:
    """The library's entry points by dtype (bfloat16, float32), and the float8-KV ones."""

    decode: dict[torch.dtype, Kernel]
    extend: dict[torch.dtype, Kernel]
    decode_fp8: Kernel
    decode_prefixed: Kernel
    extend_fp8: Kernel
    store_e4m3: Kernel


_lock = threading.Lock()
_kernels: Kernels | None = None
_error: str | None = None


def library_path(cc: str | None = None, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the compiled library for this source, compiler (default: gcc on PATH), flags and CPU lives."""
    cc = cc or shutil.which(COMPILER) or COMPILER
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    for part in (*texts, version, " ".join(flags), platform.machine(), cpu_signature()):
        key.update(part.encode())
        key.update(b"\0")
    return cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:20]}.so"


def _build(cc: str, flags: tuple[str, ...], target: Path) -> None:
    proc = compile_atomically(lambda tmp: [cc, *flags, "-o", tmp, *map(str, SOURCES)], target)
    if proc.returncode != 0:
        names = " ".join(map(str, SOURCES))
        raise CpuDecodeUnavailable(
            f"compiling {names} failed ({cc} {' '.join(flags)}, exit {proc.returncode}):\n{proc.stderr}"
        )


def load_library(flags: tuple[str, ...] = FLAGS) -> Kernels:
    """Build (if not cached) and load the library with ``flags``; its kernels by dtype.

    The attention wrappers use the default flags; other flags (e.g. ``-DPAGED_PORTABLE``, which turns off
    the AVX512-BF16 dot products and the AVX-512 intrinsics) are for tests. Raises CpuDecodeUnavailable.
    """
    cc = shutil.which(COMPILER)
    if cc is None:
        names = ", ".join(p.name for p in SOURCES)
        raise CpuDecodeUnavailable(f"{COMPILER} not found on PATH; it is needed to build {names}")
    try:
        path = library_path(cc, flags)
        if not path.is_file():
            # A few seconds, once per source / compiler / CPU: say so, the process looks idle meanwhile.
            logger.info("compiling the C attention kernels (first use here) into %s", path)
            t0 = time.perf_counter()
            _build(cc, flags, path)
            logger.info("compiled the C attention kernels in %.1f s", time.perf_counter() - t0)
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuDecodeUnavailable(f"building or loading the paged attention kernels failed: {exc}") from exc

    def bind_one(name: str, argtypes: Sequence[type]) -> Kernel:
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]

    def bind(symbols: dict[torch.dtype, str], argtypes: Sequence[type]) -> dict[torch.dtype, Kernel]:
        return {dtype: bind_one(name, argtypes) for dtype, name in symbols.items()}

    return Kernels(
        decode=bind(_SYMBOLS, _ARGTYPES),
        extend=bind(_EXTEND_SYMBOLS, _EXTEND_ARGTYPES),
        decode_fp8=bind_one("paged_decode_fp8", _ARGTYPES + _FP8_EXTRA),
        decode_prefixed=bind_one("paged_decode_prefixed", _ARGTYPES + _PREFIX_EXTRA),
        extend_fp8=bind_one("paged_extend_fp8", _EXTEND_ARGTYPES + _FP8_EXTRA),
        store_e4m3=bind_one("store_kv_e4m3", _STORE_ARGTYPES),
    )


def kernels() -> Kernels:
    """The loaded library (built on the first call); raises CpuDecodeUnavailable."""
    return _kernels if _kernels is not None else _ensure_loaded()


def _ensure_loaded() -> Kernels:
    global _kernels, _error
    if _kernels is not None:
        return _kernels
    with _lock:
        if _kernels is None:
            if _error is not None:
                raise CpuDecodeUnavailable(_error)
            try:
                _kernels = load_library()
            except CpuDecodeUnavailable as exc:
                _error = str(exc)
                raise
    return _kernels


def available() -> bool:
    """Whether the kernel is usable here; builds it on the first call (~3 s) and remembers the answer."""
    try:
        _ensure_loaded()
    except CpuDecodeUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (e.g. no gcc, or the compiler's stderr); None when it is usable."""
    return None if available() else _error


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"paged_decode_attention: {name} {what}")


def fp8_extra_args(
    who: str, q: torch.Tensor, k_buf: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[list[int], list[torch.Tensor]]:
    """The float8 kernels' four extra arguments (q_bf16, kv_kind, k_scale and v_scale pointers) for a float8
    ``k_buf`` ``[num_slots, KVH, D]``, and the tensors they point into (keep them alive over the call).

    ``k_scale``: None (1), ``[KVH]`` (per head) or ``[KVH, D]`` (per channel) float32; ``v_scale``: None or
    ``[KVH]`` float32. Raises ValueError naming ``who`` and the bad argument."""
    _, KVH, D = k_buf.shape
    keep: list[torch.Tensor] = []
    ptrs = []
    for name, t, shapes in (("k_scale", k_scale, ((KVH,), (KVH, D))), ("v_scale", v_scale, ((KVH,),))):
        if t is None:
            ptrs.append(0)
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_cpu:
            raise ValueError(f"{who}: {name} must be a float32 CPU tensor or None")
        if tuple(t.shape) not in shapes:
            raise ValueError(f"{who}: {name} shape {tuple(t.shape)} is not one of {list(shapes)}")
        if name == "k_scale" and t.dim() == 1:
            t = t[:, None].expand(KVH, D)
        t = t.contiguous()
        keep.append(t)
        ptrs.append(t.data_ptr())
    return [int(q.dtype == torch.bfloat16), FP8_KINDS[k_buf.dtype], *ptrs], keep


def _prefix_args(
    q: torch.Tensor, k_buf: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor]
) -> list[int]:
    """paged_decode_prefixed's three extra arguments (q_bf16, prefix out and lse pointers), checked."""
    out, lse = prefix
    B, H, D = q.shape
    KVH = k_buf.shape[1] if k_buf.dim() == 3 else 0
    G = H // KVH if KVH and H % KVH == 0 else 0
    if not (out.is_cpu and out.dtype == q.dtype and out.is_contiguous() and out.numel() == KVH * B * G * D):
        raise _bad("prefix", f"out must be a contiguous [KVH, B, G, D] {q.dtype} CPU tensor")
    if not (lse.is_cpu and lse.dtype == torch.float32 and lse.is_contiguous() and lse.numel() == KVH * B * G):
        raise _bad("prefix", "lse must be a contiguous [KVH, B, G] float32 CPU tensor")
    return [int(q.dtype == torch.bfloat16), out.data_ptr(), lse.data_ptr()]


def _diagnose(
    q: object, k_buf: object, v_buf: object, slot_table: object, seq_lens: object, window: object, out: object
) -> ValueError:
    """The ValueError naming the first bad argument (the fast path only knows that one is bad)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_cpu:
        return _bad("q", "must be a 3-D [B, H, D] CPU tensor")
    if q.dtype not in _SYMBOLS:
        return _bad("q", f"dtype must be bfloat16 or float32, got {q.dtype}")
    B, H, D = q.shape
    if q.stride(2) != 1 or (H > 1 and q.stride(1) != D) or (B > 1 and q.stride(0) < H * D):
        return _bad("q", f"must have contiguous heads (strides (>= H*D, D, 1)), got strides {q.stride()}")
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        if not isinstance(buf, torch.Tensor) or buf.dim() != 3 or not buf.is_cpu:
            return _bad(name, "must be a 3-D [num_slots, KVH, D] CPU tensor")
        if buf.dtype != q.dtype and buf.dtype not in FP8_KINDS:
            return _bad(name, f"dtype {buf.dtype} is neither q's {q.dtype} nor a float8 format")
        if not buf.is_contiguous():
            return _bad(name, "must be contiguous")
    assert isinstance(k_buf, torch.Tensor) and isinstance(v_buf, torch.Tensor)
    if v_buf.dtype != k_buf.dtype:
        return _bad("v_buf", f"dtype {v_buf.dtype} differs from k_buf's {k_buf.dtype}")
    _, KVH, Dk = k_buf.shape
    if Dk != D or KVH == 0 or H % KVH != 0:
        return _bad("k_buf", f"shape {tuple(k_buf.shape)} does not fit q's [B={B}, H={H}, D={D}]")
    if v_buf.shape != k_buf.shape:
        return _bad("v_buf", f"shape {tuple(v_buf.shape)} differs from k_buf's {tuple(k_buf.shape)}")
    if not isinstance(slot_table, torch.Tensor) or slot_table.dim() != 2 or not slot_table.is_cpu:
        return _bad("slot_table", "must be a 2-D [B, max_seq_len] CPU tensor")
    if slot_table.dtype != torch.int64 or slot_table.shape[0] != B:
        return _bad(
            "slot_table", f"must be int64 with {B} rows, got {slot_table.dtype} {tuple(slot_table.shape)}"
        )
    if slot_table.shape[1] > 1 and slot_table.stride(1) != 1:
        return _bad("slot_table", "must have a unit inner stride")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or not seq_lens.is_cpu:
        return _bad("seq_lens", "must be a 1-D [B] CPU tensor")
    if seq_lens.dtype != torch.int64 or seq_lens.shape[0] != B or not seq_lens.is_contiguous():
        return _bad(
            "seq_lens",
            f"must be contiguous int64 of length {B}, got {seq_lens.dtype} {tuple(seq_lens.shape)}",
        )
    if window is not None and (not isinstance(window, int) or window < 0):
        return _bad("window", f"must be None or an int >= 0, got {window!r}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != q.shape
        or out.dtype != q.dtype
        or not out.is_cpu
        or not out.is_contiguous()
    ):
        return _bad("out", f"must be a contiguous [{B}, {H}, {D}] {q.dtype} CPU tensor")
    return _bad("arguments", "are invalid")  # not reached unless the fast path and this disagree


def paged_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per request over its KV slots, read from the pool in place.

    Args:
        q: ``[B, H, D]`` bfloat16 or float32 CPU tensor with contiguous heads (strides ``(>= H*D, D, 1)``,
            so a row-strided view of a fused QKV projection works without a copy).
        k_buf, v_buf: one layer's ``[num_slots, KVH, D]`` contiguous pool buffers, of ``q``'s dtype or both
            float8 (e4m3fn / e5m2, read as ``code * scale``); ``H`` must be a multiple of ``KVH`` (query head
            ``h`` uses kv head ``h // (H // KVH)``).
        slot_table: ``[B, >= max(seq_lens)]`` int64 with a unit inner stride (any row stride); the first
            ``seq_lens[b]`` entries of row ``b`` are request ``b``'s slots in position order, the rest
            are not read.
        seq_lens: ``[B]`` contiguous int64, the positions each request attends over (its new token
            included); a request with ``seq_len == 0`` gets a zero output row.
        scale: the softmax scale of ``q . k``.
        window: sliding window: when positive, only the last ``window`` positions are attended.
        out: optional contiguous ``[B, H, D]`` tensor of ``q``'s dtype to write (not overlapping inputs).
        k_scale, v_scale: float8 buffers only: float32 dequantization scales, ``k_scale`` ``[KVH]`` or
            ``[KVH, D]`` (per channel), ``v_scale`` ``[KVH]``; None reads the codes as they are.
        prefix: ``(out, lse)``, attention already computed over positions before the slots given here
            (`radixrt.kernels.cpu_cascade`): contiguous ``[KVH, B, G, D]`` of ``q``'s dtype and ``[KVH, B, G]``
            float32 log-sum-exp (-inf: nothing), ``G = H // KVH``, merged into each request's softmax;
            bf16 / f32 buffers and no window only, and every ``seq_lens[b] >= 1``.

    Returns:
        ``[B, H, D]`` contiguous tensor of ``q``'s dtype: ``softmax(scale * q k^T) v`` computed in float32
        (the bfloat16 output rounded to nearest-even). Runs on ``torch.get_num_threads()`` OpenMP threads.

    Raises:
        ValueError: naming the argument, for a wrong type, dtype, shape, layout or device, or a seq_len
            or slot out of range (these two are found by the kernel; ``out`` is then unspecified).
        CpuDecodeUnavailable: when the kernel cannot be built here.
        MemoryError: when the kernel's scratch allocation fails.
    """
    lib = _kernels if _kernels is not None else _ensure_loaded()
    extra: list[int] = []
    if isinstance(k_buf, torch.Tensor) and k_buf.dtype in FP8_KINDS and k_buf.dim() == 3:
        extra, _keep = fp8_extra_args("paged_decode_attention", q, k_buf, k_scale, v_scale)
    elif k_scale is not None or v_scale is not None:
        raise _bad("k_scale / v_scale", "apply to float8 buffers only")
    if prefix is not None:
        if extra or window:
            raise _bad("prefix", "applies to bfloat16 / float32 buffers without a window only")
        extra = _prefix_args(q, k_buf, prefix)
    # Fast path: one pass of cheap checks; _diagnose names the culprit when one fails.
    try:
        fn = (
            lib.decode_prefixed
            if prefix is not None
            else lib.decode[q.dtype]
            if not extra
            else lib.decode_fp8
        )
        kv_dtype = q.dtype if not extra or prefix is not None else k_buf.dtype
        B, H, D = q.shape
        num_slots, KVH, Dk = k_buf.shape
        qs = q.stride()
        width = slot_table.shape[1]
        ok = (
            q.is_cpu
            and q.dtype in _SYMBOLS
            and qs[2] == 1
            and (qs[1] == D or H == 1)
            and (qs[0] >= H * D or B == 1)
            and k_buf.is_cpu
            and k_buf.dtype == kv_dtype
            and k_buf.is_contiguous()
            and Dk == D
            and KVH > 0
            and H % KVH == 0
            and v_buf.is_cpu
            and v_buf.dtype == kv_dtype
            and v_buf.is_contiguous()
            and v_buf.shape == k_buf.shape
            and slot_table.is_cpu
            and slot_table.dtype == torch.int64
            and slot_table.dim() == 2
            and slot_table.shape[0] == B
            and (slot_table.stride(1) == 1 or width <= 1)
            and seq_lens.is_cpu
            and seq_lens.dtype == torch.int64
            and seq_lens.dim() == 1
            and seq_lens.shape[0] == B
            and seq_lens.is_contiguous()
            and (window is None or (isinstance(window, int) and window >= 0))
        )
        if out is None:
            out = (
                torch.empty_like(q)
                if q.is_contiguous()
                else torch.empty_like(q, memory_format=torch.contiguous_format)
            )
        else:
            ok = ok and out.is_cpu and out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError):
        ok = False
    if not ok or out is None:
        raise _diagnose(q, k_buf, v_buf, slot_table, seq_lens, window, out)
    if B == 0 or H == 0 or D == 0:
        return out
    status = fn(
        q.data_ptr(),
        qs[0],
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        num_slots,
        slot_table.data_ptr(),
        slot_table.stride(0),
        width,
        seq_lens.data_ptr(),
        B,
        H,
        KVH,
        D,
        float(scale),
        window or 0,
        out.data_ptr(),
        torch.get_num_threads(),
        *extra,
    )
    if status:
        if status == 3:
            raise MemoryError("paged_decode_attention: the kernel could not allocate its scratch memory")
        if status == 1 and prefix is not None:
            raise _bad("seq_lens", "with a prefix every entry must be in [1, slot_table.shape[1]]")
        raise ValueError(f"paged_decode_attention: {_STATUS_ERRORS.get(status, f'kernel status {status}')}")
    return out
