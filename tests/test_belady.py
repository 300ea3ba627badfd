"""The prefix-cache simulator of benchmarks/belady.py against naive references: longest common prefixes
(unbounded cache), a token-set re-implementation of LRU / priority eviction, and a brute-force optimum
over every eviction choice where Belady's rule is provably optimal (unit-size pages)."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.belady import TraceRequest, simulate, working_set


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _random_trace(rng: random.Random, n: int, vocab: int = 3, max_len: int = 8) -> list[TraceRequest]:
    """Requests that often extend or share earlier ones (a few namespaces, priorities 0..2)."""
    trace: list[TraceRequest] = []
    for _ in range(n):
        if trace and rng.random() < 0.6:
            base = rng.choice(trace)
            seq = (base.prompt + base.output)[: rng.randint(1, len(base.prompt) + len(base.output))]
            ns = base.namespace
        else:
            seq, ns = [], rng.choice([None, "a"])
        prompt = seq + [rng.randrange(vocab) for _ in range(rng.randint(1, max_len // 2))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        trace.append(TraceRequest(prompt, output, ns, rng.randrange(3)))
    return trace


class NaiveCache:
    """Reference: the cache as a set of cached token prefixes with per-prefix access time and priority,
    and the set of prefixes where a tree node ends (a match end, an insert's branch point and end).
    A leaf node is the run of prefixes above a childless node end up to the previous node end."""

    def __init__(self, capacity: int, policy: str, min_compute: int = 1) -> None:
        self.capacity, self.policy, self.min_compute = capacity, policy, min_compute
        self.access: dict[tuple[int | str | None, ...], int] = {}
        self.priority: dict[tuple[int | str | None, ...], int] = {}
        self.ends: set[tuple[int | str | None, ...]] = set()

    def _walk(self, ns: str | None, seq: list[int], t: int, prio: int, insert: bool) -> int:
        m = 0
        while m < len(seq) and (ns, *seq[: m + 1]) in self.access:
            m += 1
        upto = len(seq) if insert else m
        for k in range(1, upto + 1):
            key = (ns, *seq[:k])
            self.access[key] = t
            self.priority[key] = max(self.priority.get(key, 0), prio)
        if m:
            self.ends.add((ns, *seq[:m]))
        if insert and seq:
            self.ends.add((ns, *seq))
        return m

    def _leaf_run(self, end: tuple[int | str | None, ...]) -> list[tuple[int | str | None, ...]]:
        run = [end]
        while len(run[-1]) > 2 and run[-1][:-1] not in self.ends:
            run.append(run[-1][:-1])
        return run

    def step(self, t: int, req: TraceRequest) -> int:
        ns = req.namespace
        hit = self._walk(ns, req.prompt[: max(len(req.prompt) - self.min_compute, 0)], t, req.priority, False)
        full = req.prompt + req.output
        self._walk(ns, full, t, req.priority, True)
        locked = {(ns, *full[:k]) for k in range(1, len(full) + 1)}
        while len(self.access) > self.capacity:
            leaves = [
                e for e in self.ends
                if e not in locked and not any(len(k) == len(e) + 1 and k[:-1] == e for k in self.access)
            ]  # fmt: skip
            if self.policy == "lru":
                victim = min(leaves, key=lambda e: self.access[e])
            else:
                victim = min(leaves, key=lambda e: (self.priority[e], self.access[e]))
            for key in self._leaf_run(victim):
                del self.access[key], self.priority[key]
                self.ends.discard(key)
        return hit


@pytest.mark.parametrize("seed", range(30))
def test_unbounded_hits_are_longest_common_prefixes(seed: int) -> None:
    trace = _random_trace(random.Random(seed), 25)
    res = simulate(trace, None, "lru")
    for t, req in enumerate(trace):
        limit = req.prompt[: len(req.prompt) - 1]
        best = max(
            (_lcp(limit, r.prompt + r.output) for r in trace[:t] if r.namespace == req.namespace), default=0
        )
        assert res.hits[t] == best, t
    union = {
        (r.namespace, *(r.prompt + r.output)[:k])
        for r in trace
        for k in range(1, len(r.prompt + r.output) + 1)
    }
    assert working_set(trace) == len(union)


@pytest.mark.parametrize("policy", ["lru", "priority"])
@pytest.mark.parametrize("seed", range(40))
def test_lru_and_priority_match_naive_reimplementation(policy: str, seed: int) -> None:
    rng = random.Random(1000 + seed)
    trace = _random_trace(rng, 30)
    capacity = max(len(r.prompt) + len(r.output) for r in trace) + rng.randint(0, 12)
    naive = NaiveCache(capacity, policy)
    expected = [naive.step(t, r) for t, r in enumerate(trace)]
    assert simulate(trace, capacity, policy).hits == expected


@pytest.mark.parametrize("seed", range(40))
def test_belady_beats_lru_and_priority_on_random_traces(seed: int) -> None:
    rng = random.Random(2000 + seed)
    trace = _random_trace(rng, 40)
    capacity = max(len(r.prompt) + len(r.output) for r in trace) + rng.randint(0, 10)
    belady = simulate(trace, capacity, "belady").hit_tokens
    assert belady >= simulate(trace, capacity, "lru").hit_tokens
    assert belady >= simulate(trace, capacity, "priority").hit_tokens
    assert belady <= simulate(trace, None, "lru").hit_tokens


def _paging_optimum(requests: list[int], slots: int, length: int) -> int:
    """Brute force over every choice of victim: the most hit tokens serving page ids ``requests`` with
    ``slots`` page frames (a hit saves the page's ``length`` tokens)."""

    def best(t: int, cached: frozenset[int]) -> int:
        if t == len(requests):
            return 0
        page = requests[t]
        if page in cached:
            return length + best(t + 1, cached)
        if len(cached) < slots:
            return best(t + 1, cached | {page})
        return max(best(t + 1, (cached - {v}) | {page}) for v in cached)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(25))
def test_belady_is_optimal_when_every_request_is_one_whole_leaf(seed: int) -> None:
    rng = random.Random(3000 + seed)
    pages, length, slots = rng.randint(3, 5), rng.randint(2, 4), rng.randint(1, 3)
    seqs = [[100 * p + i for i in range(length)] for p in range(pages)]  # disjoint first tokens
    order = [rng.randrange(pages) for _ in range(rng.randint(6, 11))]
    trace = [TraceRequest(list(seqs[p])) for p in order]
    res = simulate(trace, slots * length, "belady", min_compute=0)
    assert res.hit_tokens == _paging_optimum(order, slots, length)
    # and LRU is no better than the optimum (usually worse)
    assert simulate(trace, slots * length, "lru", min_compute=0).hit_tokens <= res.hit_tokens


def test_belady_keeps_the_prefix_used_again_and_lru_does_not() -> None:
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    trace = [TraceRequest(a), TraceRequest(b), TraceRequest(c), TraceRequest(a)]
    # capacity 8: c evicts one; LRU evicts a (oldest), Belady evicts b (never used again)
    assert simulate(trace, 8, "lru", min_compute=0).hit_tokens == 0
    assert simulate(trace, 8, "belady", min_compute=0).hit_tokens == 4
    prio = [TraceRequest(a, priority=5), TraceRequest(b), TraceRequest(c), TraceRequest(a)]
    assert simulate(prio, 8, "priority", min_compute=0).hit_tokens == 4


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="policy"):
        simulate([], 4, "fifo")
    with pytest.raises(ValueError, match="capacity"):
        simulate([], 0, "lru")
    with pytest.raises(ValueError, match="capacity"):
        simulate([TraceRequest([1, 2, 3]), TraceRequest([4, 5, 6])], 2, "lru")


def test_namespaces_never_share() -> None:
    trace = [TraceRequest([1, 2, 3], namespace="x"), TraceRequest([1, 2, 3, 4], namespace="y")]
    assert simulate(trace, None, "lru").hits == [0, 0]
    assert list(itertools.accumulate(simulate(trace[:1] * 2, None, "lru").hits)) == [0, 2]
