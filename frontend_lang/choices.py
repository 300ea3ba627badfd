"""How ``select`` turns per-token logprobs of each choice into one decision.

A backend scores every choice in one batched prefill-only request and hands each method the logprobs
of the choice's tokens given the prompt (and, for ``unconditional_likelihood_normalized``, given no
prompt). The method returns the chosen index and the intermediate values it used (``meta_info``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ChoiceScores:
    """Per-choice token logprobs: ``conditional[i][j]`` is token j of choice i given the prompt;
    ``unconditional[i][j]`` the same token given only the preceding tokens of the choice (its first
    token has no context, so that entry is None)."""

    choices: list[str]
    conditional: list[list[float]]
    unconditional: list[list[float | None]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ChoicesDecision:
    """The chosen choice and the values that led to it."""

    index: int
    choice: str
    meta_info: dict[str, Any]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pick(scores: list[float], temperature: float, rng: random.Random | None = None) -> int:
    """argmax (first on ties) at temperature 0, else a draw from softmax(scores / temperature)."""
    if temperature <= 0:
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return (rng or random).choices(range(len(scores)), weights=weights)[0]


class ChoicesMethod:
    """Base class: ``decide`` picks a choice from its scores."""

    name = "base"
    requires_unconditional = False

    def scores(self, s: ChoiceScores) -> tuple[list[float], dict[str, Any]]:
        """One score per choice (higher is better) and the method's intermediate values."""
        raise NotImplementedError

    def decide(self, s: ChoiceScores, temperature: float = 0.0) -> ChoicesDecision:
        if not s.choices:
            raise ValueError("choices: select needs at least one choice")
        scores, meta = self.scores(s)
        index = _pick(scores, temperature)
        meta_info = {
            "choices_method": self.name,
            "choices": list(s.choices),
            "scores": scores,
            "normalized_prompt_logprobs": [_mean(c) for c in s.conditional],
            "input_token_logprobs": [list(c) for c in s.conditional],
            **meta,
            **s.extra,
        }
        return ChoicesDecision(index, s.choices[index], meta_info)


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean token logprob (the default)."""

    name = "token_length_normalized"

    def scores(self, s: ChoiceScores) -> tuple[list[float], dict[str, Any]]:
        return [_mean(c) for c in s.conditional], {}


class GreedyTokenSelection(ChoicesMethod):
    """Compare choices token by token: keep those whose logprob at position j is the highest, until
    one is left. A choice shorter than another is extended with its own mean logprob, so that a choice
    that is a prefix of a longer one can still win."""

    name = "greedy_token_selection"

    def scores(self, s: ChoiceScores) -> tuple[list[float], dict[str, Any]]:
        width = max((len(c) for c in s.conditional), default=0)
        padded = [c + [_mean(c)] * (width - len(c)) for c in s.conditional]
        alive = list(range(len(s.choices)))
        for j in range(width):
            best = max(padded[i][j] for i in alive)
            alive = [i for i in alive if padded[i][j] == best]
            if len(alive) == 1:
                break
        scores = [0.0 if i == alive[0] else -math.inf for i in range(len(s.choices))]
        return scores, {"greedy_logprob_matrix": padded}


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice whose tokens gain the most from the prompt: mean over its tokens of
    ``logprob(token | prompt) - logprob(token | choice prefix only)`` (for the first token, which has
    no unconditional logprob, the conditional logprob alone)."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional = True

    def scores(self, s: ChoiceScores) -> tuple[list[float], dict[str, Any]]:
        if s.unconditional is None:
            raise ValueError(f"{self.name}: the backend returned no unconditional logprobs")
        scores = []
        for cond, uncond in zip(s.conditional, s.unconditional, strict=True):
            diffs = [c - (u or 0.0) for c, u in zip(cond, uncond, strict=True)]
            scores.append(_mean(diffs))
        return scores, {"unconditional_token_logprobs": [list(u) for u in s.unconditional]}


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_BY_NAME = {
    m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)
}


def resolve_method(method: ChoicesMethod | str | None) -> ChoicesMethod:
    """A method object from itself, its name, or None (the default)."""
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if method in _BY_NAME:
        return _BY_NAME[method]
    raise ValueError(f"choices_method: unknown method {method!r} (expected one of {sorted(_BY_NAME)})")
