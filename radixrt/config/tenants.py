"""Tenants: who a request belongs to, the cache namespace that follows from it, and each tenant's KV share.

``--tenants FILE`` names a JSON document::

    {"tenants": [{"name": "alpha", "api_keys": ["key-a"], "kv_quota": 0.5, "priority": 0, "reserved": 0.0}]}

- ``name``: letters, digits, ``_ . -`` (1-64 characters, the first a letter or digit), unique;
- ``api_keys``: one or more non-empty strings, unique across tenants; a request's tenant is the one whose
  key it sends as ``Authorization: Bearer <key>``;
- ``kv_quota`` (default 0.5): the most of the KV pool (cached plus running tokens) the tenant may hold
  while other tenants have work; its least recently used cached prefixes go first when it is over;
- ``priority`` (default 0): higher is admitted first among waiting requests of equal standing;
- ``reserved`` (default 0.0): share of the pool the tenant's cached prefixes keep against other tenants'
  evictions; the reserves of all tenants sum to less than 1.

The cache namespace of a request is derived here from its tenant, never taken from the client: a
client's ``cache_salt`` only subdivides its own tenant's namespace (`namespace`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
ADMIN_TENANT = "_admin"  # requests with the admin key when tenants exist (no tenant name starts with "_")
_FIELDS = {"name", "api_keys", "kv_quota", "priority", "reserved"}


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the server (see the module docstring for the fields)."""

    name: str
    api_keys: tuple[str, ...]
    kv_quota: float = 0.5
    priority: int = 0
    reserved: float = 0.0


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """The validated ``--tenants`` file."""

    tenants: tuple[Tenant, ...]

    @classmethod
    def load(cls, path: str | Path) -> TenantConfig:
        """Read and validate a tenants file; ValueError names the file and the bad field."""
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except OSError as exc:
            raise ValueError(f"tenants: cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"tenants: {path} is not JSON: {exc}") from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Any) -> TenantConfig:
        """Validate a parsed tenants document; ValueError names the field (``tenants[1].kv_quota``)."""
        if not isinstance(doc, dict) or set(doc) != {"tenants"}:
            raise ValueError('tenants: expected an object {"tenants": [...]} and nothing else')
        items = doc["tenants"]
        if not isinstance(items, list) or not items:
            raise ValueError("tenants: must be a non-empty list")
        tenants = [_parse_tenant(i, item) for i, item in enumerate(items)]
        names = [t.name for t in tenants]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tenants: name {dup!r} appears twice")
        keys = [k for t in tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("tenants: an api key belongs to two tenants (or twice to one)")
        if sum(t.reserved for t in tenants) >= 1.0:
            raise ValueError("tenants: the reserved shares sum to 1 or more; they must leave room for others")
        return cls(tuple(tenants))

    def by_key(self, key: str | None) -> Tenant | None:
        """The tenant owning ``key``, or None."""
        if key is None:
            return None
        return next((t for t in self.tenants if key in t.api_keys), None)

    def get(self, name: str) -> Tenant:
        return next(t for t in self.tenants if t.name == name)


def _parse_tenant(i: int, item: Any) -> Tenant:
    where = f"tenants[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: must be an object")
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field (known: {sorted(_FIELDS)})")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{where}.name: must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    keys = item.get("api_keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{where}.api_keys: must be a non-empty list of non-empty strings")

    def share(field: str, default: float, low_open: bool) -> float:
        v = item.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{where}.{field}: must be a number")
        ok = (0 < v <= 1) if low_open else (0 <= v < 1)
        if not ok:
            raise ValueError(f"{where}.{field}: must be in {'(0, 1]' if low_open else '[0, 1)'}, got {v}")
        return float(v)

    quota = share("kv_quota", 0.5, True)
    reserved = share("reserved", 0.0, False)
    if reserved > quota:
        raise ValueError(f"{where}.reserved: {reserved} exceeds its kv_quota {quota}")
    priority = item.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"{where}.priority: must be an integer")
    return Tenant(name, tuple(keys), quota, priority, reserved)


def namespace(tenant: str | None, cache_salt: str | None) -> str | None:
    """The RadixCache namespace of a request: without a tenant the client's salt as is; with one, an
    encoding of (tenant, salt) that no salt can make equal to another tenant's (JSON of the pair)."""
    if tenant is None:
        return cache_salt
    return json.dumps(["tenant", tenant, cache_salt])
