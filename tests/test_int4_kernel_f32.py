"""radixrt's float32 (AVX2) int4 / 8-bit-code GEMM (radixrt/kernels/csrc/int4_gemm_f32.cpp): against a float64
matmul by the dequantized weight over shapes, planes, group sizes, batch sizes and thread counts; through
Int4Linear and Int8Linear against their reference weights; GGUF blocks; inside a compiled graph; bad inputs;
and the float32 default for a GGUF file (blocks for decode, the dense copy for prefill) against the dense
model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.kernels import int4_gemm
from radixrt.layers.quant_linear import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not int4_gemm.available(torch.float32),
    reason=f"radixrt's float32 int4 kernel cannot run here: {int4_gemm.unavailable_reason(torch.float32)}",
)

ROWS = (0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31)


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` (float32) is the exact product up to fp32 accumulation error (relative to sum |x| |w|)."""
    ref = x.double() @ w.T
    bound = (x.double().abs() @ w.abs().T) * 2.0**-18 + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, at bound {float(bound.max()):.3g}"


def _with_threads(threads: int, fn) -> None:  # type: ignore[no-untyped-def]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(
    ("n_planes", "n", "k", "group"),
    [(1, 64, 64, 32), (1, 1536, 576, 32), (2, 576, 1536, 32), (1, 200, 256, 64), (1, 48, 512, 128),
     (2, 40, 768, 256), (1, 16, 32, 32), (1, 8, 64, 16), (1, 100, 96, 32)],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])  # 2 and 3: batch-1 passes of 2 blocks (balanced_blocks)
def test_int4_matches_the_dequantized_weight(n_planes: int, n: int, k: int, group: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n * k + group)
    codes = torch.randint(0, 16, (n_planes, n, k), generator=g, dtype=torch.uint8)
    codes[0, 0] = 15  # the extreme codes
    codes[0, 1 % n] = 0
    scales = torch.rand(n_planes, n, k // group, generator=g) * 0.05
    zeros = torch.randn(n_planes, n, k // group, generator=g) * 0.02
    packed = int4_gemm.pack(codes, scales, zeros, group, torch.float32)
    q = codes.double().view(n_planes, n, k // group, group) - 8
    w = (q * scales.double()[..., None] + zeros.double()[..., None]).sum(0).view(n, k)

    def run() -> None:
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = int4_gemm.int4_mm(x, packed)
            assert y.shape == (m, n) and y.dtype == torch.float32
            _check_close(y, x, w)

    _with_threads(threads, run)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (576, 1536, 32), (200, 256, 64), (40, 768, 256),
                                               (8, 64, 16), (1000, 576, 32)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 3])
def test_u8_matches_the_dequantized_weight(n: int, k: int, group: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n + k + group)
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    u[0] = 255
    u[1] = 0
    scales = torch.rand(n, k // group, generator=g) * 0.01
    zeros = torch.randn(n, k // group, generator=g) * 0.5
    w = (u.double().view(n, k // group, group) - 136) * scales.double()[..., None] + zeros.double()[..., None]
    packed = int4_gemm.pack_u8(u, scales, zeros, group)

    def run() -> None:
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = int4_gemm.u8_mm(x, packed)
            assert y.shape == (m, n) and y.dtype == torch.float32
            _check_close(y, x, w.view(n, k))

    _with_threads(threads, run)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_blocks_through_the_linears(qtype: str) -> None:
    """The GGUF block types the gguf package can write (int4 planes, the 8-bit code of Q8_0 / Q5_*) on the
    float32 kernel equal the reference weight's product, compiled too."""
    from radixrt.layers.gguf_linear import gguf_linear_from_float

    pytest.importorskip("gguf")
    torch.manual_seed(5)
    lin = gguf_linear_from_float(torch.randn(136, 512) * 0.05, qtype, compute_dtype=torch.float32)
    assert isinstance(lin, (Int4Linear, Int8Linear))
    x = torch.randn(9, 512)
    kept = lin.use_radixrt_kernel(torch.float32)
    assert kept > 0 and (lin.u8_codes is not None or getattr(lin, "i4_codes", None) is not None)
    ours = lin(x)
    _check_close(ours, x, lin.reference_weight(torch.float32).double())
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), ours)


def test_int8_linear_with_padded_k() -> None:
    lin = Int8Linear.from_float(torch.randn(40, 200) * 0.1, compute_dtype=torch.float32)
    lin.use_radixrt_kernel(torch.float32)
    x = torch.randn(6, 200)
    ours = lin(x)
    _check_close(ours, x, lin.reference_weight().double())
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), ours)
    with pytest.raises(ValueError, match="float32"):
        lin.use_radixrt_kernel(torch.bfloat16)


def test_bad_inputs() -> None:
    codes = torch.randint(0, 16, (1, 32, 64), dtype=torch.uint8)
    scales, zeros = torch.rand(1, 32, 2), torch.zeros(1, 32, 2)
    packed = int4_gemm.pack(codes, scales, zeros, 32, torch.float32)
    assert int4_gemm.int4_mm(torch.empty(0, 64), packed).shape == (0, 32)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.radixrt_int4_f32.mm(torch.randn(2, 64).bfloat16(), packed.codes, packed.sz, 32)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.radixrt_int4_f32.mm(torch.randn(2, 32), packed.codes, packed.sz, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.radixrt_int4_f32.mm(torch.randn(2, 64), packed.codes, packed.sz, 24)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        int4_gemm.pack(codes, scales, zeros, 32, torch.float16)


def test_float32_gguf_default_runs_the_blocks(tmp_path: Path, engine_factory) -> None:
    """A GGUF file in float32 with quantization unset runs ``gguf`` on this kernel (decode reads the blocks,
    prefill the dense copy); its greedy ids equal the same file with ``--quantization none`` (the dequantized
    weights, dense), and its prompt logprobs stay within fp32 accumulation error of them."""
    from radixrt.testing.gguf_writer import write_gguf
    from radixrt.testing.random_checkpoint import make_checkpoint
    from tests.engine_fixtures import prompts_of

    pytest.importorskip("gguf")
    ckpt = make_checkpoint(tmp_path / "tiny", arch="llama", size="tiny", seed=2)
    gguf_path = write_gguf(ckpt, tmp_path / "q" / "tiny-q4_1.gguf", "Q4_1")
    prompts = prompts_of([5, 40, 90], seed=7)
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outs = {}
    for quant in (None, "none"):
        eng = engine_factory(gguf_path, quantization=quant)
        assert eng.worker.scheduler.runner.quantization == ("gguf" if quant is None else "none")
        outs[quant] = eng.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0
        )
    assert [o["output_ids"] for o in outs[None]] == [o["output_ids"] for o in outs["none"]]
    for ours, dense in zip(outs[None], outs["none"], strict=True):
        a = torch.tensor([lp[0] for lp in ours["meta_info"]["output_token_logprobs"]])
        b = torch.tensor([lp[0] for lp in dense["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
