"""Repetition / frequency / presence penalties, batched over rows with tensor scatters.

Semantics:
- ``repetition_penalty`` (HF transformers ``RepetitionPenaltyLogitsProcessor``): for every token
  present in prompt + output, a positive logit is divided by the penalty, a negative one multiplied.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): on output tokens only, subtract
  ``frequency_penalty * count`` and ``presence_penalty * (count > 0)``.
Repetition is applied first, then frequency and presence.

Token ids of all rows are flattened into one (row, col) index pair per occurrence, so duplicates and
ragged rows need no padding and no Python loop over rows or the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from radixrt.sampling.sampling_params import SamplingParams


def flat_row_index(
    ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ragged per-row token ids into ``(rows, cols)`` int64 index tensors.

    Raises ValueError if any id is outside ``[0, vocab_size)``.
    """
    lengths = torch.tensor([len(r) for r in ids], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int64), lengths)
    cols = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.int64)
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size})")
    return rows.to(device), cols.to(device)


@dataclass(slots=True)
class PenaltyInfo:
    """Penalty tensors for one batch; a field is None when no row uses that penalty."""

    repetition: torch.Tensor | None  # [B, 1] float32
    rep_index: tuple[torch.Tensor, torch.Tensor] | None  # prompt + output ids of rows with a penalty
    frequency: torch.Tensor | None  # [B, 1] float32
    presence: torch.Tensor | None  # [B, 1] float32
    out_index: tuple[torch.Tensor, torch.Tensor] | None  # output ids of rows with freq/presence

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyInfo | None:
        """Return None (the fast path) when no row uses any penalty."""
        use_rep = [p.repetition_penalty != 1.0 for p in params]
        use_out = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        if not any(use_rep) and not any(use_out):
            return None

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        repetition = rep_index = frequency = presence = out_index = None
        if any(use_rep):
            repetition = column([p.repetition_penalty for p in params])
            seen = [
                list(pr) + list(o) if u else []
                for u, pr, o in zip(use_rep, prompt_ids, output_ids, strict=True)
            ]
            rep_index = flat_row_index(seen, vocab_size, device)
        if any(use_out):
            frequency = column([p.frequency_penalty for p in params])
            presence = column([p.presence_penalty for p in params])
            outs = [o if u else [] for u, o in zip(use_out, output_ids, strict=True)]
            out_index = flat_row_index(outs, vocab_size, device)
        return cls(repetition, rep_index, frequency, presence, out_index)


def apply_penalties(logits: torch.Tensor, info: PenaltyInfo) -> torch.Tensor:
    """Return penalized logits ``[B, V]`` (a new tensor; ``logits`` is not modified)."""
    out = logits
    if info.repetition is not None and info.rep_index is not None:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        seen.index_put_(info.rep_index, torch.ones((), dtype=torch.bool, device=logits.device))
        penalized = torch.where(out > 0, out / info.repetition, out * info.repetition)
        out = torch.where(seen, penalized, out)
    if info.frequency is not None and info.presence is not None and info.out_index is not None:
        counts = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        ones = torch.ones(info.out_index[0].shape, dtype=logits.dtype, device=logits.device)
        counts.index_put_(info.out_index, ones, accumulate=True)
        out = out - info.frequency * counts - info.presence * (counts > 0).to(logits.dtype)
    return out
