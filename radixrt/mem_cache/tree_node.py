"""The RadixCache's node, match result, counters and the protocols it depends on.

A node's KV lives in one or several tiers: ``value`` holds its device slots (None once evicted from the
device pool), ``host_value`` its host-pool slots (hierarchical cache only), and ``on_disk`` says that
every token of the node is stored in whole chunks of the persistent disk tier. A node in the tree is on
the device or on the host (or both); the device-resident nodes form a subtree hanging from the root.

``priority`` is the highest request priority that inserted or matched the node (a parent's is never
lower than its children's); ``pin_ref`` counts the TTL pins whose prefix covers the node (`pins.py`).
The ``swa_*`` fields belong to the sliding-window cache (`swa_radix_cache.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

_node_ids = itertools.count()


class SlotFreer(Protocol):
    """What the cache needs from the token-slot allocator."""

    page_size: int

    def free(self, slots: torch.Tensor) -> None: ...


class TenantShares(Protocol):
    """The tenants' KV shares, in tokens, as eviction (and the pin budget) needs them."""

    @property
    def total(self) -> int:
        """The device KV pool, in tokens."""
        ...

    def quota_tokens(self, tenant: str | None) -> int: ...

    def reserved_tokens(self, tenant: str | None) -> int: ...

    def running_tokens(self) -> dict[str | None, int]:
        """Slots each tenant's live requests hold outside the tree."""
        ...


class TreeNode:
    """One edge of the tree: ``key`` token ids, ``value`` their int64 device slots (same length, or None
    when the node is not on the device), ``host_value`` their host slots (or None)."""

    __slots__ = (
        "key", "value", "host_value", "on_disk", "children", "parent", "lock_ref", "last_access_time",
        "hit_count", "id", "tenant", "priority", "pin_ref", "swa_evicted", "swa_lock_ref", "own_locks",
        "swa_lock_len",
    )  # fmt: skip

    def __init__(
        self,
        key: tuple[int, ...],
        value: torch.Tensor | None,
        parent: TreeNode | None,
        last_access_time: int,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        self.key = key
        self.tenant: str | None = parent.tenant if parent is not None else tenant
        self.value = value
        self.host_value: torch.Tensor | None = None
        self.on_disk = False
        # Keyed by the first token (page_size 1) or the first page tuple (page_size > 1).
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.hit_count = 0
        self.priority = priority
        self.pin_ref = 0  # pins covering this node; each also holds one lock_ref on its deepest node
        self.id = next(_node_ids)  # unique tie-break for the eviction heaps
        # The sliding-window cache (`SWARadixCache`): whether the local layers' K/V of the node was freed (a
        # tombstone: the global layers' K/V stays), the locks that keep it, the locks taken at this node and
        # how many tokens up from its end they keep the local K/V of.
        self.swa_evicted = False
        self.swa_lock_ref = 0
        self.own_locks = 0
        self.swa_lock_len = 0

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None

    def tiers(self) -> tuple[str, ...]:
        """Where this node's KV lives: a subset of ("device", "host", "disk")."""
        where = (("device", self.on_device), ("host", self.on_host), ("disk", self.on_disk))
        return tuple(t for t, here in where if here)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, pin_ref={self.pin_ref}, "
            f"tiers={self.tiers()})"
        )


class MatchResult(NamedTuple):
    """Result of ``match_prefix``: the device-resident part of the match, then the host-only nodes that
    continue it (empty without a host tier; ``load_back`` moves them to the device)."""

    slots: torch.Tensor  # int64 device slots of the matched prefix (page aligned), empty when nothing matched
    last_node: TreeNode  # deepest matched device node; the namespace root when nothing matched
    host_nodes: tuple[TreeNode, ...] = ()

    @property
    def host_len(self) -> int:
        return sum(len(n.key) for n in self.host_nodes)


@dataclass(slots=True)
class CacheStats:
    """Counters over the cache's lifetime (all sizes in tokens)."""

    match_calls: int = 0
    queried_tokens: int = 0
    cached_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache."""
        return self.cached_tokens / self.queried_tokens if self.queried_tokens else 0.0


def as_tuple(key: Sequence[int]) -> tuple[int, ...]:
    if isinstance(key, tuple):
        return key
    tolist = getattr(key, "tolist", None)  # torch / numpy: avoid tuples of scalar objects
    return tuple(tolist()) if tolist is not None else tuple(key)


def child_key(key: tuple[int, ...], start: int, page_size: int) -> int | tuple[int, ...]:
    """The key of the child that ``key[start:]`` continues into: its first token, or its first page."""
    return key[start] if page_size == 1 else key[start : start + page_size]


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of ``a`` and ``b``, comparing slices in C instead of token by token."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    # Invariant: a[:lo] == b[:lo] and the first mismatch is before hi.
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo
