"""``--quantization``: turn a loaded model's linears into weight-only quantized ones (`radixrt.layers`).

``int8`` / ``int4`` quantize the loaded float weights; ``gguf`` builds every linear from the blocks of the
GGUF file the checkpoint was converted from (`radixrt.models.gguf.read_weights`), so the model runs the
file's own quantized weights (exactly: see `radixrt.layers.gguf_linear`). Unset: ``gguf`` for a GGUF
checkpoint in bf16 (as vLLM does), ``none`` (its weights dequantized) in float32 / float16, else ``none``.
The embedding stays float; a tied LM head is a linear like the others (for GGUF it uses ``token_embd``'s
blocks). Mixture-of-experts layers: every expert's gate/up and down through the same method
(`radixrt.layers.experts`; for GGUF, each expert's slice of the file's stacked ``ffn_*_exps`` blocks), the
shared expert like a dense MLP; the routers (``mlp.gate``, ``shared_expert_gate``) stay float, as SGLang and
vLLM keep them: they are tiny, and a quantized router would move tokens between experts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from radixrt.layers import (
    QUANTIZATION_CHOICES,
    Int4Linear,
    Int8Linear,
    keep_dense_weights,
    quantize_model_linears,
    use_radixrt_int4_kernel,
)
from radixrt.layers.experts import QuantizedExperts, quantize_experts
from radixrt.models.gguf import GGUFWeight, read_weights
from radixrt.models.llama import LlamaForCausalLM
from radixrt.models.moe import SparseMoE

logger = logging.getLogger(__name__)
#: ``--int4-kernel`` values under which int4 linears run radixrt's own kernels (q8: int8 activations in float32).
RADIXRT_INT4_KERNELS = ("auto", "q8")
# What torch's float32 / float16 weight-only kernels (scalar loops, not vectorised) cost; measured on the
# embedded SmolLM2-135M Q4_1 file (docs/cpu.md has the dtype x quantization matrix).
SLOW_DTYPE_COST = (
    "batch-1 decode ~20x slower than bfloat16 and ~5x slower than dense float32 weights (prefill too "
    "with --dense-gemm-min-tokens 0)"
)


def resolve_quantization(
    method: str | None, gguf_file: Path | None, dtype: torch.dtype = torch.bfloat16, int4_kernel: str = "auto"
) -> str:
    """The method to apply: ``method`` validated, or the default for this checkpoint and dtype.

    Unset on a GGUF checkpoint: ``gguf`` in bf16, and in float32 where radixrt's float32 kernel runs
    (AVX2 + FMA, ``int4_kernel`` "auto"): decode-sized batches read the file's blocks (~0.6 bytes a weight
    instead of 4), larger ones a dense copy (``--dense-gemm-min-tokens``). Otherwise (float16, or no
    float32 kernel) ``none``: the file's weights dequantized once, dense GEMMs, because torch's weight-only
    kernels are scalar loops there (see ``SLOW_DTYPE_COST``). An explicit weight-only method in such a
    dtype is honoured with a warning.
    """
    fast_f32 = dtype == torch.float32 and int4_kernel in RADIXRT_INT4_KERNELS and _f32_kernel_reason() is None
    if method is None:
        if gguf_file is None:
            return "none"
        if fast_f32:
            logger.info("quantization unset, dtype float32: the GGUF file's blocks run radixrt's float32 kernel "
                        "for decode-sized batches (quantization gguf)")  # fmt: skip
            return "gguf"
        if dtype != torch.bfloat16:
            logger.info(
                "quantization unset, dtype %s: the GGUF file's weights run dequantized (quantization none); "
                "its blocks would run torch's scalar %s weight-only kernels (%s)",
                _name(dtype), _name(dtype), SLOW_DTYPE_COST,
            )  # fmt: skip
            return "none"
        return "gguf"
    if method not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization: {method!r} is not supported; supported: {', '.join(QUANTIZATION_CHOICES)}"
        )
    if method == "gguf" and gguf_file is None:
        raise ValueError("quantization: 'gguf' needs a GGUF checkpoint (--model-path FILE.gguf)")
    if method != "none" and dtype != torch.bfloat16 and not fast_f32:
        logger.warning(
            "quantization %s with dtype %s runs torch's scalar %s weight-only kernels: %s; use --dtype "
            "bfloat16, or --quantization none for exact %s",
            method, _name(dtype), _name(dtype), SLOW_DTYPE_COST, _name(dtype),
        )  # fmt: skip
    return method


def _f32_kernel_reason() -> str | None:
    from radixrt.kernels import int4_gemm

    return int4_gemm.unavailable_reason(torch.float32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The batch size from which quantized linears multiply by their dense copy (``--dense-gemm-min-tokens``
# unset): 32, or 16 in bf16 on a CPU with AMX. There oneDNN's bf16 GEMM runs on AMX tiles while radixrt's int4
# kernel is bound by its AVX512-BF16 dot products at 16 rows (~60 GFLOP/s a core): a 16-stream decode of the
# embedded model ran 1.4-1.9x faster through the copy, 8 streams alike (docs/cpu.md). Where the int4 kernel
# runs on the tiles too, 64: the dense copy reads 4x the weight bytes, so up to ~64 rows it is bound by memory
# (an extend of 32-48 tokens over a 360-3k cached prefix took 15-25% less time with the int4 kernel, 64 alike,
# 100 a few percent more: docs/cpu.md, "Compiled extends").
DENSE_MIN_TOKENS = 32
DENSE_MIN_TOKENS_AMX = 16
DENSE_MIN_TOKENS_INT4_TILES = 64


def _int4_tiles() -> bool:
    """Whether radixrt's bf16 int4 kernel runs decode-sized batches on AMX tiles here."""
    from radixrt.kernels import int4_gemm

    return int4_gemm.amx_min_rows() is not None


def default_dense_min_tokens(dtype: torch.dtype, device: torch.device, int4_tiles: bool = False) -> int:
    """``--dense-gemm-min-tokens`` when unset, for a model in ``dtype`` on ``device``: `DENSE_MIN_TOKENS`, or
    `DENSE_MIN_TOKENS_AMX` in bf16 on an AMX CPU unless the int4 kernel multiplies on the tiles too
    (``int4_tiles``): its AVX512-BF16 dots are slower than the dense copy's AMX GEMM from 16 rows, its tile
    path is as fast or faster up to ~64 (`DENSE_MIN_TOKENS_INT4_TILES`)."""
    amx = device.type == "cpu" and dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
    if not amx:
        return DENSE_MIN_TOKENS
    return DENSE_MIN_TOKENS_INT4_TILES if int4_tiles else DENSE_MIN_TOKENS_AMX


def apply_quantization(
    model: LlamaForCausalLM,
    method: str,
    model_dir: Path,
    gguf_file: Path | None,
    dense_min_tokens: int | None = 0,
    int4_kernel: str = "auto",
    dense_int8: bool = False,
) -> None:
    """Replace the model's linears in place according to ``method`` (see the module docstring).

    Scales are stored in the model's dtype, so the kernels never cast them at run time (bf16: the fast
    vectorized kernels; float32: exact, but torch's fp32 weight-only kernels are scalar and slow).
    ``dense_min_tokens`` > 0: the quantized linears also keep their dequantized weights for batches of at
    least that many tokens (`radixrt.layers.keep_dense_weights`; ``--dense-gemm-min-tokens``); None:
    `default_dense_min_tokens`.
    ``int4_kernel`` "auto": int4 linears run radixrt's kernel where it can run here, AVX512-BF16 in bf16,
    AVX2 in float32 (where int8 linears use it too; ``--int4-kernel``; the reason is logged where it
    cannot); "q8": the same, float32 int4 linears multiplying int8-rounded activations; "torch": torch's
    kernels. ``dense_int8``: the
    large-batch copies are int8 with int8 activations (``--dense-gemm-int8``)."""
    if method == "none":
        return
    if method in ("int8", "int4"):
        quantize_model_linears(model, method, _is_router, compute_dtype=model.config.dtype)
        for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
            moe.use_experts(
                quantize_experts(moe.w_gate_up, moe.w_down, method, compute_dtype=model.config.dtype)
            )
    else:
        assert gguf_file is not None
        _load_gguf_linears(model, model_dir, gguf_file)
    if int4_kernel in RADIXRT_INT4_KERNELS and model.config.dtype in (torch.bfloat16, torch.float32):
        _use_int4_kernel(model, model.config.dtype, int4_kernel == "q8")
    if dense_min_tokens is None:
        tiles = int4_kernel in RADIXRT_INT4_KERNELS and model.config.dtype == torch.bfloat16 and _int4_tiles()
        dense_min_tokens = default_dense_min_tokens(
            model.config.dtype, next(model.parameters()).device, tiles
        )
    if dense_min_tokens > 0:
        t0 = time.perf_counter()
        kept = keep_dense_weights(model, dense_min_tokens, dense_int8)
        logger.info(
            "quantized linears keep their weights %s for batches of >= %d tokens: +%.0f MiB, "
            "%.1f s (--dense-gemm-min-tokens 0: off)",
            "requantized to int8 (int8 activations)" if dense_int8 else f"dequantized to {_name(model.config.dtype)}",
            dense_min_tokens, kept / 2**20, time.perf_counter() - t0,
        )  # fmt: skip


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate", ".mlp.shared_expert_gate"))


def _use_int4_kernel(model: LlamaForCausalLM, dtype: torch.dtype, act_int8: bool) -> None:
    from radixrt.kernels import int4_gemm

    if act_int8 and dtype != torch.float32:
        logger.info(
            "--int4-kernel q8 changes float32 compute only; %s runs the AVX512-BF16 kernel", _name(dtype)
        )

    kinds = (Int4Linear, Int8Linear) if dtype == torch.float32 else (Int4Linear,)
    if not any(isinstance(m, kinds) for m in model.modules()):
        return
    reason = int4_gemm.unavailable_reason(dtype)
    if reason is not None:
        logger.warning("quantized linears run torch's weight-only kernels: radixrt's %s kernel cannot run here "
                       "(%s)", _name(dtype), reason)  # fmt: skip
        return
    t0 = time.perf_counter()
    q8 = act_int8 and dtype == torch.float32
    kept = use_radixrt_int4_kernel(model, dtype, q8)
    kind = (
        "AVX512-BF16"
        if dtype == torch.bfloat16
        else "AVX2 float32 (int8 activations)"
        if q8
        else "AVX2 float32"
    )
    logger.info(
        "quantized linears run radixrt's %s kernel below the dense threshold: +%.0f MiB, %.1f s "
        "(--int4-kernel torch: torch's kernel)", kind, kept / 2**20, time.perf_counter() - t0,
    )  # fmt: skip


class ConcatLinear(nn.Module):
    """Several linears over the same input whose outputs are concatenated (fused q/k/v of mixed types)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _load_gguf_linears(model: LlamaForCausalLM, model_dir: Path, gguf_file: Path) -> None:

    config = json.loads((model_dir / "config.json").read_text())
    # NOTE: reading the file and packing the blocks take tens of seconds on a small CPU: show the progress
    bar = tqdm(total=len(model.layers) + 2, desc=f"loading {gguf_file.name} blocks", unit="step")
    weights = read_weights(gguf_file, config)
    bar.update()
    dtype = model.config.dtype

    def linear(names: list[str], bias: list[str] | None = None) -> nn.Module:
        b = [weights[n] for n in bias] if bias else None
        return _gguf_module([weights[n] for n in names], dtype, gguf_file.name, b)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
        fused = p + "self_attn.qkv_proj.weight"  # Phi-3's attn_qkv
        qkv = [fused] if fused in weights else [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        bias = [p + f"self_attn.{x}_proj.bias" for x in "qkv"] if model.config.attention_bias else None
        setattr(attn, "qkv_proj", linear(qkv, bias))  # noqa: B010 (nn.Module attribute types are Linear)
        setattr(attn, "o_proj", linear([p + "self_attn.o_proj.weight"]))  # noqa: B010
        if isinstance(mlp, SparseMoE):
            mlp.use_experts(_gguf_experts(weights, p + "mlp.experts.", dtype, gguf_file.name))
            if mlp.shared_expert is not None:
                mlp, p = mlp.shared_expert, p + "mlp.shared_expert."
            else:
                bar.update()
                continue
        else:
            p += "mlp."
        if p + "gate_up_proj.weight" in weights:  # Phi-3's ffn_up: [gate; up] rows
            both = weights[p + "gate_up_proj.weight"]
            half = both.shape[0] // 2
            for name, part in (("gate_proj", _rows(both, 0, half)), ("up_proj", _rows(both, half, 2 * half))):
                setattr(mlp, name, _gguf_module([part], dtype, gguf_file.name))
        else:
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, linear([p + f"{name}.weight"]))
        setattr(mlp, "down_proj", linear([p + "down_proj.weight"]))  # noqa: B010
        bar.update()
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    model.lm_head = linear([head])  # type: ignore[assignment]
    bar.update()
    bar.close()


def _rows(w: GGUFWeight, start: int, stop: int) -> GGUFWeight:
    """Rows ``[start, stop)`` of a matrix (whole rows: blocks stay intact), or of each expert of a stack."""
    data = w.data[start:stop] if len(w.shape) == 2 else w.data[:, start:stop]
    shape = (stop - start, *w.shape[1:]) if len(w.shape) == 2 else (w.shape[0], stop - start, w.shape[2])
    return GGUFWeight(w.name, w.ggml_type, shape, data)


def _gguf_module(
    ws: list[GGUFWeight], dtype: torch.dtype, file_name: str, bias: list[GGUFWeight] | None = None
) -> nn.Module:
    """One linear over the row-concatenation of ``ws`` (fused q/k/v, an expert's gate/up) from their blocks."""
    from radixrt.layers.gguf_linear import gguf_linear

    b = torch.cat([w.dequantize() for w in bias]).to(dtype) if bias else None
    if len({w.ggml_type for w in ws}) > 1:  # blocks of different types cannot share one layout
        if b is not None:
            raise ValueError(
                f"GGUF {file_name}: mixed-type fused projection with bias: {[w.name for w in ws]}"
            )
        return ConcatLinear([gguf_linear(w.data, w.ggml_type, _shape(w), compute_dtype=dtype) for w in ws])
    rows = np.concatenate([w.data for w in ws])
    shape = (sum(_shape(w)[0] for w in ws), _shape(ws[0])[1])
    return gguf_linear(rows, ws[0].ggml_type, shape, bias=b, compute_dtype=dtype)


def _shape(w: GGUFWeight) -> tuple[int, int]:
    return int(w.shape[-2]), int(w.shape[-1])


def _gguf_experts(
    weights: dict[str, GGUFWeight], prefix: str, dtype: torch.dtype, file_name: str
) -> QuantizedExperts:
    """Expert ``e``'s linears from slice ``e`` of the stacked ``ffn_{gate,up,down}_exps`` blocks."""

    def expert(w: GGUFWeight, e: int) -> GGUFWeight:
        return GGUFWeight(f"{w.name}[{e}]", w.ggml_type, tuple(w.shape[1:]), w.data[e])

    gate, up, down = (weights[f"{prefix}{x}_proj.weight"] for x in ("gate", "up", "down"))
    n = gate.shape[0]
    gate_up = [_gguf_module([expert(gate, e), expert(up, e)], dtype, file_name) for e in range(n)]
    return QuantizedExperts(gate_up, [_gguf_module([expert(down, e)], dtype, file_name) for e in range(n)])
