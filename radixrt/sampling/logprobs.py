"""Log-probabilities of chosen tokens and of the top alternatives, for the ``logprobs`` APIs."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogprobResult(NamedTuple):
    """Per-position logprobs: ``token_logprobs [N]``, ``top_logprobs [N, k]``, ``top_ids [N, k]``."""

    token_logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> LogprobResult:
    """Logprobs of ``token_ids [N]`` and the ``top_k`` most likely tokens under ``logits [N, V]``.

    Computed from ``log_softmax`` of the RAW model logits, i.e. before penalties, bans, temperature
    and top-k/top-p/min-p filtering (OpenAI and SGLang report the model's distribution). Computed in
    float32. ``top_k`` is clamped to V; ``top_k == 0`` gives empty ``[N, 0]`` top tensors.
    """
    if top_k < 0:
        raise ValueError(f"top_k: must be >= 0, got {top_k}")
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, token_ids {tuple(token_ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    k = min(top_k, logits.shape[1])
    if k == 0:
        n = logits.shape[0]
        empty_ids = torch.empty((n, 0), dtype=torch.int64, device=logits.device)
        return LogprobResult(token_logprobs, logprobs.new_empty((n, 0)), empty_ids)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return LogprobResult(token_logprobs, top_logprobs, top_ids)
