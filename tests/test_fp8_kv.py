"""FP8 KV cache: the codec against torch's float8 casts, round-trip bounds, the attention backend against
attention over the dequantized values (centred keys against the keys themselves), and the engine against an
fp32-KV engine that stores exactly the values an fp8 pool would hand back (same outputs), plus the disk tier
across a restart in fp8."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixrt.kernels.base import ForwardMode
from radixrt.kernels.fp8 import dequantize_fp8, quantize_fp8, store_e4m3
from radixrt.kernels.torch_native import TorchNativeBackend
from radixrt.mem_cache.kv_pool import FP8_DTYPES, KVPool, kv_storage_dtype, pow2_scale
from radixrt.worker.model_runner import ForwardInput, ModelRunner
from tests.engine_fixtures import make_engine, prompts_of

FORMATS = list(FP8_DTYPES.values())
# (largest relative rounding error of a normal number, smallest normal) per format
BOUNDS = {torch.float8_e4m3fn: (2.0**-4, 2.0**-6), torch.float8_e5m2: (2.0**-3, 2.0**-14)}


@pytest.mark.parametrize("dtype", FORMATS)
def test_codec_is_torch_cast_bitwise(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    ref = codes.float()
    got = dequantize_fp8(codes)
    finite = ~torch.isnan(ref)
    assert torch.equal(got[finite], ref[finite])


@pytest.mark.parametrize("dtype", FORMATS)
def test_round_trip_bounds_and_saturation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, 2, 8, generator=g) * s for s in (1e-3, 0.1, 1.0, 30.0)])
    x[0, 0, 0], x[1, 1, 1] = 1e9, -1e9  # far past the format's range: saturate, never inf / NaN
    fmax = torch.finfo(dtype).max
    scale = None
    if dtype == torch.float8_e4m3fn:
        scale = pow2_scale(x[2:].abs().amax(dim=(0, 2)), fmax)
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), "scales are powers of two"
        assert (x[2:].abs().amax(dim=(0, 2)) * 4 / scale <= fmax).all()
    q = quantize_fp8(x, dtype, scale)
    assert q.dtype == dtype
    s = torch.ones(2) if scale is None else scale
    back = dequantize_fp8(q) * s[:, None]
    assert torch.isfinite(back).all()
    assert back[0, 0, 0] == fmax * s[0] and back[1, 1, 1] == -fmax * s[1]
    rel, min_normal = BOUNDS[dtype]
    y, b = x[2:], back[2:]
    normal = y.abs() >= min_normal * s[:, None]
    assert ((b - y).abs() <= rel * y.abs())[normal].all()
    # below the normal range the error is at most half the subnormal step
    step = min_normal * 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    assert ((b - y).abs() <= step / 2 * s[:, None])[~normal].all()
    assert torch.equal(q.view(torch.uint8), (x / s[:, None]).clamp(-fmax, fmax).to(dtype).view(torch.uint8))


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_c_store_is_the_torch_quantization_bitwise(src: torch.dtype) -> None:
    """The pool's one-call C store (centred, scaled, saturated, rounded to nearest-even) writes exactly the
    codes of the torch path, ties between codes, subnormals and values past the range included."""
    g = torch.Generator().manual_seed(3)
    KVH, D = 2, 16
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = torch.cat([(grid[:-1] + grid[1:]) / 2, -(grid[:-1] + grid[1:]) / 2])  # exact in bf16 too
    x = torch.cat([torch.randn(3000, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, 1e4)])
    x = torch.cat([ties, x, torch.tensor([1e30, -1e30, 0.0, -0.0])])
    x = x[: x.numel() // (KVH * D) * KVH * D].view(-1, KVH, D).to(src)
    k, v = x, x.flip(0)
    T = k.shape[0]
    k_scale = torch.exp2(torch.randint(-3, 3, (KVH, D), generator=g).float())
    k_offset = torch.randn(KVH, D, generator=g).to(src).float() * (torch.arange(D) % 2)  # half the channels 0
    v_scale = torch.tensor([0.5, 4.0])
    k_buf = torch.zeros(T + 7, KVH, D, dtype=torch.float8_e4m3fn)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(T + 7, generator=g)[:T]
    assert store_e4m3(k, v, k_scale, k_offset, v_scale, k_buf, v_buf, loc)
    want_k = quantize_fp8(k.float() - k_offset, torch.float8_e4m3fn, k_scale)
    want_v = quantize_fp8(v, torch.float8_e4m3fn, v_scale)
    assert torch.equal(k_buf[loc].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_buf[loc].view(torch.uint8), want_v.view(torch.uint8))
    with pytest.raises(IndexError):
        store_e4m3(k, v, k_scale, k_offset, v_scale, k_buf, v_buf, loc + 100)


def test_storage_dtype_names() -> None:
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert KVPool.bytes_per_token(2, 2, 8, torch.float8_e5m2) * 2 == KVPool.bytes_per_token(
        2, 2, 8, torch.bfloat16
    )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("int4", torch.float32)


# ---- the backend reads float8 exactly as the dequantized values ------------------------------------


def metadata(prefix_lens: list[int], extend_lens: list[int], page_size: int = 4) -> tuple[Any, int]:
    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    rows = torch.zeros(len(seq) + 1, max(seq) + page_size, dtype=torch.int64)
    start = 1
    for b, n in enumerate(seq):
        pages = -(-n // page_size)
        rows[b, : pages * page_size] = torch.arange(start * page_size, (start + pages) * page_size)
        start += pages
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        args=SimpleNamespace(page_size=page_size),
        req_to_token_pool=SimpleNamespace(req_to_token=rows),
    )
    mode = ForwardMode.DECODE if max(extend_lens) == 1 else ForwardMode.EXTEND
    fi = ForwardInput(mode, list(range(len(seq))), prefix_lens, extend_lens, [], torch.zeros(0))
    return ModelRunner.build_metadata(runner, fi), start * page_size  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize(
    "batch",
    [([0, 21, 40], [9, 5, 17]), ([3, 30, 64], [1, 1, 1]), ([0, 21, 40], [3, 5, 2])],
    ids=["extend", "decode", "short_extend"],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["c_kernels", "gather"])
def test_backend_attends_over_dequantized_kv(
    dtype: torch.dtype, batch: tuple[list[int], list[int]], kernel: bool
) -> None:
    """Through the C kernels (reading float8 in place) or the gather path, an fp8 pool attends exactly as an
    fp32 pool holding the dequantized values (the same path over fp32)."""
    H, KVH, D = 6, 2, 16
    md, num_slots = metadata(*batch)
    g = torch.Generator().manual_seed(1)
    fp8 = KVPool(num_slots, 1, KVH, D, torch.float32, store_dtype=dtype)
    if fp8.k_scale is not None and fp8.v_scale is not None:  # per channel: 0.25 or 2 times 1/2, 1 or 2
        fp8.k_scale[0] = torch.tensor([0.25, 2.0])[:, None] * torch.exp2(torch.arange(D) % 3 - 1.0)
        fp8.v_scale[0] = torch.tensor([1.0, 0.5])
    old_k, old_v = (
        torch.randn(num_slots, KVH, D, generator=g) * 3,
        torch.randn(num_slots, KVH, D, generator=g),
    )
    fp8.set_kv(0, torch.arange(num_slots), old_k, old_v)
    T = int(md.qo_indptr[-1])
    q, k, v = (
        torch.randn(T, H, D, generator=g),
        torch.randn(T, KVH, D, generator=g),
        torch.randn(T, KVH, D, generator=g),
    )
    out = run_backend(fp8, md, q, k, v, H, KVH, D, kernel)

    ref = KVPool(num_slots, 1, KVH, D, torch.float32)  # holds what the fp8 pool hands back, in fp32
    out_ref_kv = read_back(fp8, md.out_cache_loc, k, v)
    ref.k_buffers[0].copy_(read_back(fp8, torch.arange(num_slots), old_k, old_v)[0])
    ref.v_buffers[0].copy_(read_back(fp8, torch.arange(num_slots), old_k, old_v)[1])
    expected = run_backend(ref, md, q, *out_ref_kv, H, KVH, D, kernel)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # and the new tokens were stored quantized
    stored = dequantize_fp8(fp8.k_buffers[0][md.out_cache_loc])
    scale = fp8.k_scale[0] if fp8.k_scale is not None else 1.0
    torch.testing.assert_close(stored * scale, out_ref_kv[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "batch",
    [([0, 21, 40], [9, 5, 17]), ([3, 30, 64], [1, 1, 1]), ([0, 21, 40], [3, 5, 2])],
    ids=["extend", "decode", "short_extend"],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["c_kernels", "gather"])
def test_centred_keys_attend_as_the_keys(batch: tuple[list[int], list[int]], kernel: bool) -> None:
    """An e4m3 pool with key offsets stores ``k - k_offset`` and attention needs no correction: it matches
    attention over the keys themselves (an fp32 pool holding the dequantized values plus the offset) up to
    float32 rounding, since softmax ignores the per-query shift ``q . k_offset`` only in exact arithmetic."""
    H, KVH, D = 6, 2, 16
    md, num_slots = metadata(*batch)
    g = torch.Generator().manual_seed(2)
    fp8 = KVPool(num_slots, 1, KVH, D, torch.float32, store_dtype=torch.float8_e4m3fn)
    assert fp8.k_offset is not None and fp8.k_scale is not None and fp8.v_scale is not None
    off = torch.randn(KVH, D, generator=g) * 4
    fp8.k_offset[0], fp8.k_scale[0], fp8.v_scale[0] = off, 2.0**-4, 2.0**-5
    old_k = torch.randn(num_slots, KVH, D, generator=g) * 3 + off
    fp8.set_kv(0, torch.arange(num_slots), old_k, torch.randn(num_slots, KVH, D, generator=g))
    T = int(md.qo_indptr[-1])
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, KVH, D, generator=g) * 3 + off, torch.randn(T, KVH, D, generator=g)
    out = run_backend(fp8, md, q, k, v, H, KVH, D, kernel)

    ref = KVPool(num_slots, 1, KVH, D, torch.float32)  # the uncentred keys the fp8 pool stands for
    ref.k_buffers[0].copy_(dequantize_fp8(fp8.k_buffers[0]) * fp8.k_scale[0] + off)
    ref.v_buffers[0].copy_(dequantize_fp8(fp8.v_buffers[0]) * fp8.v_scale[0][:, None])
    loc = md.out_cache_loc
    expected = run_backend(ref, md, q, ref.k_buffers[0][loc], ref.v_buffers[0][loc], H, KVH, D, kernel)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def read_back(
    pool: KVPool, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values ``pool`` returns for ``k``/``v`` stored at ``loc`` (quantized, dequantized)."""
    scales = pool.kv_scales(0)
    ks, vs = scales if scales is not None else (None, None)
    kq, vq = quantize_fp8(k, pool.dtype, ks), quantize_fp8(v, pool.dtype, vs)
    kb, vb = dequantize_fp8(kq), dequantize_fp8(vq)
    if ks is not None and vs is not None:
        kb, vb = kb * ks, vb * vs[:, None]  # K per channel [KVH, D], V per head [KVH]
    return kb, vb


def run_backend(
    pool: KVPool,
    md: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
    kernel: bool,
) -> torch.Tensor:
    backend = TorchNativeBackend(pool, H, KVH, D, D**-0.5, use_decode_kernel=kernel)
    assert backend.use_decode_kernel == kernel
    backend.init_forward_metadata(md)
    return backend.forward(q, k, v, 0, md)


# ---- the engine ----------------------------------------------------------------------------------


def fake_fp8(
    pool: KVPool,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_offset: torch.Tensor | None,
) -> None:
    """Make an fp32 pool store exactly what an fp8 pool with these scales and key offsets would hand back:
    the keys stay centred (``k - k_offset``, as the fp8 pool stores them). Adding the offset back would be
    the same attention only in exact arithmetic (softmax ignores the per-query shift ``q . k_offset``); in
    float32 the scores round differently, and the next layer's float8 rounding turns an ulp into a whole
    code step now and then (how often depends on the CPU's GEMM rounding). The shift itself is tested
    alone, in `test_centred_keys_attend_as_the_keys`."""
    original = pool.set_kv

    def set_kv(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        out = []
        off = 0.0 if k_offset is None else k_offset[layer_id]
        for x, scale, shift in ((k, k_scale, off), (v, v_scale, 0.0)):
            s = None if scale is None else scale[layer_id]
            y = dequantize_fp8(quantize_fp8(x - shift, dtype, s))
            out.append(y if s is None else y * (s if s.dim() == 2 else s[:, None]))
        original(layer_id, loc, out[0], out[1])

    pool.set_kv = set_kv  # type: ignore[method-assign]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_equals_fp32_kv_holding_the_fp8_values(
    tiny_llama: Path, engine_factory, kv_cache_dtype: str
) -> None:
    eng = engine_factory(tiny_llama, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=48)
    ref = engine_factory(tiny_llama, chunked_prefill_size=48)
    pool = eng.worker.scheduler.runner.kv_pool
    ref_pool = ref.worker.scheduler.runner.kv_pool
    assert pool.dtype == FP8_DTYPES[kv_cache_dtype] and pool.size_bytes * 4 == ref_pool.size_bytes
    if pool.k_scale is not None:  # calibrated per head, deterministic: a second engine gets the same
        assert torch.equal(pool.k_scale, make_engine_scales(tiny_llama, kv_cache_dtype))
    ref.worker.call(
        lambda s: fake_fp8(s.runner.kv_pool, pool.dtype, pool.k_scale, pool.v_scale, pool.k_offset)
    )
    if pool.k_offset is not None:  # centred keys: calibrated offsets, not all zero
        assert pool.k_offset.abs().amax() > 0
    system = prompts_of([60], seed=41)[0]
    prompts = [system + p for p in prompts_of([20, 35, 7], seed=42)]  # shared prefix: cache hits too
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    kw: dict[str, Any] = {"return_logprob": True, "logprob_start_len": 64}
    got = [eng.generate(input_ids=p, sampling_params=params, **kw) for p in prompts]
    want = [ref.generate(input_ids=p, sampling_params=params, **kw) for p in prompts]
    assert got[-1]["meta_info"]["cached_tokens"] == 60  # the shared prefix
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = torch.tensor([x[0] for x in a["meta_info"]["input_token_logprobs"][1:]])
        lb = torch.tensor([x[0] for x in b["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-4)


def make_engine_scales(path: Path, kv_cache_dtype: str) -> torch.Tensor:
    eng = make_engine(path, kv_cache_dtype=kv_cache_dtype)
    try:
        scale = eng.worker.scheduler.runner.kv_pool.k_scale
        assert scale is not None
        return scale.clone()
    finally:
        eng.shutdown()


def test_fp8_pages_persist_on_disk_across_a_restart(tiny_llama: Path, tmp_path: Path) -> None:
    ids = prompts_of([100], seed=43)[0]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outs = []
    for _ in range(2):
        eng = make_engine(
            tiny_llama,
            kv_cache_dtype="fp8_e4m3",
            enable_hierarchical_cache=True,
            hicache_storage_dir=str(tmp_path),
        )
        try:
            outs.append(eng.generate(input_ids=ids, sampling_params=params))
            eng.check_invariant()
        finally:
            eng.shutdown()
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[1]["meta_info"]["cached_tokens_details"]["disk"] == 96
