"""``SamplingBatchInfo``: the tensors the sampler needs for one batch, built once per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixrt.sampling.penalties import PenaltyInfo, flat_row_index
from radixrt.sampling.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-6
_NEUTRAL = SamplingParams()


def _signed64(x: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the int64 torch can hold."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64 tensors (wrapping arithmetic): a counter -> pseudo-random bits.

    Elementwise, so the output for one element never depends on its neighbours or the batch shape.
    """
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One pseudo-random 64-bit key per (seed, step): the source of the row's uniform draw."""
    return mix64(mix64(seeds) ^ steps)


@dataclass(slots=True)
class SamplingBatchInfo:
    """Sampling tensors for one batch of B rows (row i = one request at its current step).

    Neutral values fill unused settings (top_k disabled -> V, top_p disabled -> +inf, greedy rows get
    temperature 1), and the ``need_*`` flags let the sampler skip work no row asks for.
    """

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    keys: torch.Tensor  # [B] int64, from (seed, step)
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    penalties: PenaltyInfo | None
    bans: tuple[torch.Tensor, torch.Tensor] | None  # flat (rows, cols) of banned ids

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return int(self.greedy.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        banned_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatchInfo:
        """Build the batch tensors.

        ``seeds[i]`` is row i's seed (the caller draws one when the user gave none), ``steps[i]`` the
        number of tokens row i has generated so far; together with the logits they fully determine
        row i's draw. ``banned_ids[i]`` are forbidden this step (EOS + stop ids under min_new_tokens).
        ``output_ids`` / ``prompt_ids`` feed the penalties and are only read when a row uses one.
        """
        b = len(params)
        lists = (seeds, steps, output_ids, prompt_ids, banned_ids)
        if any(len(x) != b for x in lists):
            raise ValueError(f"batch lists must all have length {b}: {[len(x) for x in lists]}")
        greedy = [p.is_greedy for p in params]
        # Greedy rows take the argmax path; give them neutral settings so they add no filtering work.
        eff = [_NEUTRAL if g else p for p, g in zip(params, greedy, strict=True)]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in eff]
        top_ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in eff]
        # NOTE: a tiny positive temperature is clamped so logits / T stays finite.
        temps = [max(p.temperature, _MIN_TEMPERATURE) for p in eff]

        def tensor(values: Sequence[float | int | bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        bans = flat_row_index(banned_ids, vocab_size, device) if any(banned_ids) else None
        seed_t = tensor([_signed64(s) for s in seeds], torch.int64)
        return cls(
            vocab_size=vocab_size,
            temperatures=tensor(temps, torch.float32).unsqueeze(1),
            top_ps=tensor(top_ps, torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            min_ps=tensor([p.min_p for p in eff], torch.float32),
            greedy=tensor(greedy, torch.bool),
            keys=row_keys(seed_t, tensor(steps, torch.int64)),
            all_greedy=all(greedy),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(p.min_p > 0 for p in eff),
            penalties=PenaltyInfo.build(params, output_ids, prompt_ids, vocab_size, device),
            bans=bans,
        )
