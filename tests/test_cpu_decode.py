"""The CPU paged decode kernel (radixrt/kernels/cpu_decode.py) against SDPA over gathered K/V.

The reference gathers each request's K/V rows through its slots, widens them to float32 and runs
``F.scaled_dot_product_attention``; bf16 outputs must equal that float32 result rounded to bf16 (up to
one bf16 ulp where the float32 sums differ in their last bits), fp32 outputs must match it closely.
Skipped only when gcc is missing (the kernel is compiled on first use); a failing build fails.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_decode

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="gcc not found on PATH: the CPU decode kernel is compiled with it"
)


def reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Float32 attention over the gathered K/V of each request (zeros for an empty request)."""
    B, H, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(B):
        L = int(seq_lens[b])
        start = max(0, L - window) if window else 0
        if L == 0:
            continue
        idx = slot_table[b, start:L]
        keys = k_buf[idx].float().transpose(0, 1)  # [KVH, n, D]
        values = v_buf[idx].float().transpose(0, 1)
        queries = q[b].float()[:, None, :]  # [H, 1, D]
        out[b] = F.scaled_dot_product_attention(queries, keys, values, scale=scale, enable_gqa=True)[:, 0]
    return out


def make_case(
    seq_lens: list[int],
    H: int,
    KVH: int,
    D: int,
    dtype: torch.dtype,
    contiguous_slots: bool = False,
    q_scale: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k_buf, v_buf, slot_table, seq_lens; table entries past seq_lens are out-of-range garbage."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    num_slots = sum(seq_lens) + 37
    k_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    q = (torch.randn(B, H, D, generator=g) * q_scale).to(dtype)
    order = torch.arange(1, num_slots) if contiguous_slots else torch.randperm(num_slots - 1, generator=g) + 1
    table = torch.full((B, max(seq_lens) + 5), -12345, dtype=torch.int64)  # never read: out of range
    offset = 0
    for b, L in enumerate(seq_lens):
        table[b, :L] = order[offset : offset + L]
        offset += L
    return q, k_buf, v_buf, table, torch.tensor(seq_lens, dtype=torch.int64)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
        return
    rounded = ref.to(torch.bfloat16).float()
    got = out.float()
    # within one bf16 ulp of the rounded reference, and equal to it almost everywhere
    torch.testing.assert_close(got, rounded, rtol=2**-7, atol=1e-6)
    exact = (got == rounded).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of the bf16 outputs equal the rounded float32 reference"


def test_available() -> None:
    assert cpu_decode.available(), cpu_decode.unavailable_reason()
    assert cpu_decode.unavailable_reason() is None


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [2048], [700, 1, 65], [3, 64, 128, 1300, 200, 17, 63, 900]],
    ids=["b1_len1", "b1_len2048", "b3", "b8"],
)
@pytest.mark.parametrize(("H", "KVH"), [(4, 4), (9, 3), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
def test_matches_sdpa(dtype: torch.dtype, seq_lens: list[int], H: int, KVH: int, threads: int) -> None:
    q, k_buf, v_buf, table, lens = make_case(seq_lens, H, KVH, 64, dtype)
    out = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.125)
    check(out, reference(q, k_buf, v_buf, table, lens, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [48, 128, 16, 80, 40], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(("H", "KVH"), [(6, 2), (10, 2), (16, 2)], ids=["gqa3", "gqa5", "gqa8"])
def test_head_dims_and_group_sizes(dtype: torch.dtype, D: int, H: int, KVH: int, threads: int) -> None:
    q, k_buf, v_buf, table, lens = make_case([1, 333, 1100], H, KVH, D, dtype, seed=D + H)
    scale = D**-0.5
    out = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, scale)
    check(out, reference(q, k_buf, v_buf, table, lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [1, 50, 64, 1000, 5000])
def test_sliding_window(dtype: torch.dtype, window: int, threads: int) -> None:
    q, k_buf, v_buf, table, lens = make_case([1, 40, 64, 1500, 3000], 9, 3, 64, dtype, seed=window)
    out = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.125, window=window)
    check(out, reference(q, k_buf, v_buf, table, lens, 0.125, window), dtype)
    if window >= 3000:  # a window covering everything is no window
        assert torch.equal(out, cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_sharp_softmax_and_contiguous_slots(dtype: torch.dtype, threads: int) -> None:
    """Large scores (the running max moves a lot between blocks) over sequential slots."""
    q, k_buf, v_buf, table, lens = make_case([2500, 130], 9, 3, 64, dtype, contiguous_slots=True, q_scale=8.0)
    out = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.125)
    check(out, reference(q, k_buf, v_buf, table, lens, 0.125), dtype)


def test_views_out_and_empty_requests() -> None:
    """A row-strided q (a fused-QKV view), a row-strided slot table, out=, and seq_len 0 -> zeros."""
    H, KVH, D = 9, 3, 64
    q, k_buf, v_buf, table, lens = make_case([5, 0, 1200, 0], H, KVH, D, torch.bfloat16)
    qkv = torch.randn(4, (H + 2 * KVH) * D).bfloat16()
    qkv[:, : H * D] = q.reshape(4, H * D)
    q_view = qkv[:, : H * D].view(4, H, D)
    assert not q_view.is_contiguous()
    wide = torch.full((4, table.shape[1] + 100), -1, dtype=torch.int64)
    wide[:, : table.shape[1]] = table
    table_view = wide[:, : table.shape[1]]
    out = torch.full((4, H, D), float("nan"), dtype=torch.bfloat16)
    got = cpu_decode.paged_decode_attention(q_view, k_buf, v_buf, table_view, lens, 0.125, out=out)
    assert got is out
    check(out, reference(q, k_buf, v_buf, table, lens, 0.125), torch.bfloat16)
    assert torch.equal(out[1], torch.zeros(H, D, dtype=torch.bfloat16))
    empty = cpu_decode.paged_decode_attention(q[:0], k_buf, v_buf, table[:0], lens[:0], 0.125)
    assert empty.shape == (0, H, D)


def test_portable_build_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build without the AVX512-BF16 dot products (-DPAGED_PORTABLE) gives the same answers.

    Two threads build it at once into a fresh cache dir: the rename makes that safe.
    """
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    flags = (*cpu_decode.FLAGS, "-DPAGED_PORTABLE")
    results: list[cpu_decode.Kernels] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(cpu_decode.load_library(flags))
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=build) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    built = list((tmp_path / "kernels").iterdir())
    assert [p.name for p in built] == [cpu_decode.library_path(flags=flags).name]  # no temp files left
    monkeypatch.setattr(cpu_decode, "_kernels", results[0])
    for dtype in DTYPES:
        q, k_buf, v_buf, table, lens = make_case([1, 90, 1500], 12, 3, 48, dtype)
        out = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.2, window=700)
        check(out, reference(q, k_buf, v_buf, table, lens, 0.2, 700), dtype)


def test_build_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("int paged_decode_bf16( {\n")
    monkeypatch.setattr(cpu_decode, "SOURCES", (broken,))
    with pytest.raises(cpu_decode.CpuDecodeUnavailable, match="compiling .*broken.c failed(.|\n)*error"):
        cpu_decode.load_library()
    monkeypatch.setattr(cpu_decode.shutil, "which", lambda name: None)
    with pytest.raises(cpu_decode.CpuDecodeUnavailable, match="gcc not found"):
        cpu_decode.load_library()


def _args(**changes: object) -> dict[str, object]:
    q, k_buf, v_buf, table, lens = make_case([10, 20], 9, 3, 64, torch.bfloat16)
    args: dict[str, object] = dict(
        q=q, k_buf=k_buf, v_buf=v_buf, slot_table=table, seq_lens=lens, scale=0.125, window=None
    )
    args.update(changes)
    return args


def _bad_inputs() -> list[tuple[str, dict[str, object]]]:
    q, k_buf, v_buf, table, lens = make_case([10, 20], 9, 3, 64, torch.bfloat16)
    bad_slot = table.clone()
    bad_slot[1, 3] = k_buf.shape[0]
    return [
        ("q", _args(q=q.half())),
        ("q", _args(q=q[0])),
        ("q", _args(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("q", _args(q=torch.empty(q.shape, dtype=q.dtype, device="meta"))),
        ("q", _args(q="not a tensor")),
        ("k_buf", _args(k_buf=k_buf.float())),
        ("k_buf", _args(k_buf=k_buf.transpose(0, 1).contiguous().transpose(0, 1))),
        ("k_buf", _args(k_buf=k_buf[:, :2].contiguous(), v_buf=v_buf[:, :2].contiguous())),  # 9 % 2
        ("k_buf", _args(k_buf=k_buf[..., :32].contiguous(), v_buf=v_buf[..., :32].contiguous())),
        ("v_buf", _args(v_buf=v_buf[:-1].contiguous())),
        ("v_buf", _args(v_buf=v_buf.float())),
        ("slot_table", _args(slot_table=table.int())),
        ("slot_table", _args(slot_table=table[:1])),
        ("slot_table", _args(slot_table=table.t().contiguous().t())),
        ("slot_table", _args(slot_table=bad_slot)),
        ("seq_lens", _args(seq_lens=lens.int())),
        ("seq_lens", _args(seq_lens=lens[:1])),
        ("seq_lens", _args(seq_lens=torch.tensor([10, table.shape[1] + 1]))),
        ("seq_lens", _args(seq_lens=torch.tensor([-1, 20]))),
        ("window", _args(window=-3)),
    ]


@pytest.mark.parametrize(("name", "args"), _bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_value_error(name: str, args: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=name):
        cpu_decode.paged_decode_attention(**args)  # type: ignore[arg-type]


def test_bad_out_raises_value_error() -> None:
    args = _args()
    q = args["q"]
    assert isinstance(q, torch.Tensor)
    for out in (
        torch.empty(q.shape),
        torch.empty(2, 9, 32, dtype=q.dtype),
        torch.empty(2, 64, 9, dtype=q.dtype).mT,
    ):
        with pytest.raises(ValueError, match="out"):
            cpu_decode.paged_decode_attention(**args, out=out)  # type: ignore[arg-type]
