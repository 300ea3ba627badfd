"""N-gram (prompt lookup) drafting: continue a sequence the way its own history continued before.

For a sequence ``s`` (prompt + output so far) and n from ``max_n`` down to 1, find the most recent
earlier occurrence of the last n tokens ``s[-n:]`` and propose the (up to k) tokens that followed it.
The index is incremental: each n-gram maps to the position right after its latest occurrence that
already has a continuation, so a lookup is one dict probe per n and an update only indexes the new
tokens (a request's ids only ever grow).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Latest-continuation index over one growing token sequence.

    Invariant after ``update(seq)``: for every n in ``1..max_n`` and every end ``e`` with
    ``n <= e <= len(seq) - 1``, ``maps[n-1][tuple(seq[e-n:e])]`` is the largest such ``e`` (so
    ``seq[e]``, the token that followed that occurrence, exists). The sequence's own suffix (ending
    at ``len(seq)``) is not indexed, which makes every hit an *earlier* occurrence.
    """

    __slots__ = ("max_n", "maps", "done")

    def __init__(self, max_n: int) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]
        self.done = 1  # ends below this are indexed (an end of 0 has no n-gram before it)

    def update(self, seq: Sequence[int]) -> None:
        """Index the n-grams ending at the positions ``seq`` gained since the last call."""
        for e in range(self.done, len(seq)):
            for n in range(1, min(self.max_n, e) + 1):
                self.maps[n - 1][tuple(seq[e - n : e])] = e
        self.done = max(self.done, len(seq))

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``seq`` (``update(seq)`` first); [] when nothing matches."""
        if k <= 0:
            return []
        self.update(seq)
        for n in range(min(self.max_n, len(seq)), 0, -1):
            e = self.maps[n - 1].get(tuple(seq[len(seq) - n :]))
            if e is not None:
                return list(seq[e : e + k])
        return []


def propose_naive(seq: Sequence[int], max_n: int, k: int) -> list[int]:
    """The same proposal by a plain backward scan: the reference the index is tested against."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(seq)), 0, -1):
        suffix = list(seq[len(seq) - n :])
        for start in range(len(seq) - n - 1, -1, -1):
            if list(seq[start : start + n]) == suffix:
                return list(seq[start + n : start + n + k])
    return []
