"""TTL pins: prefixes of the RadixCache that eviction may not take until their time is up.

A request carrying ``cache_control: {"type": "ephemeral", "ttl": ...}`` (or the admin's ``/pin_prefix``)
pins the prefix it cached when it finishes. A pin holds one lock on the deepest node of its prefix, so the
whole prefix stays on the device (the hierarchical cache included) exactly as a running request's
prefix does, and ``pin_ref`` on every node of the prefix counts the pins covering it. Pinned tokens are
the union of the pinned prefixes; they are capped by ``max_pinned_tokens`` (and, with tenants, each
tenant by that share of its KV quota): a pin that does not fit pins the longest page-aligned prefix
that does. A match that covers a whole pinned prefix refreshes its expiry; expired pins are released
lazily, at eviction and at every ``expire_pins`` sweep. Pins live in the request's namespace
(tenant + salt) and are identified by a hash of the namespace and the pinned tokens, so pinning the
same prefix twice extends one pin.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from radixrt.mem_cache.tree_node import TenantShares, TreeNode, as_tuple, common_prefix_len

if TYPE_CHECKING:
    from collections.abc import Sequence

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


class PinnedPrefixes:
    """The pin half of the RadixCache (a mixin; the cache calls ``_init_pins`` and the hooks below)."""

    max_pinned_tokens: int
    pin_clock: Callable[[], float]
    _pins: dict[str, Pin]
    _pins_at: dict[TreeNode, list[Pin]]
    _pin_tokens: int
    _tenant_pin_tokens: dict[str | None, int]
    _next_expiry: float

    if TYPE_CHECKING:  # provided by RadixCache
        page_size: int
        disable: bool
        shares: TenantShares | None
        _roots: dict[str | None, TreeNode]
        _clock: int

        def inc_lock_ref(self, node: TreeNode) -> None: ...

        def dec_lock_ref(self, node: TreeNode) -> None: ...

        def _aligned(self, key: tuple[int, ...]) -> tuple[int, ...]: ...

        def _child_key(self, key: tuple[int, ...], start: int = 0) -> int | tuple[int, ...]: ...

        def _walk(
            self, root: TreeNode, key: tuple[int, ...], now: int
        ) -> tuple[TreeNode, int, list[TreeNode]]: ...

    def _init_pins(self, max_pinned_tokens: int, clock: Callable[[], float]) -> None:
        if max_pinned_tokens < 0:
            raise ValueError(f"max_pinned_tokens: must be >= 0, got {max_pinned_tokens}")
        self.max_pinned_tokens = max_pinned_tokens
        self.pin_clock = clock
        self._pins = {}
        self._pins_at = {}
        self._pin_tokens = 0
        self._tenant_pin_tokens = {}
        self._next_expiry = math.inf

    # ---- public API -------------------------------------------------------------------------------

    def pin(self, key: Sequence[int], cache_salt: str | None, ttl_s: float) -> PinResult:
        """Pin the longest page-aligned, device-resident prefix of ``key`` that the budget allows for
        ``ttl_s`` seconds (an existing pin of the same prefix gets the later expiry)."""
        root = self._roots.get(cache_salt)
        if self.disable or root is None or ttl_s <= 0:
            return PinResult(None, 0)
        tkey = self._aligned(as_tuple(key))
        matched, pinned = self._measure(root, tkey)
        room = self._pin_room(root.tenant)
        target = min(matched, pinned + room - room % self.page_size)
        if target <= 0:
            return PinResult(None, 0)
        self._clock += 1
        node, walked, _ = self._walk(root, tkey[:target], self._clock)
        assert walked == target and node.value is not None
        pin_id = pin_id_of(cache_salt, tkey[:target])
        expires = self.pin_clock() + ttl_s
        pin = self._pins.get(pin_id)
        if pin is None:
            pin = self._pins[pin_id] = Pin(pin_id, node, target, ttl_s, expires, root.tenant)
            self._pins_at.setdefault(node, []).append(pin)
            self.inc_lock_ref(node)
            self._add_pin_ref(node, 1)
        else:
            pin.ttl_s, pin.expires_at = max(pin.ttl_s, ttl_s), max(pin.expires_at, expires)
        self._next_expiry = min(self._next_expiry, pin.expires_at)
        return PinResult(pin_id, target)

    def expire_pins(self) -> int:
        """Release the pins whose time is up; returns how many. Cheap when none is due."""
        now = self.pin_clock()
        if now < self._next_expiry:
            return 0
        due = [p for p in self._pins.values() if p.expires_at <= now]
        for p in due:
            self._release_pin(p)
        self._next_expiry = min((p.expires_at for p in self._pins.values()), default=math.inf)
        return len(due)

    def list_pins(self) -> list[PinView]:
        """The live pins (expired ones are released first), soonest expiry first."""
        self.expire_pins()
        now = self.pin_clock()
        pins = sorted(self._pins.values(), key=lambda p: (p.expires_at, p.pin_id))
        return [PinView(p.pin_id, p.tokens, p.expires_at - now, p.tenant) for p in pins]

    def drop_pin(self, pin_id: str) -> bool:
        """Release one pin now; False when there is no such pin."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return False
        self._release_pin(pin)
        return True

    def drop_pins(self) -> int:
        """Release every pin; returns how many there were."""
        pins = list(self._pins.values())
        for p in pins:
            self._release_pin(p)
        self._next_expiry = math.inf
        return len(pins)

    def pinned_size(self) -> int:
        """Tokens covered by pins (the union of the pinned prefixes; all on the device, all locked)."""
        return self._pin_tokens

    def tenant_pinned_size(self, tenant: str | None) -> int:
        """Pinned tokens in ``tenant``'s namespaces."""
        return self._tenant_pin_tokens.get(tenant, 0)

    # ---- hooks of the RadixCache ------------------------------------------------------------------

    def _refresh_pins(self, path: list[TreeNode]) -> None:
        """A match walked ``path``: every pin ending on it was hit as a whole and lives ``ttl_s`` more."""
        if not self._pins_at:
            return
        now = self.pin_clock()
        for node in path:
            for p in self._pins_at.get(node, ()):
                p.expires_at = max(p.expires_at, now + p.ttl_s)

    def _check_pins(self, nodes: list[TreeNode]) -> None:
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

    def _measure(self, root: TreeNode, key: tuple[int, ...]) -> tuple[int, int]:
        """(device-resident page-aligned match length of ``key``, the pinned part of it), no splits."""
        node, i, pinned = root, 0, 0
        while i < len(key):
            child = node.children.get(self._child_key(key, i))
            if child is None or child.value is None:
                break
            klen = len(child.key)
            m = common_prefix_len(child.key, key[i : i + klen])
            m -= m % self.page_size
            if m == 0:
                break
            i += m
            if child.pin_ref:
                pinned = i
            node = child
            if m < klen:
                break
        return i, pinned

    def _pin_room(self, tenant: str | None) -> int:
        """Tokens that may still be pinned for ``tenant``: the global budget, and with tenant shares
        the same fraction of the tenant's KV quota."""
        room = self.max_pinned_tokens - self._pin_tokens
        if self.shares is not None:
            share = self.max_pinned_tokens * self.shares.quota_tokens(tenant) // max(self.shares.total, 1)
            room = min(room, share - self.tenant_pinned_size(tenant))
        return max(room, 0)

    def _add_pin_ref(self, node: TreeNode, delta: int) -> None:
        while node.parent is not None:
            before = node.pin_ref
            node.pin_ref += delta
            if (before == 0) != (node.pin_ref == 0):
                size = len(node.key) if node.pin_ref else -len(node.key)
                self._pin_tokens += size
                self._tenant_pin_tokens[node.tenant] = self._tenant_pin_tokens.get(node.tenant, 0) + size
            node = node.parent

    def _release_pin(self, pin: Pin) -> None:
        del self._pins[pin.pin_id]
        at = self._pins_at[pin.node]
        at.remove(pin)
        if not at:
            del self._pins_at[pin.node]
        self._add_pin_ref(pin.node, -1)
        self.dec_lock_ref(pin.node)
