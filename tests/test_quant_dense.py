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
from radixrt.models.quantize import resolve_quantization

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


def test_keep_dense_weights_on_a_model() -> None:
    """Every weight-only linear gets its twin once (a shared module too); dense GGUF tensors need none."""
    lin = Int4Linear.from_float(_rand(32, 64, seed=4), compute_dtype=torch.bfloat16)
    model = nn.ModuleDict({"a": lin, "b": lin, "c": DenseLinear(_rand(16, 64, seed=5))})
    assert keep_dense_weights(model, 8) == 32 * 64 * 2
    assert lin.dense_min_tokens == 8 and model["c"].dense_weight is None
    assert "dense_weight" not in lin.state_dict()  # not a checkpoint tensor
    with pytest.raises(ValueError, match="min_tokens"):
        keep_dense_weights(model, 0)


def test_default_quantization_per_dtype(caplog: pytest.LogCaptureFixture) -> None:
    gguf_file = Path("m.gguf")
    assert resolve_quantization(None, gguf_file, torch.bfloat16) == "gguf"
    with caplog.at_level(logging.INFO, logger="radixrt.models.quantize"):
        assert resolve_quantization(None, gguf_file, torch.float32) == "none"
        assert resolve_quantization(None, gguf_file, torch.float16) == "none"
        assert resolve_quantization(None, None, torch.float32) == "none"
    assert "run dequantized" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixrt.models.quantize"):
        assert resolve_quantization("gguf", gguf_file, torch.float32) == "gguf"  # asked for: honoured
        assert "scalar float32 weight-only kernels" in caplog.text
        caplog.clear()
        assert resolve_quantization("int4", None, torch.bfloat16) == "int4"
        assert resolve_quantization("none", gguf_file, torch.float32) == "none"
        assert caplog.text == ""
