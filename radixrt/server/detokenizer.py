"""Incremental detokenization and stop-string matching for one request's output stream."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (from ``prefix_offset``) twice per step so that tokenizers that merge
    spaces and multi-byte characters split across tokens (shown as U+FFFD until complete) give the
    same text as decoding everything at once.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.spaces_between = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special, spaces_between_special_tokens=self.spaces_between
        )
        assert isinstance(text, str)
        return text

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (may be empty while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is still pending, even an incomplete character."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``search_from`` of any stop string: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, max(search_from, 0))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
