"""The global suffix index: what the server has served, per cache namespace, under a token budget.

Finished requests' prompt + output ids go into the ``SuffixTrie`` of their RadixCache namespace (the
request's ``cache_salt``: its tenant and salt), so a request only ever drafts from text served in its own
namespace: no tenant's tokens can appear in another tenant's drafts. The sequences are kept in one LRU
over all namespaces; when their tokens exceed ``max_tokens`` the least recently added or re-served is
removed from its trie (counts drop, empty nodes go). A sequence served again (same namespace, same ids)
is only moved to the back of the LRU, so repeating a workload does not inflate its counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radixrt.speculative.suffix import SuffixTrie


class SuffixCache:
    """Per-namespace suffix tries over finished sequences, with one LRU token budget."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.depth = depth
        self.max_tokens = max_tokens
        self.tokens = 0
        self._tries: dict[str | None, SuffixTrie] = {}
        self._lru: OrderedDict[tuple[str | None, tuple[int, ...]], None] = OrderedDict()

    def add(self, namespace: str | None, seq: Sequence[int]) -> None:
        """Index ``seq`` (its last ``max_tokens`` ids at most) in ``namespace``'s trie."""
        ids = tuple(seq[max(0, len(seq) - self.max_tokens) :])
        if not ids:
            return
        key = (namespace, ids)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        while self.tokens + len(ids) > self.max_tokens:
            self._evict()
        trie = self._tries.get(namespace)
        if trie is None:
            trie = self._tries[namespace] = SuffixTrie(self.depth)
        trie.add(ids)
        self._lru[key] = None
        self.tokens += len(ids)

    def _evict(self) -> None:
        (namespace, ids), _ = self._lru.popitem(last=False)
        trie = self._tries[namespace]
        trie.remove(ids)
        self.tokens -= len(ids)
        if trie.nodes == 0:
            del self._tries[namespace]

    def trie(self, namespace: str | None) -> SuffixTrie | None:
        """``namespace``'s trie (None when nothing of it is indexed)."""
        return self._tries.get(namespace)

    @property
    def nodes(self) -> int:
        """Trie nodes held, all namespaces (the index's memory is about 120 bytes per node)."""
        return sum(t.nodes for t in self._tries.values())

    @property
    def sequences(self) -> int:
        return len(self._lru)
