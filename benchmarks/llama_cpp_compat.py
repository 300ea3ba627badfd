"""llama.cpp (llama-cpp-python, benchmark-only) as the benchmarks run it: on a CPU with AMX without its AMX
weight buffers.

llama-cpp-python 0.3.36 built here (``-march=native``) puts quantized weights in ggml's AMX buffer type on a
CPU with AMX, and its first matmul there dies with SIGILL at ``tilezero`` on the 2-core AMX machine of
2026-12-06 (the tile configuration is not loaded on that thread), which ends the benchmark process. With
``use_extra_bufts`` off (llama.cpp's ``--no-extra-bufts``) it runs its AVX-512 kernels on repacked weights,
as on a CPU without AMX; the docs say which path each llama.cpp figure took.

``python -m benchmarks.llama_cpp_compat ARGS`` runs ``python -m llama_cpp.server ARGS`` the same way.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

__all__ = ["amx_buffers_off"]


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def amx_buffers_off() -> bool:
    """Turn llama.cpp's extra (AMX) buffer types off in this process where the CPU has AMX; whether it did.
    Call before any ``Llama`` is built."""
    if not _has_amx():
        return False
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_module.llama_cpp.llama_model_default_params = params
    return True


if __name__ == "__main__":
    amx_buffers_off()
    sys.argv[0] = "llama_cpp.server"
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
