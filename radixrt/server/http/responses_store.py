"""Stored responses for GET / DELETE /v1/responses/{id} and ``previous_response_id``.

An in-memory store bounded two ways: an entry expires ``ttl_s`` seconds after it was stored, and beyond
``max_items`` entries the oldest go first. Each entry belongs to the tenant that created it: another
tenant's lookup finds nothing (the route answers 404, as for an id that never existed), so ids cannot be
probed across tenants. Entries hold the response object as served and the conversation up to and including
its output, in chat-message form, which a continuation renders again (and finds in the RadixCache), and
the input items the model saw (GET /v1/responses/{id}/input_items).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its owner, the response object, and the conversation it ends."""

    tenant: str | None
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # chat messages (no instructions): the input history plus the output
    expires_at: float
    input_items: list[dict[str, Any]]  # the items the model saw, oldest first (ids included)


class ResponsesStore:
    """Responses by id, per tenant, with an expiry and a maximum count."""

    def __init__(self, max_items: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or ttl_s <= 0:
            raise ValueError("responses store: max_items must be >= 1 and ttl_s > 0")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(
        self,
        response_id: str,
        tenant: str | None,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        input_items: list[dict[str, Any]] | None = None,
    ) -> None:
        """Store (or replace) a response; expired and, beyond ``max_items``, the oldest entries go."""
        self._items.pop(response_id, None)
        expires = self.clock() + self.ttl_s
        self._items[response_id] = StoredResponse(tenant, response, messages, expires, input_items or [])
        self._expire()
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The tenant's live entry, or None (absent, expired, deleted or another tenant's)."""
        self._expire()
        entry = self._items.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None) -> bool:
        """Remove the tenant's entry; False when `get` would not find it."""
        if self.get(response_id, tenant) is None:
            return False
        del self._items[response_id]
        return True

    def _expire(self) -> None:
        now = self.clock()
        # entries were stored in time order with one TTL, so the expired ones are at the front
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.expires_at > now:
                break
            self._items.popitem(last=False)
