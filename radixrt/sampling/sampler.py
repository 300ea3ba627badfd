"""The batched sampler: penalties -> bans -> greedy argmax or temperature / top-k / top-p / min-p draw.

Draws are counter-based: each row gets one uniform ``u`` that is a hash of (row seed, row step), and
the token is found by inverse CDF, the first index whose cumulative (filtered) probability exceeds
``u * total``. A row's token therefore depends only on its seed, its step and its logits, never on
the batch size or its position in the batch. (One uniform per row instead of Gumbel noise per
vocabulary entry: hashing B x V counters cost ~10x the rest of the sampler on CPU.)
"""

from __future__ import annotations

import torch

from radixrt.sampling.penalties import apply_penalties
from radixrt.sampling.sampling_batch import SamplingBatchInfo

_NEG_INF = float("-inf")
_TOP_P_HEAD = 1024


def row_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64 ``[B]``, from the top 53 bits of the (already mixed) keys."""
    top53 = (keys >> 11) & ((1 << 53) - 1)
    return top53.to(torch.float64) * (2.0**-53)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``[B, 1]`` drawn from each row of non-negative ``weights [B, V]`` (not renormalized).

    The pick is the first j with ``cum[j] > u * total``, so ``weights[j] > 0``; when rounding puts the
    target at ``total`` itself, it falls back to the first index reaching ``total`` (also positive).
    """
    cum = weights.cumsum(dim=-1)
    total = cum[:, -1:].contiguous()
    target = (u.unsqueeze(1) * total.double()).to(cum.dtype)
    idx = torch.searchsorted(cum, target, right=True)
    return torch.minimum(idx, torch.searchsorted(cum, total))


def _top_k_mask(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Set every logit below the row's k-th largest to -inf (ties with the k-th are kept)."""
    k = info.top_ks
    enabled = k < info.vocab_size
    k_max = int(k[enabled].max())
    kth = scaled.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
    kth = torch.where(enabled.unsqueeze(1), kth, torch.tensor(_NEG_INF, device=scaled.device))
    return scaled.masked_fill(scaled < kth, _NEG_INF)


def _draw(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Sample ``[B]`` ids from temperature-scaled logits with top_k, then top_p, then min_p.

    top_p keeps the smallest prefix (by descending probability, renormalized after top_k) whose mass
    reaches top_p, always including the top token; min_p drops tokens with prob < min_p * max prob.
    """
    if info.need_top_k:
        scaled = _top_k_mask(scaled, info)
    probs = torch.softmax(scaled, dim=-1)
    u = row_uniforms(info.keys)
    min_p = info.min_ps.unsqueeze(1)
    if not info.need_top_p:
        if info.need_min_p:
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return _inverse_cdf(probs, u).squeeze(1)
    total = probs.sum(dim=-1, keepdim=True)
    sorted_p, order = _sorted_head(probs, info.top_ps.unsqueeze(1) * total)
    cum = sorted_p.cumsum(dim=-1)
    # drop position j once the mass strictly before it already reaches top_p
    sorted_p = sorted_p.masked_fill((cum - sorted_p) >= info.top_ps.unsqueeze(1) * total, 0.0)
    if info.need_min_p:
        sorted_p = sorted_p.masked_fill(sorted_p < min_p * sorted_p[:, :1], 0.0)
    return order.gather(1, _inverse_cdf(sorted_p, u)).squeeze(1)


def _sorted_head(probs: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities in descending order with their ids, truncated to a head holding ``mass`` per row.

    Sorting a 150k vocabulary per row dominates the sampler on CPU; the top ``_TOP_P_HEAD`` entries
    almost always hold the top_p mass, and then every later entry would be dropped anyway, so the
    truncated head gives the same draw. Rows where it does not, fall back to the full sort.
    """
    vocab = probs.shape[-1]
    if vocab > 2 * _TOP_P_HEAD:
        head_p, head_ids = probs.topk(_TOP_P_HEAD, dim=-1)
        if bool((head_p.sum(dim=-1, keepdim=True) >= mass).all()):
            return head_p, head_ids
    return probs.sort(dim=-1, descending=True)


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
        logits = logits.index_put(info.bans, torch.tensor(_NEG_INF, device=logits.device))
    greedy_ids = torch.argmax(logits, dim=-1)
    if info.all_greedy:
        return greedy_ids
    sampled = _draw(logits / info.temperatures, info)
    return torch.where(info.greedy, greedy_ids, sampled)
