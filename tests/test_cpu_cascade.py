"""Cascade decode attention (radixrt/kernels/cpu_cascade.py): the plan against a naive search over the slot
tables, and the output (shared prefix through SDPA, suffixes through the C kernel, merged in C) against
float32 SDPA over each request's gathered K/V (`test_cpu_decode.reference`).

float32 must match closely; bf16 is within one bf16 ulp of the rounded float32 reference plus the prefix
part's own bf16 rounding (SDPA returns it in the query's dtype), so its bound is a little wider than the
plain kernel's. Skipped only when gcc is missing."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_cpu_decode import reference

from radixrt.kernels import cpu_cascade, cpu_decode

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="gcc not found on PATH: the CPU decode kernel is compiled with it"
)


def make_batch(
    prefix: int,
    suffixes: list[int],
    others: list[int],
    H: int,
    KVH: int,
    D: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k_buf, v_buf, slot_table, seq_lens: requests holding slots [1, 1 + prefix) then ``suffixes[i]``
    scattered slots of their own, then requests with ``others[j]`` scattered slots only (0: a padding row,
    slot 0, length 1); a sharing request's suffix includes its new token."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 1 + prefix + sum(suffixes) + sum(others) + 29
    k_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    free = (torch.randperm(num_slots - 1 - prefix, generator=g) + 1 + prefix).tolist()
    B = len(suffixes) + len(others)
    width = max([prefix + s for s in suffixes] + others + [1]) + 7
    table = torch.full((B, width), -777, dtype=torch.int64)  # out of range: never read
    lens = []
    for b, s in enumerate(suffixes):
        table[b, :prefix] = torch.arange(1, 1 + prefix)
        table[b, prefix : prefix + s] = torch.tensor(free[:s], dtype=torch.int64)
        free = free[s:]
        lens.append(prefix + s)
    for j, n in enumerate(others):
        b = len(suffixes) + j
        if n == 0:
            table[b, 0] = 0
            lens.append(1)
        else:
            table[b, :n] = torch.tensor(free[:n], dtype=torch.int64)
            free = free[n:]
            lens.append(n)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, k_buf, v_buf, table, torch.tensor(lens, dtype=torch.int64)


def naive_plan(table: torch.Tensor, lens: torch.Tensor, min_positions: int) -> tuple[int, list[bool]] | None:
    """(length, sharing) by brute force: every candidate length, the requests whose first `length` slots
    (short of their last position) are the consecutive run from row 0's first slot."""
    B = table.shape[0]
    start = int(table[0, 0])
    best: tuple[int, int, list[bool]] | None = None
    for length in range(1, int(lens.max())):
        sharing = [
            int(lens[b]) - 1 >= length and all(int(table[b, j]) == start + j for j in range(length))
            for b in range(B)
        ]
        count = sum(sharing)
        if count >= cpu_cascade.MIN_SHARING and count * length >= min_positions:
            if best is None or count * length > best[0]:
                best = (count * length, length, sharing)
    return None if best is None else (best[1], best[2])


@pytest.mark.parametrize(
    ("prefix", "suffixes", "others", "min_positions"),
    [
        (300, [5, 9, 1, 40], [], 1000),
        (300, [5, 9, 1, 40], [], 2000),  # 4 x 300 < 2000: none
        (200, [3, 3, 3, 3, 3], [0, 0, 0], 500),  # padding rows stay out
        (100, [1, 1, 1], [50, 400], 100),  # only 3 share: fewer than MIN_SHARING
        (250, [2, 2, 2, 2, 2, 2], [260, 7], 100),
    ],
)
def test_plan_matches_brute_force(
    prefix: int, suffixes: list[int], others: list[int], min_positions: int
) -> None:
    _, _, _, table, lens = make_batch(prefix, suffixes, others, 3, 1, 16, torch.float32)
    plan = cpu_cascade.plan_shared_prefix(table, lens, min_positions)
    expected = naive_plan(table, lens, min_positions)
    if expected is None:
        assert plan is None
        return
    assert plan is not None and plan.start == 1
    assert (plan.length, plan.sharing.tolist()) == expected
    for b in range(table.shape[0]):
        skip = plan.length if plan.sharing[b] else 0
        n = int(lens[b]) - skip
        assert int(plan.suffix_lens[b]) == n >= 1
        assert torch.equal(plan.suffix_table[b, :n], table[b, skip : skip + n])


def test_plan_of_a_partial_run() -> None:
    """Requests whose runs end at different places: the plan takes the length that covers the most."""
    _, _, _, table, lens = make_batch(400, [5, 5, 5, 5, 5, 5], [], 3, 1, 16, torch.float32, seed=3)
    table[4:, 150] = table[0, -8]  # two requests leave the run at position 150
    plan = cpu_cascade.plan_shared_prefix(table, lens, 1)
    assert plan is not None and (plan.length, plan.sharing.tolist()) == naive_plan(table, lens, 1)
    assert plan.length == 400 and plan.sharing.tolist() == [True] * 4 + [False] * 2


def check_cascade(out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
        return
    got, rounded = out.float(), ref.to(torch.bfloat16).float()
    torch.testing.assert_close(got, rounded, rtol=2**-7, atol=2**-9 * float(ref.abs().max()))
    # no worse on average than the plain kernel's rounding by more than the prefix's own bf16 rounding
    err, plain_err = (got - ref).abs().mean(), (plain.float() - ref).abs().mean()
    assert err <= 2.5 * plain_err + 1e-6, (float(err), float(plain_err))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("prefix", "suffixes", "others"),
    [
        (1500, [1, 17, 300, 64], []),
        (700, [2, 2, 2, 2, 2, 2, 2, 2], [0, 0]),
        (900, [40, 1, 1, 5, 3], [1000, 12]),
    ],
    ids=["four", "eight_padded", "mixed"],
)
@pytest.mark.parametrize(("H", "KVH", "D"), [(9, 3, 64), (8, 8, 64), (8, 2, 128), (6, 2, 80)])
def test_cascade_matches_sdpa(
    dtype: torch.dtype,
    prefix: int,
    suffixes: list[int],
    others: list[int],
    H: int,
    KVH: int,
    D: int,
    threads: int,
) -> None:
    q, k_buf, v_buf, table, lens = make_batch(prefix, suffixes, others, H, KVH, D, dtype, seed=H + D)
    plan = cpu_cascade.plan_shared_prefix(table, lens, 1)
    assert plan is not None and plan.length == prefix
    scale = D**-0.5
    out = cpu_cascade.cascade_decode_attention(q, k_buf, v_buf, plan, scale)
    plain = cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, scale)
    check_cascade(out, reference(q, k_buf, v_buf, table, lens, scale), plain, dtype)


def test_sharp_scores_and_a_strided_query() -> None:
    """Large scores (the prefix or the suffix dominates the merged softmax) and a fused-QKV view as q."""
    H, KVH, D = 9, 3, 64
    q, k_buf, v_buf, table, lens = make_batch(1200, [3, 800, 1, 2], [], H, KVH, D, torch.float32, seed=5)
    qkv = torch.randn(4, (H + 2 * KVH) * D) * 8.0
    q_view = qkv[:, : H * D].view(4, H, D)
    plan = cpu_cascade.plan_shared_prefix(table, lens, 1)
    assert plan is not None
    out = cpu_cascade.cascade_decode_attention(q_view, k_buf, v_buf, plan, 0.125)
    ref = reference(q_view, k_buf, v_buf, table, lens, 0.125)
    plain = cpu_decode.paged_decode_attention(q_view, k_buf, v_buf, table, lens, 0.125)
    # scores up to ~100: float32 exp and sums differ in their last bits between any two orders
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert (out - ref).abs().mean() <= 2 * (plain - ref).abs().mean() + 1e-7


def test_bad_prefix_arguments() -> None:
    q, k_buf, v_buf, table, lens = make_batch(64, [1, 1, 1, 1], [], 4, 2, 16, torch.float32)
    out, lse = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2)
    with pytest.raises(ValueError, match="prefix out must be"):
        cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.25, prefix=(out[:1], lse))
    with pytest.raises(ValueError, match="prefix lse must be"):
        cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.25, prefix=(out, lse.double()))
    with pytest.raises(ValueError, match="without a window"):
        cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, 0.25, window=8, prefix=(out, lse))
    empty = lens.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match=r"with a prefix every entry must be in \[1"):
        cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, empty, 0.25, prefix=(out, lse))


def test_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "many")
    with pytest.raises(ValueError, match=cpu_cascade.CASCADE_ENV):
        cpu_cascade.cascade_min_positions()
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "0")
    assert cpu_cascade.cascade_min_positions() == 0
    monkeypatch.delenv(cpu_cascade.CASCADE_ENV)
    assert cpu_cascade.cascade_min_positions() == cpu_cascade.CASCADE_MIN_DEFAULT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("prefix", "new"), [(1, 17), (300, 49), (2048, 256)])
@pytest.mark.parametrize(("H", "KVH", "D"), [(9, 3, 64), (8, 8, 64), (8, 2, 128)])
def test_extend_over_prefix_matches_sdpa(
    dtype: torch.dtype, prefix: int, new: int, H: int, KVH: int, D: int
) -> None:
    """One request's extend through the split path against one masked float32 SDPA over prefix + new tokens."""
    g = torch.Generator().manual_seed(prefix + new + H)
    n = prefix + new + 31
    k_buf = torch.randn(n, KVH, D, generator=g).to(dtype)
    v_buf = torch.randn(n, KVH, D, generator=g).to(dtype)
    slots = torch.randperm(n - 1, generator=g)[: prefix + new] + 1
    q = torch.randn(new, H, D, generator=g).to(dtype)
    scale = D**-0.5
    out = cpu_cascade.extend_over_prefix(q, k_buf[slots[prefix:]], v_buf[slots[prefix:]], k_buf, v_buf,
                                         slots[:prefix], scale)  # fmt: skip
    keys, values = k_buf[slots].float().transpose(0, 1), v_buf[slots].float().transpose(0, 1)
    causal = torch.arange(prefix + new)[None, :] <= (prefix + torch.arange(new))[:, None]
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=causal, scale=scale, enable_gqa=True
    ).transpose(0, 1)
    assert out.dtype == dtype and out.shape == (new, H, D)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
    else:  # both parts come back in bf16 before the merge: two roundings, then the output's
        torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-7 * float(ref.abs().max()))
        assert (out.float() - ref).abs().mean() <= 2**-8 * ref.abs().mean()


def test_slot_run_against_a_naive_check() -> None:
    """`slot_run` is a slice exactly when the slots are consecutive ascending (checked element by element)."""
    g = torch.Generator().manual_seed(5)
    cases = [torch.arange(7, 7 + n) for n in (1, 2, 300)]
    cases += [
        torch.tensor([3, 4, 6]),
        torch.tensor([5, 4]),
        torch.tensor([2, 3, 4, 4]),
        torch.tensor([9, 8, 10]),
    ]
    cases += [torch.randperm(50, generator=g)[:n] for n in (2, 5, 40)]
    for slots in cases:
        run = cpu_cascade.slot_run(slots)
        consecutive = all(int(slots[i + 1]) == int(slots[i]) + 1 for i in range(len(slots) - 1))
        if consecutive:
            assert run == slice(int(slots[0]), int(slots[0]) + len(slots))
        else:
            assert run is slots
    assert cpu_cascade.slot_run(torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_extend_over_a_prefix_run_reads_in_place() -> None:
    """A prefix that is one run of slots, passed as a slice: the same output as the gathered slots."""
    g = torch.Generator().manual_seed(8)
    k_buf, v_buf = torch.randn(600, 3, 64, generator=g), torch.randn(600, 3, 64, generator=g)
    q, k, v = torch.randn(40, 9, 64, generator=g), k_buf[500:540], v_buf[500:540]
    slots = torch.arange(100, 400)
    run = cpu_cascade.slot_run(slots)
    assert isinstance(run, slice)
    gathered = cpu_cascade.extend_over_prefix(q, k, v, k_buf, v_buf, slots, 0.125)
    in_place = cpu_cascade.extend_over_prefix(q, k, v, k_buf, v_buf, run, 0.125)
    assert torch.equal(gathered, in_place)


def test_pad_tokens_aligns_and_keeps_causal_attention() -> None:
    """Zeros appended up to a multiple of CAUSAL_ALIGN; causal SDPA of the padded block, cut back, equals the
    unpadded one (padded keys come after every real query)."""
    g = torch.Generator().manual_seed(2)
    for n in (1, 31, 32, 33, 361):
        x = torch.randn(n, 3, 8, generator=g)
        padded = cpu_cascade.pad_tokens(x, 0)
        assert (
            padded.shape[0] % cpu_cascade.CAUSAL_ALIGN == 0 and padded.shape[0] - n < cpu_cascade.CAUSAL_ALIGN
        )
        assert torch.equal(padded[:n], x) and not padded[n:].any()
        if n % cpu_cascade.CAUSAL_ALIGN == 0:
            assert padded is x
        q = torch.randn(1, 3, n, 8, generator=g)
        want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        p = cpu_cascade.pad_tokens(q, 2)
        got = F.scaled_dot_product_attention(p, p, p, is_causal=True)[:, :, :n]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
