"""radixrt's float32 int4 kernel with int8 activations (``radixrt_int4_f32::mm_q8``, ``--int4-kernel q8``):
against a float64 oracle that rounds the activations the same way (per row and group: d = max|x| / 127,
xq = round-half-even(x * 127 / max|x|)) over shapes, planes, group sizes, batch sizes and thread counts; the
int16 sums at their largest; the rounding error against the exact product; through Int4Linear, compiled; and
an Engine on a GGUF file with ``int4_kernel="q8"`` against the exact kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.kernels import int4_gemm
from radixrt.layers.quant_linear import Int4Linear

pytestmark = pytest.mark.skipif(
    not int4_gemm.available(torch.float32),
    reason=f"radixrt's float32 int4 kernel cannot run here: {int4_gemm.unavailable_reason(torch.float32)}",
)

ROWS = (0, 1, 2, 3, 5, 8, 17)


def _rounded(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, d)``: the activations as the kernel rounds them, ``[M, K/G, G]`` integers and ``[M, K/G]``."""
    xg = x.view(x.shape[0], x.shape[1] // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xg * inv), (amax / 127.0).squeeze(-1)


def _oracle(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):  # type: ignore[no-untyped-def]
    """``(y, bound)`` in float64: the kernel's arithmetic exactly, and the fp32 accumulation error allowed."""
    xq, d = _rounded(x, group)
    m, k = x.shape
    sx = x.view(m, k // group, group).double().sum(-1)  # [M, K/G]
    y = torch.zeros(m, codes.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(y)
    for p in range(codes.shape[0]):
        q = codes[p].double().view(codes.shape[1], -1, group)  # [N, K/G, G]
        dot = torch.einsum("mgt,ngt->mng", xq.double(), q)  # integers, exact
        s = scales[p].float().double()
        zb = (zeros[p].float() - 8 * scales[p].float()).double()
        term = dot * s[None] * d.double()[:, None, :] + zb[None] * sx[:, None, :]
        y += term.sum(-1)
        mag += (dot.abs() * s[None] * d.double()[:, None, :] + (zb[None] * sx[:, None, :]).abs()).sum(-1)
    return y, mag * 2.0**-18 + 1e-30


@pytest.mark.parametrize(
    ("n_planes", "n", "k", "group"),
    [(1, 64, 64, 32), (1, 1536, 576, 32), (2, 576, 1536, 32), (1, 200, 256, 64), (1, 48, 512, 128),
     (1, 16, 32, 32), (1, 8, 64, 16), (1, 100, 96, 32)],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 3])
def test_q8_matches_the_rounded_oracle(n_planes: int, n: int, k: int, group: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n * k + group + 1)
    codes = torch.randint(0, 16, (n_planes, n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n_planes, n, k // group, generator=g) * 0.05
    zeros = torch.randn(n_planes, n, k // group, generator=g) * 0.02
    packed = int4_gemm.pack(codes, scales, zeros, group, torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            if m:
                x[0, :group] = 0.0  # an all-zero group: d = 0, nothing added but the zero term's 0
            y = torch.ops.radixrt_int4_f32.mm_q8(x, packed.codes, packed.sz, group)[:, :n]
            assert y.shape == (m, n) and y.dtype == torch.float32
            ref, bound = _oracle(x, codes, scales, zeros, group)
            err = (y.double() - ref).abs()
            assert bool((err <= bound).all()), f"m={m}: max error {float(err.max()):.3g}"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_int16_sums_do_not_saturate(sign: float) -> None:
    """Codes 15 against activations all at +-127 (per group 32 x 15 x 127 = 60960, past int16 in one sum)."""
    k, n, group = 256, 32, 32
    codes = torch.full((1, n, k), 15, dtype=torch.uint8)
    scales, zeros = torch.ones(1, n, k // group), torch.zeros(1, n, k // group)
    packed = int4_gemm.pack(codes, scales, zeros, group, torch.float32)
    x = torch.full((2, k), sign)
    y = torch.ops.radixrt_int4_f32.mm_q8(x, packed.codes, packed.sz, group)
    # w = 15 - 8 = 7 everywhere: x exactly representable, so the result is exact
    assert torch.equal(y, torch.full((2, n), sign * 7 * k))


def test_error_against_the_exact_product_is_the_rounding() -> None:
    """The distance to the exact product stays within what rounding each activation by d / 2 can cause."""
    n, k, group = 300, 576, 32
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (1, n, k), generator=g, dtype=torch.uint8)
    scales, zeros = (
        torch.rand(1, n, k // group, generator=g) * 0.05,
        torch.randn(1, n, k // group, generator=g) * 0.02,
    )
    packed = int4_gemm.pack(codes, scales, zeros, group, torch.float32)
    w = (
        (codes.double().view(n, -1, group) - 8) * scales[0].double()[..., None] + zeros[0].double()[..., None]
    ).view(n, k)
    x = torch.randn(4, k, generator=g)
    y = torch.ops.radixrt_int4_f32.mm_q8(x, packed.codes, packed.sz, group)[:, :n].double()
    _, d = _rounded(x, group)
    half_step = (d.double() / 2).repeat_interleave(group, dim=1)  # [M, K]
    bound = half_step @ w.abs().T + (x.double().abs() @ w.abs().T) * 2.0**-18
    err = (y - x.double() @ w.T).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # the activations were rounded: not the exact kernel


def test_int4_linear_with_int8_activations() -> None:
    torch.manual_seed(4)
    lin = Int4Linear.from_float(torch.randn(72, 256) * 0.05, group_size=32, compute_dtype=torch.float32)
    lin.use_radixrt_kernel(torch.float32, act_int8=True)
    assert lin.act_int8
    x = torch.randn(3, 256)
    ours = lin(x)
    direct = torch.ops.radixrt_int4_f32.mm_q8(x, lin.i4_codes, lin.i4_sz, 32)[:, :72]
    assert torch.equal(ours, direct)
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), ours)
    lin.use_radixrt_kernel(torch.float32)
    assert not lin.act_int8 and torch.equal(
        lin(x), int4_gemm.int4_mm(x, int4_gemm.Int4Packed(lin.i4_codes, lin.i4_sz, 32, 72))
    )


def test_bad_inputs() -> None:
    codes = torch.randint(0, 16, (1, 32, 64), dtype=torch.uint8)
    packed = int4_gemm.pack(codes, torch.rand(1, 32, 2), torch.zeros(1, 32, 2), 32, torch.float32)
    assert torch.ops.radixrt_int4_f32.mm_q8(torch.empty(0, 64), packed.codes, packed.sz, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.radixrt_int4_f32.mm_q8(torch.randn(2, 64).bfloat16(), packed.codes, packed.sz, 32)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.radixrt_int4_f32.mm_q8(torch.randn(2, 32), packed.codes, packed.sz, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.radixrt_int4_f32.mm_q8(torch.randn(2, 64), packed.codes, packed.sz, 24)


def test_engine_with_q8_against_the_exact_kernel(tmp_path: Path, engine_factory) -> None:
    """A Q4_1 GGUF file in float32 with ``int4_kernel="q8"``: every int4 linear multiplies int8 activations,
    and the prompt logprobs stay within 10% of the exact kernel's (the rounding, not a different model)."""
    from radixrt.testing.gguf_writer import write_gguf
    from radixrt.testing.random_checkpoint import make_checkpoint
    from tests.engine_fixtures import prompts_of

    pytest.importorskip("gguf")
    ckpt = make_checkpoint(tmp_path / "tiny", arch="llama", size="tiny", seed=2)
    gguf_path = write_gguf(ckpt, tmp_path / "q" / "tiny-q4_1.gguf", "Q4_1")
    prompts = prompts_of([6, 20], seed=3)  # 26 tokens: below the dense copy's 32, so prefill runs q8 too
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    lps = {}
    for kernel in ("auto", "q8"):
        eng = engine_factory(gguf_path, int4_kernel=kernel, dtype="float32")
        model = eng.worker.scheduler.runner.model
        flags = [m.act_int8 for m in model.modules() if isinstance(m, Int4Linear)]
        assert flags and all(flags) == (kernel == "q8")
        out = eng.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0
        )
        lps[kernel] = [
            torch.tensor([lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]]) for o in out
        ]
    for a, b in zip(lps["auto"], lps["q8"], strict=True):
        diff = (a - b).abs().max().item()
        # a random tiny model's logprobs (~-12) move by up to ~4% under the rounding (the kernel itself is held
        # to the oracle above); a broken product moves them by whole units
        assert 0 < diff < 0.1 * a.abs().mean().item(), diff
