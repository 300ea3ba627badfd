"""radixrt's AVX512-BF16 int4 GEMM (radixrt/kernels/int4_gemm.py): against a float64 matmul by the dequantized
weight over many shapes, planes, group sizes, batch sizes and thread counts; the 8-bit-code variant (mm_u8)
the same way and as the layout of GGUF's two-plane blocks (Q8_0, Q5_*); through Int4Linear against torch's
int4 kernel; inside a compiled graph; bad inputs; and the Engine in bf16 against torch's kernel."""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels import int4_gemm
from radixrt.layers.quant_linear import Int4Linear

pytestmark = pytest.mark.skipif(
    not int4_gemm.available(),
    reason=f"radixrt's int4 kernel cannot run here: {int4_gemm.unavailable_reason()}",
)


def _weights(n_planes: int, n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n_planes, n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n_planes, n, k // group, generator=g) * 0.05).bfloat16().float()
    zeros = (torch.randn(n_planes, n, k // group, generator=g) * 0.02).bfloat16().float()
    return codes, scales, zeros


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    n_planes, n, k = codes.shape
    q = codes.double().view(n_planes, n, k // group, group) - 8
    w = q * scales.double()[..., None] + zeros.double()[..., None]
    return w.sum(0).view(n, k)


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` (bf16) is the exact product rounded once to bf16, up to fp32 accumulation error."""
    ref = x.double() @ w.T
    bound = ref.abs() * 2.0**-8 + (x.double().abs() @ w.abs().T) * 2.0**-20
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, at bound {float(bound.max()):.3g}"


@pytest.mark.parametrize(
    ("n_planes", "n", "k", "group"),
    [(1, 64, 64, 32), (1, 1536, 576, 32), (2, 576, 1536, 32), (1, 200, 256, 64), (1, 48, 512, 128),
     (2, 40, 768, 256), (1, 16, 32, 32), (1, 8, 64, 16)],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_the_dequantized_weight(n_planes: int, n: int, k: int, group: int, threads: int) -> None:
    codes, scales, zeros = _weights(n_planes, n, k, group, seed=n * k + group)
    packed = int4_gemm.pack(codes, scales, zeros, group)
    w = _dequantized(codes, scales, zeros, group)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y = int4_gemm.int4_mm(x, packed)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            _check_close(y, x, w)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (576, 1536, 32), (200, 256, 64), (40, 768, 256),
                                               (8, 64, 16), (1000, 576, 32)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 3])
def test_u8_matches_the_dequantized_weight(n: int, k: int, group: int, threads: int) -> None:
    """Both layouts of the scales (float32 scale and zb; bf16 scale and zero, where all are bf16 values) meet
    the exact product's bound and give the same bits."""
    g = torch.Generator().manual_seed(n + k + group)
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    u[0] = 255  # the extreme codes
    u[1] = 0
    scales = (torch.rand(n, k // group, generator=g) * 0.01).bfloat16().float()
    zeros = (torch.randn(n, k // group, generator=g) * 0.5).bfloat16().float()
    w = (u.double().view(n, k // group, group) - 136) * scales.double()[..., None] + zeros.double()[..., None]
    packed = int4_gemm.pack_u8(u, scales, zeros, group)
    packed16 = int4_gemm.pack_u8(u, scales, zeros, group, torch.bfloat16)
    assert packed.sz.dtype == torch.float32 and packed16.sz.dtype == torch.bfloat16
    assert packed16.nbytes() < packed.nbytes()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y = int4_gemm.u8_mm(x, packed)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert torch.equal(int4_gemm.u8_mm(x, packed16), y)
            if m:
                _check_close(y, x, w.view(n, k))
    finally:
        torch.set_num_threads(old)


def test_u8_keeps_float32_scales_unless_all_are_bf16_values() -> None:
    """A zero that is not a bf16 value (two planes' zeros summed, say) keeps the float32 layout."""
    u = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    scales = torch.full((32, 2), 2.0**-7)
    zeros = torch.full((32, 2), 1.0 + 2.0**-12)  # not a bf16 value
    assert int4_gemm.pack_u8(u, scales, zeros, 32, torch.bfloat16).sz.dtype == torch.float32
    assert (
        int4_gemm.pack_u8(u, scales, zeros.bfloat16().float(), 32, torch.bfloat16).sz.dtype == torch.bfloat16
    )
    with pytest.raises(ValueError, match="float16"):
        int4_gemm.pack_u8(u, scales, zeros, 32, torch.float16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1"])
def test_two_plane_gguf_blocks_run_as_one_8bit_code(qtype: str) -> None:
    """GGUF's 8- and 5-bit blocks are two int4 planes whose high scale is 16x the low one: radixrt's kernel
    multiplies them as one code 16 hi + lo; the result is the reference weight's product (what torch's kernel
    computes as two planes, rounding each plane's product on its own), and a linear with two unrelated planes keeps the plane kernel."""
    from radixrt.layers.gguf_linear import gguf_linear_from_float

    pytest.importorskip("gguf")
    torch.manual_seed(3)
    lin = gguf_linear_from_float(torch.randn(136, 576) * 0.05, qtype, compute_dtype=torch.bfloat16)
    assert isinstance(lin, Int4Linear) and lin.n_planes == 2
    x = torch.randn(11, 576).bfloat16()
    theirs = lin(x)
    lin.use_radixrt_kernel(torch.bfloat16)
    assert lin.u8_codes is not None and lin.i4_codes is None
    ours = lin(x)
    ref_w = lin.reference_weight(torch.bfloat16).double()
    _check_close(ours, x, ref_w)
    # torch's kernel rounds each plane's product to bf16 before their sum: never closer than one code
    ref = x.double() @ ref_w.T
    assert float((ours.double() - ref).abs().max()) <= float((theirs.double() - ref).abs().max())
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), ours)

    codes, scales, zeros = _weights(2, 48, 64, 32, seed=4)  # unrelated planes
    planes = Int4Linear(codes, scales, zeros, 32, compute_dtype=torch.bfloat16)
    planes.use_radixrt_kernel(torch.bfloat16)
    assert planes.u8_codes is None and planes.i4_codes is not None
    x = torch.randn(5, 64).bfloat16()
    _check_close(planes(x), x, _dequantized(codes, scales, zeros, 32))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 1536), (37, 200, 45), (64, 1536, 576), (5, 7, 3)])
def test_int8_activation_ops_equal_their_torch_formulas(m: int, k: int, n: int) -> None:
    """quant_rows / dequant_rows (--dense-gemm-int8's fused passes) compute exactly the torch expressions
    w8a8_linear falls back to: the fp32 absmax / 127 scale, round-half-even codes, the rescaled bf16 output."""
    g = torch.Generator().manual_seed(m * k + n)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    x[0, : min(k, 4)] = torch.tensor([127.0, -63.5, 0.5, -1.5][: min(k, 4)]).bfloat16()  # ties at scale 1
    if m > 2:
        x[2] = 0
    xq, sx = torch.ops.radixrt_int4.quant_rows(x)
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    want_s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    assert torch.equal(sx, want_s) and torch.equal(xq, torch.round(xf / want_s).to(torch.int8))
    acc = torch.randint(-(2**24), 2**24, (m, n), generator=g, dtype=torch.int32)
    ws = torch.rand(n, generator=g) * 1e-3
    y = torch.ops.radixrt_int4.dequant_rows(acc, sx, ws)
    assert torch.equal(y, (acc.float() * sx * ws).bfloat16())
    with pytest.raises(RuntimeError, match="sx must be"):
        torch.ops.radixrt_int4.dequant_rows(acc, sx[:-1] if m > 1 else sx.double(), ws)


def test_empty_batch_and_extreme_codes() -> None:
    codes, scales, zeros = _weights(1, 32, 64, 32, seed=1)
    codes[0, :16] = 15
    codes[0, 16:] = 0
    packed = int4_gemm.pack(codes, scales, zeros, 32)
    assert int4_gemm.int4_mm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    x = torch.randn(5, 64).bfloat16()
    _check_close(int4_gemm.int4_mm(x, packed), x, _dequantized(codes, scales, zeros, 32))


def test_bad_inputs_are_refused() -> None:
    codes, scales, zeros = _weights(1, 32, 64, 32, seed=2)
    p = int4_gemm.pack(codes, scales, zeros, 32)
    op = torch.ops.radixrt_int4.mm
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.randn(2, 64), p.codes, p.sz, 32)
    with pytest.raises(RuntimeError, match="K and the group size"):
        op(torch.randn(2, 128).bfloat16(), p.codes, p.sz, 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(torch.randn(2, 64).bfloat16(), p.codes, p.sz, 24)
    with pytest.raises(RuntimeError, match="sz must be"):
        op(torch.randn(2, 64).bfloat16(), p.codes, p.sz.float(), 32)
    with pytest.raises(ValueError, match="group_size"):
        int4_gemm.pack(codes[:, :, :40], scales, zeros, 32)
    u8 = int4_gemm.pack_u8(codes[0] * 16, scales[0], zeros[0], 32)
    op8 = torch.ops.radixrt_int4.mm_u8
    with pytest.raises(RuntimeError, match="bfloat16"):
        op8(torch.randn(2, 64), u8.codes, u8.sz, 32)
    with pytest.raises(RuntimeError, match="K and the group size"):
        op8(torch.randn(2, 128).bfloat16(), u8.codes, u8.sz, 32)
    with pytest.raises(RuntimeError, match="sz must be"):
        op8(torch.randn(2, 64).bfloat16(), u8.codes, u8.sz.half(), 32)
    with pytest.raises(RuntimeError, match="codes must be"):
        op8(torch.randn(2, 64).bfloat16(), p.codes, u8.sz, 32)
    with pytest.raises(ValueError, match="scales/zeros"):
        int4_gemm.pack_u8(codes[0], scales[0, :, :1], zeros[0], 32)


def test_int4_linear_matches_torch_kernel_and_compiles() -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 576) * 0.05
    lin = Int4Linear.from_float(weight, compute_dtype=torch.bfloat16)
    x = torch.randn(12, 576).bfloat16()
    theirs = lin(x)
    kept = lin.use_radixrt_kernel(torch.bfloat16)
    assert kept > 0 and lin.i4_codes is not None
    ours = lin(x)
    assert ours.shape == theirs.shape == (12, 200)
    _check_close(ours, x, lin.reference_weight(torch.bfloat16).double())
    # Both kernels multiply by the same weight: at most a bf16 rounding apart.
    assert torch.allclose(ours.float(), theirs.float(), rtol=2**-7, atol=1e-2)
    compiled = torch.compile(lin, fullgraph=True)
    assert torch.equal(compiled(x), ours)
    if not int4_gemm.available(torch.float32):  # where it runs (AVX2 + FMA), float32 is a valid choice
        with pytest.raises(ValueError, match="bfloat16"):
            lin.use_radixrt_kernel(torch.float32)


def test_engine_in_bf16_is_as_close_to_fp32_as_torch_kernel() -> None:
    """The embedded GGUF model scores a text in bf16 through either int4 kernel (every row through the
    quantized kernels: no dense copy) and in float32 with the file's weights dequantized (exact, the oracle).
    Both bf16 runs round every activation to bf16, so both sit ~0.05 nats per token from float32; radixrt's
    kernel must be no further from it than torch's (a wrong code, scale or zero would be far off)."""
    from radixrt import Engine

    text = (
        "The RadixCache keeps the KV of every prefix it has computed, so a ReAct agent whose scratchpad grows "
        "by one thought, one action and one observation per turn computes only the new text each turn."
    )
    runs = {"auto": {"int4_kernel": "auto", "dtype": "bfloat16"},
            "torch": {"int4_kernel": "torch", "dtype": "bfloat16"}, "fp32": {"dtype": "float32"}}  # fmt: skip
    scores = {}
    for name, kw in runs.items():
        engine = Engine(max_total_tokens=4096, disable_compile=True, dense_gemm_min_tokens=0, **kw)
        try:
            meta = engine.generate(
                text, sampling_params={"temperature": 0, "max_new_tokens": 1},
                return_logprob=True, logprob_start_len=0,
            )["meta_info"]  # fmt: skip
            scores[name] = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
        finally:
            engine.shutdown()
    ours = float((scores["auto"] - scores["fp32"]).abs().mean())
    theirs = float((scores["torch"] - scores["fp32"]).abs().mean())
    assert len(scores["fp32"]) > 30
    assert ours <= 1.25 * theirs + 0.01, (ours, theirs)


@pytest.mark.skipif(int4_gemm.amx_min_rows() is None, reason="the int4 kernel has no AMX tile path here")
@pytest.mark.parametrize(
    ("n_planes", "n", "k", "group"), [(1, 960, 576, 32), (2, 40, 704, 64), (1, 48, 512, 128)]
)
def test_amx_tiles_and_avx512_paths_agree(n_planes: int, n: int, k: int, group: int) -> None:
    """On a CPU with AMX, the tile path (every batch size forced onto it) and the AVX512-BF16 path (forced
    off) both meet the exact product's bound for int4 planes and 8-bit codes, rows 1-40 (row passes of 16,
    odd group counts), and agree with each other to fp32 summation order."""
    codes, scales, zeros = _weights(n_planes, n, k, group, seed=n + k)
    packed = int4_gemm.pack(codes, scales, zeros, group)
    w = _dequantized(codes, scales, zeros, group)
    u = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(k), dtype=torch.uint8)
    s8 = scales[0] * 0.1
    w8 = int4_gemm.pack_u8(u, s8, zeros[0], group)
    w8_bf16 = int4_gemm.pack_u8(u, s8.bfloat16().float(), zeros[0].bfloat16().float(), group, torch.bfloat16)
    assert w8_bf16.sz.dtype == torch.bfloat16
    ref8 = (u.double().view(n, k // group, group) - 136) * s8.double()[..., None] + zeros[0].double()[
        ..., None
    ]
    default = int4_gemm.amx_min_rows()
    assert default == int4_gemm.AMX_MIN_ROWS_DEFAULT
    try:
        for m in (1, 2, 3, 15, 16, 17, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            out = {}
            for rows in (1, 0):  # the tiles, then AVX512-BF16
                torch.ops.radixrt_int4.amx_rows(rows)
                out[rows] = (int4_gemm.int4_mm(x, packed), int4_gemm.u8_mm(x, w8))
                _check_close(out[rows][0], x, w)
                _check_close(out[rows][1], x, ref8.view(n, k))
                # the bf16 scale layout: the float32 layout's bits for the same (bf16-valued) weights
                w8_f32 = int4_gemm.pack_u8(u, s8.bfloat16().float(), zeros[0].bfloat16().float(), group)
                assert torch.equal(int4_gemm.u8_mm(x, w8_bf16), int4_gemm.u8_mm(x, w8_f32))
            for tiles, avx in zip(out[1], out[0], strict=True):
                torch.testing.assert_close(tiles.float(), avx.float(), rtol=2**-7, atol=1e-5)
    finally:
        torch.ops.radixrt_int4.amx_rows(default)


def test_amx_threshold_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad RADIXRT_INT4_AMX_MIN_ROWS is a ValueError naming the variable; 0 turns the tile path off."""
    for bad in ("many", "-2"):
        monkeypatch.setenv(int4_gemm.AMX_ENV, bad)
        with pytest.raises(ValueError, match=int4_gemm.AMX_ENV):
            int4_gemm._configure_amx()
    monkeypatch.setenv(int4_gemm.AMX_ENV, "0")
    try:
        int4_gemm._configure_amx()
        assert int4_gemm.amx_min_rows() is None
    finally:
        monkeypatch.delenv(int4_gemm.AMX_ENV)
        int4_gemm._configure_amx()
