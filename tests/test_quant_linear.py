"""Quantized CPU linears (radixrt.layers): kernel output vs a plain fp32 matmul on the dequantized weight.

Oracles: ``y == x.float() @ reference_weight().T (+ bias)``; fp32 to accumulation-order noise, bf16 to the
single output rounding (u = 2^-8) per kernel call; GGUF reference weights against ``gguf.quants.dequantize``
(bit-exact for the direct layouts with fp32 compute); from-float weights against the original weight.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from radixrt.layers import (
    QUANTIZATION_CHOICES,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    QuantLinearBase,
    get_quant_method,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    quantize_linear,
    quantize_model_linears,
)

BF16_U = 2.0**-8  # bf16 unit roundoff (8-bit significand)


def _rand(*shape: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _oracle(m: QuantLinearBase, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 matmul of the (compute-dtype rounded) input with the module's reference weight."""
    xr = x.to(dtype).float()
    y = xr @ m.reference_weight(dtype).T
    b = m.reference_bias(dtype)
    return y if b is None else y + b


def _assert_matches(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, calls: int = 1) -> None:
    y = y.float()
    scale = ref.abs().max().item()
    if dtype == torch.float32:
        tol = 1e-5 * scale + 1e-5 * ref.abs()
    else:  # one output rounding per kernel call (+ the bias add in bf16)
        tol = (calls + 1) * BF16_U * (ref.abs() + 0.25 * scale)
    err = (y - ref).abs()
    assert torch.all(err <= tol), f"max err {err.max().item():.3g} (scale {scale:.3g}, {dtype})"


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------------- int8


@pytest.mark.parametrize("in_f,out_f", [(576, 1536), (1536, 576), (64, 192), (100, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_forward_matches_reference(in_f: int, out_f: int, dtype: torch.dtype) -> None:
    w, b = _rand(out_f, in_f, seed=1), _rand(out_f, seed=2)
    for bias in (None, b):
        m = Int8Linear.from_float(w, bias)
        for t in (1, 7, 32):
            x = _rand(t, in_f, seed=t, scale=1.0).to(dtype)
            y = m(x)
            assert y.dtype == dtype and y.shape == (t, out_f)
            _assert_matches(y, _oracle(m, x, dtype), dtype)


def test_int8_weight_close_to_float() -> None:
    w = _rand(576, 1536, seed=3)
    q, s = quantize_int8_per_channel(w)
    ref = Int8Linear(q, s).reference_weight()
    # round-to-nearest with a bf16-rounded scale: half a step plus the scale's own rounding
    bound = s[:, None] * (0.5 + 127 * BF16_U) + 1e-8
    assert torch.all((ref - w).abs() <= bound)
    assert ((ref - w).norm() / w.norm()).item() < 0.012
    assert torch.equal(s.bfloat16().float(), s)  # scales on the bf16 grid


def test_int8_zero_row_and_3d_input() -> None:
    w = _rand(32, 64, seed=4)
    w[3] = 0
    m = Int8Linear.from_float(w)
    assert torch.all(m.reference_weight()[3] == 0)
    x = _rand(2, 5, 64, seed=5, scale=1.0)
    y = m(x)
    assert y.shape == (2, 5, 32)
    _assert_matches(y.reshape(10, 32), _oracle(m, x.reshape(10, 64), torch.float32), torch.float32)


# ---------------------------------------------------------------------------------------------- int4


@pytest.mark.parametrize(
    "in_f,out_f,group", [(576, 1536, 32), (1536, 576, 64), (512, 192, 128), (256, 40, 256), (96, 48, 32)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_forward_matches_reference(in_f: int, out_f: int, group: int, dtype: torch.dtype) -> None:
    w, b = _rand(out_f, in_f, seed=6), _rand(out_f, seed=7)
    for bias in (None, b):
        m = Int4Linear.from_float(w, bias, group_size=group)
        for t in (1, 7, 32):
            x = _rand(t, in_f, seed=10 + t, scale=1.0).to(dtype)
            y = m(x)
            assert y.dtype == dtype and y.shape == (t, out_f)
            _assert_matches(y, _oracle(m, x, dtype), dtype)


@pytest.mark.parametrize("group,rel_bound", [(32, 0.10), (64, 0.11), (128, 0.12)])
def test_int4_weight_close_to_float(group: int, rel_bound: float) -> None:
    w = _rand(192, 1536, seed=8)
    codes, scales, zeros = quantize_int4_groupwise(w, group)
    m = Int4Linear(codes, scales, zeros, group)
    ref = m.reference_weight()
    step = scales.repeat_interleave(group, 1)
    zero = zeros.repeat_interleave(group, 1)
    # half a step, plus the bf16 rounding of scale (times |q-8| <= 8) and of zero
    bound = step * (0.5 + 8 * BF16_U) + zero.abs() * BF16_U + 1e-8
    assert torch.all((ref - w).abs() <= bound)
    assert ((ref - w).norm() / w.norm()).item() < rel_bound
    assert torch.equal(m.codes()[0], codes)  # codes read back through the kernel


def test_int4_from_float_same_weight_in_fp32_and_bf16() -> None:
    w = _rand(64, 256, seed=9)
    for m in (Int4Linear.from_float(w), Int8Linear.from_float(w)):
        assert torch.equal(m.reference_weight(torch.float32), m.reference_weight(torch.bfloat16))


def test_int4_constant_group() -> None:
    w = _rand(16, 64, seed=10)
    w[2, :32] = 0.125
    ref = Int4Linear.from_float(w).reference_weight()
    assert torch.all(ref[2, :32] == 0.125)


def test_compute_dtype_bf16_under_fp32_activations() -> None:
    w = _rand(192, 576, seed=11)
    x = _rand(7, 576, seed=12, scale=1.0)
    for m in (
        Int4Linear.from_float(w, compute_dtype=torch.bfloat16),
        Int8Linear.from_float(w, compute_dtype=torch.bfloat16),
    ):
        scales = m.scales_and_zeros if isinstance(m, Int4Linear) else m.scales
        assert scales.dtype == torch.bfloat16  # stored in the compute dtype
        y = m(x)
        assert y.dtype == torch.float32
        _assert_matches(y, _oracle(m, x, torch.bfloat16), torch.bfloat16)


def test_scale_cast_cache_follows_buffer_updates() -> None:
    m = Int8Linear.from_float(_rand(32, 64, seed=13))
    x = _rand(3, 64, seed=14, scale=1.0).bfloat16()
    y1 = m(x).float()
    with torch.no_grad():
        m.scales.mul_(2)
    y2 = m(x).float()
    torch.testing.assert_close(y2, 2 * y1, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- GGUF

DIRECT_EXACT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]
VIA_INT8 = ["Q6_K", "Q3_K", "Q2_K"]
QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # what gguf 0.19's numpy quantizer implements


def _gguf_raw(name: str, out_f: int, in_f: int, seed: int) -> tuple[np.ndarray, int]:
    """Raw blocks of type ``name``: gguf's own quantizer where it has one, else random blocks with sane d fields."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name in QUANTIZABLE:
        w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
        w[0, :32] += 0.3  # a skewed block: Q4_1's min is far from -8d
        return gguf.quants.quantize(w, qtype), qtype
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out_f, in_f // block, type_size), dtype=np.uint8)

    def set_f16(offset: int, lo: float, hi: float) -> None:
        v = rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = v[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)

    if name in ("Q4_K", "Q5_K"):  # d, dmin lead the block
        set_f16(0, 1e-4, 1e-3)
        set_f16(2, 1e-4, 1e-3)
    elif name == "Q2_K":  # ..., d, dmin
        set_f16(type_size - 4, 1e-3, 1e-2)
        set_f16(type_size - 2, 1e-3, 1e-2)
    else:  # Q3_K, Q6_K: ..., d
        set_f16(type_size - 2, 1e-4, 1e-3)
    return raw.reshape(out_f, -1), qtype


def _gguf_shape(name: str) -> tuple[int, int]:
    return (192, 512) if name.endswith("_K") else (40, 576)


def _bf16_bound(m: Int4Linear) -> torch.Tensor:
    """Per-element bound of the bf16-scale error: u * sum over planes of (|q-8| * s + |z|)."""
    sz = m.scales_and_zeros.float()[:, :, : m.out_features]
    q = m.codes().float() - 8
    bound = torch.zeros(m.out_features, m.in_features)
    for p in range(m.n_planes):
        s = sz[p, :, :, 0].T.repeat_interleave(m.group_size, 1)
        z = sz[p, :, :, 1].T.repeat_interleave(m.group_size, 1)
        bound += BF16_U * (q[p].abs() * s.abs() + z.abs())
    return bound + 1e-9


@pytest.mark.parametrize("name", DIRECT_EXACT)
def test_gguf_direct_layouts_are_exact(name: str) -> None:
    gguf = pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    out_f, in_f = _gguf_shape(name)
    raw, qtype = _gguf_raw(name, out_f, in_f, seed=20)
    deq = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    m = gguf_linear(raw, qtype, (out_f, in_f))
    assert isinstance(m, Int4Linear)
    assert m.n_planes == (1 if name in ("Q4_0", "Q4_1", "Q4_K") else 2)
    assert torch.equal(m.reference_weight(torch.float32), deq)  # bit-exact with fp32 compute
    err_bf16 = (m.reference_weight(torch.bfloat16) - deq).abs()
    assert torch.all(err_bf16 <= _bf16_bound(m))
    for dtype in DTYPES:
        for t in (1, 7, 32):
            x = _rand(t, in_f, seed=30 + t, scale=1.0).to(dtype)
            _assert_matches(m(x), _oracle(m, x, dtype), dtype, calls=m.n_planes)


@pytest.mark.parametrize("name", VIA_INT8)
def test_gguf_dequantized_layouts_within_int8_error(name: str) -> None:
    gguf = pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    out_f, in_f = _gguf_shape(name)
    raw, qtype = _gguf_raw(name, out_f, in_f, seed=21)
    deq = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    m = gguf_linear(raw, qtype, (out_f, in_f))
    assert isinstance(m, Int8Linear)
    rowmax = deq.abs().amax(dim=1, keepdim=True)
    for dtype in DTYPES:  # the row scales are on the bf16 grid: same weight for both
        err = (m.reference_weight(dtype) - deq).abs()
        assert torch.all(err <= rowmax * (0.5 + 127 * BF16_U) / 127 + 1e-9)
    x = _rand(7, in_f, seed=40, scale=1.0)
    _assert_matches(m(x), _oracle(m, x, torch.float32), torch.float32)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_gguf_float_types_are_dense(name: str) -> None:
    gguf = pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    w = (np.random.default_rng(22).standard_normal((40, 64)) * 0.02).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[name]
    raw = gguf.quants.quantize(w, qtype)
    m = gguf_linear(raw, qtype, (40, 64), bias=torch.ones(40))
    assert isinstance(m, DenseLinear)
    assert torch.equal(m.reference_weight(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    x = _rand(5, 64, seed=41, scale=1.0)
    _assert_matches(m(x), _oracle(m, x, torch.float32), torch.float32)


def test_gguf_accepts_flat_bytes_and_names() -> None:
    gguf = pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    raw, qtype = _gguf_raw("Q4_1", 40, 576, seed=23)
    ref = gguf_linear(raw, qtype, (40, 576)).reference_weight()
    for variant in (raw.reshape(-1), torch.from_numpy(raw)):
        for t in ("q4_1", int(gguf.GGMLQuantizationType.Q4_1)):
            assert torch.equal(gguf_linear(variant, t, (40, 576)).reference_weight(), ref)
    with pytest.raises(ValueError, match="bytes"):
        gguf_linear(raw[:-1], qtype, (40, 576))


# ---------------------------------------------------------------------------------------------- errors


def test_unsupported_method_names_it() -> None:
    with pytest.raises(ValueError, match=r"'fp8'.*none, int8, int4, gguf"):
        get_quant_method("fp8")
    assert QUANTIZATION_CHOICES == ("none", "int8", "int4", "gguf")
    assert get_quant_method(None).name == "none"


def test_unsupported_ggml_type_names_it() -> None:
    pytest.importorskip("gguf")
    from radixrt.layers.gguf_linear import gguf_linear

    raw = np.zeros((4, 292), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"Q8_K.*supported: F32, F16, BF16, Q4_0"):
        gguf_linear(raw, "Q8_K", (4, 256))
    with pytest.raises(ValueError, match=r"'NOPE'"):
        gguf_linear(raw, "NOPE", (4, 256))
    with pytest.raises(ValueError, match=r"Q8_K"):
        quantize_model_linears(nn.Sequential(nn.Linear(256, 16)), "gguf", ggml_type="Q8_K")


def test_bad_group_and_shapes() -> None:
    w = _rand(16, 96, seed=24)
    with pytest.raises(ValueError, match="group size 16"):
        Int4Linear.from_float(w, group_size=16)
    with pytest.raises(ValueError, match="multiple of the int4 group size 64"):
        Int4Linear.from_float(w, group_size=64)
    with pytest.raises(ValueError, match="group size 48"):
        quantize_linear(nn.Linear(96, 16), "int4", group_size=48)
    with pytest.raises(ValueError, match="last dim 96"):
        Int8Linear.from_float(w)(torch.zeros(2, 95))


# ---------------------------------------------------------------------------------------------- model


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(96, 64)
        self.layers = nn.ModuleDict(
            {"up": nn.Linear(64, 128, bias=True), "down": nn.Linear(128, 64, bias=False)}
        )
        self.lm_head = nn.Linear(64, 96, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        h = h + self.layers["down"](torch.relu(self.layers["up"](h)))
        return self.lm_head(h)


def _tiny_oracle(model: _TinyLM, ids: torch.Tensor) -> torch.Tensor:
    def lin(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(mod, QuantLinearBase):
            b = mod.reference_bias()
            y = x @ mod.reference_weight().T
            return y if b is None else y + b
        assert isinstance(mod, nn.Linear)
        return nn.functional.linear(x, mod.weight, mod.bias)

    h = model.embed_tokens(ids)
    h = h + lin(model.layers["down"], torch.relu(lin(model.layers["up"], h)))
    return lin(model.lm_head, h)


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_quantize_model_linears_with_tied_head(method: str) -> None:
    if method == "gguf":
        pytest.importorskip("gguf")
    torch.manual_seed(0)
    model = _TinyLM()
    emb_before = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[1, 5, 7, 95]])
    with torch.no_grad():
        y_float = model(ids)
        names = quantize_model_linears(model, method, ggml_type="Q4_1")
        assert sorted(names) == ["layers.down", "layers.up", "lm_head"]
        assert isinstance(model.lm_head, QuantLinearBase)
        assert isinstance(model.embed_tokens, nn.Embedding)
        assert isinstance(model.embed_tokens.weight, nn.Parameter)
        assert torch.equal(model.embed_tokens.weight, emb_before)
        y = model(ids)
        _assert_matches(y[0], _tiny_oracle(model, ids)[0], torch.float32)
        # the quantized head is close to the float one
        assert ((y - y_float).norm() / y_float.norm()).item() < 0.2


def test_quantize_model_linears_skip_shared_and_none() -> None:
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(64, 32))
    assert quantize_model_linears(model, "none") == []
    assert isinstance(model[0], nn.Linear)
    names = quantize_model_linears(model, "int8", skip=lambda n: n == "3")
    assert names == ["0", "2"]
    assert isinstance(model[0], Int8Linear) and model[0] is model[2]
    assert type(model[3]) is nn.Linear


def test_failed_conversion_leaves_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(48, 8))  # 48 % 32 != 0
    with pytest.raises(ValueError, match="int4 group size 32"):
        quantize_model_linears(model, "int4")
    assert all(type(m) is nn.Linear for m in model)
    with pytest.raises(ValueError, match="'awq'"):
        quantize_model_linears(model, "awq")
