"""The KV memory hierarchy: host tier behind the RadixCache, persistent disk tier.

Oracles: a token-derived KV pattern that every tier move must preserve (unit tests of the tree), outputs of
the same engine with the tiers off (and HF), the original KV bytes of a node loaded back from the host,
and a restarted engine that must serve a prefix from disk exactly when the files are genuine.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from radixrt import Engine
from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.disk_store import DiskStore
from radixrt.mem_cache.hiradix_cache import HiRadixCache
from radixrt.mem_cache.host_pool import HostPool
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.mem_cache.tree_node import TreeNode
from tests.engine_fixtures import make_engine, prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TIERS = {"enable_hierarchical_cache": True}


# ---- the tree's tier moves against a token-derived KV pattern ---------------------------------------


def pattern(tokens: list[int], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V that identify each token (and layer): what every tier must hand back unchanged."""
    t = torch.tensor(tokens, dtype=torch.float32)
    k = torch.stack([t + 1000 * layer for layer in range(layers)])[:, :, None, None].expand(-1, -1, 2, 4)
    return k.contiguous(), (-k).contiguous()


def check_tier_contents(cache: HiRadixCache, pool: KVPool, host: HostPool) -> None:
    """Every node's KV on every tier it is on equals the pattern of its tokens."""
    cache.check_integrity()
    stack: list[TreeNode] = [r for r in cache._roots.values()]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is None:
            continue
        want_k, want_v = pattern(list(node.key), pool.num_layers)
        for src, slots in ((pool, node.value), (host.pool, node.host_value)):
            if slots is not None:
                k, v = src.read_slots(slots)
                assert torch.equal(k, want_k) and torch.equal(v, want_v), f"{node!r}: KV changed on a move"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_tier_moves_keep_kv_and_accounting(policy: str, page_size: int) -> None:
    """Random inserts, matches with load-back, locks and evictions: after every step the tree's walk agrees
    with its counters on both pools, nothing leaks, and every node's KV is still its tokens' pattern."""
    ps, layers = page_size, 2
    alloc = TokenSlotAllocator(48 * ps + ps, page_size=ps)
    pool = KVPool(alloc.num_pages * ps, layers, 2, 4, torch.float32)
    host = HostPool(pool, 64 * ps, ps)
    cache = HiRadixCache(alloc, pool, ps, "lru", host, None, policy)
    rng = random.Random(ps * 7 + len(policy))
    keys = [[rng.randrange(3) for _ in range(rng.randrange(1, 10) * ps)] for _ in range(12)]
    locks: list[TreeNode] = []
    loaded = backed = 0
    for _ in range(300):
        op = rng.choice(["insert", "insert", "match", "match", "lock", "unlock", "evict"])
        key = rng.choice(keys)
        if op == "insert":
            m = cache.match_prefix(key)
            if m.host_nodes:
                cache.inc_lock_ref(m.last_node)
                with cache.pinned(m.host_nodes):
                    cache.evict(m.host_len - alloc.available_size())
                cache.dec_lock_ref(m.last_node)
                m = cache.load_back(m)
            n = len(m.slots)
            cache.evict(len(key) - n - alloc.available_size())
            new = alloc.alloc(len(key) - n)
            if new is None:
                continue
            pool.write_slots(new, *pattern(key[n:], layers))
            slots = torch.cat([m.slots, new])
            prefix_len = cache.insert(key, slots)
            alloc.free(slots[n:prefix_len])
        elif op in ("match", "lock"):
            m = cache.match_prefix(key)
            if op == "lock" and not m.host_nodes:
                cache.inc_lock_ref(m.last_node)
                locks.append(m.last_node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op == "evict":
            cache.evict(rng.randrange(1, 12) * ps)
        assert alloc.available_size() + cache.total_size() == alloc.total_slots
        check_tier_contents(cache, pool, host)
        loaded, backed = cache.tier_stats.host_load_tokens, cache.tier_stats.host_backup_tokens
    assert loaded > 0 and backed > 0, "the workload never moved KV between the tiers"
    for node in locks:
        cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == alloc.total_slots and host.available_size() == host.total_slots


def test_host_tier_has_its_own_lru_and_capacity() -> None:
    alloc = TokenSlotAllocator(9, page_size=1)  # 8 device slots
    pool = KVPool(9, 1, 2, 4, torch.float32)
    host = HostPool(pool, 8, 1)  # 8 host slots
    cache = HiRadixCache(alloc, pool, 1, "lru", host, None, "write_back")
    for i in range(4):  # four 4-token keys: 16 tokens for 8 device + 8 host slots
        key = [10 * i + j for j in range(4)]
        cache.evict(4 - alloc.available_size())
        slots = alloc.alloc(4)
        assert slots is not None
        pool.write_slots(slots, *pattern(key, 1))
        cache.insert(key, slots)
        check_tier_contents(cache, pool, host)
    tiers = [cache.match_prefix([10 * i + j for j in range(4)]) for i in range(4)]
    # newest two on the device, the two before on the host, nothing forgotten yet
    assert [len(m.slots) for m in tiers] == [0, 0, 4, 4] and [m.host_len for m in tiers] == [4, 4, 0, 0]
    cache.match_prefix([0, 1, 2, 3])  # touch key 0 on the host: key 1 is now the host tier's LRU
    cache.evict(4)  # a device eviction needs host room: the host tier drops key 1
    assert cache.match_prefix([10, 11, 12, 13]).host_len == 0
    assert cache.match_prefix([0, 1, 2, 3]).host_len == 4
    assert cache.tier_stats.host_evicted_tokens == 4 and cache.host_size() == 8
    check_tier_contents(cache, pool, host)


def test_disk_tier_has_its_own_lru_and_capacity(tmp_path: Path) -> None:
    def store() -> DiskStore:
        return DiskStore(tmp_path, {"model": "m"}, 4, (1, 2, 4), torch.float32, capacity_bytes=3 * size)

    probe = DiskStore(tmp_path / "probe", {"model": "m"}, 4, (1, 2, 4), torch.float32, 1 << 20)
    probe.put("0" * 32, 0, None, *pattern([1, 2, 3, 4], 1))
    probe.close()
    size = probe.size_bytes  # one chunk's file
    disk = store()
    keys = disk.chunk_keys(None, list(range(20)), 5)
    for i in range(3):
        assert disk.put(keys[i], i, None, *pattern(list(range(4 * i, 4 * i + 4)), 1))
    disk.flush()
    assert disk.get(keys[0], 0, None) is not None  # chunk 0 is now the most recently used
    for i in (3, 4):
        disk.put(keys[i], i, None, *pattern(list(range(4 * i, 4 * i + 4)), 1))
    disk.close()
    disk.check_integrity(files=True)
    assert [disk.contains(k) for k in keys] == [True, False, False, True, True]
    assert disk.stats.evicted_files == 2
    again = store()  # a restart finds the same three chunks, in LRU order
    again.check_integrity(files=True)
    assert [again.contains(k) for k in keys] == [True, False, False, True, True]
    k, v = again.get(keys[0], 0, None) or (None, None)
    assert k is not None and torch.equal(k, pattern([0, 1, 2, 3], 1)[0])
    assert again.get(keys[3], 2, None) is None, "a chunk read at the wrong position is rejected"
    again.close()


# ---- the engine: identical outputs, loaded back not recomputed ----------------------------------------


def chat_turns(eng: Engine, convs: list[list[int]], turns: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hist = [list(c) for c in convs]
    outs = []
    for _ in range(turns):
        for i, h in enumerate(hist):
            out = eng.generate(input_ids=h, sampling_params=GREEDY)
            details = out["meta_info"].get("cached_tokens_details")
            if details is not None:
                assert min(details.values()) >= 0 and details["disk"] == 0
            outs.append(out["output_ids"])
            hist[i] = h + out["output_ids"] + [rng.randrange(10, 8000) for _ in range(12)]
    return outs


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_outputs_identical_with_tiers_on_and_off(tiny_llama: Path, engine_factory, policy: str) -> None:
    convs = prompts_of([70] * 5, seed=31)
    off = engine_factory(tiny_llama, max_total_tokens=256)
    on = engine_factory(tiny_llama, max_total_tokens=256, hicache_write_policy=policy, **TIERS)
    ref = chat_turns(off, convs, 3, seed=32)
    got = chat_turns(on, convs, 3, seed=32)
    assert got == ref
    assert ref[0] == hf_greedy(tiny_llama, convs[0], GREEDY["max_new_tokens"])
    i_off, i_on = off.get_server_info(), on.get_server_info()
    assert i_on["cached_tokens_host"] > 0 and i_on["host_load_tokens"] > 0
    assert i_on["computed_prefill_tokens"] < i_off["computed_prefill_tokens"]


def test_node_evicted_to_host_is_loaded_back_bitwise(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama, max_total_tokens=160, page_size=4, **TIERS)
    a = prompts_of([64], seed=33)[0]
    first = {**GREEDY, "max_new_tokens": 1}
    eng.generate(input_ids=a, sampling_params=first)

    def kv_of(prefix: list[int]) -> Any:
        def read(s: Any) -> Any:
            m = s.tree.match_prefix(prefix)
            return len(m.slots), m.host_len, s.runner.kv_pool.read_slots(m.slots) if len(m.slots) else None

        return eng.worker.call(read)

    n, host_len, original = kv_of(a[:60])
    assert (n, host_len) == (60, 0)
    eng.generate(input_ids=prompts_of([120], seed=34), sampling_params=first)  # pushes `a` off the device
    n, host_len, _ = kv_of(a[:60])
    assert n < 60 and n + host_len == 60, "the evicted prefix should be on the host"
    before = eng.get_server_info()
    again = eng.generate(input_ids=a, sampling_params=first)
    after = eng.get_server_info()
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] == host_len and again["meta_info"]["cached_tokens"] == 60
    # never recomputed: only the 4 tokens past the last whole cached page went through the model
    assert after["computed_prefill_tokens"] - before["computed_prefill_tokens"] == 4
    n, host_len, loaded = kv_of(a[:60])
    assert (n, host_len) == (60, 0)
    assert torch.equal(loaded[0].view(torch.uint8), original[0].view(torch.uint8))
    assert torch.equal(loaded[1].view(torch.uint8), original[1].view(torch.uint8))
    # /metrics exposes the split and the tier counters, from the same worker stats
    from prometheus_client.parser import text_string_to_metric_families

    from radixrt.server.http.metrics import ServerMetrics

    samples = {
        (s.name, s.labels.get("tier")): s.value
        for fam in text_string_to_metric_families(ServerMetrics("m").render(after, None).decode())
        for s in fam.samples
    }
    assert samples[("radixrt:cached_tokens_by_tier_total", "host")] == after["cached_tokens_host"] >= host_len
    assert samples[("radixrt:cached_tokens_by_tier_total", "device")] == after["cached_tokens_device"]
    assert samples[("radixrt:host_backup_tokens_total", None)] >= 60
    assert samples[("radixrt:host_load_tokens_total", None)] == after["host_load_tokens"] > 0
    assert samples[("radixrt:kv_host_total_tokens", None)] > 0


# ---- the disk tier: restart, rejection --------------------------------------------------------------


def disk_engine(path: Path, store: Path, **kw: Any) -> Engine:
    return make_engine(path, hicache_storage_dir=str(store), **TIERS, **kw)


def run_and_close(eng: Engine, ids: list[int], **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Generate once, check the invariants (every pool, the disk directory), shut down (drains writes)."""
    try:
        out = eng.generate(input_ids=ids, sampling_params=GREEDY, **kw)
        eng.check_invariant()
        info = eng.get_server_info()
    finally:
        eng.shutdown()
    eng.worker.scheduler.tree.disk.check_integrity(files=True)
    return out, info


def disk_files(eng: Engine, ids: list[int], salt: str | None = None) -> tuple[DiskStore, list[Path]]:
    disk = eng.worker.scheduler.tree.disk
    keys = disk.chunk_keys(salt, ids, len(ids) // disk.chunk_tokens)
    return disk, [disk.path(k) for k in keys]


def test_disk_tier_survives_a_restart(tiny_llama: Path, tmp_path: Path) -> None:
    ids = prompts_of([200], seed=35)[0]
    ref = hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    out, info = run_and_close(disk_engine(tiny_llama, tmp_path), ids)
    assert out["output_ids"] == ref and info["disk_written_chunks"] >= 12
    eng = disk_engine(tiny_llama, tmp_path)
    disk, files = disk_files(eng, ids)
    assert all(f.is_file() for f in files[:12])
    out, info = run_and_close(eng, ids)
    assert out["output_ids"] == ref
    assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 192}
    assert info["computed_prefill_tokens"] == 200 - 192 and info["disk_rejected_files"] == 0


def test_disk_tier_rejects_corrupt_truncated_and_foreign_files(
    tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = prompts_of([200], seed=36)[0]
    ref = hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    eng = disk_engine(tiny_llama, tmp_path)
    _, files = disk_files(eng, ids)
    run_and_close(eng, ids)
    pristine = [f.read_bytes() for f in files[:12]]

    data = bytearray(pristine[5])
    data[-3] ^= 0x40  # one flipped bit in chunk 5's payload
    files[5].write_bytes(bytes(data))
    files[8].write_bytes(pristine[8][: len(pristine[8]) // 2])  # chunk 8 truncated
    caplog.set_level(logging.WARNING, logger="radixrt.mem_cache.disk_store")
    out, info = run_and_close(disk_engine(tiny_llama, tmp_path), ids)
    assert out["output_ids"] == ref
    assert out["meta_info"]["cached_tokens_details"]["disk"] == 5 * 16  # up to the corrupt chunk
    assert info["disk_rejected_files"] == 1 and "checksum" in caplog.text
    assert files[5].read_bytes() != bytes(data), "the rejected file is replaced by a recomputed chunk"
    out, info = run_and_close(disk_engine(tiny_llama, tmp_path), ids)  # chunk 5 recomputed and rewritten
    assert out["meta_info"]["cached_tokens_details"]["disk"] == 8 * 16 and info["disk_rejected_files"] == 1
    assert "truncated" in caplog.text or "not a valid safetensors" in caplog.text

    # Files copied under the keys another model / page size / namespace would read: found, never served.
    for path, kw, salt in (
        (tiny_qwen2, {}, None),
        (tiny_llama, {"page_size": 4}, None),
        (tiny_llama, {}, "x"),
    ):
        eng = disk_engine(path, tmp_path, **kw)
        disk, theirs = disk_files(eng, ids, salt)
        for mine, target in zip(files[:4], theirs[:4], strict=True):
            shutil.copy(mine, target)
        disk.rescan()  # pick up the planted files as a restart would
        out, info = run_and_close(eng, ids, cache_salt=salt)
        assert out["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
        assert out["meta_info"]["cached_tokens_details"]["disk"] == 0
        assert info["disk_rejected_files"] == 1
    assert "identity" in caplog.text and "namespace" in caplog.text
