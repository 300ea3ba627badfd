"""A least-recently-used cache of compiled grammars, bounded by bytes.

A compiled grammar's size is xgrammar's own accounting (``CompiledGrammar.memory_size_bytes``: the
token-mask cache and the grammar) plus the constraint text it is keyed by. Used from the scheduler
thread only.
"""

from __future__ import annotations

from collections import OrderedDict

import xgrammar as xgr

GrammarKey = tuple[str, str]


def entry_bytes(key: GrammarKey, compiled: xgr.CompiledGrammar) -> int:
    """What one cache entry holds: the compiled grammar plus its key's text."""
    return int(compiled.memory_size_bytes) + len(key[1].encode())


class GrammarCache:
    """Compiled grammars by (kind, text); the least recently used go first once over ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[GrammarKey, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self.entries

    def get(self, key: GrammarKey) -> xgr.CompiledGrammar | None:
        """The compiled grammar (now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: GrammarKey, compiled: xgr.CompiledGrammar) -> bool:
        """Cache ``compiled``, evicting the least recently used to stay within the limit; False (not
        cached) when it alone is larger than the limit."""
        size = entry_bytes(key, compiled)
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.limit_bytes:
            return False
        while self.entries and self.bytes + size > self.limit_bytes:
            _, (_, freed) = self.entries.popitem(last=False)
            self.bytes -= freed
            self.evictions += 1
        self.entries[key] = (compiled, size)
        self.bytes += size
        return True

    def check(self) -> None:
        """Integrity: the byte count is the sum of the entries' sizes and within the limit."""
        total = sum(size for _, size in self.entries.values())
        assert total == self.bytes, (total, self.bytes)
        assert self.bytes <= self.limit_bytes, (self.bytes, self.limit_bytes)
