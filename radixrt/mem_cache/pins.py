"""TTL pins: prefixes of the RadixCache that eviction may not take until their time is up.

A request carrying ``cache_control: {"type": "ephemeral", "ttl": ...}`` (or the admin's ``/pin_prefix``)
pins the prefix it cached when it finishes. A pin holds one lock on the deepest node of its prefix, so the
whole prefix stays on the device (the hierarchical cache included) exactly as a running request's
prefix does, and ``pin_ref`` on every node of the prefix counts the pins covering it. Pinned tokens are
the union of the pinned prefixes; they are capped by ``max_pinned_tokens`` (and, with tenants, each
tenant by that share of its KV quota): a pin that does not fit pins the longest page-aligned prefix
that does. A match that covers a whole pinned prefix refreshes its expiry; expired pins are released
lazily, at eviction and at every ``expire`` sweep. Pins live in the request's namespace
(tenant + salt) and are identified by a hash of the namespace and the pinned tokens, so pinning the
same prefix twice extends one pin.

The cache owns a `PinTable` (``RadixCache.pins``): the cache finds and locks the prefix to pin
(``RadixCache.pin``), the table keeps the pins, their counts and expiries, and unlocks through the
cache when a pin ends.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixrt.mem_cache.tree_node import TenantShares, TreeNode, child_key, common_prefix_len

DEFAULT_TTL_S = 300.0  # Anthropic's default ephemeral TTL ("5m")
MAX_TTL_S = 86400.0
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(value: Any, name: str = "cache_control.ttl") -> float:
    """Seconds from a number or a string like ``"600"``, ``"30s"``, ``"5m"``, ``"1h"``; ValueError
    naming ``name`` otherwise (and outside ``(0, MAX_TTL_S]``)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f'{name}: must be a number of seconds or a string like "600", "5m", "1h"')
    if isinstance(value, str):
        m = _TTL.match(value)
        if m is None:
            raise ValueError(f'{name}: {value!r} is not a duration like "600", "30s", "5m", "1h"')
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TTL_S:
        raise ValueError(f"{name}: must be in (0, {MAX_TTL_S:.0f}] seconds, got {value!r}")
    return seconds


def parse_cache_control(value: Any, name: str = "cache_control") -> float | None:
    """The pin TTL in seconds asked for by a ``cache_control`` field (None when absent); ValueError naming
    the field for anything but ``{"type": "ephemeral", "ttl"?: ...}``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f'{name}: must be an object like {{"type": "ephemeral", "ttl": "5m"}}')
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown field (expected type, ttl)")
    if value.get("type") != "ephemeral":
        raise ValueError(f'{name}.type: must be "ephemeral", got {value.get("type")!r}')
    ttl = value.get("ttl")
    return DEFAULT_TTL_S if ttl is None else parse_ttl(ttl, f"{name}.ttl")


def pin_id_of(cache_salt: str | None, key: tuple[int, ...]) -> str:
    """The id of the pin over ``key`` in namespace ``cache_salt``."""
    return hashlib.blake2b(repr((cache_salt, key)).encode(), digest_size=8).hexdigest()


@dataclass(slots=True, eq=False)
class Pin:
    """One pinned prefix: ``node`` ends it (and is locked once by it); ``tokens`` long."""

    pin_id: str
    node: TreeNode
    tokens: int
    ttl_s: float
    expires_at: float
    tenant: str | None


class PinResult(NamedTuple):
    """What a ``pin`` call pinned: its id (None when nothing fit) and the pinned prefix length."""

    pin_id: str | None
    tokens: int


class PinView(NamedTuple):
    """A pin as ``list_pins`` reports it."""

    pin_id: str
    tokens: int
    expires_in_s: float
    tenant: str | None


def pinnable_prefix(root: TreeNode, key: tuple[int, ...], page_size: int) -> tuple[int, int]:
    """(device-resident page-aligned match length of ``key`` under ``root``, the pinned part of it); reads
    the tree only (no splits, no access stamps)."""
    node, i, pinned = root, 0, 0
    while i < len(key):
        child = node.children.get(child_key(key, i, page_size))
        if child is None or child.value is None:
            break
        klen = len(child.key)
        m = common_prefix_len(child.key, key[i : i + klen])
        m -= m % page_size
        if m == 0:
            break
        i += m
        if child.pin_ref:
            pinned = i
        node = child
        if m < klen:
            break
    return i, pinned


class PinTable:
    """The TTL pins of one RadixCache: which nodes they end on, how many tokens they cover (in all and per
    tenant), when they expire. ``lock`` / ``unlock`` are the cache's node locks (a pin holds one)."""

    def __init__(
        self,
        max_pinned_tokens: int,
        clock: Callable[[], float],
        lock: Callable[[TreeNode], None],
        unlock: Callable[[TreeNode], None],
    ) -> None:
        if max_pinned_tokens < 0:
            raise ValueError(f"max_pinned_tokens: must be >= 0, got {max_pinned_tokens}")
        self.max_pinned_tokens = max_pinned_tokens
        self.clock = clock
        self._lock = lock
        self._unlock = unlock
        self._pins: dict[str, Pin] = {}
        self._pins_at: dict[TreeNode, list[Pin]] = {}
        self._pin_tokens = 0
        self._tenant_pin_tokens: dict[str | None, int] = {}
        self._next_expiry = math.inf
        self.yielded = 0  # pins released early by `yield_to` (reported as kv_pins_yielded)

    # ---- public API -------------------------------------------------------------------------------

    def add(self, pin_id: str, node: TreeNode, tokens: int, ttl_s: float, tenant: str | None) -> PinResult:
        """Pin the ``tokens``-long prefix ending at device node ``node`` for ``ttl_s`` seconds (an existing
        pin ``pin_id`` gets the later expiry). The caller sized it with `room`."""
        expires = self.clock() + ttl_s
        pin = self._pins.get(pin_id)
        if pin is None:
            pin = self._pins[pin_id] = Pin(pin_id, node, tokens, ttl_s, expires, tenant)
            self._pins_at.setdefault(node, []).append(pin)
            self._lock(node)
            self._add_pin_ref(node, 1)
        else:
            pin.ttl_s, pin.expires_at = max(pin.ttl_s, ttl_s), max(pin.expires_at, expires)
        self._next_expiry = min(self._next_expiry, pin.expires_at)
        return PinResult(pin_id, tokens)

    def room(self, tenant: str | None, shares: TenantShares | None) -> int:
        """Tokens that may still be pinned for ``tenant``: the global budget, and with tenant ``shares``
        the same fraction of the tenant's KV quota."""
        room = self.max_pinned_tokens - self._pin_tokens
        if shares is not None:
            share = self.max_pinned_tokens * shares.quota_tokens(tenant) // max(shares.total, 1)
            room = min(room, share - self.tenant_pinned_size(tenant))
        return max(room, 0)

    def expire(self) -> int:
        """Release the pins whose time is up; returns how many. Cheap when none is due."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        due = [p for p in self._pins.values() if p.expires_at <= now]
        for p in due:
            self._release(p)
        self._next_expiry = min((p.expires_at for p in self._pins.values()), default=math.inf)
        return len(due)

    def live(self) -> list[PinView]:
        """The live pins (expired ones are released first), soonest expiry first."""
        self.expire()
        now = self.clock()
        pins = sorted(self._pins.values(), key=lambda p: (p.expires_at, p.pin_id))
        return [PinView(p.pin_id, p.tokens, p.expires_at - now, p.tenant) for p in pins]

    def drop(self, pin_id: str) -> bool:
        """Release one pin now; False when there is no such pin."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return False
        self._release(pin)
        return True

    def drop_all(self) -> int:
        """Release every pin; returns how many there were."""
        pins = list(self._pins.values())
        for p in pins:
            self._release(p)
        self._next_expiry = math.inf
        return len(pins)

    def off_path_size(self, end: TreeNode) -> int:
        """Pinned tokens outside the path root..``end`` (a request's locked prefix, which it holds anyway)."""
        on_path, node = 0, end
        while node.parent is not None:
            on_path += len(node.key) if node.pin_ref else 0
            node = node.parent
        return self._pin_tokens - on_path

    def yield_to(self, end: TreeNode, short: int, tenant: str | None) -> int:
        """Release pins until ``short`` fewer pinned tokens lie outside the path root..``end``: the
        requesting ``tenant``'s own pins first, then the soonest to expire. Pins ending on the path free
        nothing for it and stay. Returns how many pins were released."""
        path: set[TreeNode] = set()
        node: TreeNode | None = end
        while node is not None:
            path.add(node)
            node = node.parent
        target = self.off_path_size(end) - short
        order = sorted(
            (p for p in self._pins.values() if p.node not in path),
            key=lambda p: (p.tenant != tenant, p.expires_at, p.pin_id),
        )
        released = 0
        for pin in order:
            if self.off_path_size(end) <= target:
                break
            self._release(pin)
            released += 1
        self.yielded += released
        return released

    def pinned_size(self) -> int:
        """Tokens covered by pins (the union of the pinned prefixes; all on the device, all locked)."""
        return self._pin_tokens

    def tenant_pinned_size(self, tenant: str | None) -> int:
        """Pinned tokens in ``tenant``'s namespaces."""
        return self._tenant_pin_tokens.get(tenant, 0)

    # ---- hooks of the RadixCache ------------------------------------------------------------------

    def refresh(self, path: list[TreeNode]) -> None:
        """A match walked ``path``: every pin ending on it was hit as a whole and lives ``ttl_s`` more."""
        if not self._pins_at:
            return
        now = self.clock()
        for node in path:
            for p in self._pins_at.get(node, ()):
                p.expires_at = max(p.expires_at, now + p.ttl_s)

    def check(self, nodes: list[TreeNode]) -> None:
        """Recompute pin counts over ``nodes`` (every node of the tree); AssertionError on a mismatch."""
        refs: dict[TreeNode, int] = {}
        for p in self._pins.values():
            assert p in self._pins_at.get(p.node, []), f"pin {p.pin_id} not indexed at its node"
            n: TreeNode | None = p.node
            length = 0
            while n is not None and n.parent is not None:
                refs[n] = refs.get(n, 0) + 1
                length += len(n.key)
                n = n.parent
            assert length == p.tokens, f"pin {p.pin_id}: {p.tokens} tokens, its path has {length}"
        assert sum(len(v) for v in self._pins_at.values()) == len(self._pins), "pin index out of date"
        total = 0
        per_tenant: dict[str | None, int] = {}
        for node in nodes:
            assert node.pin_ref == refs.get(node, 0), f"{node!r} pin_ref != {refs.get(node, 0)} pins"
            if node.pin_ref:
                assert node.value is not None and node.lock_ref >= node.pin_ref, f"{node!r} pinned off"
                total += len(node.key)
                per_tenant[node.tenant] = per_tenant.get(node.tenant, 0) + len(node.key)
        assert total == self._pin_tokens, f"pinned {self._pin_tokens} != walked {total}"
        counted = {t: n for t, n in self._tenant_pin_tokens.items() if n}
        assert per_tenant == counted, f"tenant pinned {counted} != walked {per_tenant}"

    # ---- internals --------------------------------------------------------------------------------

    def _add_pin_ref(self, node: TreeNode, delta: int) -> None:
        while node.parent is not None:
            before = node.pin_ref
            node.pin_ref += delta
            if (before == 0) != (node.pin_ref == 0):
                size = len(node.key) if node.pin_ref else -len(node.key)
                self._pin_tokens += size
                self._tenant_pin_tokens[node.tenant] = self._tenant_pin_tokens.get(node.tenant, 0) + size
            node = node.parent

    def _release(self, pin: Pin) -> None:
        del self._pins[pin.pin_id]
        at = self._pins_at[pin.node]
        at.remove(pin)
        if not at:
            del self._pins_at[pin.node]
        self._add_pin_ref(pin.node, -1)
        self._unlock(pin.node)
