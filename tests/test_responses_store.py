"""The /v1/responses store: expiry, the maximum count (oldest first), tenant isolation; against a fake clock."""

from __future__ import annotations

import pytest

from radixrt.server.http.responses_store import ResponsesStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_expiry_and_max_count() -> None:
    clock = Clock()
    store = ResponsesStore(max_items=3, ttl_s=10.0, clock=clock)
    for i in range(3):
        clock.now = float(i)
        store.put(f"r{i}", None, {"id": f"r{i}"}, [])
    assert len(store) == 3
    store.put("r3", None, {"id": "r3"}, [])  # over the maximum: the oldest goes
    assert store.get("r0", None) is None and store.get("r1", None) is not None and len(store) == 3
    clock.now = 11.5  # r1 was stored at 1.0: expired; r2 (2.0) and r3 (2.0) live
    assert store.get("r1", None) is None
    assert [store.get(r, None) is not None for r in ("r2", "r3")] == [True, True]
    clock.now = 12.0
    assert len(store) == 0


def test_tenants_and_delete() -> None:
    store = ResponsesStore(max_items=10, ttl_s=60.0, clock=Clock())
    store.put("r", "alpha", {"id": "r"}, [{"role": "user", "content": "x"}])
    assert store.get("r", "beta") is None and store.get("r", None) is None
    assert not store.delete("r", "beta")
    entry = store.get("r", "alpha")
    assert entry is not None and entry.messages == [{"role": "user", "content": "x"}]
    assert store.delete("r", "alpha") and store.get("r", "alpha") is None
    assert not store.delete("r", "alpha")


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_items"):
        ResponsesStore(max_items=0, ttl_s=1.0)
