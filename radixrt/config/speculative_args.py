"""Range checks of the speculative-decoding flags (``ServerArgs.validate`` calls ``check_speculative``)."""

from __future__ import annotations

from typing import Protocol


class SpeculativeArgs(Protocol):
    """The speculative-decoding fields of `ServerArgs`."""

    speculative_algorithm: str | None
    speculative_num_draft_tokens: int | None
    speculative_ngram_max_match_window_size: int
    speculative_max_batch_size: int
    speculative_verify_cost: float | None
    speculative_suffix_max_depth: int
    speculative_suffix_min_prob: float
    speculative_suffix_cache_tokens: int
    speculative_suffix_prompt_window: int


# Most draft tokens per request per step when --speculative-num-draft-tokens is unset. SUFFIX drafts only as
# far as its index is confident (the adaptive rule), so a larger cap costs nothing where matches are weak and
# pays where a served sequence repeats: on the ReAct replay with a warm index, batch 1, float32, 2 cores,
# 4 / 8 / 12 drafts gave 1.9x / 2.4x / 2.6x over plain decoding (docs/speculative.md). NGRAM's drafts are not
# scored, so it keeps the short cap.
DEFAULT_DRAFT_TOKENS = {"NGRAM": 4, "SUFFIX": 8}


def draft_tokens(args: SpeculativeArgs) -> int:
    """The draft cap in effect: ``speculative_num_draft_tokens``, or the algorithm's default when unset."""
    if args.speculative_num_draft_tokens is not None:
        return args.speculative_num_draft_tokens
    return DEFAULT_DRAFT_TOKENS.get(args.speculative_algorithm or "", 4)


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
        if value is None and name in ("speculative_verify_cost", "speculative_num_draft_tokens"):  # unset
            continue
        if not value >= low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if not 0.0 <= args.speculative_suffix_min_prob <= 1.0:
        raise ValueError(
            f"speculative_suffix_min_prob: must be in [0, 1], got {args.speculative_suffix_min_prob}"
        )
