"""Where the worker runs: the device, its default dtype and attention backend, and the KV memory budget.

One place decides what ``auto`` means for ``--device``, ``--dtype``, ``--attention-backend`` and
``--mem-fraction-static``, so the model runner only reads the answers.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

CPU_MEM_FRACTION = 0.2  # of free RAM, for the KV pool
CUDA_MEM_FRACTION = 0.85  # of the GPU's total memory, for weights + KV pool (SGLang's sizing)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but torch sees no CUDA GPU here")
    return device


def resolve_dtype(name: str, device: torch.device) -> str:
    """``auto`` on cuda is bf16; on cpu the model config decides (bf16 where the CPU has it natively)."""
    if name == "auto" and device.type == "cuda":
        return "bfloat16"
    return name


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto`` -> flashinfer on cuda when installed, else triton; torch_native on cpu.

    A GPU backend on a cpu device is an error: their kernels need CUDA (the Triton kernels run on CPU only
    under Triton's interpreter, ``TRITON_INTERPRET=1``, which the tests use).
    """
    if name == "auto":
        if device.type != "cuda":
            return "torch_native"
        if importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer"
        logger.info("flashinfer is not installed: attention runs on the Triton kernels")
        return "triton"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("attention_backend 'flashinfer' needs --device cuda (FlashInfer has no CPU kernels)")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' needs --device cuda (or TRITON_INTERPRET=1 to run its kernels in "
            "Triton's CPU interpreter, for testing)"
        )
    return name


def _free_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def kv_budget_bytes(device: torch.device, mem_fraction_static: float | None) -> int:
    """Bytes the KV pool may take, measured after the weights are loaded.

    cpu: ``fraction`` (default 0.2) of the free RAM. cuda: ``fraction`` (default 0.85) of the GPU's total
    memory is for weights + KV, so the pool gets that minus what is already in use (weights, CUDA context).
    """
    if device.type == "cuda":
        frac = CUDA_MEM_FRACTION if mem_fraction_static is None else mem_fraction_static
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * frac) - (total - free)
        if budget <= 0:
            raise ValueError(
                f"mem_fraction_static: {frac} of {total / 2**30:.1f} GiB leaves no room for the KV pool "
                f"({(total - free) / 2**30:.1f} GiB already in use); raise it"
            )
        return budget
    frac = CPU_MEM_FRACTION if mem_fraction_static is None else mem_fraction_static
    return int(_free_ram_bytes() * frac)
