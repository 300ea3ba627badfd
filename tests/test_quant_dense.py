"""Quantized linears' dense twin for large batches (``--dense-gemm-min-tokens``) and the default
quantization per dtype (no scalar-kernel trap in float32).

Oracles: below the threshold the module's output is the weight-only kernel's, bit for bit; from the
threshold up it is ``F.linear`` with ``reference_weight()`` rounded once to the compute dtype, bit for bit,
and that weight is the kernel's own in float32 (so the two paths agree to accumulation order) and within
one bf16 rounding of it in bf16.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixrt.layers import DenseLinear, Int4Linear, Int8Linear, QuantLinearBase, keep_dense_weights
from radixrt.models.quantize import (
    DENSE_MIN_TOKENS,
    DENSE_MIN_TOKENS_AMX,
    DENSE_MIN_TOKENS_INT4_TILES,
    default_dense_min_tokens,
    resolve_quantization,
)

BF16_U = 2.0**-8


def _rand(*shape: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _modules(dtype: torch.dtype) -> list[QuantLinearBase]:
    """An int8, an int4 (one plane, with bias), a GGUF Q4_1 (one plane) and a GGUF Q8_0 (two planes) linear
    computing in ``dtype``."""
    gguf = pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    w = _rand(48, 96, seed=1)
    w_gguf = _rand(40, 64, seed=2).numpy().astype(np.float32)
    w_gguf[0, :32] += 0.3  # a skewed block: Q4_1's min is far from -8d
    q41 = gguf.quants.quantize(w_gguf, gguf.GGMLQuantizationType.Q4_1)
    q80 = gguf.quants.quantize(w_gguf, gguf.GGMLQuantizationType.Q8_0)
    return [
        Int8Linear.from_float(w, compute_dtype=dtype),
        Int4Linear.from_float(w, bias=_rand(48, seed=3), compute_dtype=dtype),
        gguf_linear(q41, "Q4_1", (40, 64), compute_dtype=dtype),
        gguf_linear(q80, "Q8_0", (40, 64), compute_dtype=dtype),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_twin_from_the_threshold_kernel_below(dtype: torch.dtype) -> None:
    for m in _modules(dtype):
        small, large = (_rand(t, m.in_features, seed=10 + t, scale=1.0).to(dtype) for t in (3, 4))
        kernel_small, kernel_large = m(small), m(large)
        kept = m.keep_dense_weight(min_tokens=4)
        w = m.reference_weight(dtype).to(dtype)
        assert m.dense_weight is not None and torch.equal(m.dense_weight, w)
        assert kept == w.numel() * w.element_size()
        assert torch.equal(m(small), kernel_small)  # below the threshold: the kernel, unchanged
        y = m(large)
        expect, ref = F.linear(large, w), large.float() @ m.reference_weight(dtype).T
        if m.bias is not None:
            expect, ref = expect + m.bias.to(dtype), ref + m.bias.float()
        assert torch.equal(y, expect)
        err, scale = (y.float() - ref).abs(), ref.abs().max()
        if dtype == torch.float32:  # the kernel's own weight: accumulation order only
            assert torch.all(err <= 1e-5 * scale), err.max()
            torch.testing.assert_close(y, kernel_large, rtol=1e-5, atol=1e-5 * float(scale))
        else:  # weight rounded once to bf16, output once (+ the bias add)
            assert torch.all(err <= 4 * BF16_U * (ref.abs() + 0.25 * scale)), err.max()
        assert torch.equal(m(large.reshape(2, 2, -1)).reshape(4, -1), y)  # leading dims are rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_twin_multiplies_the_rounded_operands(dtype: torch.dtype) -> None:
    """--dense-gemm-int8: below the threshold the kernel, bit for bit; from it up the product of the weight
    requantized per output row and the activations rounded per row (exact int32 sums, one output rounding),
    within both roundings' bound of the exact product by the reference weight; no dense copy kept."""
    from radixrt.layers.quant_math import quantize_int8_symmetric

    for m in _modules(dtype):
        small = _rand(3, m.in_features, seed=20, scale=1.0).to(dtype)
        large = _rand(40, m.in_features, seed=21, scale=1.0).to(dtype)
        large[0] = 0  # an all-zero row: scale 1, output the bias
        kernel_small = m(small)
        kept = m.keep_dense_weight(min_tokens=4, int8=True)
        assert m.dense_weight is None and m.dense_int8 is not None
        assert kept == m.in_features * m.out_features + 4 * m.out_features
        assert torch.equal(m(small), kernel_small)
        y = m(large).float()
        w = m.reference_weight(dtype).double()
        codes, ws = quantize_int8_symmetric(w.float())
        x32 = large.float()  # the activations' scale is formed in float32, as the module forms it
        sx32 = x32.abs().amax(1, keepdim=True) / 127
        sx32[0] = 1.0
        xq = torch.round(x32 / sx32).double()
        xf, sx = large.double(), sx32.double()
        rounded = (xq @ codes.double().T) * sx * ws.double()[None, :]  # the same operands, exactly
        ref = xf @ w.T  # the exact product by the reference weight
        out_u = 2.0**-23 if dtype == torch.float32 else BF16_U
        tol = 2 * out_u * rounded.abs() + 1e-6  # the product rounded to the dtype, then the bias added
        if m.bias is not None:
            rounded, ref = rounded + m.bias.double(), ref + m.bias.double()
            tol = tol + 2 * out_u * rounded.abs()
        assert torch.all((y - rounded).abs() <= tol), (y - rounded).abs().max()
        bound = 0.5 * (
            xf.abs() @ (ws.double()[:, None] * torch.ones_like(w)).T + sx * w.abs().sum(1)[None, :]
        )
        bound = bound + 0.25 * sx * ws.double()[None, :] * m.in_features + 2 * out_u * ref.abs() + 1e-6
        assert torch.all((y - ref).abs() <= bound)
        assert torch.equal(y[0], torch.zeros_like(y[0]) if m.bias is None else m.bias.to(dtype).float())


def test_keep_dense_weights_on_a_model() -> None:
    """Every weight-only linear gets its twin once (a shared module too); dense GGUF tensors need none."""
    lin = Int4Linear.from_float(_rand(32, 64, seed=4), compute_dtype=torch.bfloat16)
    model = nn.ModuleDict({"a": lin, "b": lin, "c": DenseLinear(_rand(16, 64, seed=5))})
    assert keep_dense_weights(model, 8) == 32 * 64 * 2
    assert lin.dense_min_tokens == 8 and model["c"].dense_weight is None
    assert "dense_weight" not in lin.state_dict()  # not a checkpoint tensor
    with pytest.raises(ValueError, match="min_tokens"):
        keep_dense_weights(model, 0)


def test_default_dense_threshold_follows_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dense-gemm-min-tokens unset: 16 rows in bf16 on a CPU with AMX (oneDNN's bf16 GEMM on AMX tiles)
    (64 where the int4 kernel runs on the tiles too), else 32; a bad value is a ValueError naming the field."""
    from radixrt.config.server_args import ServerArgs

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert default_dense_min_tokens(torch.bfloat16, cpu) == DENSE_MIN_TOKENS_AMX == 16
    assert default_dense_min_tokens(torch.float32, cpu) == DENSE_MIN_TOKENS == 32
    assert default_dense_min_tokens(torch.bfloat16, cuda) == DENSE_MIN_TOKENS
    assert default_dense_min_tokens(torch.bfloat16, cpu, int4_tiles=True) == DENSE_MIN_TOKENS_INT4_TILES == 64
    assert default_dense_min_tokens(torch.float32, cpu, int4_tiles=True) == DENSE_MIN_TOKENS
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert default_dense_min_tokens(torch.bfloat16, cpu) == DENSE_MIN_TOKENS
    with pytest.raises(ValueError, match="dense_gemm_min_tokens"):
        ServerArgs(dense_gemm_min_tokens=-1)


def test_default_quantization_per_dtype(caplog: pytest.LogCaptureFixture) -> None:
    from radixrt.kernels import int4_gemm

    gguf_file = Path("m.gguf")
    f32_kernel = int4_gemm.available(torch.float32)
    assert resolve_quantization(None, gguf_file, torch.bfloat16) == "gguf"
    with caplog.at_level(logging.INFO, logger="radixrt.models.quantize"):
        # float32: the blocks where radixrt's float32 kernel runs, else the dequantized weights
        assert resolve_quantization(None, gguf_file, torch.float32) == ("gguf" if f32_kernel else "none")
        assert resolve_quantization(None, gguf_file, torch.float32, "torch") == "none"
        assert resolve_quantization(None, gguf_file, torch.float16) == "none"
        assert resolve_quantization(None, None, torch.float32) == "none"
    assert "run dequantized" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixrt.models.quantize"):
        assert (
            resolve_quantization("gguf", gguf_file, torch.float32, "torch") == "gguf"
        )  # asked for: honoured
        assert "scalar float32 weight-only kernels" in caplog.text
        caplog.clear()
        assert resolve_quantization("gguf", gguf_file, torch.float32) == "gguf"
        assert ("scalar" in caplog.text) != f32_kernel  # warned only where torch's scalar kernel runs
        caplog.clear()
        assert resolve_quantization("int4", None, torch.bfloat16) == "int4"
        assert resolve_quantization("none", gguf_file, torch.float32) == "none"
        assert caplog.text == ""


def test_int8_dense_gemms_on_the_embedded_model() -> None:
    """--dense-gemm-int8 on the embedded GGUF model: a 70-token prompt (one batch above the threshold) is
    scored close to the float32 dequantized model (the oracle): within 8x the mean |logprob| difference of the
    bf16 default (dense bf16 copy) plus 0.05 nats (measured: ~0.24 against ~0.05 nats; rounding every
    activation row to int8 costs that much on this 135M model, docs/cpu.md), so the int8 path multiplies by
    the right weights and scales (a wrong code, scale or row is off by nats), and no bf16 copy is kept."""
    from radixrt import Engine
    from radixrt.layers import QuantLinearBase

    text = (
        "Thought: I need to search for the director of the film, then find the year the director was born. "
        "Action: Search[the film] Observation: The film was directed by a French director and released in "
        "1962 to wide acclaim; it won the Golden Lion at the Venice festival that year."
    )
    runs = {"int8": {"dtype": "bfloat16", "dense_gemm_int8": True}, "bf16": {"dtype": "bfloat16"},
            "fp32": {"dtype": "float32"}}  # fmt: skip
    scores = {}
    for name, kw in runs.items():
        engine = Engine(max_total_tokens=4096, disable_compile=True, **kw)
        try:
            if name == "int8":

                def dense(s) -> tuple[int, int]:  # type: ignore[no-untyped-def]
                    mods = [m for m in s.runner.model.modules() if isinstance(m, QuantLinearBase)]
                    return sum(m.dense_int8 is not None for m in mods), sum(
                        m.dense_weight is not None for m in mods
                    )

                with_int8, with_bf16 = engine.worker.call(dense, timeout=60)
                assert with_int8 > 100 and with_bf16 == 0
            meta = engine.generate(
                text, sampling_params={"temperature": 0, "max_new_tokens": 1},
                return_logprob=True, logprob_start_len=0,
            )["meta_info"]  # fmt: skip
            scores[name] = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
        finally:
            engine.shutdown()
    assert len(scores["fp32"]) >= 40
    ours = float((scores["int8"] - scores["fp32"]).abs().mean())
    dense = float((scores["bf16"] - scores["fp32"]).abs().mean())
    assert ours <= 8 * dense + 0.05, (ours, dense)
