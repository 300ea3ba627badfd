"""The RadixCache of a sliding-window model (``--enable-swa-cache``): nodes whose local-layer K/V was freed.

Every node holds its tokens' full slots (the global layers' K/V, kept as long as the node is cached); the
local layers' K/V of those slots may be freed while the node stays: the node is then a *tombstone*
(``swa_evicted``). A prefix is usable when the next token can attend over its local window, so
``match_prefix`` returns the longest cached prefix whose last ``window - 1`` tokens (or all of it, when it is
shorter) have their local K/V; the tokens past that point are computed again (SGLang's SWA radix cache
semantics). Because tombstones are whole nodes and node ends are page aligned, that prefix ends at a node.

Locks: ``inc_lock_ref(node)`` locks the full K/V of the whole path (as in `RadixCache`) and the local K/V of
the path's tail only: whole nodes up from ``node`` until ``window - 1`` tokens are covered (``swa_lock_ref``).
The tail's length is fixed at the first lock taken at ``node`` (``swa_lock_len``), so every unlock walks the
same tokens even after a node on the way was split.

Eviction: ``evict_swa`` frees the local K/V of nodes no lock keeps (a locked full path may lose the local K/V
above its window): first those no match can end after within a window (not within ``window - 1`` tokens
before a leaf's end or a branch: the early chunks of a long prompt), then the rest, least recently used first
in each class. An unlocked leaf goes whole (a tombstoned leaf serves no match), and the tombstoned leaves that
leaves behind go too. ``evict`` (the full pool) is `RadixCache`'s. Requests free their own out-of-window local
K/V; what they inserted (every prefill chunk is inserted) stays until evicted, so a shared prefix that a later
request continues (a system prompt) keeps its window.

Inserting a request's tokens: the ones whose local K/V the request already freed (out of its window,
``swa_freed_to``) become tombstones; a tombstoned node that the request computed again within its window
takes the request's local K/V (its pages are handed over), so the request's window stays readable through the
tree's slots.

Accounting (`check_integrity`, `KVManager.check_invariant`): for the local pool, free + ``swa_evictable_size``
+ ``swa_protected_size`` + the running requests' own local K/V == total.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import torch

from radixrt.mem_cache.radix_cache import MatchResult, RadixCache
from radixrt.mem_cache.swa_pool import SWAAllocator
from radixrt.mem_cache.tree_node import TreeNode, as_tuple


class SWARadixCache(RadixCache):
    """`RadixCache` over an `SWAAllocator` for a model whose local layers attend over ``window`` tokens."""

    def __init__(
        self,
        allocator: SWAAllocator,
        window: int,
        page_size: int = 1,
        eviction_policy: str = "lru",
        disable: bool = False,
        max_pinned_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.swa = allocator
        self.keep = window - 1  # tokens before a new one that its local attention reads
        self.swa_evicted_tokens = 0  # local K/V freed by evict_swa (tombstoned or dropped with the leaf)
        super().__init__(allocator, page_size, eviction_policy, disable, max_pinned_tokens, clock)

    # ---- sizes ------------------------------------------------------------------------------------

    def swa_evictable_size(self) -> int:
        """Tokens whose local K/V the tree holds unlocked."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        """Tokens whose local K/V the tree holds locked (a running request's or a pin's window)."""
        return self._swa_protected

    # ---- match, insert ----------------------------------------------------------------------------

    def match_prefix(
        self, key: Sequence[int], cache_salt: str | None = None, priority: int | None = None
    ) -> MatchResult:
        """`RadixCache.match_prefix` cut to the longest prefix whose tail window has its local K/V."""
        return self.match_prefix_swa(key, cache_salt, priority)[0]

    def match_prefix_swa(
        self, key: Sequence[int], cache_salt: str | None = None, priority: int | None = None
    ) -> tuple[MatchResult, int]:
        """The match and how many more tokens the tree holds full K/V for past it (they must be computed
        again because the local K/V of their window was freed)."""
        res = super().match_prefix(key, cache_salt, priority)
        if not len(res.slots):
            return res, 0
        path: list[TreeNode] = []
        node = res.last_node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        cut = self._valid_end(path)
        if cut == len(path):
            return res, 0
        kept = sum(len(n.key) for n in path[:cut])
        lost = len(res.slots) - kept
        self.stats.cached_tokens -= lost
        last = path[cut - 1] if cut else node
        return MatchResult(res.slots[:kept], last), lost

    def _valid_end(self, path: list[TreeNode]) -> int:
        """How many nodes of ``path`` (root first) the match keeps: the deepest end whose last ``keep``
        tokens are in nodes with local K/V, or whose whole prefix is."""
        j = len(path)
        while j > 0:
            if path[j - 1].swa_evicted:
                j -= 1
                continue
            run, i = 0, j
            while i > 0 and not path[i - 1].swa_evicted and run < self.keep:
                run += len(path[i - 1].key)
                i -= 1
            if run >= self.keep or i == 0:
                return j
            j = i  # path[i - 1] is a tombstone: every end inside this run has a shorter run
        return 0

    def insert(
        self,
        key: Sequence[int],
        slots: torch.Tensor,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int | None = None,
        swa_freed_to: int = 0,
    ) -> int:
        """`RadixCache.insert`; the caller freed the local K/V of its own tokens below ``swa_freed_to``
        (page aligned): those become tombstones, and tombstoned nodes at or past it take the caller's."""
        prefix_len = super().insert(key, slots, cache_salt, tenant, priority)
        tkey = self._aligned(as_tuple(key))
        n = len(tkey)
        if self.disable or n == 0:
            return prefix_len
        b = min(swa_freed_to, n)
        node, i = self._roots[cache_salt], 0
        while i < n:
            child = node.children[self._child_key(tkey, i)]
            length = len(child.key)
            if i < b < i + length:
                child, length = self._split(child, b - i), b - i
            if i + length <= b:
                if i >= prefix_len and not child.swa_evicted:  # new, its local K/V already freed
                    self._tombstone(child)
            elif child.swa_evicted and i < prefix_len and not self._same_slots(child, slots, i):
                self._revive(child, slots[i : i + length])  # the caller computed it again, in its window
            node, i = child, i + length
        return prefix_len

    @staticmethod
    def _same_slots(node: TreeNode, slots: torch.Tensor, at: int) -> bool:
        """Whether ``node`` holds the caller's own slots from ``at`` (its cached prefix, not a duplicate)."""
        return node.value is not None and int(node.value[0]) == int(slots[at])

    # ---- locks ------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the full K/V of ``node``'s path and the local K/V of its last ``window - 1`` tokens."""
        super().inc_lock_ref(node)
        if node.parent is None:
            return
        if node.own_locks == 0:
            acc, up = 0, node
            while up.parent is not None and acc < self.keep:
                acc += len(up.key)
                up = up.parent
            node.swa_lock_len = acc
        node.own_locks += 1
        self._swa_lock(node, 1)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        super().dec_lock_ref(node)
        if node.parent is None:
            return
        if node.own_locks <= 0:
            raise RuntimeError(f"dec_lock_ref on {node!r}, which holds no lock of its own")
        node.own_locks -= 1
        self._swa_lock(node, -1)

    def _swa_lock(self, node: TreeNode, delta: int) -> None:
        acc, extent = 0, node.swa_lock_len
        while node.parent is not None and acc < extent:
            intact = not node.swa_evicted
            if intact:
                self._swa_forget(node)
            node.swa_lock_ref += delta
            assert node.swa_lock_ref >= 0, f"{node!r} swa_lock_ref below 0"
            if intact:
                self._swa_count(node)
            acc += len(node.key)
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------------------

    def evict_swa(self, num_tokens: int) -> int:
        """Free the local K/V of ``num_tokens`` tokens (or all that is evictable), least recently used
        nodes first; returns the local-pool tokens freed. Unlocked leaves go whole."""
        self.pins.expire()
        if num_tokens <= 0 or not self._swa_nodes:
            return 0
        useful = self._window_useful()
        heap = [((n in useful, *self._policy_key(n)), n) for n in self._swa_nodes]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            if node not in self._swa_nodes:
                continue
            freed += len(node.key)
            self.swa_evicted_tokens += len(node.key)
            if node.lock_ref == 0 and self._is_device_leaf(node):
                self._drop_leaf(node)
            else:
                self._tombstone(node)
        self._prune_roots()
        return freed

    def _window_useful(self) -> set[TreeNode]:
        """The nodes within the last ``window - 1`` tokens before a place a match may end: a leaf's end or a
        branch (two or more children). The rest (a long prompt's early chunks, say) serve no match: their
        local K/V goes first."""
        nearest: dict[TreeNode, int] = {}  # node -> fewest tokens after its end to a match end
        for root in self._roots.values():
            for node in self._iter_nodes(root):
                if node.parent is None or len(node.children) == 1:
                    continue
                acc, up = 0, node
                while up.parent is not None and acc < self.keep and nearest.get(up, self.keep) > acc:
                    nearest[up] = acc
                    acc += len(up.key)
                    up = up.parent
        return set(nearest)

    def _drop_leaf(self, node: TreeNode) -> None:
        """Evict unlocked leaf ``node`` from both pools, then its ancestors that become tombstoned leaves."""
        while True:
            parent = node.parent
            assert parent is not None and node.lock_ref == 0
            n = len(node.key)
            self._evictable_leaves.discard(node)
            self._evict_node(node)
            self._evictable -= n
            self._tenant_tokens[node.tenant] -= n
            self.tenant_evicted[node.tenant] = self.tenant_evicted.get(node.tenant, 0) + n
            self.stats.evicted_tokens += n
            if parent.parent is None or parent.lock_ref or not self._is_device_leaf(parent):
                return
            if not parent.swa_evicted:
                self._evictable_leaves.add(parent)
                return
            node = parent

    def _tombstone(self, node: TreeNode) -> None:
        assert not node.swa_evicted and node.swa_lock_ref == 0 and node.value is not None
        self._swa_forget(node)
        self.swa.free_swa(node.value)
        node.swa_evicted = True

    def _revive(self, node: TreeNode, src: torch.Tensor) -> None:
        assert node.swa_evicted and node.value is not None
        self.swa.move_swa(src, node.value)
        node.swa_evicted = False
        self._swa_count(node)

    # ---- counters and hooks -----------------------------------------------------------------------

    def _swa_count(self, node: TreeNode) -> None:
        """``node`` (intact) enters the local-K/V sizes."""
        if node.swa_lock_ref:
            self._swa_protected += len(node.key)
        else:
            self._swa_evictable += len(node.key)
            self._swa_nodes.add(node)

    def _swa_forget(self, node: TreeNode) -> None:
        """``node`` (intact) leaves the local-K/V sizes."""
        if node.swa_lock_ref:
            self._swa_protected -= len(node.key)
        else:
            self._swa_evictable -= len(node.key)
            self._swa_nodes.discard(node)

    def _clear(self) -> None:
        super()._clear()
        self._swa_evictable = 0
        self._swa_protected = 0
        self._swa_nodes: set[TreeNode] = set()  # intact, no swa lock: what evict_swa may take

    def _on_new_leaf(self, leaf: TreeNode) -> None:
        self._swa_count(leaf)

    def _evict_node(self, node: TreeNode) -> None:
        if not node.swa_evicted:
            self._swa_forget(node)
        super()._evict_node(node)  # the allocator frees the full pages and the local ones they hold

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        upper = super()._split(node, at)  # sizes do not move: both parts keep the node's state
        upper.swa_evicted, upper.swa_lock_ref = node.swa_evicted, node.swa_lock_ref
        if node in self._swa_nodes:
            self._swa_nodes.add(upper)
        return upper

    # ---- checks -----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """`RadixCache.check_integrity`, then the local-K/V state: every intact node's pages hold local
        pages (no two the same), tombstones hold none, the sizes and the locks match a walk."""
        super().check_integrity()
        ps = self.page_size
        nodes = [n for root in self._roots.values() for n in self._iter_nodes(root) if n.parent is not None]
        expect: dict[TreeNode, int] = {}
        for node in nodes:
            acc, up = 0, node
            while node.own_locks and up.parent is not None and acc < node.swa_lock_len:
                expect[up] = expect.get(up, 0) + node.own_locks
                acc += len(up.key)
                up = up.parent
        evictable = protected = 0
        free_nodes: set[TreeNode] = set()
        held: list[torch.Tensor] = []
        for node in nodes:
            assert node.swa_lock_ref == expect.get(node, 0), f"{node!r} swa_lock_ref {node.swa_lock_ref}"
            assert node.own_locks <= node.lock_ref, f"{node!r} holds more locks than its lock_ref"
            assert node.value is not None, f"{node!r} off the device in a sliding-window tree"
            if node.swa_evicted:
                assert self.swa.lacks_swa(node.value), f"tombstone {node!r} holds local K/V"
                continue
            assert self.swa.has_swa(node.value), f"{node!r} lost local K/V without a tombstone"
            held.append(self.swa.full_to_swa[node.value[::ps] // ps])
            if node.swa_lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                free_nodes.add(node)
        assert evictable == self._swa_evictable, f"swa evictable {self._swa_evictable} != walked {evictable}"
        assert protected == self._swa_protected, f"swa protected {self._swa_protected} != walked {protected}"
        assert free_nodes == self._swa_nodes, "swa-evictable node set out of date"
        if held:
            pages = torch.cat(held)
            assert torch.unique(pages).numel() == pages.numel(), "a local page is held by two nodes"
