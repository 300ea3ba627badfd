"""The batched sampler: penalties -> bans -> greedy argmax or temperature / top-k / top-p / min-p draw.

Draws use counter-based noise: the uniform for (row, token j) is a hash of (row seed, row step, j),
and the token is the Gumbel-max ``argmax(logits / T + Gumbel)`` over the allowed set, which is an
exact draw from the renormalized filtered distribution. A row's token therefore depends only on its
seed, its step and its logits, never on the batch size or its position in the batch.
"""

from __future__ import annotations

import torch

from radixrt.sampling.penalties import apply_penalties
from radixrt.sampling.sampling_batch import SamplingBatchInfo, mix64

_UNIFORM_BITS = 24  # float32 mantissa: every value below is exactly representable


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), ``[B, V]`` float32; element (i, j) is a function of ``keys[i]`` and j only."""
    idx = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = mix64(keys.unsqueeze(1) + idx)
    top = (bits >> (64 - _UNIFORM_BITS)) & ((1 << _UNIFORM_BITS) - 1)
    return (top.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)


def _allowed(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor | None:
    """Boolean ``[B, V]`` mask of the tokens top_k, then top_p, then min_p allow; None if no row filters.

    top_k keeps the k largest logits (ties with the k-th are kept); top_p then keeps the smallest
    prefix (by descending probability, renormalized after top_k) whose mass reaches top_p, always
    including the top token; min_p drops tokens with prob < min_p * max prob (done in log space).
    """
    if not (info.need_top_k or info.need_top_p or info.need_min_p):
        return None
    neg_inf = torch.tensor(float("-inf"), device=scaled.device)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if info.need_top_k:
        k = info.top_ks.clamp(max=info.vocab_size)
        k_max = int(k[k < info.vocab_size].max())
        top_vals = scaled.topk(k_max, dim=-1).values
        kth = top_vals.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
        kth = torch.where((k < info.vocab_size).unsqueeze(1), kth, neg_inf)
        keep &= scaled >= kth
    if info.need_top_p:
        probs = torch.softmax(torch.where(keep, scaled, neg_inf), dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        # keep position j while the mass strictly before it is still short of top_p
        keep_sorted = (cum - sorted_p) < info.top_ps.unsqueeze(1) * cum[:, -1:]
        keep &= torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    if info.need_min_p:
        row_max = scaled.max(dim=-1, keepdim=True).values
        keep &= scaled >= row_max + torch.log(info.min_ps).unsqueeze(1)
    return keep


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Next token ids ``[B]`` int64 from model logits ``[B, V]`` (float32; not modified in place).

    Greedy rows (temperature 0 or top_k 1) get exactly ``torch.argmax`` of the penalized, banned
    logits, so greedy output matches HF greedy decoding.
    """
    if logits.dim() != 2 or logits.shape[1] != info.vocab_size or logits.shape[0] != info.batch_size:
        raise ValueError(f"logits shape {tuple(logits.shape)} != [{info.batch_size}, {info.vocab_size}]")
    if info.all_greedy and info.penalties is None and info.bans is None:
        return torch.argmax(logits, dim=-1)
    logits = logits.float()
    if info.penalties is not None:
        logits = apply_penalties(logits, info.penalties)
    if info.bans is not None:
        logits = logits.index_put(info.bans, torch.tensor(float("-inf"), device=logits.device))
    greedy_ids = torch.argmax(logits, dim=-1)
    if info.all_greedy:
        return greedy_ids
    scaled = logits / info.temperatures
    keep = _allowed(scaled, info)
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(info.keys, info.vocab_size)))
    sampled = torch.argmax(scaled + gumbel, dim=-1)
    return torch.where(info.greedy, greedy_ids, sampled)
