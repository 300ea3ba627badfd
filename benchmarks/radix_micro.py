"""Microbenchmark: ``match_prefix`` + ``insert`` of one long key against a large radix cache.

Run from the repo root: ``python -m benchmarks.radix_micro`` (prints JSON). Target: each op under
2 ms for an 8k-token key against a tree holding 1M tokens (page_size 1).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

import torch

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.radix_cache import RadixCache

VOCAB = 150_000


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _insert(cache: RadixCache, alloc: TokenSlotAllocator, key: list[int]) -> None:
    slots = alloc.alloc(len(key))
    assert slots is not None, "benchmark allocator too small"
    prefix_len = cache.insert(key, slots)
    alloc.free(slots[:prefix_len])  # duplicates of cached tokens stay ours


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def bench_match_insert(tree_tokens: int = 1_000_000, key_len: int = 8192, repeats: int = 20) -> dict:
    """Build a ~``tree_tokens`` tree of random prefix-sharing sequences, then time ops on ``key_len`` keys.

    Each repeat takes a fresh key that shares a random-length prefix with a cached sequence (so the
    match usually ends inside a node and splits it) and continues with new tokens; it times
    ``match_prefix(key)`` and then ``insert(key, slots)`` separately. Returns ms statistics.
    """
    rng = random.Random(0)
    alloc = TokenSlotAllocator(tree_tokens + (repeats + 2) * key_len + 1, page_size=1)
    cache = RadixCache(alloc)
    # A few long "system prompts", each continued by many requests that branch at random points.
    prompts = [_random_tokens(rng, rng.randrange(512, 4096)) for _ in range(32)]
    sequences: list[list[int]] = []
    while cache.total_size() < tree_tokens:
        base = rng.choice(sequences) if sequences and rng.random() < 0.5 else rng.choice(prompts)
        cut = rng.randrange(len(base) // 2, len(base) + 1)
        seq = base[:cut] + _random_tokens(rng, rng.randrange(256, key_len))
        seq = seq[:key_len]
        _insert(cache, alloc, seq)
        sequences.append(seq)
    build_tokens = cache.total_size()

    match_ms: list[float] = []
    insert_ms: list[float] = []
    matched: list[int] = []
    for _ in range(repeats):
        base = rng.choice(sequences)
        cut = rng.randrange(0, len(base) + 1)
        key = base[:cut] + _random_tokens(rng, key_len - cut)
        slots = alloc.alloc(key_len)
        assert slots is not None
        gc.collect()  # keep collector pauses of the benchmark's own garbage out of the timings
        t0 = time.perf_counter()
        res = cache.match_prefix(key)
        t1 = time.perf_counter()
        prefix_len = cache.insert(key, slots)
        t2 = time.perf_counter()
        alloc.free(slots[:prefix_len])
        match_ms.append((t1 - t0) * 1e3)
        insert_ms.append((t2 - t1) * 1e3)
        matched.append(len(res.slots))
    total_ms = [a + b for a, b in zip(match_ms, insert_ms, strict=True)]
    cache.check_integrity()
    return {
        "tree_tokens": build_tokens,
        "tree_sequences": len(sequences),
        "key_len": key_len,
        "repeats": repeats,
        "mean_matched_tokens": statistics.fmean(matched),
        "match_ms_median": statistics.median(match_ms),
        "match_ms_p90": _percentile(match_ms, 0.9),
        "insert_ms_median": statistics.median(insert_ms),
        "insert_ms_p90": _percentile(insert_ms, 0.9),
        "match_insert_ms_median": statistics.median(total_ms),
        "match_insert_ms_p90": _percentile(total_ms, 0.9),
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print(json.dumps(bench_match_insert(), indent=2))
