"""The compiled decode step's attention as a native torch operator, ``torch.ops.radixrt_attn.decode(q, k, v)``
(C++: ``csrc/decode_op.cpp``): it stores the new K/V rows in the pool and calls the C paged decode kernel
(`radixrt.kernels.cpu_decode`, through the addresses of its ctypes-loaded functions), with the cascade over a
shared prefix when the step planned one (`radixrt.kernels.cpu_cascade`).

Why: the Python op (``radixrt::decode_attention`` in `radixrt.worker.graph_runner`) costs ~25 us a layer
outside the kernel (the custom-op wrapper ~10, the backend's dispatch and argument checks ~10, the K/V store
~5): ~0.75 ms of a 12.6 ms batch-1 decode step of the embedded model's 30 layers. The native op is reached
from the inductor graphs without Python.

Used where every step it serves can run it: a `TorchNativeBackend` over a plain bf16 / float32 `KVPool` with
the C kernels built, and no speculative decoding (a verify may take gather + SDPA, which stays in Python).
``RADIXRT_NATIVE_DECODE_OP=0`` keeps the Python op. Per step: `begin` (the step's slot table, lengths, the
new tokens' slots and the cascade plan), the graphs' layers, then `finish` (layers run, seconds in them).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import torch

from radixrt.config.env import env_switch
from radixrt.kernels import cpu_decode
from radixrt.kernels.base import AttentionBackend, NativeStep
from radixrt.kernels.torch_op_build import TorchOpLibrary

__all__ = ["NATIVE_ENV", "NativeDecode", "available", "unavailable_reason"]

NATIVE_ENV = "RADIXRT_NATIVE_DECODE_OP"


def _register_fake() -> None:
    @torch.library.register_fake("radixrt_attn::decode")  # type: ignore[misc]
    def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


_LIB = TorchOpLibrary(
    Path(__file__).parent / "csrc" / "decode_op.cpp", (), "decode attention op", _register_fake
)


def _enabled() -> bool:
    """`NATIVE_ENV`: 1 (default) the native op, 0 the Python op."""
    return env_switch(NATIVE_ENV)


def unavailable_reason() -> str | None:
    """Why the native op cannot run here (`NATIVE_ENV` = 0, no C kernels, its build failed), or None."""
    if not _enabled():
        return f"{NATIVE_ENV}=0"
    if not cpu_decode.available():
        return cpu_decode.unavailable_reason()
    return _LIB.reason()


def available() -> bool:
    """Whether the native op runs here (builds it on the first call, ~15 s once per machine)."""
    return unavailable_reason() is None


def _address(fn: cpu_decode.Kernel) -> int:
    address = ctypes.cast(cast(Any, fn), ctypes.c_void_p).value
    if not address:
        raise RuntimeError("decode op: a C kernel has no address")
    return address


class _Bound(threading.local):
    """The backend the op is bound to on this thread (its state is per thread): a weak reference, so a freed
    engine's pool is never kept and a new one rebinds (the op holds the pool's addresses, not the buffers)."""

    ref: weakref.ref[NativeDecode] | None = None


_bound = _Bound()


class NativeDecode:
    """The native op for one backend: ``begin(md)`` before a compiled step, ``finish()`` after it."""

    def __init__(self, backend: AttentionBackend) -> None:
        buffers = backend.native_decode_buffers()
        if buffers is None:
            raise ValueError("decode op: this backend's decode steps cannot run the native op")
        self.backend = backend
        self.k_bufs, self.v_bufs = buffers
        lib = cpu_decode.kernels()
        self._decode = _address(lib.decode[self.k_bufs[0].dtype])
        self._prefixed = _address(lib.decode_prefixed)

    def begin(self, out_cache_loc: torch.Tensor) -> None:
        """Hand the op this step's tables (after the backend planned the step's metadata)."""
        step: NativeStep | None = self.backend.native_decode_step()
        if step is None:
            raise RuntimeError("decode op: the backend planned a step the native op cannot run")
        bound = _bound.ref
        if bound is None or bound() is not self:
            window = self.backend.sliding_window or 0
            torch.ops.radixrt_attn.bind(self.k_bufs, self.v_bufs, self._decode, self._prefixed,
                                        self.backend.scale, window)  # fmt: skip
            _bound.ref = weakref.ref(self)
        table, lens, plan = step
        start, length, not_sharing = 0, 0, None
        if plan is not None:
            start, length, not_sharing = plan.start, plan.length, plan.not_sharing
        torch.ops.radixrt_attn.begin(
            table, lens, out_cache_loc, torch.get_num_threads(), start, length, not_sharing
        )

    @staticmethod
    def finish() -> tuple[int, float]:
        """(layers run, seconds spent in them) of the step, which ends it."""
        layers, seconds = torch.ops.radixrt_attn.finish()
        return int(layers), float(seconds)
