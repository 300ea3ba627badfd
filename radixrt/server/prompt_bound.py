"""A lower bound on a text's token count without tokenizing it, for refusing provably long prompts early.

A tokenizer that keeps every byte of its input (no normalizer or pre-tokenizer that deletes characters,
no unknown token that swallows a run of them, no added token that strips the whitespace around it)
covers a text of B UTF-8 bytes with tokens of at most ``max_token_bytes`` bytes each, so it needs at
least ``ceil(B / max_token_bytes)`` tokens. ``max_token_bytes`` is computed once per tokenizer from its
``tokenizer.json``; for a tokenizer that may drop bytes (or a slow one) there is no bound (None).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from transformers import PreTrainedTokenizerBase

# Pipeline steps that never delete input bytes (anything else makes the bound unprovable). NFC may
# shorten text: it composes a character's canonical decomposition (at most 3x its UTF-8 length, a
# Hangul syllable from three jamo) and maps singletons such as U+2126 OHM SIGN to shorter ones.
_NORMALIZERS = {"Prepend": 1, "NFC": 3}
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, int | None] = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most input bytes one token of ``tokenizer`` can cover; None when no such bound is provable."""
    if tokenizer not in _cache:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        _cache[tokenizer] = None if backend is None else _from_spec(json.loads(backend.to_str()))
    return _cache[tokenizer]


def min_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """A lower bound on ``len(tokenizer.encode(text))`` (0 when none is provable)."""
    per_token = max_token_bytes(tokenizer)
    if per_token is None:
        return 0
    return -(-len(text.encode("utf-8", "surrogatepass")) // per_token)


def _from_spec(spec: dict[str, Any]) -> int | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    pre = spec.get("pre_tokenizer")
    byte_level = any(step.get("type") == "ByteLevel" for step in _steps(pre, "pretokenizers"))
    if model.get("unk_token") is not None and not (byte_level or model.get("byte_fallback")):
        return None  # an unknown token may stand for a run of characters of any length
    shrink = _shrink_factor(spec.get("normalizer"), pre)
    if shrink is None:
        return None
    added = spec.get("added_tokens") or []
    if any(tok.get("lstrip") or tok.get("rstrip") for tok in added):
        return None  # such a token also covers the whitespace next to it, however long
    vocab: dict[str, int] = model.get("vocab") or {}
    # NOTE: a byte-level vocabulary spells each byte as one character; otherwise the UTF-8 length of a
    # token's spelling is at least the bytes it covers ("▁" for " ", "<0x0A>" for a byte fallback).
    sizes = [len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in vocab]
    sizes += [len(str(tok.get("content", "")).encode("utf-8", "surrogatepass")) for tok in added]
    return max(sizes, default=0) * shrink or None


def _steps(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [s for child in node.get(key) or [] for s in _steps(child, key)]
    return [node]


def _shrink_factor(normalizer: dict[str, Any] | None, pre: dict[str, Any] | None) -> int | None:
    """How many times shorter (UTF-8) the normalized text can be than the input; None if unbounded."""
    factor = 1
    for step in _steps(normalizer, "normalizers"):
        kind = str(step.get("type"))
        if kind == "Replace":
            pattern, content = step.get("pattern") or {}, str(step.get("content", ""))
            if "String" not in pattern or len(content.encode()) < len(str(pattern["String"]).encode()):
                return None
        elif kind in _NORMALIZERS:
            factor *= _NORMALIZERS[kind]
        else:
            return None
    for step in _steps(pre, "pretokenizers"):
        if step.get("type") not in _PRE_TOKENIZERS or str(step.get("behavior", "")).lower() == "removed":
            return None
    return factor
