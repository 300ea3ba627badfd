"""`SWARadixCache` against a naive reference: a flat map from every cached page (named by the prefix it ends) to
whether its local K/V is still there.

The reference applies the insert rules by itself (tokens whose local K/V the request freed become tombstones,
a tombstone the request computed again within its window is revived) and answers ``match_prefix`` by the rule
itself: the longest page-aligned cached prefix whose last ``window - 1`` tokens are intact (or all of it). The
tree's eviction choices are policy, so after an eviction the reference checks what must hold (nothing became
intact or cached, no locked window lost its local K/V, no locked path lost its full K/V) and then takes the
tree's state. After every operation: ``check_integrity`` and both pools' accounting.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.mem_cache.swa_pool import SWAAllocator
from radixrt.mem_cache.swa_radix_cache import SWARadixCache
from radixrt.mem_cache.tree_node import TreeNode

WINDOW = 6
KEEP = WINDOW - 1


class Reference:
    """page prefix (a tuple of whole pages) -> intact (the local K/V of that last page is held)."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: dict[tuple[int, ...], bool] = {}
        self.cut = self.revived = 0  # matches shortened by a tombstoned window; tombstones revived

    def _page(self, key: list[int], i: int) -> tuple[int, ...]:
        """The prefix up to the end of token ``i``'s page (keys are page aligned)."""
        return tuple(key[: (i // self.ps + 1) * self.ps])

    def match(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and self._page(key, n) in self.pages:
            n += self.ps
        for end in range(n, 0, -self.ps):
            if all(self.pages[self._page(key, i)] for i in range(max(0, end - KEEP), end)):
                self.cut += end < n
                return end
        self.cut += n > 0
        return 0

    def insert(self, key: list[int], matched: int, freed_to: int) -> None:
        for i in range(0, len(key), self.ps):
            p = self._page(key, i)
            if p not in self.pages:
                self.pages[p] = i >= freed_to
            elif i >= matched and i >= freed_to:
                self.revived += not self.pages[p]
                self.pages[p] = True  # a tombstone the request computed again: revived


def tree_pages(tree: SWARadixCache) -> dict[tuple[int, ...], bool]:
    ps = tree.page_size
    out: dict[tuple[int, ...], bool] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(r, ()) for r in tree._roots.values()]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            for j in range(ps, len(child.key) + 1, ps):
                out[prefix + child.key[:j]] = not child.swa_evicted
            stack.append((child, prefix + child.key))
    return out


def locked_windows(held: list[tuple[TreeNode, list[int]]], ps: int) -> set[tuple[int, ...]]:
    """The pages whose local K/V a held lock keeps: those of the last ``KEEP`` tokens of each locked path."""
    out: set[tuple[int, ...]] = set()
    for _, key in held:
        out.update(tuple(key[: (i // ps + 1) * ps]) for i in range(max(0, len(key) - KEEP), len(key)))
    return out


def check(tree: SWARadixCache, alloc: SWAAllocator) -> None:
    tree.check_integrity()
    full = alloc.available_size() + tree.evictable_size() + tree.protected_size()
    assert full == alloc.total_slots, "full pool leak"
    swa = alloc.swa_available_size() + tree.swa_evictable_size() + tree.swa_protected_size()
    assert swa == alloc.swa_total_slots, "local pool leak"
    assert alloc.mapped_swa_slots() == alloc.swa_total_slots - alloc.swa_available_size()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_tree_matches_reference(page_size: int, seed: int) -> None:
    rng = random.Random(seed * 10 + page_size)
    ps = page_size
    alloc = SWAAllocator(400 + ps, 160 + ps, ps)
    tree = SWARadixCache(alloc, WINDOW, ps)
    ref = Reference(ps)
    bases = [[rng.randrange(1, 4) for _ in range(48)] for _ in range(3)]
    held: list[tuple[TreeNode, list[int]]] = []
    for _ in range(120):
        op = rng.random()
        if op < 0.6:
            base = rng.choice(bases)
            key = base[: rng.randrange(1, 49)] + [rng.randrange(1, 4) for _ in range(rng.randrange(0, 12))]
            key = key[: len(key) // ps * ps]
            if not key:
                continue
            m = tree.match_prefix(key)
            k = len(m.slots)
            assert k == ref.match(key), (key, k, ref.match(key))
            tree.inc_lock_ref(m.last_node)
            new = alloc.alloc(len(key) - k)
            if new is None:
                tree.evict(len(key))
                tree.evict_swa(len(key))
                ref.pages = tree_pages(tree)
                new = alloc.alloc(len(key) - k)
            if new is None:
                tree.dec_lock_ref(m.last_node)
                continue
            row = torch.cat([m.slots, new])
            top = (len(key) - KEEP) // ps * ps
            freed_to = rng.choice([0, *range(k, top + 1, ps)]) if top >= k else 0
            if freed_to > k:
                alloc.free_swa(row[k:freed_to])
            prefix_len = tree.insert(key, row, swa_freed_to=freed_to)
            if prefix_len > k:
                alloc.free(row[k:prefix_len])
            tree.dec_lock_ref(m.last_node)
            ref.insert(key, k, freed_to)
            assert tree_pages(tree) == ref.pages
            if rng.random() < 0.3:  # a running request keeps its prefix (window included) locked
                m2 = tree.match_prefix(key)
                tree.inc_lock_ref(m2.last_node)
                held.append((m2.last_node, key[: len(m2.slots)]))
        elif op < 0.75 and held:
            node, _ = held.pop(rng.randrange(len(held)))
            tree.dec_lock_ref(node)
        else:
            before = tree_pages(tree)
            if rng.random() < 0.5:
                tree.evict_swa(rng.randrange(1, 60))
            else:
                tree.evict(rng.randrange(1, 60))
            after = tree_pages(tree)
            assert set(after) <= set(before), "eviction cached something"
            assert all(before[p] or not ok for p, ok in after.items()), "eviction revived something"
            for p in locked_windows(held, ps):
                assert after.get(p), f"a locked window lost its local K/V at {len(p)}"
            for _, key in held:
                assert all(tuple(key[:i]) in after for i in range(ps, len(key) + 1, ps)), (
                    "a locked path was evicted"
                )
            ref.pages = after
        check(tree, alloc)
    assert ref.cut and ref.revived and tree.swa_evicted_tokens, "the workload exercised no tombstone"
    for node, _ in held:
        tree.dec_lock_ref(node)
    check(tree, alloc)
    assert tree.protected_size() == 0 and tree.swa_protected_size() == 0
    tree.reset()
    check(tree, alloc)
    assert alloc.available_size() == alloc.total_slots and alloc.swa_available_size() == alloc.swa_total_slots


def test_evict_swa_takes_what_no_match_can_use_first() -> None:
    """A prompt inserted chunk by chunk (as chunked prefill does) leaves early chunks no match can end
    after; their local K/V goes before the more recently unused tail windows of other sequences and before a
    branch point's window (a shared system prompt)."""
    alloc = SWAAllocator(400, 200)
    tree = SWARadixCache(alloc, WINDOW)
    rng = random.Random(5)
    system = [rng.randrange(1, 50) for _ in range(20)]
    old = system + [rng.randrange(50, 99) for _ in range(20)]  # inserted first: least recently used
    tree.insert(old, alloc.alloc(len(old)))  # type: ignore[arg-type]
    long = system + [rng.randrange(100, 150) for _ in range(60)]
    for end in (40, 60, 80):  # chunks of 20 after the system prompt
        m = tree.match_prefix(long[:end])
        row = torch.cat([m.slots, alloc.alloc(end - len(m.slots))])  # type: ignore[list-item]
        prefix_len = tree.insert(long[:end], row)
        alloc.free(row[len(m.slots) : prefix_len])
    freed = tree.evict_swa(30)
    assert freed >= 30
    pages = tree_pages(tree)
    chunk1, chunk2 = tuple(long[:40]), tuple(long[:60])
    assert not pages[chunk1] and not pages[chunk2], "the early chunks keep their local K/V"
    for p in (tuple(old), tuple(long), tuple(system)):
        assert all(pages[p[:i]] for i in range(len(p) - KEEP + 1, len(p) + 1)), "a usable window lost its K/V"
    check(tree, alloc)
