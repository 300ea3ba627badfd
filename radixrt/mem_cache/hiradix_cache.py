"""HiRadixCache: the RadixCache with a host tier and a persistent disk tier behind the same tree.

- **Device -> host.** Device eviction (same order as the plain tree: policy, tenants) copies a node's KV
  into the host pool instead of dropping it; the node stays in the tree, host-only. With no host room
  left after the host tier's own LRU eviction, the node (and its host-only subtree) is forgotten.
  ``write_back`` copies at eviction and frees the host copy when the node is on the device again (one
  copy at a time); ``write_through`` copies every new node at insert and keeps the copy, so a later
  eviction only frees device slots.
- **Host -> device.** ``match_prefix`` returns the device part of a match plus the host-only nodes that
  continue it; ``load_back`` copies those into fresh device slots before the request's extend. Nodes
  being loaded are pinned so that the evictions making room cannot drop them.
- **Disk.** Every insert writes the whole chunks of the inserted key that the disk tier lacks
  (asynchronously, `DiskStore`); at admission, past the end of the tree's match, ``disk_plan`` finds the
  stored chunks that continue the prefix and ``load_disk`` reads them into fresh device slots and
  inserts them into the tree. After a restart the tree is empty and the disk tier serves the prefix.

The host tier's LRU orders host-only leaves and (write-through) duplicate host copies by last access
(by request priority first under the ``priority`` policy). TTL-pinned prefixes are locked on the device,
so no tier drops them; the host copies of pinned nodes (duplicates) go last.
Sizes of the plain tree keep counting device tokens; the host tier counts its own (`check_tiers`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.disk_store import DiskStore
from radixrt.mem_cache.host_pool import HostPool
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.tree_node import MatchResult, TreeNode, as_tuple

WRITE_POLICIES = ("write_back", "write_through")


@dataclass(slots=True)
class TierStats:
    """Token moves between tiers since start."""

    host_backup_tokens: int = 0  # device -> host copies
    host_load_tokens: int = 0  # host -> device (load-back before an extend)
    host_evicted_tokens: int = 0  # dropped by the host tier's LRU
    device_dropped_tokens: int = 0  # evicted from the device with no host room: forgotten
    disk_load_tokens: int = 0  # disk -> device


class DiskPlan(NamedTuple):
    """Stored chunks ``first .. first + len(keys)`` continue a match that ends at token ``start``."""

    start: int
    first: int
    keys: list[str]
    chunk_tokens: int

    @property
    def end(self) -> int:
        return (self.first + len(self.keys)) * self.chunk_tokens

    @property
    def tokens(self) -> int:
        return self.end - self.start


class HiRadixCache(RadixCache):
    """The tiered tree; see the module docstring. ``host`` and ``disk`` are optional tiers."""

    def __init__(
        self,
        allocator: TokenSlotAllocator,
        device_pool: KVPool,
        page_size: int = 1,
        eviction_policy: str = "lru",
        host: HostPool | None = None,
        disk: DiskStore | None = None,
        write_policy: str = "write_back",
        max_pinned_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: {write_policy!r} not in {WRITE_POLICIES}")
        if disk is not None and disk.chunk_tokens % page_size:
            raise ValueError(f"disk chunks of {disk.chunk_tokens} tokens are not whole pages of {page_size}")
        super().__init__(
            allocator, page_size, eviction_policy, max_pinned_tokens=max_pinned_tokens, clock=clock
        )
        self.device_allocator = allocator
        self.device_pool = device_pool
        self.host = host
        self.disk = disk
        self.write_through = write_policy == "write_through"
        self.tier_stats = TierStats()
        self._host_nodes: set[TreeNode] = set()
        self._host_tokens = 0
        self._pinned: set[TreeNode] = set()

    # ---- public API -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every node of the device and host tiers (the disk tier persists)."""
        super().reset()
        if self.host is not None:
            self.host.allocator.clear()
        self._host_nodes.clear()
        self._host_tokens = 0

    def insert(
        self,
        key: Sequence[int],
        slots: torch.Tensor,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> int:
        """``RadixCache.insert``, then queue the key's whole chunks that the disk tier lacks."""
        prefix_len = super().insert(key, slots, cache_salt, tenant, priority)
        if self.disk is not None and not self.disable:
            self._persist(self._aligned(as_tuple(key)), slots, cache_salt)
        return prefix_len

    def host_size(self) -> int:
        """Tokens held in the host pool."""
        return self._host_tokens

    @contextmanager
    def pinned(self, nodes: Sequence[TreeNode]) -> Iterator[None]:
        """Keep ``nodes`` in the host tier (its LRU skips them) while the caller makes device room."""
        added = [n for n in nodes if n not in self._pinned]
        self._pinned.update(added)
        try:
            yield
        finally:
            self._pinned.difference_update(added)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy ``match``'s host-only nodes into fresh device slots (the caller made room; nothing is
        loaded when the slots are not free) and return the match extended over them."""
        nodes = match.host_nodes
        n = match.host_len
        if not nodes or self.host is None:
            return match
        slots = self.device_allocator.alloc(n)
        if slots is None:
            return match
        off = 0
        for node in nodes:
            part = slots[off : off + len(node.key)]
            off += len(node.key)
            assert node.host_value is not None and node.value is None
            self.host.pool.copy_to(self.device_pool, node.host_value, part)
            self._set_device(node, part)
        self.tier_stats.host_load_tokens += n
        return MatchResult(torch.cat([match.slots, slots]), nodes[-1])

    def disk_plan(self, key: Sequence[int], cache_salt: str | None, start: int) -> DiskPlan | None:
        """The disk tier's chunks that continue a match of ``key`` ending at token ``start`` (whole
        chunks within ``key``), or None."""
        disk = self.disk
        if disk is None or self.disable or (disk.num_chunks == 0 and disk.pending_chunks == 0):
            return None
        c = disk.chunk_tokens
        usable, first = len(key) // c, start // c
        if first >= usable:
            return None
        keys = disk.chunk_keys(cache_salt, key, usable)
        end = first
        while end < usable and disk.contains(keys[end]):
            end += 1
        return DiskPlan(start, first, keys[first:end], c) if end > first else None

    def load_disk(
        self,
        key: Sequence[int],
        cache_salt: str | None,
        tenant: str | None,
        match: MatchResult,
        plan: DiskPlan,
    ) -> tuple[MatchResult, int]:
        """Read ``plan``'s chunks into fresh device slots (the caller made room), stopping at the first
        missing or rejected one; insert them after ``match`` and return the new match and tokens loaded."""
        assert self.disk is not None and not match.host_nodes and len(match.slots) == plan.start
        slots = self.device_allocator.alloc(plan.tokens)
        if slots is None:
            return match, 0
        got, pos = 0, plan.start
        for i, chunk_key in enumerate(plan.keys):
            chunk = plan.first + i
            kv = self.disk.get(chunk_key, chunk, cache_salt)
            if kv is None:
                break
            lo = pos - chunk * plan.chunk_tokens
            take = plan.chunk_tokens - lo
            self.device_pool.write_slots(slots[got : got + take], kv[0][:, lo:], kv[1][:, lo:])
            got, pos = got + take, pos + take
        self.device_allocator.free(slots[got:])  # whole pages: chunk ends and the match end are aligned
        if got == 0:
            return match, 0
        full = torch.cat([match.slots, slots[:got]])
        tkey = self._aligned(as_tuple(key))[: plan.start + got]
        prefix_len = RadixCache.insert(self, tkey, full, cache_salt, tenant)
        if prefix_len > plan.start:  # someone cached part of it meanwhile: ours are duplicates
            self.device_allocator.free(full[plan.start : prefix_len])
        self._mark_on_disk(tkey, len(tkey), cache_salt)
        self.tier_stats.disk_load_tokens += got
        return self.match_prefix(tkey, cache_salt), got

    def close(self) -> None:
        """Finish the disk tier's queued writes."""
        if self.disk is not None:
            self.disk.close()

    def tier_snapshot(self) -> dict[str, float]:
        """Sizes and counters of the host and disk tiers (tokens, chunks, bytes) for the stats."""
        out: dict[str, float] = {k: float(v) for k, v in asdict(self.tier_stats).items()}
        out["kv_host_total_tokens"] = self.host.total_slots if self.host is not None else 0
        out["kv_host_used_tokens"] = self._host_tokens
        if self.disk is not None:
            d = self.disk
            d.check_dir()  # a directory deleted under us: recreated, its chunks no longer counted
            out.update(
                disk_tier_failed=float(d.failure is not None),
                disk_chunks=d.num_chunks,
                disk_tokens=d.num_chunks * d.chunk_tokens,
                disk_bytes=d.size_bytes,
                disk_pending_chunks=d.pending_chunks,
                **{f"disk_{k}": float(v) for k, v in asdict(d.stats).items()},
            )
        return out

    def check_tiers(self, idle: bool = False) -> None:
        """The host pool's and disk tier's accounting (cheap; every scheduler step in tests)."""
        if self.host is not None:
            free, total = self.host.available_size(), self.host.total_slots
            assert free + self._host_tokens == total, (
                f"host KV leak: free {free} + held {self._host_tokens} != {total}"
            )
        assert not (idle and self._pinned), f"{len(self._pinned)} host nodes still pinned at idle"
        if self.disk is not None:
            self.disk.check_integrity()

    def check_integrity(self) -> None:
        super().check_integrity()
        held: set[TreeNode] = set()
        values = []
        for root in self._roots.values():
            for node in self._iter_nodes(root):
                if node.host_value is not None:
                    assert node.host_value.numel() == len(node.key), f"{node!r} host length mismatch"
                    held.add(node)
                    values.append(node.host_value)
        assert held == self._host_nodes, "host node set out of date"
        assert sum(v.numel() for v in values) == self._host_tokens, "host size out of date"
        if values:
            slots = torch.cat(values)
            assert torch.unique(slots).numel() == slots.numel(), "a host slot is owned by two nodes"
        self.check_tiers()

    # ---- tier hooks -------------------------------------------------------------------------------

    def _evict_node(self, node: TreeNode) -> None:
        assert node.value is not None
        if self.host is not None and node.host_value is None:
            host_slots = self._host_alloc(len(node.key))
            if host_slots is not None:
                self.device_pool.copy_to(self.host.pool, node.value, host_slots)
                self._add_host(node, host_slots)
                self.tier_stats.host_backup_tokens += len(node.key)
        if node.host_value is not None:
            self.device_allocator.free(node.value)
            node.value = None
            return
        self.tier_stats.device_dropped_tokens += len(node.key)
        for d in self._iter_nodes(node):  # its descendants are host-only: forget them too
            if d is not node and d.host_value is not None:
                self._remove_host(d)
        super()._evict_node(node)

    def _on_device_again(self, node: TreeNode) -> None:
        if not self.write_through and node.host_value is not None:
            self._remove_host(node)  # write-back: one copy at a time

    def _on_new_leaf(self, leaf: TreeNode) -> None:
        if self.write_through and self.host is not None and leaf.value is not None:
            host_slots = self._host_alloc(len(leaf.key))
            if host_slots is not None:
                self.device_pool.copy_to(self.host.pool, leaf.value, host_slots)
                self._add_host(leaf, host_slots)
                self.tier_stats.host_backup_tokens += len(leaf.key)

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        upper = super()._split(node, at)
        if upper.host_value is not None:
            self._host_nodes.add(upper)
        if node in self._pinned:
            self._pinned.add(upper)
        return upper

    # ---- the host tier ----------------------------------------------------------------------------

    def _add_host(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        node.host_value = host_slots
        self._host_nodes.add(node)
        self._host_tokens += len(node.key)

    def _remove_host(self, node: TreeNode) -> None:
        assert self.host is not None and node.host_value is not None
        self.host.free(node.host_value)
        node.host_value = None
        self._host_nodes.discard(node)
        self._host_tokens -= len(node.key)

    def _host_alloc(self, num_tokens: int) -> torch.Tensor | None:
        assert self.host is not None
        slots = self.host.alloc(num_tokens)
        if slots is None:
            self._evict_host(num_tokens - self.host.available_size())
            slots = self.host.alloc(num_tokens)
        return slots

    def _host_evictable(self, node: TreeNode) -> bool:
        """A duplicate host copy (write-through), or a host-only leaf, not pinned."""
        return (
            node.host_value is not None
            and node not in self._pinned
            and (node.value is not None or not node.children)
        )

    def _host_key(self, node: TreeNode) -> tuple[int, ...]:
        """Host eviction order, smallest first: copies of pinned nodes last, then (with the priority
        policy) lower priority first, then least recently used."""
        prio = node.priority if self.eviction_policy == "priority" else 0
        return (1 if node.pin_ref else 0, prio, node.last_access_time, node.id)

    def _evict_host(self, num_tokens: int) -> int:
        """Free host copies in `_host_key` order until ``num_tokens`` are free; returns tokens."""
        heap = [(self._host_key(n), n) for n in self._host_nodes if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            freed += len(node.key)
            self.tier_stats.host_evicted_tokens += len(node.key)
            self._remove_host(node)
            if node.value is None:  # host-only leaf: forget it
                parent = node.parent
                self._unlink(node)
                if parent is not None and parent.parent is not None and self._host_evictable(parent):
                    heapq.heappush(heap, (self._host_key(parent), parent))
        self._prune_roots()
        return freed

    # ---- the disk tier ----------------------------------------------------------------------------

    def _persist(self, key: tuple[int, ...], slots: torch.Tensor, cache_salt: str | None) -> None:
        """Queue the whole chunks of ``key`` (KV at ``slots``) that the disk tier does not have."""
        disk = self.disk
        assert disk is not None
        c = disk.chunk_tokens
        num_chunks = min(len(key), slots.numel()) // c
        if num_chunks == 0:
            return
        keys = disk.chunk_keys(cache_salt, key, num_chunks)
        todo = [i for i in range(num_chunks) if not disk.contains(keys[i])]
        if todo:
            k, v = self.device_pool.read_slots(torch.cat([slots[i * c : (i + 1) * c] for i in todo]))
            for j, i in enumerate(todo):
                part = slice(j * c, (j + 1) * c)
                disk.put(keys[i], i, cache_salt, k[:, part].contiguous(), v[:, part].contiguous())
        self._mark_on_disk(key, num_chunks * c, cache_salt)

    def _mark_on_disk(self, key: tuple[int, ...], upto: int, cache_salt: str | None) -> None:
        """Flag the nodes along ``key`` that lie wholly within its first ``upto`` tokens (no splits)."""
        node = self._roots.get(cache_salt)
        i = 0
        while node is not None and i < upto:
            child = node.children.get(self._child_key(key, i)) if i < len(key) else None
            if child is None or i + len(child.key) > upto or key[i : i + len(child.key)] != child.key:
                return
            child.on_disk = True
            node, i = child, i + len(child.key)
