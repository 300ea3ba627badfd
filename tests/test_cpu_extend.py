"""The CPU paged extend kernel (radixrt/kernels/cpu_extend.py) against SDPA over gathered K/V.

The reference gathers each request's K/V rows through its slots, widens them to float32 and runs
``F.scaled_dot_product_attention`` with the causal (and sliding-window) mask of its new tokens. fp32 outputs
must match it closely. bf16 outputs with the AVX512-BF16 path round the probabilities to bf16 before ``P V``
(as torch's bf16 flash attention does), so each output may differ from the float32 result by the two bf16
roundings: at most ``2^-8`` of the attention-weighted mean of ``|v|`` (P) plus ``2^-8`` of ``|out|`` (the output);
the portable build (bf16 widened to fp32 throughout) must equal the rounded float32 result almost everywhere.
Engine tests: fp32 greedy ids equal HF transformers with the kernel on (and it ran).
Skipped only when gcc is missing (the kernel is compiled on first use); a failing build fails.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_decode, cpu_extend
from radixrt.kernels.base import AttentionMetadata, ForwardMode
from radixrt.kernels.torch_native import (
    AMX_C_EXTEND_MAX,
    C_EXTEND_ALWAYS,
    EXTEND_KERNEL_ENV,
    TorchNativeBackend,
    extend_kernel_max_tokens,
)
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None,
    reason="gcc not found on PATH: the CPU attention kernels are compiled with it",
)

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slot_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    absolute: bool = False,
) -> torch.Tensor:
    """Float64 causal attention of each request's new tokens (over ``|v|`` when ``absolute``)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        L, lo, hi = int(seq_lens[b]), int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        idx = slot_table[b, :L]
        keys = k_buf[idx].double().transpose(0, 1)  # [KVH, L, D]
        values = v_buf[idx].double().transpose(0, 1)
        if absolute:
            values = values.abs()
        q_pos = torch.arange(L - (hi - lo), L)[:, None]
        k_pos = torch.arange(L)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        queries = q[lo:hi].double().transpose(0, 1)  # [H, n, D]
        att = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[lo:hi] = att.transpose(0, 1)
    return out


def make_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    H: int,
    KVH: int,
    D: int,
    dtype: torch.dtype,
    page_size: int = 1,
    q_scale: float = 1.0,
    seed: int = 0,
) -> Case:
    """q, k_buf, v_buf, slot_table, qo_indptr, seq_lens: each request owns whole pages of the pool in a
    random order (slot = page * page_size + offset); table entries past seq_lens are out of range."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages = [(L + page_size - 1) // page_size for L in seq_lens]
    num_pages = sum(pages) + 3
    num_slots = num_pages * page_size
    k_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    q = (torch.randn(sum(extend_lens), H, D, generator=g) * q_scale).to(dtype)
    order = torch.randperm(num_pages - 1, generator=g) + 1  # page 0 stays the padding page
    table = torch.full((len(seq_lens), max(seq_lens, default=0) + 5), -12345, dtype=torch.int64)
    used = 0
    for b, (L, n) in enumerate(zip(seq_lens, pages, strict=True)):
        slots = (order[used : used + n, None] * page_size + torch.arange(page_size)).reshape(-1)
        table[b, :L] = slots[:L]
        used += n
    qo_indptr = torch.tensor([0, *torch.tensor(extend_lens, dtype=torch.int64).cumsum(0).tolist()])
    return q, k_buf, v_buf, table, qo_indptr, torch.tensor(seq_lens, dtype=torch.int64)


def dpbf16_kernel() -> bool:
    """Whether the default build takes the AVX512-BF16 path (P rounded to bf16)."""
    with open("/proc/cpuinfo") as f:
        return "avx512_bf16" in f.read()


def check(
    out: torch.Tensor,
    case: Case,
    scale: float,
    window: int | None = None,
    exact_bf16: bool = False,
    atol: float = 3e-6,
) -> None:
    q = case[0]
    ref = reference(*case, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=atol)
        return
    got = out.double()
    if exact_bf16 or not dpbf16_kernel():
        rounded = ref.to(torch.bfloat16).double()
        torch.testing.assert_close(got, rounded, rtol=2**-7, atol=1e-6)
        exact = (got == rounded).float().mean().item()
        assert exact > 0.99, f"only {exact:.4f} of the bf16 outputs equal the rounded float32 reference"
        return
    bound = 2**-8 * (reference(*case, scale, window, absolute=True) + ref.abs()) * 1.01 + 1e-6
    err = (got - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"a bf16 output is off by {worst:.2f}x the bound of its two roundings"
    # typical errors are far below the worst case (a systematic bias would not be)
    assert err.mean().item() < 0.25 * bound.mean().item()


DTYPES = [torch.bfloat16, torch.float32]
SHAPES = {
    "long_prefix": ([3000], [256]),
    "prefill": ([0], [300]),
    "mixed": ([0, 50, 700, 1200, 5], [130, 17, 100, 1, 64]),
    "short": ([9], [20]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize(("H", "KVH"), [(4, 4), (9, 3), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
def test_matches_sdpa(dtype: torch.dtype, shape: str, page_size: int, H: int, KVH: int, threads: int) -> None:
    prefix, extend = SHAPES[shape]
    case = make_case(prefix, extend, H, KVH, 64, dtype, page_size=page_size, seed=H + page_size)
    check(cpu_extend.paged_extend_attention(*case, 0.125), case, 0.125)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [48, 128, 16, 80, 17], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("H", "KVH"), [(6, 2), (10, 2), (16, 2)], ids=["gqa3", "gqa5", "gqa8"])
def test_head_dims_and_group_sizes(dtype: torch.dtype, D: int, H: int, KVH: int) -> None:
    case = make_case([0, 333, 40], [70, 45, 1], H, KVH, D, dtype, page_size=16, seed=D + H)
    scale = D**-0.5
    check(cpu_extend.paged_extend_attention(*case, scale), case, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [1, 50, 64, 1000, 5000])
def test_sliding_window(dtype: torch.dtype, window: int, threads: int) -> None:
    case = make_case([0, 40, 1500, 3000], [90, 64, 200, 33], 9, 3, 64, dtype, seed=window)
    out = cpu_extend.paged_extend_attention(*case, 0.125, window=window)
    check(out, case, 0.125, window)
    if window >= 3300:  # a window covering everything is no window
        assert torch.equal(out, cpu_extend.paged_extend_attention(*case, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
def test_chunked_extend_equals_one_pass(dtype: torch.dtype, page_size: int) -> None:
    """A 700-token prompt extended in chunks of 160 (each over the K/V of the chunks before) gives what one
    causal pass over the whole prompt gives."""
    q, k_buf, v_buf, table, _, _ = make_case([0], [700], 9, 3, 64, dtype, page_size=page_size, seed=5)
    whole = cpu_extend.paged_extend_attention(
        q, k_buf, v_buf, table, torch.tensor([0, 700]), torch.tensor([700]), 0.125
    )
    chunks = []
    for start in range(0, 700, 160):
        end = min(start + 160, 700)
        qo, lens = torch.tensor([0, end - start]), torch.tensor([end])
        chunks.append(cpu_extend.paged_extend_attention(q[start:end], k_buf, v_buf, table, qo, lens, 0.125))
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=2e-5, atol=3e-6)
    check(whole, (q, k_buf, v_buf, table, torch.tensor([0, 700]), torch.tensor([700])), 0.125)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_sharp_softmax_and_contiguous_slots(dtype: torch.dtype, threads: int) -> None:
    """Large scores (the running max moves a lot between tiles) over sequential slots. Scores reach ~40
    here, so rounding them to fp32 alone moves outputs by ~1e-5 (SDPA in fp32 is off by as much)."""
    q, k_buf, v_buf, _, qo, lens = make_case([2500, 130], [100, 77], 9, 3, 64, dtype, q_scale=8.0)
    table = torch.full((2, 2700), -1, dtype=torch.int64)
    table[0, :2600] = torch.arange(1, 2601)
    table[1, :207] = torch.arange(2601, 2808)
    case = (q, k_buf, v_buf, table, qo, lens)
    check(cpu_extend.paged_extend_attention(*case, 0.125), case, 0.125, atol=3e-5)


def test_views_out_and_empty_requests() -> None:
    """A row-strided q (a fused-QKV view), a row-strided slot table, out=, and requests without new
    tokens (left untouched) or with nothing at all."""
    H, KVH, D = 9, 3, 64
    q, k_buf, v_buf, table, qo, lens = make_case([5, 30, 1200, 0], [40, 0, 70, 0], H, KVH, D, torch.bfloat16)
    T = q.shape[0]
    qkv = torch.randn(T, (H + 2 * KVH) * D).bfloat16()
    qkv[:, : H * D] = q.reshape(T, H * D)
    q_view = qkv[:, : H * D].view(T, H, D)
    assert not q_view.is_contiguous()
    wide = torch.full((4, table.shape[1] + 100), -1, dtype=torch.int64)
    wide[:, : table.shape[1]] = table
    table_view = wide[:, : table.shape[1]]
    out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16)
    got = cpu_extend.paged_extend_attention(q_view, k_buf, v_buf, table_view, qo, lens, 0.125, out=out)
    assert got is out
    check(out, (q, k_buf, v_buf, table, qo, lens), 0.125)
    nothing = torch.tensor([0, 0, 0])
    empty = cpu_extend.paged_extend_attention(q[:0], k_buf, v_buf, table[:2], nothing, lens[:2], 0.125)
    assert empty.shape == (0, H, D)


def test_portable_build_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain GNU C build (-DPAGED_PORTABLE: no AVX-512 intrinsics, bf16 widened to fp32) gives the
    float32 answer: fp32 closely, bf16 rounded once."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    lib = cpu_decode.load_library((*cpu_decode.FLAGS, "-DPAGED_PORTABLE"))
    monkeypatch.setattr(cpu_decode, "_kernels", lib)
    for dtype in DTYPES:
        for D, window in ((64, None), (48, 700), (17, 33)):
            case = make_case([0, 90, 1500], [100, 20, 150], 12, 3, D, dtype, page_size=16, seed=D)
            out = cpu_extend.paged_extend_attention(*case, 0.2, window=window)
            check(out, case, 0.2, window, exact_bf16=True)


def _args(**changes: object) -> dict[str, object]:
    q, k_buf, v_buf, table, qo, lens = make_case([10, 20], [5, 7], 9, 3, 64, torch.bfloat16)
    args: dict[str, object] = dict(
        q=q, k_buf=k_buf, v_buf=v_buf, slot_table=table, qo_indptr=qo, seq_lens=lens, scale=0.125, window=None
    )
    args.update(changes)
    return args


def _bad_inputs() -> list[tuple[str, dict[str, object]]]:
    q, k_buf, v_buf, table, qo, lens = make_case([10, 20], [5, 7], 9, 3, 64, torch.bfloat16)
    bad_slot = table.clone()
    bad_slot[1, 3] = k_buf.shape[0]
    return [
        ("q", _args(q=q.half())),
        ("q", _args(q=q[0])),
        ("q", _args(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("q", _args(q="not a tensor")),
        ("k_buf", _args(k_buf=k_buf.float())),
        ("k_buf", _args(k_buf=k_buf[:, :2].contiguous(), v_buf=v_buf[:, :2].contiguous())),  # 9 % 2
        ("v_buf", _args(v_buf=v_buf[:-1].contiguous())),
        ("slot_table", _args(slot_table=table.int())),
        ("slot_table", _args(slot_table=table.t().contiguous().t())),
        ("slot_table", _args(slot_table=bad_slot)),
        ("qo_indptr", _args(qo_indptr=qo[:2])),
        ("qo_indptr", _args(qo_indptr=qo.int())),
        ("qo_indptr", _args(qo_indptr=torch.tensor([0, 7, 5]))),  # decreasing
        ("qo_indptr", _args(qo_indptr=torch.tensor([0, 5, 13]))),  # past q's 12 rows
        ("seq_lens", _args(seq_lens=lens[:1])),
        ("seq_lens", _args(seq_lens=torch.tensor([4, 27]))),  # fewer positions than new tokens
        ("seq_lens", _args(seq_lens=torch.tensor([15, table.shape[1] + 1]))),
        ("window", _args(window=-3)),
    ]


@pytest.mark.parametrize(("name", "args"), _bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_value_error(name: str, args: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=name):
        cpu_extend.paged_extend_attention(**args)  # type: ignore[arg-type]


# -- the Engine: the kernel runs every extend above SMALL_EXTEND tokens ---------------------------------------
@pytest.fixture
def extend_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the kernel's calls (the new tokens of each) while the test runs."""
    calls: list[int] = []
    real = cpu_extend.paged_extend_attention

    def counting(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_extend, "paged_extend_attention", counting)
    return calls


GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
def test_engine_greedy_equals_hf(
    tiny_llama: Path, page_size: int, engine_factory, extend_calls: list[int]
) -> None:
    """fp32: prompts of different lengths in one batch, chunked prefill, then requests that extend a cached
    system prompt: greedy ids equal HF's."""
    eng = engine_factory(tiny_llama, page_size=page_size, chunked_prefill_size=96)
    rng = random.Random(7)
    system = [rng.randrange(10, 8000) for _ in range(150)]
    prompts = prompts_of([40, 230, 17], seed=8) + [system + prompts_of([30], seed=9)[0]]
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [system + q for q in prompts_of([25, 60], seed=10)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs[-2:]) >= 2 * (150 // page_size * page_size)
    for ids, out in zip(prompts + followups, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    assert extend_calls and max(extend_calls) > 16


def test_engine_sliding_window_equals_hf(
    checkpoints_dir: Path, engine_factory, extend_calls: list[int]
) -> None:
    """A Mistral with an 8-token sliding window: long prompts, chunked, equal HF's greedy ids."""
    path = make_checkpoint(
        checkpoints_dir / "extend_swa", arch="mistral", size="tiny", seed=6, sliding_window=8
    )
    eng = engine_factory(path, chunked_prefill_size=64)
    prompts = prompts_of([150, 45], seed=11)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
    assert extend_calls


def test_extend_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXRT_CPU_EXTEND_KERNEL picks the extend path; auto follows the CPU (the C kernel on AVX2 and AVX-512,
    only up to AMX_C_EXTEND_MAX new tokens of a batch of requests where AMX runs SDPA, never without AVX2) and
    the backend routes each forward by its longest extend; a bad value is a ValueError naming the variable."""
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "sdpa")
    assert extend_kernel_max_tokens() == 0
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "C")
    assert extend_kernel_max_tokens() == C_EXTEND_ALWAYS
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert extend_kernel_max_tokens() == 0
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert extend_kernel_max_tokens() == C_EXTEND_ALWAYS
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert extend_kernel_max_tokens() == C_EXTEND_ALWAYS
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert extend_kernel_max_tokens() == AMX_C_EXTEND_MAX
    pool = KVPool(256, 1, 2, 16, torch.float32)
    backend = TorchNativeBackend(pool, 4, 2, 16, 0.25)
    assert backend.use_extend_kernel == cpu_decode.available()
    for n, batch, c_kernel in (
        (AMX_C_EXTEND_MAX, 2, True),
        (AMX_C_EXTEND_MAX + 1, 2, False),
        (AMX_C_EXTEND_MAX, 1, False),  # one request: the split path at any length where AMX runs SDPA
    ):
        md = AttentionMetadata(
            mode=ForwardMode.EXTEND,
            qo_indptr=torch.arange(batch + 1) * n,
            kv_indptr=torch.arange(batch + 1) * n,
            kv_indices=torch.arange(1, batch * n + 1),
            kv_last_page_len=torch.ones(batch, dtype=torch.int64),
            page_size=1,
            prefix_lens=torch.zeros(batch, dtype=torch.int64),
            seq_lens=torch.full((batch,), n),
            out_cache_loc=torch.arange(1, batch * n + 1),
            max_extend_len=n,
            max_seq_len=n,
            slot_table=torch.arange(1, batch * n + 1).reshape(batch, n),
        )
        backend.init_forward_metadata(md)
        assert backend._extend_kernel == (c_kernel and cpu_decode.available()), (n, batch)
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=EXTEND_KERNEL_ENV):
        extend_kernel_max_tokens()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extends_apart_match_the_masked_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch the C kernel does not take (AMX, past AMX_C_EXTEND_MAX tokens) runs request by request: over
    a prefix that is one slot run (read in place), a scattered prefix, and nothing cached; the output equals
    the gather + masked SDPA reference backend's."""
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    g = torch.Generator().manual_seed(3)
    H, KVH, D = 6, 2, 32
    pool = KVPool(1024, 1, KVH, D, dtype)
    fast = TorchNativeBackend(pool, H, KVH, D, D**-0.5)
    ref = TorchNativeBackend(pool, H, KVH, D, D**-0.5, use_decode_kernel=False)
    prefixes, news = [120, 0, 75], [AMX_C_EXTEND_MAX + 9, 60, 17]
    run = torch.arange(300, 300 + prefixes[0] + news[0])  # one ascending run of slots
    scattered = torch.randperm(280, generator=g)[: prefixes[2] + news[2]] + 1
    fresh = torch.arange(600, 600 + news[1])
    tables = [run, fresh, scattered]
    for t, p in zip(tables, prefixes, strict=True):  # the cached prefixes' K/V
        pool.set_kv(0, t[:p], torch.randn(p, KVH, D, generator=g), torch.randn(p, KVH, D, generator=g))
    width = max(len(t) for t in tables)
    slot_table = torch.zeros(3, width, dtype=torch.int64)
    for r, t in enumerate(tables):
        slot_table[r, : len(t)] = t
    qo = torch.tensor([0, *torch.cumsum(torch.tensor(news), 0).tolist()])
    seq = torch.tensor([p + n for p, n in zip(prefixes, news, strict=True)])
    md = AttentionMetadata(
        mode=ForwardMode.EXTEND,
        qo_indptr=qo,
        kv_indptr=torch.tensor([0, *torch.cumsum(seq, 0).tolist()]),
        kv_indices=torch.cat(tables),
        kv_last_page_len=torch.ones(3, dtype=torch.int64),
        page_size=1,
        prefix_lens=torch.tensor(prefixes),
        seq_lens=seq,
        out_cache_loc=torch.cat([t[p:] for t, p in zip(tables, prefixes, strict=True)]),
        max_extend_len=max(news),
        max_seq_len=int(seq.max()),
        slot_table=slot_table,
    )
    T = int(qo[-1])
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, KVH, D, generator=g).to(dtype)
    v = torch.randn(T, KVH, D, generator=g).to(dtype)
    fast.init_forward_metadata(md)
    assert fast._requests is not None and not fast._extend_kernel
    assert isinstance(fast._requests[0][2], slice) and fast._requests[1][2] is None
    assert isinstance(fast._requests[2][2], torch.Tensor)
    got = fast.forward(q, k, v, 0, md)
    ref.init_forward_metadata(md)
    assert ref._requests is None
    want = ref.forward(q, k, v, 0, md)
    tol = {"rtol": 2e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(got.float(), want.float(), **tol)
