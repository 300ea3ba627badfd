"""The CPU attention kernels reading a float8 KV pool (e4m3fn, e5m2) in place, against SDPA over the
dequantized pool (``code * scale``, per-channel K scales and per-head V scales, powers of two as the pool's).

The kernels widen the codes exactly and fold the scales into the query and the output, so they must match the
references of tests/test_cpu_decode.py and tests/test_cpu_extend.py run over the dequantized float32 pool as
closely as those kernels do over bf16 / fp32 pools: decode runs in float32 (a bf16 output rounded once); the
extend kernel with a bf16 query takes the bf16 path where the CPU has AVX512-BF16 (codes widened to bf16,
probabilities rounded to bf16: test_cpu_extend's bound), else float32.
Every finite code is checked bit for bit (one position: the output is its V row). Skipped only when gcc is
missing; a failing build fails.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from radixrt.kernels import cpu_decode, cpu_extend
from radixrt.kernels.fp8 import dequantize_fp8, quantize_fp8
from tests import test_cpu_decode as dec
from tests import test_cpu_extend as ext

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None,
    reason="gcc not found on PATH: the CPU attention kernels are compiled with it",
)

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
QTYPES = [torch.bfloat16, torch.float32]


def quantized(
    k: torch.Tensor, v: torch.Tensor, fmt: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float8 codes of ``k`` / ``v`` ``[N, KVH, D]`` with random power-of-two scales (K per channel, V per
    head; e5m2 unscaled, as the pool's), the scales, and the dequantized float32 pool."""
    g = torch.Generator().manual_seed(seed)
    _, KVH, D = k.shape
    ks = torch.exp2(torch.randint(-4, 3, (KVH, D), generator=g).float())
    vs = torch.exp2(torch.randint(-2, 3, (KVH,), generator=g).float())
    kq, vq = quantize_fp8(k.float() * ks, fmt, ks), quantize_fp8(v.float(), fmt, vs)
    return kq, vq, ks, vs, dequantize_fp8(kq) * ks, dequantize_fp8(vq) * vs[:, None]


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qtype", QTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("seq_lens", [[1, 7, 64, 300], [2500], [0, 65, 129]], ids=["mixed", "long", "empty"])
@pytest.mark.parametrize(("H", "KVH", "D"), [(9, 3, 64), (8, 2, 128), (6, 2, 48), (4, 4, 80)])
def test_decode_matches_sdpa(
    fmt: torch.dtype, qtype: torch.dtype, seq_lens: list[int], H: int, KVH: int, D: int, threads: int
) -> None:
    q, k_buf, v_buf, table, lens = dec.make_case(seq_lens, H, KVH, D, torch.float32, seed=D)
    kq, vq, ks, vs, kf, vf = quantized(k_buf, v_buf, fmt, seed=D)
    q = q.to(qtype)
    out = cpu_decode.paged_decode_attention(q, kq, vq, table, lens, D**-0.5, k_scale=ks, v_scale=vs)
    dec.check(out, dec.reference(q, kf, vf, table, lens, D**-0.5), qtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [1, 50, 1000])
def test_decode_sliding_window_and_per_head_scales(fmt: torch.dtype, window: int) -> None:
    """A ``[KVH]`` K scale is one scale per head; a sliding window reads only the last positions."""
    q, k_buf, v_buf, table, lens = dec.make_case([1, 90, 1500], 12, 3, 64, torch.float32, seed=3)
    ks, vs = torch.tensor([0.5, 2.0, 8.0]), torch.tensor([1.0, 0.25, 4.0])
    kq, vq = quantize_fp8(k_buf, fmt, ks), quantize_fp8(v_buf, fmt, vs)
    kf, vf = dequantize_fp8(kq) * ks[:, None], dequantize_fp8(vq) * vs[:, None]
    out = cpu_decode.paged_decode_attention(q, kq, vq, table, lens, 0.2, window, k_scale=ks, v_scale=vs)
    dec.check(out, dec.reference(q, kf, vf, table, lens, 0.2, window), torch.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qtype", QTYPES, ids=["bf16", "fp32"])
def test_every_finite_code_widens_exactly(fmt: torch.dtype, qtype: torch.dtype) -> None:
    """One position per request: the output is its V row, i.e. every code (subnormals, zeros of both signs,
    the largest finite values) widened and scaled, bit for bit, by both kernels, with a float32 or a bf16
    query (every code times a power of two is exact in bf16, so a bf16 output is exact too)."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(fmt).float())]
    D, n = 32, -(-finite.numel() // 32)
    rows = torch.zeros(n * D, dtype=torch.uint8)
    rows[: finite.numel()] = finite
    vq = rows.view(n, 1, D).view(fmt)
    kq = torch.zeros_like(vq)
    vs = torch.tensor([2.0**-5])
    want = dequantize_fp8(vq)[:, 0] * vs
    table, lens = torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64)
    q = torch.randn(n, 2, D).to(qtype)
    got = cpu_decode.paged_decode_attention(q, kq, vq, table, lens, 1.0, v_scale=vs).float()
    assert torch.equal(got[:, 0], want) and torch.equal(got[:, 1], want)
    qo = torch.arange(n + 1)
    got = cpu_extend.paged_extend_attention(q, kq, vq, table, qo, lens, 1.0, v_scale=vs).float()
    assert torch.equal(got[:, 0], want) and torch.equal(got[:, 1], want)


@pytest.mark.parametrize("qtype", QTYPES, ids=["bf16", "fp32"])
def test_every_finite_key_code_scores_exactly(qtype: torch.dtype) -> None:
    """Every finite e4m3 code as a key: query head h is one-hot at channel h, so its score is exactly that
    channel's code times its (power-of-two) K scale; against a zero key and V rows +1 / -1 the output is
    tanh(score / 2), which a misread code (a subnormal taken as zero or as twice its value, a lost sign)
    moves by far more than the output's rounding."""
    fmt = torch.float8_e4m3fn
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(fmt).float())]
    D = 32
    n = -(-finite.numel() // D)
    keys = torch.zeros(n * D, dtype=torch.uint8)
    keys[: finite.numel()] = finite
    kq = torch.zeros(2 * n, 1, D, dtype=torch.uint8)
    kq[0::2, 0] = keys.view(n, D)  # slot 2r: the codes; slot 2r + 1: a zero key
    kq = kq.view(fmt)
    vq = torch.ones(2 * n, 1, D).to(fmt)
    vq[1::2] = torch.tensor(-1.0).to(fmt)
    ks = torch.exp2(torch.arange(D) % 5 - 2.0).float()[None]  # [1, D] per channel: 1/4 .. 4
    vs = torch.ones(1)
    q = torch.eye(D)[None].expand(n, D, D).contiguous().to(qtype)  # head h one-hot at channel h
    table, lens = torch.arange(2 * n).view(n, 2), torch.full((n,), 2, dtype=torch.int64)
    got = cpu_decode.paged_decode_attention(q, kq, vq, table, lens, 1.0, k_scale=ks, v_scale=vs).float()
    kf = dequantize_fp8(kq) * ks
    want = torch.tanh((kf[0::2, 0, None, :] * torch.eye(D)).sum(-1)[..., None] / 2).expand(n, D, D)
    # rtol: the bf16 output's rounding (2^-8 relative), or float32's of 1 - p near p = 1 (the smallest scores);
    # far below a misread code's error (a factor of 2 or more)
    rtol = 2**-8 if qtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-30)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qtype", QTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(ext.SHAPES))
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize(("H", "KVH"), [(9, 3), (8, 2)], ids=["gqa3", "gqa4"])
def test_extend_matches_sdpa(
    fmt: torch.dtype, qtype: torch.dtype, shape: str, page_size: int, H: int, KVH: int
) -> None:
    q, k_buf, v_buf, table, qo, lens = ext.make_case(*ext.SHAPES[shape], H, KVH, 64, torch.float32, page_size)
    kq, vq, ks, vs, kf, vf = quantized(k_buf, v_buf, fmt)
    q = q.to(qtype)
    out = cpu_extend.paged_extend_attention(q, kq, vq, table, qo, lens, 0.125, k_scale=ks, v_scale=vs)
    ext.check(out, (q, kf, vf, table, qo, lens), 0.125, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
def test_chunked_extend_equals_one_pass(fmt: torch.dtype, page_size: int) -> None:
    """A 700-token prompt extended in chunks of 160 over the float8 K/V of the chunks before gives what one
    causal pass gives, and both the SDPA answer over the dequantized pool; odd head dims (48, 17) too."""
    for D in (64, 48, 17):
        q, k_buf, v_buf, table, _, _ = ext.make_case([0], [700], 9, 3, D, torch.float32, page_size, seed=D)
        kq, vq, ks, vs, kf, vf = quantized(k_buf, v_buf, fmt, seed=D)
        full = (torch.tensor([0, 700]), torch.tensor([700]))
        whole = cpu_extend.paged_extend_attention(q, kq, vq, table, *full, 0.125, k_scale=ks, v_scale=vs)
        chunks = []
        for start in range(0, 700, 160):
            end = min(start + 160, 700)
            qo, seq = torch.tensor([0, end - start]), torch.tensor([end])
            chunks.append(
                cpu_extend.paged_extend_attention(
                    q[start:end], kq, vq, table, qo, seq, 0.125, k_scale=ks, v_scale=vs
                )
            )
        torch.testing.assert_close(torch.cat(chunks), whole, rtol=2e-5, atol=3e-6)
        ext.check(whole, (q, kf, vf, table, *full), 0.125, atol=1e-5)


def test_portable_build_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain GNU C build (-DPAGED_PORTABLE) reads float8 the same way."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        cpu_decode, "_kernels", cpu_decode.load_library((*cpu_decode.FLAGS, "-DPAGED_PORTABLE"))
    )
    for fmt in FORMATS:
        for qtype in QTYPES:
            q, k_buf, v_buf, table, lens = dec.make_case([1, 90, 1500], 12, 3, 48, torch.float32)
            kq, vq, ks, vs, kf, vf = quantized(k_buf, v_buf, fmt)
            out = cpu_decode.paged_decode_attention(
                q.to(qtype), kq, vq, table, lens, 0.2, 700, k_scale=ks, v_scale=vs
            )
            dec.check(out, dec.reference(q.to(qtype), kf, vf, table, lens, 0.2, 700), qtype)
            case = ext.make_case([0, 90, 1500], [100, 20, 150], 12, 3, 80, torch.float32, page_size=16)
            kq, vq, ks, vs, kf, vf = quantized(case[1], case[2], fmt)
            qx = case[0].to(qtype)
            out = cpu_extend.paged_extend_attention(qx, kq, vq, *case[3:], 0.2, 33, k_scale=ks, v_scale=vs)
            ext.check(out, (qx, kf, vf, *case[3:]), 0.2, 33, exact_bf16=True, atol=1e-5)


def test_bad_scales_raise_value_error() -> None:
    q, k_buf, v_buf, table, lens = dec.make_case([5, 9], 4, 2, 16, torch.float32)
    kq, vq = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
    qo = torch.tensor([0, 1, 2])
    for fn, args in (
        (cpu_decode.paged_decode_attention, (q, kq, vq, table, lens, 0.25)),
        (cpu_extend.paged_extend_attention, (q.view(-1, 4, 16)[:2], kq, vq, table, qo, lens, 0.25)),
    ):
        with pytest.raises(ValueError, match="k_scale shape"):
            fn(*args, k_scale=torch.ones(2, 8))
        with pytest.raises(ValueError, match="v_scale must be a float32"):
            fn(*args, v_scale=torch.ones(2, dtype=torch.float64))
        with pytest.raises(ValueError, match="float8 buffers only"):
            fn(args[0], k_buf, v_buf, *args[3:], k_scale=torch.ones(2))
        with pytest.raises(ValueError, match="v_buf dtype"):
            fn(args[0], kq, v_buf, *args[3:])
