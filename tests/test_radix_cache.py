"""RadixCache against a naive reference model (one entry per cached page-aligned prefix) + unit tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.radix_cache import RadixCache, TreeNode

SALTS: list[str | None] = [None, "a", "b"]
Prefix = tuple[str | None, tuple[int, ...]]  # (salt, page-aligned token prefix)


# ---- reference model ------------------------------------------------------------------------------


@dataclass
class RefPage:
    """The last page of one cached prefix: its slots, last access time and hit count."""

    slots: tuple[int, ...]
    time: int
    hits: int = 0


class RefCache:
    """Naive model: a dict from every cached page-aligned prefix to its last page's data.

    Access times and hit counts live per prefix, which is what a radix tree computes per node as long
    as nodes split exactly where an access stops.
    """

    def __init__(self, page_size: int, policy: str) -> None:
        self.ps = page_size
        self.policy = policy
        self.pages: dict[Prefix, RefPage] = {}
        self.clock = 0
        self.locks: list[tuple[TreeNode, str | None, tuple[int, ...]]] = []

    def cached_len(self, salt: str | None, key: tuple[int, ...]) -> int:
        i = 0
        while i + self.ps <= len(key) and (salt, key[: i + self.ps]) in self.pages:
            i += self.ps
        return i

    def touch(self, salt: str | None, key: tuple[int, ...], upto: int, hit: bool) -> None:
        for j in range(self.ps, upto + 1, self.ps):
            page = self.pages[(salt, key[:j])]
            page.time = self.clock
            page.hits += hit

    def match(self, salt: str | None, key: tuple[int, ...]) -> list[int]:
        self.clock += 1
        n = self.cached_len(salt, key)
        self.touch(salt, key, n, hit=True)
        return [s for j in range(self.ps, n + 1, self.ps) for s in self.pages[(salt, key[:j])].slots]

    def insert(self, salt: str | None, key: tuple[int, ...], slots: list[int]) -> int:
        self.clock += 1
        aligned = len(key) // self.ps * self.ps
        n = self.cached_len(salt, key)
        self.touch(salt, key, n, hit=False)
        for j in range(n + self.ps, aligned + 1, self.ps):
            self.pages[(salt, key[:j])] = RefPage(tuple(slots[j - self.ps : j]), self.clock)
        return n

    def locked(self) -> set[Prefix]:
        return {(s, p[:j]) for _, s, p in self.locks for j in range(self.ps, len(p) + 1, self.ps)}

    def priority(self, prefix: Prefix) -> tuple[int, ...]:
        page = self.pages[prefix]
        return (page.hits, page.time) if self.policy == "lfu" else (page.time,)


def tree_pages(cache: RadixCache, page_size: int) -> dict[Prefix, tuple[int, ...]]:
    """Every cached prefix in the real tree, read through the public node fields."""
    out: dict[Prefix, tuple[int, ...]] = {}
    for salt in SALTS:
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.match_prefix([], salt).last_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                full, vals = path + tuple(child.key), child.value.tolist()
                for j in range(page_size, len(child.key) + 1, page_size):
                    out[(salt, full[: len(path) + j])] = tuple(vals[j - page_size : j])
                stack.append((child, full))
    return out


def check_against_ref(cache: RadixCache, ref: RefCache, alloc: TokenSlotAllocator) -> None:
    """Content, sizes, lock accounting and slot ownership (no leak, no double free) match the model."""
    ps = ref.ps
    cache.check_integrity()
    got = tree_pages(cache, ps)
    assert got == {k: v.slots for k, v in ref.pages.items()}
    total, protected = len(ref.pages) * ps, len(ref.locked()) * ps
    assert (cache.total_size(), cache.protected_size()) == (total, protected)
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert alloc.available_size() + cache.total_size() == alloc.total_slots
    # Drain the allocator: every free page must be distinct and not owned by the tree.
    rest = alloc.alloc(alloc.available_size())
    assert rest is not None
    free_pages = (rest // ps).tolist()[::ps]
    tree_page_ids = {s // ps for slots in got.values() for s in slots}
    assert len(set(free_pages)) == len(free_pages)
    assert not tree_page_ids & set(free_pages)
    assert len(tree_page_ids) + len(free_pages) == alloc.num_pages - 1
    alloc.free(rest)


# ---- property test --------------------------------------------------------------------------------

PAGE_POOL = [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1), (1, 1, 1, 1)]


def key_strategy(page_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    if page_size == 1:
        return st.lists(st.integers(0, 2), max_size=10).map(tuple)
    pages = st.lists(st.sampled_from(PAGE_POOL), max_size=3)
    tail = st.lists(st.integers(0, 1), max_size=page_size - 1)
    return st.tuples(pages, tail).map(lambda pt: tuple(t for p in pt[0] for t in p) + tuple(pt[1]))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_matches_reference_model(page_size: int, policy: str, data: st.DataObject) -> None:
    ps = page_size
    alloc = TokenSlotAllocator(640 * ps, page_size=ps)
    cache = RadixCache(alloc, page_size=ps, eviction_policy=policy)
    ref = RefCache(ps, policy)
    history: list[tuple[int, ...]] = []
    inserted = evicted = cached = 0
    ops = st.sampled_from(["insert", "extend", "match", "lock", "unlock", "evict"])
    salts, fresh_keys = st.sampled_from(SALTS), key_strategy(ps)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(ops, label="op")
        salt = data.draw(salts, label="salt")
        if len(history) > 0 and data.draw(st.booleans(), label="reuse key"):
            key = history[data.draw(st.integers(0, len(history) - 1), label="key index")]
        else:
            key = data.draw(fresh_keys, label="key")
            history.append(key)
        aligned = len(key) // ps * ps
        if op == "insert":
            slots = alloc.alloc(len(key))
            assert slots is not None
            expected = ref.insert(salt, key, slots.tolist())
            prefix_len = cache.insert(list(key), slots, cache_salt=salt)
            assert prefix_len == expected
            inserted += aligned - prefix_len
            alloc.free(slots[:prefix_len])  # our duplicates
            alloc.free(slots[aligned:])  # the partial page is never cached
        elif op == "extend":  # the scheduler's pattern: reuse the matched slots, compute the rest
            res = cache.match_prefix(key, cache_salt=salt)
            assert res.slots.tolist() == ref.match(salt, key)
            m = len(res.slots)
            new = alloc.alloc(len(key) - m)
            assert new is not None
            slots = torch.cat([res.slots, new])
            expected = ref.insert(salt, key, slots.tolist())
            prefix_len = cache.insert(key, slots, cache_salt=salt)
            assert prefix_len == expected >= m
            cached += m
            inserted += aligned - prefix_len
            alloc.free(slots[m:prefix_len])
            alloc.free(slots[aligned:])
        elif op in ("match", "lock"):
            res = cache.match_prefix(key, cache_salt=salt)
            expected_slots = ref.match(salt, key)
            assert res.slots.dtype == torch.int64
            assert res.slots.tolist() == expected_slots
            m = len(expected_slots)
            cached += m
            # last_node ends exactly at the match: the keys from root to it spell key[:m].
            parts, node = [], res.last_node
            while node.parent is not None:
                parts.append(tuple(node.key))
                node = node.parent
            assert tuple(t for p in reversed(parts) for t in p) == key[:m]
            if op == "lock":
                cache.inc_lock_ref(res.last_node)
                ref.locks.append((res.last_node, salt, key[:m]))
        elif op == "unlock" and ref.locks:
            i = data.draw(st.integers(0, len(ref.locks) - 1), label="lock")
            cache.dec_lock_ref(ref.locks.pop(i)[0])
        elif op == "evict":
            want = data.draw(st.integers(0, 6 * ps), label="evict")
            before, locked = set(ref.pages), ref.locked()
            unlocked_before = len(before - locked) * ps
            freed = cache.evict(want)
            after = set(tree_pages(cache, ps))
            gone = before - after
            assert after <= before and freed == len(gone) * ps
            assert not gone & locked, "evicted a locked node or an ancestor of one"
            assert freed >= min(want, unlocked_before)
            if gone:
                parents = {(s, p[:-ps]) for s, p in after}
                leaves = after - parents - locked
                worst = max(ref.priority(p) for p in gone)
                # Policy order: everything evicted ranks before every evictable leaf left behind.
                assert all(ref.priority(p) >= worst for p in leaves)
                # No overshoot beyond the last node: without the worst-ranked pages we were short.
                last = sum(1 for p in gone if ref.priority(p) == worst)
                assert (len(gone) - last) * ps < want
            for p in gone:
                del ref.pages[p]
            evicted += freed
        check_against_ref(cache, ref, alloc)
        assert (cache.stats.inserted_tokens, cache.stats.evicted_tokens) == (inserted, evicted)
        assert cache.stats.cached_tokens == cached
    for node, _, _ in ref.locks:
        cache.dec_lock_ref(node)
    ref.locks.clear()
    assert cache.protected_size() == 0
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.total_slots


# ---- unit tests -----------------------------------------------------------------------------------


def make(page_size: int = 1, policy: str = "lru", slots: int = 1024) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(slots, page_size=page_size)
    return alloc, RadixCache(alloc, page_size=page_size, eviction_policy=policy)


def put(
    alloc: TokenSlotAllocator, cache: RadixCache, key: list[int], salt: str | None = None
) -> torch.Tensor:
    """Insert ``key`` with fresh slots, freeing our duplicates; returns the slots the tree now owns."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    prefix_len = cache.insert(key, slots, cache_salt=salt)
    alloc.free(slots[:prefix_len])
    return slots[prefix_len:]


def test_match_splits_node_and_returns_inserted_slots() -> None:
    alloc, cache = make()
    slots = alloc.alloc(5)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    res = cache.match_prefix([1, 2, 3, 9])
    assert res.slots.tolist() == slots[:3].tolist()
    assert res.last_node.key == (1, 2, 3) and res.last_node.value.tolist() == slots[:3].tolist()
    (child,) = res.last_node.children.values()
    assert child.key == (4, 5) and child.value.tolist() == slots[3:].tolist()
    assert child.parent is res.last_node and res.last_node.parent is not None
    assert cache.total_size() == 5
    cache.check_integrity()
    # Insert diverging inside a node splits it too, and reports the shared prefix length.
    assert cache.insert([1, 2, 3, 4, 7], torch.tensor([90, 91, 92, 93, 94])) == 4
    assert cache.match_prefix([1, 2, 3, 4, 7]).slots.tolist() == slots[:4].tolist() + [94]
    assert cache.total_size() == 6
    cache.check_integrity()
    assert "len=" in cache.pretty_print()


def test_insert_copies_slots() -> None:
    alloc, cache = make()
    slots = torch.tensor([5, 6, 7])
    cache.insert([1, 2, 3], slots)
    slots[:] = 0  # the caller reusing its buffer must not corrupt the tree
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [5, 6, 7]


def test_page_alignment() -> None:
    alloc, cache = make(page_size=4)
    slots = alloc.alloc(10)
    assert slots is not None
    assert cache.insert(list(range(10)), slots) == 0
    assert cache.total_size() == 8  # only whole pages are cached
    alloc.free(slots[8:])
    assert cache.match_prefix(list(range(7))).slots.tolist() == slots[:4].tolist()
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 7]).slots.tolist() == slots[:4].tolist()
    assert len(cache.match_prefix([0, 1, 2])[0]) == 0
    assert cache.insert(list(range(12)), torch.arange(100, 112)) == 8
    assert cache.total_size() == 12
    cache.check_integrity()


def test_salt_isolation() -> None:
    alloc, cache = make()
    a = put(alloc, cache, [1, 2, 3], salt="a")
    assert len(cache.match_prefix([1, 2, 3], cache_salt="b").slots) == 0
    assert len(cache.match_prefix([1, 2, 3]).slots) == 0
    b = put(alloc, cache, [1, 2, 3], salt="b")  # nothing shared: the tree owns a second copy
    assert len(b) == 3 and not set(a.tolist()) & set(b.tolist())
    assert cache.match_prefix([1, 2, 3], cache_salt="a").slots.tolist() == a.tolist()
    assert cache.match_prefix([1, 2, 3], cache_salt="b").slots.tolist() == b.tolist()
    assert cache.total_size() == 6
    res = cache.match_prefix([1, 2], cache_salt="a")
    cache.inc_lock_ref(res.last_node)
    assert cache.protected_size() == 2  # salt "b" stays evictable
    assert cache.evict(100) == 4  # all of "b", and the unlocked tail of "a"
    assert len(cache.match_prefix([1, 2, 3], cache_salt="b").slots) == 0
    assert cache.match_prefix([1, 2, 3], cache_salt="a").slots.tolist() == a[:2].tolist()
    cache.dec_lock_ref(res.last_node)
    assert cache.evict(100) == 2 and cache.total_size() == 0
    assert alloc.available_size() == alloc.total_slots
    cache.check_integrity()


@pytest.mark.parametrize(("policy", "first_victim"), [("lru", "y"), ("lfu", "x")])
def test_lru_vs_lfu_order(policy: str, first_victim: str) -> None:
    alloc, cache = make(policy=policy)
    keys = {"x": [1, 1, 1], "y": [2, 2, 2]}
    put(alloc, cache, keys["x"])
    put(alloc, cache, keys["y"])
    cache.match_prefix(keys["y"])
    cache.match_prefix(keys["y"])
    cache.match_prefix(keys["x"])  # x: most recent, 1 hit; y: older, 2 hits
    assert cache.evict(1) == 3
    survivor = "x" if first_victim == "y" else "y"
    assert len(cache.match_prefix(keys[first_victim]).slots) == 0
    assert len(cache.match_prefix(keys[survivor]).slots) == 3


def test_evict_parent_after_children_and_never_locked() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5, 6])  # root -> [1,2] -> {[3,4], [5,6]}
    locked = cache.match_prefix([1, 2, 5, 6]).last_node
    cache.inc_lock_ref(locked)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    assert cache.evict(100) == 2  # only [3,4]; [1,2] is an ancestor of a locked node
    assert cache.match_prefix([1, 2, 5, 6]).slots.numel() == 4
    cache.dec_lock_ref(locked)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(locked)
    assert cache.evict(1) == 2  # leaf [5,6] first (whole node), then its parent becomes a candidate
    assert cache.evict(1) == 2 and cache.total_size() == 0
    assert alloc.available_size() == alloc.total_slots


def test_reset_frees_everything() -> None:
    alloc, cache = make(page_size=2)
    for key in ([1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [9, 9]):
        put(alloc, cache, key)
    put(alloc, cache, [1, 2], salt="s")
    assert cache.total_size() == 12
    node = cache.match_prefix([9, 9]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.total_slots
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 0
    cache.check_integrity()


def test_disable_mode() -> None:
    alloc = TokenSlotAllocator(64)
    cache = RadixCache(alloc, disable=True)
    slots = alloc.alloc(4)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4], slots) == 0
    res = cache.match_prefix([1, 2, 3, 4])
    assert res.slots.numel() == 0 and res.last_node.parent is None
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert alloc.available_size() == alloc.total_slots - 4  # the caller still owns its slots
    assert cache.stats.match_calls == 1 and cache.stats.hit_rate == 0.0


def test_stats_and_bad_policy() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 7, 7])
    assert (cache.stats.queried_tokens, cache.stats.cached_tokens, cache.stats.inserted_tokens) == (4, 2, 4)
    assert cache.stats.hit_rate == 0.5
    with pytest.raises(ValueError):
        RadixCache(alloc, eviction_policy="fifo")


def test_lfu_split_keeps_hit_count() -> None:
    alloc, cache = make(policy="lfu")
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [5, 5])
    for _ in range(3):
        cache.match_prefix([1, 2, 3, 4])
    for _ in range(4):
        cache.match_prefix([5, 5])
    cache.match_prefix([1, 2, 9])  # split: [1,2] has 4 hits (newest), [3,4] keeps 3
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 2  # [3,4] went first (fewest hits)
    assert cache.evict(1) == 2  # then [5,5] (4 hits) before [1,2] (5 hits after the match above)
    assert cache.match_prefix([5, 5]).slots.numel() == 0
    assert cache.match_prefix([1, 2]).slots.numel() == 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3000),
    cut=st.integers(0, 3000),
    page_size=st.sampled_from([1, 16]),
    seed=st.integers(0, 2**16),
)
def test_long_keys_match_up_to_first_mismatch(n: int, cut: int, page_size: int, seed: int) -> None:
    """Long keys exercise the sliced comparison (binary search) that short keys never reach."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randint(0, 50_000, (n,), generator=gen).tolist()
    alloc, cache = make(page_size=page_size, slots=8192 + page_size)
    slots = put(alloc, cache, key)
    cut = min(cut, n)
    probe = key[:cut] + [50_001] + key[cut + 1 :]  # differs exactly at `cut` (if cut < n)
    expected = (min(cut, n) // page_size) * page_size
    res = cache.match_prefix(probe)
    assert res.slots.tolist() == slots[:expected].tolist()
    assert cache.insert(probe, torch.arange(len(probe)) + 10_000) == expected
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_freed_slots_come_back_as_ascending_runs(page_size: int) -> None:
    """Slots freed together are handed out again in ascending order, whatever order they were freed in (the
    attention kernels read consecutive slots fastest; a shared prefix must be one run for the cascade)."""
    alloc = TokenSlotAllocator(64 * page_size, page_size=page_size)
    first = alloc.alloc(12 * page_size)
    assert first is not None and torch.equal(first, torch.arange(first[0], first[0] + 12 * page_size))
    alloc.free(first.flip(0))  # freed in descending order
    again = alloc.alloc(12 * page_size)
    assert again is not None and torch.equal(again, first)
    alloc.free(again[torch.randperm(again.numel(), generator=torch.Generator().manual_seed(0))])
    third = alloc.alloc(5 * page_size)
    assert third is not None and torch.equal(third, first[: 5 * page_size])
