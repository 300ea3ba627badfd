"""Cascade decode attention on CPU: the prefix that several requests of a decode batch share in the KV pool
(a RadixCache hit: the same slots) is attended once for all their queries, then each request's own suffix
by the C decode kernel, which merges the two softmax states (FlashInfer's "cascade" / shared-prefix batch
decoding, on the CPU).

Why: the C decode kernel reads each request's K/V once per request (~35-60 GFLOP/s, its dot products are
AVX512-BF16 vector work for one query token at a time). On an agent workload eight requests decode over the
same ~3k-token few-shot prompt: one SDPA call over that prefix multiplies all 8 x 9 query heads at once as a
GEMM (on AMX tiles where the CPU has them), ~4x less time than eight passes over it (docs/cpu.md).

Per decode step ``plan_shared_prefix`` finds the longest run of consecutive pool slots, from the first
request's position 0, that enough requests hold at the start of their tables (only a run of consecutive
slots is read as a strided view without a copy); per layer ``cascade_decode_attention`` runs
``_scaled_dot_product_flash_attention_for_cpu`` (it returns the log-sum-exp the merge needs) over that view
for all requests' queries, then the C kernel ``paged_decode_prefixed`` over the suffixes. Requests that do
not hold the prefix (a different prompt, the compiled step's padding rows) get a log-sum-exp of -inf for it,
so the kernel attends their whole table as usual.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixrt.kernels import cpu_decode

__all__ = [
    "CASCADE_ENV",
    "SharedPrefix",
    "cascade_decode_attention",
    "cascade_min_positions",
    "extend_over_prefix",
    "plan_shared_prefix",
]

# The least (sharing requests x shared positions) worth a cascade, and the fewest sharing requests: below
# them one SDPA call's fixed cost (~50 us a layer) and its poor use of few query rows outweigh what it saves
# over the C kernel (bf16, 2 threads, AMX CPU, embedded model's heads: 2 requests x 3k shared 0.80x the
# kernel's speed, 4 x 500 0.89x, 4 x 1k 1.52x, 8 x 1k 1.66x, 16 x 3k 2.28x).
CASCADE_ENV = "RADIXRT_CPU_CASCADE_MIN"
CASCADE_MIN_DEFAULT = 4096
MIN_SHARING = 4
# Causal blocks are padded to a multiple of this many tokens: torch's CPU flash attention ran an unaligned
# block of keys up to ~3x slower (361 tokens causal, 9 heads, bf16, AMX: 1.2-3.2 ms against 0.6-0.9 for 384).
CAUSAL_ALIGN = 32


def cascade_min_positions() -> int:
    """`CASCADE_ENV` (default `CASCADE_MIN_DEFAULT`; 0 turns cascades off); ValueError naming it if bad."""
    raw = os.environ.get(CASCADE_ENV, str(CASCADE_MIN_DEFAULT))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{CASCADE_ENV}: must be an integer >= 0 (0: no cascade), got {raw!r}")
    return value


@dataclass(frozen=True)
class SharedPrefix:
    """One decode step's cascade plan: slots ``[start, start + length)`` are positions ``[0, length)`` of the
    requests in ``sharing``; ``suffix_table`` / ``suffix_lens`` are every request's remaining positions."""

    start: int
    length: int
    sharing: torch.Tensor  # [B] bool
    suffix_table: torch.Tensor  # [B, W] int64
    suffix_lens: torch.Tensor  # [B] int64
    not_sharing: torch.Tensor | None  # [B] bool: the requests outside it (None when all share it)


def plan_shared_prefix(
    slot_table: torch.Tensor, seq_lens: torch.Tensor, min_positions: int
) -> SharedPrefix | None:
    """The cascade plan for a decode batch (``slot_table`` ``[B, W]``, ``seq_lens`` ``[B]``, both int64), or
    None when no shared run of slots is worth one (``min_positions``: see `CASCADE_ENV`).

    Every request keeps at least its last position (its new token) out of the prefix."""
    B = int(seq_lens.shape[0])
    if B < MIN_SHARING or min_positions <= 0:
        return None
    own = seq_lens - 1  # positions a request may share
    width = min(int(own.max()), int(slot_table.shape[1]))
    if width * B < min_positions or width <= 0:
        return None
    start = int(slot_table[0, 0])
    pos = torch.arange(width)
    # the run of consecutive slots in the first request bounds every candidate: cheap to rule out first
    off_run = slot_table[0, :width] != start + pos
    run0 = int(off_run.to(torch.uint8).argmax()) if bool(off_run.any()) else width
    run0 = min(run0, int(own[0]))
    if run0 * B < min_positions:
        return None
    width, pos = run0, pos[:run0]
    match = (slot_table[:, :width] == start + pos) & (pos < own[:, None])
    whole = match.all(dim=1)
    runs = torch.where(
        whole, width, (~match).to(torch.uint8).argmax(dim=1)
    )  # [B] leading positions on the run
    best, best_len = 0, 0
    for i, length in enumerate(sorted(runs.tolist(), reverse=True)):
        if (
            i + 1 >= MIN_SHARING and (i + 1) * length > best
        ):  # i + 1 requests hold at least `length` positions of it
            best, best_len = (i + 1) * length, int(length)
    if best < min_positions:
        return None
    sharing = runs >= best_len
    shift = sharing.to(torch.int64) * best_len
    cols = torch.arange(slot_table.shape[1])
    idx = (cols[None, :] + shift[:, None]).clamp_(max=slot_table.shape[1] - 1)
    suffix_table = slot_table.gather(1, idx)
    return SharedPrefix(
        start, best_len, sharing, suffix_table, seq_lens - shift, None if bool(sharing.all()) else ~sharing
    )


def cascade_decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: SharedPrefix, scale: float
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H, D]`` (bf16 or f32, heads contiguous) over each request's slots, the
    shared prefix of ``plan`` attended once for all requests; ``k_buf`` / ``v_buf`` ``[num_slots, KVH, D]``
    of ``q``'s dtype. Returns ``[B, H, D]``; ValueError for a plan that does not fit the buffers."""
    B, H, D = q.shape
    num_slots, KVH, _ = k_buf.shape
    G = H // KVH
    if plan.start < 0 or plan.start + plan.length > num_slots or k_buf.dtype != q.dtype:
        raise ValueError(
            f"cascade_decode_attention: plan slots [{plan.start}, +{plan.length}) or dtype do not fit"
        )
    end = plan.start + plan.length
    keys = k_buf[plan.start : end].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D], a view
    values = v_buf[plan.start : end].transpose(0, 1).unsqueeze(0)
    queries = q.reshape(B, KVH, G, D).transpose(0, 1).reshape(1, KVH, B * G, D)
    pre_out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, False, scale=scale
    )
    pre_out = pre_out.contiguous()
    lse = lse.contiguous()
    if plan.not_sharing is not None:
        lse.view(KVH, B, G).masked_fill_(plan.not_sharing[None, :, None], float("-inf"))
    return cpu_decode.paged_decode_attention(
        q, k_buf, v_buf, plan.suffix_table, plan.suffix_lens, scale, prefix=(pre_out, lse)
    )


def extend_over_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    prefix_slots: torch.Tensor | slice,
    scale: float,
) -> torch.Tensor:
    """One request's extend: ``q`` / ``k`` / ``v`` ``[Q, H or KVH, D]`` are its new tokens (already stored in
    the pool), ``prefix_slots`` ``[P]`` (P >= 1) the slots of its cached prefix in ``k_buf`` / ``v_buf``
    (``[num_slots, KVH, D]``, ``q``'s dtype), or a slice where they are one ascending run (`slot_run`: the
    prefix is read in place, no gathered copy). Returns causal attention ``[Q, H, D]``.

    Two flash-attention calls merged by their log-sum-exp: the prefix without a mask, the G query heads of
    each kv head stacked into one ``[G * Q, D]`` operand (one GEMM per kv head, no repeated K/V), then the
    new tokens with the causal mask of a square block (is_causal, no mask tensor). One masked SDPA call over
    prefix + new tokens took ~1.5x the time (256 tokens over a 3k prefix, bf16, 2 threads, AMX machine)."""
    Q, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    keys = k_buf[prefix_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, P, D]
    values = v_buf[prefix_slots].transpose(0, 1).unsqueeze(0)
    grouped = q.reshape(Q, KVH, G, D).permute(1, 2, 0, 3).reshape(1, KVH, G * Q, D)
    pre_out, pre_lse = flash(grouped, keys, values, 0.0, False, scale=scale)
    heads = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    new_k = k.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)
    new_v = v.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)
    heads, new_k, new_v = (pad_tokens(t, 2) for t in (heads, new_k, new_v))
    new_out, new_lse = flash(heads, new_k, new_v, 0.0, True, scale=scale)
    new_out, new_lse = new_out[:, :, :Q], new_lse[:, :, :Q]
    lse_a, lse_b = pre_lse.reshape(H, Q), new_lse.reshape(H, Q)
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    out = pre_out.reshape(H, Q, D) * (wa / total).unsqueeze(-1) + new_out[0] * (wb / total).unsqueeze(-1)
    return out.to(q.dtype).transpose(0, 1)


def pad_tokens(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with zeros appended along its token dimension ``dim`` up to a multiple of `CAUSAL_ALIGN` (``x``
    itself when aligned). For causal attention only: a padded query row is dropped after, a padded key sits
    after every real query and is masked out by causality."""
    pad = -x.shape[dim] % CAUSAL_ALIGN
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def slot_run(slots: torch.Tensor) -> torch.Tensor | slice:
    """``slots`` ``[P]`` as a slice when they are one ascending run of consecutive slots (the allocator hands
    out ascending runs: a prefix prefilled at once is usually one), else ``slots`` itself."""
    n = slots.shape[0]
    if n == 0:
        return slots
    first, last = int(slots[0]), int(slots[-1])
    if last - first == n - 1 and bool(torch.all(slots[1:] - slots[:-1] == 1)):
        return slice(first, last + 1)
    return slots
