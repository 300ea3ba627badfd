"""Suffix decoding's index: the trie against plain counting, the LRU budget, namespaces (tenant isolation)."""

from __future__ import annotations

import random

import pytest

from radixrt.speculative.suffix import SuffixTrie, draft_naive
from radixrt.speculative.suffix_cache import SuffixCache


def _stream(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random tokens with repeats (copied spans), so matches and continuations of many lengths occur."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(1, 8)])
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def _substring_counts(corpus: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seq in corpus:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                key = tuple(seq[i:j])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in (node.children or {}).items():
            out[path + (tok,)] = child.count
            stack.append((path + (tok,), child))
    return out


def test_draft_examples() -> None:
    t = SuffixTrie(8)
    t.add([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    # after [1, 2, 3]: 4 twice, 5 once -> 4 (p 2/3); then after [1, 2, 3, 4]: 1 once -> p 2/3
    assert t.draft([9, 1, 2, 3], 5, 4, 0.5) == ([4, 1, 2, 3], pytest.approx(4 * 2 / 3))
    assert t.draft([9, 1, 2, 3], 5, 4, 0.7) == ([], 0.0)  # 2/3 is under the threshold
    assert t.draft([7, 7], 5, 4, 0.1) == ([], 0.0)  # nothing matches
    assert t.draft([3, 4], 5, 2, 0.1)[0] == [1, 2]  # match [3, 4] once, continued by 1 then 2


def test_trie_matches_naive_counting_on_random_streams() -> None:
    rng = random.Random(0)
    for trial in range(40):
        depth = rng.randint(2, 7)
        vocab = 2 + trial % 6
        corpus = [_stream(rng, rng.randint(0, 40), vocab) for _ in range(rng.randint(1, 4))]
        trie = SuffixTrie(depth)
        for seq in corpus:
            trie.add(seq)
        assert _trie_counts(trie) == _substring_counts(corpus, depth)
        assert trie.nodes == len(_substring_counts(corpus, depth))
        for _ in range(15):
            ctx = _stream(rng, rng.randint(0, 12), vocab)
            k, max_match, min_prob = (
                rng.randint(1, 6),
                rng.randint(1, depth),
                rng.choice([0.0, 0.1, 0.3, 0.6]),
            )
            got = trie.draft(ctx, max_match, k, min_prob)
            want = draft_naive(corpus, ctx, depth, max_match, k, min_prob)
            assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (corpus, ctx, depth, k, min_prob)


def test_grow_equals_add_and_remove_undoes_add() -> None:
    rng = random.Random(1)
    for _ in range(20):
        depth = rng.randint(2, 6)
        seq = _stream(rng, rng.randint(1, 60), 4)
        grown = SuffixTrie(depth)
        cut = 0
        while cut < len(seq):  # a growing sequence, extended in random steps
            cut = min(len(seq), cut + rng.randint(1, 5))
            grown.grow(seq[:cut])
            assert _trie_counts(grown) == _substring_counts([seq[:cut]], depth)
        other = _stream(rng, rng.randint(1, 40), 4)
        both = SuffixTrie(depth)
        both.add(seq)
        both.add(other)
        both.remove(seq)
        assert _trie_counts(both) == _substring_counts([other], depth)
        assert both.nodes == len(_trie_counts(both))
        both.remove(other)
        assert both.nodes == 0 and not both.root.children


def test_cache_lru_budget_and_dedup() -> None:
    cache = SuffixCache(depth=4, max_tokens=10)
    cache.add(None, [1, 2, 3, 4])
    cache.add(None, [5, 6, 7])
    cache.add(None, [1, 2, 3, 4])  # served again: moved to the back, not counted twice
    assert cache.tokens == 7 and cache.sequences == 2
    trie = cache.trie(None)
    assert trie is not None and trie.find([1, 2]) is not None and trie.find([1, 2]).count == 1  # type: ignore[union-attr]
    cache.add(None, [8, 9, 10, 11])  # over budget: the least recent ([5, 6, 7]) goes
    assert cache.tokens == 8 and trie.find([5]) is None and trie.find([1, 2, 3]) is not None
    assert _trie_counts(trie) == _substring_counts([[1, 2, 3, 4], [8, 9, 10, 11]], 4)
    cache.add(None, list(range(100, 130)))  # longer than the budget: its last 10 tokens, alone
    assert cache.tokens == 10 and _trie_counts(trie) == {} and cache.trie(None) is not trie
    assert _trie_counts(cache.trie(None)) == _substring_counts([list(range(120, 130))], 4)  # type: ignore[arg-type]


def test_namespaces_never_share_drafts() -> None:
    """A tenant's served text never appears in another namespace's drafts, and eviction keeps it so."""
    rng = random.Random(2)
    cache = SuffixCache(depth=6, max_tokens=400)
    served: dict[str, list[list[int]]] = {"alpha": [], "beta": []}
    for _ in range(60):
        ns = rng.choice(["alpha", "beta"])
        base = 0 if ns == "alpha" else 1000  # disjoint vocabularies make leaks visible
        seq = [base + t for t in _stream(rng, rng.randint(5, 30), 5)]
        cache.add(ns, seq)
        served[ns].append(seq)
        for probe_ns, probe_base in (("alpha", 0), ("beta", 1000)):
            trie = cache.trie(probe_ns)
            if trie is None:
                continue
            assert all(tok // 1000 == probe_base // 1000 for path in _trie_counts(trie) for tok in path)
            ctx = [probe_base + t for t in _stream(rng, 4, 5)]
            draft, _ = trie.draft(ctx, 5, 4, 0.0)
            assert all(tok // 1000 == probe_base // 1000 for tok in draft)
    # the other namespace's context (its tokens) finds nothing in this one
    alpha = cache.trie("alpha")
    assert alpha is not None and alpha.draft(served["beta"][-1], 5, 4, 0.0) == ([], 0.0)


def test_growing_sequence_indexed_from_start() -> None:
    """``SuffixTrie(depth, start)``: a request's own trie skips the prompt before its window (issue 23)."""
    seq = [5, 6, 7, 8, 1, 2, 3, 9, 1, 2]
    whole, windowed = SuffixTrie(6), SuffixTrie(6, start=4)
    whole.grow(seq)
    windowed.grow(seq)
    assert whole.find([6, 7]) is not None and windowed.find([6, 7]) is None
    assert windowed.find([1, 2, 3]) is not None and windowed.draft(seq, 4, 2, 0.0)[0] == [3, 9]
    assert windowed.nodes < whole.nodes
