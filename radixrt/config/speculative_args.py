"""Range checks of the speculative-decoding flags (``ServerArgs.validate`` calls ``check_speculative``)."""

from __future__ import annotations

from typing import Protocol


class SpeculativeArgs(Protocol):
    """The speculative-decoding fields of `ServerArgs`."""

    speculative_num_draft_tokens: int
    speculative_ngram_max_match_window_size: int
    speculative_max_batch_size: int
    speculative_verify_cost: float | None
    speculative_suffix_max_depth: int
    speculative_suffix_min_prob: float
    speculative_suffix_cache_tokens: int
    speculative_suffix_prompt_window: int


def check_speculative(args: SpeculativeArgs) -> None:
    """Raise ValueError naming the first speculative-decoding field out of its range."""
    at_least = {
        "speculative_num_draft_tokens": 1,
        "speculative_ngram_max_match_window_size": 1,
        "speculative_max_batch_size": 0,
        "speculative_verify_cost": 1,
        "speculative_suffix_max_depth": 2,
        "speculative_suffix_cache_tokens": 1,
        "speculative_suffix_prompt_window": 0,
    }
    for name, low in at_least.items():
        value = getattr(args, name)
        if value is None and name == "speculative_verify_cost":  # None: measured
            continue
        if not value >= low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if not 0.0 <= args.speculative_suffix_min_prob <= 1.0:
        raise ValueError(
            f"speculative_suffix_min_prob: must be in [0, 1], got {args.speculative_suffix_min_prob}"
        )
