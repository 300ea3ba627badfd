"""Radix-tree prefix cache: token ids -> the KV slots that already hold their keys and values.

Each node owns the slot indices of the tokens on its edge. Finished requests ``insert`` their tokens;
new requests ``match_prefix`` to reuse the longest cached page-aligned prefix. Nodes in use are locked
(ref counts up to the namespace root); unlocked leaves are evicted least-recently (or least-frequently)
used first. Every ``cache_salt`` (namespace) gets its own root, so tenants never share a node.

Requests carry a priority (default 0): the nodes a request inserts or matches take the larger of theirs
and its; with ``eviction_policy="priority"`` lower priorities are evicted first, least recently used
first within a priority. TTL pins (``pin``; the cache's `PinTable` ``pins``, ``pins.py``) keep prefixes
from eviction until they expire.

With tenants, every node records its tenant and the tree counts each tenant's tokens. Given the tenants'
shares (`TenantShares`), eviction takes the leaves of tenants over their KV quota first (least recently
used among them), and never cuts into another tenant's reserved share to make room for a requester.

Sizes (evictable, protected, per tenant) count device-resident tokens. This tree drops what it evicts;
`HiRadixCache` (``hiradix_cache.py``) overrides the tier hooks below to move evicted nodes to a host pool
instead, so nodes may then be off the device (``value`` None) and ``match_prefix`` reports them apart.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import torch

from radixrt.mem_cache.pins import PinResult, PinTable, PinView, pin_id_of, pinnable_prefix
from radixrt.mem_cache.tree_node import (
    CacheStats,
    MatchResult,
    SlotFreer,
    TenantShares,
    TreeNode,
    as_tuple,
    child_key,
    common_prefix_len,
)

__all__ = [
    "CacheStats", "MatchResult", "PinResult", "PinView", "RadixCache", "SlotFreer", "TenantShares", "TreeNode",
]  # fmt: skip

_EVICTION_POLICIES = ("lru", "lfu", "priority")


class RadixCache:
    """Radix tree over token ids whose nodes own KV slots; see the module docstring.

    ``max_pinned_tokens`` caps the TTL pins; ``clock`` (seconds, monotonic) times them. ``pin`` pins a
    prefix; ``pins`` (`PinTable`) lists, drops, expires and counts the pins.
    """

    def __init__(
        self,
        allocator: SlotFreer,
        page_size: int = 1,
        eviction_policy: str = "lru",
        disable: bool = False,
        max_pinned_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if eviction_policy not in _EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {_EVICTION_POLICIES}, got {eviction_policy!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.disable = disable
        self.stats = CacheStats()
        self.shares: TenantShares | None = None
        self.tenant_evicted: dict[str | None, int] = {}
        self._empty = torch.empty(0, dtype=torch.int64)
        self._clock = 0
        self.pins = PinTable(max_pinned_tokens, clock, self.inc_lock_ref, self.dec_lock_ref)
        self._clear()

    # ---- public API -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every pin and node and free its slots; the caller guarantees no request holds a lock."""
        self.pins.drop_all()
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} locked tokens")
        values = [
            n.value for root in self._roots.values() for n in self._iter_nodes(root) if n.value is not None
        ]
        if values:
            self.allocator.free(torch.cat(values))
        self._clear()

    def match_prefix(
        self, key: Sequence[int], cache_salt: str | None = None, priority: int | None = None
    ) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` in the ``cache_salt`` namespace.

        Splits the last node when the match ends inside it, so ``last_node`` ends exactly at the match;
        refreshes access time and hit count of every matched node (and the pins the match covers whole);
        with a ``priority``, raises the matched nodes' to it. ``slots`` and ``last_node`` cover the
        device-resident part; host-only nodes that continue it are ``host_nodes``.
        """
        self.stats.match_calls += 1
        self.stats.queried_tokens += len(key)
        root = self._roots.get(cache_salt)
        if root is None:
            # NOTE: an unregistered empty root; locking a root is a no-op, so callers may hold it safely.
            return MatchResult(self._empty, self._new_root())
        if self.disable or len(key) < self.page_size:
            return MatchResult(self._empty, root)
        tkey = self._aligned(as_tuple(key))
        self._clock += 1
        node, matched, path = self._walk(root, tkey, self._clock)
        for n in path:
            n.hit_count += 1
            if priority is not None and n.priority < priority:
                n.priority = priority
        self.pins.refresh(path)
        dev = next((i for i, n in enumerate(path) if n.value is None), len(path))
        values = [n.value for n in path[:dev] if n.value is not None]
        self.stats.cached_tokens += sum(len(v) for v in values)
        if not values:
            return MatchResult(self._empty, root, tuple(path))
        return MatchResult(torch.cat(values), path[dev - 1], tuple(path[dev:]))

    def insert(
        self,
        key: Sequence[int],
        slots: torch.Tensor,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> int:
        """Cache ``key[:aligned_len]`` (whole pages only) with ``slots`` (one per token, at least aligned_len).

        Returns ``prefix_len``, how many leading tokens were already cached on the device. The tree takes
        ownership of (a copy of) ``slots[prefix_len:aligned_len]``; the caller keeps, and must free, the
        slots it computed for positions below ``prefix_len`` (duplicates) and from ``aligned_len`` on.
        Host-only nodes on the path take the caller's slots (they are on the device again). ``tenant``
        owns the namespace ``cache_salt`` (recorded when the namespace is created). The nodes along the
        key take the larger of their priority and ``priority`` (default 0); new nodes take ``priority``.
        """
        if self.disable:
            return 0
        tkey = self._aligned(as_tuple(key))
        n = len(tkey)
        if n == 0:
            return 0
        if slots.numel() < n:
            raise ValueError(f"insert: {slots.numel()} slots for {n} tokens")
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = self._new_root(tenant)
        elif root.tenant != tenant:
            raise ValueError(
                f"insert: namespace {cache_salt!r} belongs to tenant {root.tenant!r}, not {tenant!r}"
            )
        self._clock += 1
        node, walked, path = self._walk(root, tkey, self._clock)
        prio = 0 if priority is None else priority
        prefix_len, i = walked, 0
        for p in path:
            if p.priority < prio:
                p.priority = prio
            if p.value is None:  # host-only: it takes the caller's (freshly computed) slots
                prefix_len = min(prefix_len, i)
                self._set_device(p, slots[i : i + len(p.key)].to(torch.int64).clone())
                self.stats.inserted_tokens += len(p.key)
            i += len(p.key)
        if walked < n:
            leaf = TreeNode(
                tkey[walked:], slots[walked:n].to(torch.int64).clone(), node, self._clock, priority=prio
            )
            self._evictable_leaves.discard(node)  # node stops being a (device) leaf
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_leaves.add(leaf)
            self._evictable += n - walked
            self._tenant_tokens[tenant] = self._tenant_tokens.get(tenant, 0) + n - walked
            self.stats.inserted_tokens += n - walked
            self._on_new_leaf(leaf)
        return prefix_len

    def pin(self, key: Sequence[int], cache_salt: str | None, ttl_s: float) -> PinResult:
        """Pin the longest page-aligned, device-resident prefix of ``key`` that the pin budget allows for
        ``ttl_s`` seconds (an existing pin of the same prefix gets the later expiry)."""
        root = self._roots.get(cache_salt)
        if self.disable or root is None or ttl_s <= 0:
            return PinResult(None, 0)
        tkey = self._aligned(as_tuple(key))
        matched, pinned = pinnable_prefix(root, tkey, self.page_size)
        room = self.pins.room(root.tenant, self.shares)
        target = min(matched, pinned + room - room % self.page_size)
        if target <= 0:
            return PinResult(None, 0)
        self._clock += 1
        node, walked, _ = self._walk(root, tkey[:target], self._clock)
        assert walked == target and node.value is not None
        return self.pins.add(pin_id_of(cache_salt, tkey[:target]), node, target, ttl_s, root.tenant)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors against eviction (the root never counts); all on the device."""
        assert node.parent is None or node.value is not None, f"locking {node!r}, which is not on the device"
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; raises RuntimeError if ``node`` is not locked."""
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if self._is_device_leaf(node):
                    self._evictable_leaves.add(node)
            node = node.parent

    def evict(
        self,
        num_tokens: int,
        requester: str | None = None,
        only: str | None = None,
        spare_reserved: bool = True,
        incoming: int = 0,
    ) -> int:
        """Free unlocked leaves in policy order until ``num_tokens`` are freed; returns tokens freed.

        May overshoot by less than one node, or free less when nothing more is evictable. With tenant
        shares set: leaves of tenants over their quota go first (the requester counts the ``incoming``
        tokens it is about to take, so a tenant growing past its quota makes room from its own prefixes
        before anyone else's); another tenant's leaves are kept while
        they are within its reserved share (unless ``spare_reserved`` is False: the last resort that lets
        running requests progress); ``only`` restricts eviction to that tenant's leaves. Expired pins are
        released first; live ones are locks, never evicted.
        """
        self.pins.expire()
        if num_tokens <= 0 or not self._evictable_leaves:
            return 0
        running = self.shares.running_tokens() if self.shares is not None else {}

        def allowed(n: TreeNode) -> bool:
            if only is not None and n.tenant != only:
                return False
            if self.shares is None or not spare_reserved or n.tenant == requester:
                return True
            return self._tenant_tokens.get(n.tenant, 0) - len(n.key) >= self.shares.reserved_tokens(n.tenant)

        def rank(n: TreeNode) -> tuple[int | float, ...]:
            if self.shares is None:
                return self._policy_key(n)
            held = self._tenant_tokens.get(n.tenant, 0) + running.get(n.tenant, 0)
            if n.tenant == requester:
                held += incoming
            return (0 if held > self.shares.quota_tokens(n.tenant) else 1, *self._policy_key(n))

        heap = [(rank(n), n) for n in self._evictable_leaves if allowed(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            key, node = heapq.heappop(heap)
            if self.shares is not None:
                fresh = rank(node)
                if fresh != key:  # its tenant fell below quota since: back in line with the others
                    heapq.heappush(heap, (fresh, node))
                    continue
                if not allowed(node):
                    continue
            parent = node.parent
            assert parent is not None
            self._evictable_leaves.discard(node)
            self._evict_node(node)
            freed += len(node.key)
            self._evictable -= len(node.key)
            self._tenant_tokens[node.tenant] -= len(node.key)
            self.tenant_evicted[node.tenant] = self.tenant_evicted.get(node.tenant, 0) + len(node.key)
            if parent.parent is not None and parent.lock_ref == 0 and self._is_device_leaf(parent):
                self._evictable_leaves.add(parent)
                if allowed(parent):
                    heapq.heappush(heap, (rank(parent), parent))
        self._prune_roots()
        self.stats.evicted_tokens += freed
        return freed

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Tokens held by the tree (all namespaces)."""
        return self._evictable + self._protected

    def tenant_size(self, tenant: str | None) -> int:
        """Tokens held by the tree in ``tenant``'s namespaces."""
        return self._tenant_tokens.get(tenant, 0)

    def check_integrity(self) -> None:
        """Recompute sizes and structure by walking the tree; raise AssertionError on any mismatch."""
        ps = self.page_size
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        values: list[torch.Tensor] = []
        per_tenant: dict[str | None, int] = {}
        every: list[TreeNode] = []
        for salt, root in self._roots.items():
            assert root.parent is None and not root.key and root.lock_ref == 0, f"bad root for {salt!r}"
            for node in self._iter_nodes(root):
                for ck, child in node.children.items():
                    assert child.parent is node, f"{child!r} has a wrong parent"
                    assert ck == self._child_key(child.key), f"{child!r} under a wrong child key"
                    assert child.lock_ref <= node.lock_ref or node is root, f"{child!r} locked above parent"
                    assert child.priority <= node.priority or node is root, f"{child!r} outranks its parent"
                if node is root:
                    continue
                every.append(node)
                assert len(node.key) > 0 and len(node.key) % ps == 0, f"{node!r} key not page aligned"
                assert node.lock_ref >= 0, f"{node!r} negative lock_ref"
                assert node.tenant == root.tenant, f"{node!r} of tenant {node.tenant!r} under {root.tenant!r}"
                assert node.value is not None or node.host_value is not None, f"{node!r} is in no tier"
                if node.value is None:
                    assert node.lock_ref == 0, f"{node!r} locked off the device"
                    continue
                assert node.value.numel() == len(node.key), f"{node!r} key/value length mismatch"
                parent = node.parent
                assert parent is not None and (parent is root or parent.value is not None), (
                    f"{node!r} misplaced"
                )
                per_tenant[node.tenant] = per_tenant.get(node.tenant, 0) + len(node.key)
                values.append(node.value)
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                    if self._is_device_leaf(node):
                        leaves.add(node)
        assert evictable == self._evictable, f"evictable {self._evictable} != walked {evictable}"
        assert protected == self._protected, f"protected {self._protected} != walked {protected}"
        assert leaves == self._evictable_leaves, "evictable-leaf set out of date"
        counted = {t: n for t, n in self._tenant_tokens.items() if n}
        assert per_tenant == counted, f"tenant sizes {counted} != walked {per_tenant}"
        if values:
            slots = torch.cat(values)
            assert torch.unique(slots).numel() == slots.numel(), "a slot is owned by two nodes"
        self.pins.check(every)

    def pretty_print(self) -> str:
        """A readable dump of every namespace (for debugging)."""
        lines = [
            f"RadixCache(total={self.total_size()}, evictable={self._evictable}, locked={self._protected})"
        ]
        for salt, root in self._roots.items():
            lines.append(f"[salt={salt!r}]")
            stack: list[tuple[TreeNode, int]] = [(c, 1) for c in reversed(list(root.children.values()))]
            while stack:
                node, depth = stack.pop()
                head = ",".join(map(str, node.key[:8])) + (",..." if len(node.key) > 8 else "")
                lines.append(
                    f"{'  ' * depth}[{head}] len={len(node.key)} lock={node.lock_ref} pins={node.pin_ref} "
                    f"prio={node.priority} t={node.last_access_time} hits={node.hit_count} "
                    f"in={'+'.join(node.tiers())}"
                )
                stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)

    # ---- internals --------------------------------------------------------------------------------

    def _clear(self) -> None:
        self._roots: dict[str | None, TreeNode] = {}
        self._evictable = 0
        self._protected = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._tenant_tokens: dict[str | None, int] = {}

    def _new_root(self, tenant: str | None = None) -> TreeNode:
        return TreeNode((), self._empty, None, 0, tenant)

    def _aligned(self, key: tuple[int, ...]) -> tuple[int, ...]:
        ps = self.page_size
        return key if ps == 1 or len(key) % ps == 0 else key[: len(key) // ps * ps]

    def _child_key(self, key: tuple[int, ...], start: int = 0) -> int | tuple[int, ...]:
        return child_key(key, start, self.page_size)

    def _policy_key(self, node: TreeNode) -> tuple[int | float, ...]:
        """Eviction order among a tenant class: the smallest key goes first."""
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time, node.id)
        if self.eviction_policy == "priority":
            return (node.priority, node.last_access_time, node.id)
        return (node.last_access_time, node.id)

    def _walk(self, root: TreeNode, key: tuple[int, ...], now: int) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow ``key`` (page aligned) from ``root``; returns (last node, matched tokens, matched path).

        Splits the node where the match stops inside its key and stamps ``now`` on every matched node.
        """
        node, i, path = root, 0, []
        n = len(key)
        while i < n:
            child = node.children.get(self._child_key(key, i))
            if child is None:
                break
            klen = len(child.key)
            m = common_prefix_len(child.key, key[i : i + klen])
            m -= m % self.page_size
            if m < klen:
                child = self._split(child, m)
            child.last_access_time = now
            path.append(child)
            node, i = child, i + m
            if m < klen:
                break
        return node, i, path

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (0 < at < len, page aligned); returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        value, host = node.value, node.host_value
        upper = TreeNode(node.key[:at], None if value is None else value[:at], parent, node.last_access_time)
        upper.lock_ref = node.lock_ref  # same locked prefix, so sizes do not move
        upper.hit_count = node.hit_count
        upper.priority, upper.pin_ref = node.priority, node.pin_ref  # pins end at or below ``node``
        upper.on_disk = node.on_disk
        parent.children[self._child_key(upper.key)] = upper
        node.key, node.parent = node.key[at:], upper
        node.value = None if value is None else value[at:]
        if host is not None:
            upper.host_value, node.host_value = host[:at], host[at:]
        upper.children[self._child_key(node.key)] = node
        return upper

    # ---- tier hooks (the device-only tree frees and drops; HiRadixCache moves KV between tiers) -----

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """On the device with no child on the device: what device eviction may take (when unlocked)."""
        return node.value is not None and not any(c.value is not None for c in node.children.values())

    def _evict_node(self, node: TreeNode) -> None:
        """Take unlocked device leaf ``node`` off the device (sizes are the caller's); here: drop it."""
        assert node.value is not None
        self.allocator.free(node.value)
        node.value = None
        self._unlink(node)

    def _unlink(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        node.parent = None

    def _set_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give unlocked ``node`` (not on the device, its parent is) device ``slots`` and count them."""
        assert node.value is None and node.lock_ref == 0 and node.parent is not None
        node.value = slots
        self._evictable += len(node.key)
        self._tenant_tokens[node.tenant] = self._tenant_tokens.get(node.tenant, 0) + len(node.key)
        self._evictable_leaves.discard(node.parent)
        if self._is_device_leaf(node):
            self._evictable_leaves.add(node)
        self._on_device_again(node)

    def _on_device_again(self, node: TreeNode) -> None:
        """``node`` is back on the device (loaded back, or recomputed by an insert)."""

    def _on_new_leaf(self, leaf: TreeNode) -> None:
        """``insert`` created ``leaf`` (on the device)."""

    def _prune_roots(self) -> None:
        for salt in [s for s, root in self._roots.items() if not root.children]:
            del self._roots[salt]

    @staticmethod
    def _iter_nodes(root: TreeNode) -> list[TreeNode]:
        out, stack = [], [root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
