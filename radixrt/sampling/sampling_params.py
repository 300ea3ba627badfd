"""Per-request sampling parameters: names and defaults follow SGLang's native ``/generate`` API.

``SamplingParams`` is a msgspec Struct because it crosses the tokenizer -> worker ZeroMQ socket.
Two steps check a user's input: ``from_dict`` checks keys and types (HTTP payloads), ``validate``
checks ranges (it needs the vocabulary size, which only the server knows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import msgspec

_INT, _FLOAT, _BOOL, _STR_LIST, _INT_LIST, _OPT_STR, _OPT_INT, _JSON = range(8)

# field -> kind, used by ``from_dict`` to type-check untrusted input.
_FIELD_KINDS: dict[str, int] = {
    "max_new_tokens": _INT,
    "min_new_tokens": _INT,
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "frequency_penalty": _FLOAT,
    "presence_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "stop": _STR_LIST,
    "stop_token_ids": _INT_LIST,
    "ignore_eos": _BOOL,
    "n": _INT,
    "seed": _OPT_INT,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "regex": _OPT_STR,
    "json_schema": _JSON,
    "ebnf": _OPT_STR,
}

MAX_SEED = 2**63 - 1
"""Seeds live in int64 tensors in the sampler."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(key: str, kind: int, v: Any) -> Any:
    """Check one untrusted value against its field kind; return it normalized or raise ValueError."""
    bad = ValueError(f"{key}: invalid type {type(v).__name__} ({v!r})")
    if kind == _INT or (kind == _OPT_INT and v is not None):
        if not _is_int(v):
            raise bad
        return v
    if kind == _FLOAT:
        if not (_is_int(v) or isinstance(v, float)):
            raise bad
        return float(v)
    if kind == _BOOL:
        if not isinstance(v, bool):
            raise bad
        return v
    if kind == _STR_LIST:
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list | tuple) or not all(isinstance(s, str) for s in v):
            raise bad
        return list(v)
    if kind == _INT_LIST:
        if not isinstance(v, list | tuple) or not all(_is_int(t) for t in v):
            raise bad
        return list(v)
    if kind == _JSON and isinstance(v, dict):
        return json.dumps(v)
    if v is not None and not isinstance(v, str):
        raise bad
    return v


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's continuation.

    ``top_k`` of -1 or 0 disables top-k (0 is accepted as "disabled" for OpenAI-style clients);
    ``temperature == 0`` or ``top_k == 1`` means greedy (exactly ``torch.argmax``). A ``stop`` given
    as one string is normalized to a list, a ``json_schema`` given as a dict to a JSON string.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        stop: Any = self.stop
        if isinstance(stop, str):
            self.stop = [stop]
        schema: Any = self.json_schema
        if isinstance(schema, dict):
            self.json_schema = json.dumps(schema)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from an untrusted JSON object, checking keys and types (not ranges: see ``validate``).

        Raises ValueError naming the field for an unknown key or a value of the wrong type (bools are
        not numbers; ints are accepted for float fields). A JSON ``null`` means "use the default",
        as OpenAI-style clients send explicit nulls.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params: expected an object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            kind = _FIELD_KINDS.get(key)
            if kind is None:
                raise ValueError(f"{key}: unknown sampling parameter")
            if value is None and kind not in (_OPT_STR, _OPT_INT, _JSON):
                continue
            kwargs[key] = _coerce(key, kind, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (every field), e.g. for logging or the OpenAI adapter."""
        return {f: getattr(self, f) for f in self.__struct_fields__}

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (no randomness at all)."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Check ranges; raise ValueError whose message starts with the offending field's name.

        ``vocab_size``, when given, bounds ``stop_token_ids``.
        """

        def check(ok: bool, field: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{field}: must be {rule}, got {getattr(self, field)!r}")

        def num(field: str) -> float:
            v = getattr(self, field)
            if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
                raise ValueError(f"{field}: must be a finite number, got {v!r}")
            return float(v)

        def integer(field: str) -> int:
            v = getattr(self, field)
            if not _is_int(v):
                raise ValueError(f"{field}: must be an integer, got {v!r}")
            return int(v)

        check(num("temperature") >= 0, "temperature", ">= 0")
        check(0 < num("top_p") <= 1, "top_p", "in (0, 1]")
        check(integer("top_k") >= -1, "top_k", ">= 1, or -1 / 0 to disable")
        check(0 <= num("min_p") <= 1, "min_p", "in [0, 1]")
        check(integer("max_new_tokens") >= 0, "max_new_tokens", ">= 0")
        check(
            0 <= integer("min_new_tokens") <= self.max_new_tokens,
            "min_new_tokens",
            f"in [0, max_new_tokens={self.max_new_tokens}]",
        )
        check(num("repetition_penalty") > 0, "repetition_penalty", "> 0")
        check(-2 <= num("frequency_penalty") <= 2, "frequency_penalty", "in [-2, 2]")
        check(-2 <= num("presence_penalty") <= 2, "presence_penalty", "in [-2, 2]")
        check(integer("n") >= 1, "n", ">= 1")
        upper = vocab_size if vocab_size is not None else MAX_SEED
        check(
            isinstance(self.stop_token_ids, list)
            and all(_is_int(t) and 0 <= t < upper for t in self.stop_token_ids),
            "stop_token_ids",
            f"token ids in [0, {upper})",
        )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
        )
        constraints = [f for f in ("regex", "json_schema", "ebnf") if getattr(self, f) is not None]
        if len(constraints) > 1:
            raise ValueError(f"{constraints[0]}: only one of regex / json_schema / ebnf may be set")
        check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
            "seed",
            f"an integer in [0, {MAX_SEED}]",
        )
