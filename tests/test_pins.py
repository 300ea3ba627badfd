"""Priority eviction and TTL pins of the RadixCache.

Oracles: a naive reference (one entry per cached page-aligned prefix with its priority and last access)
for the ``priority`` eviction order; an injectable clock for pin expiry; the tree's own walk
(``check_integrity``) for pin counts; a server under eviction pressure for pins end to end.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import ServerProcess, wait_idle

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.hiradix_cache import HiRadixCache
from radixrt.mem_cache.host_pool import HostPool
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.mem_cache.pins import DEFAULT_TTL_S, parse_cache_control, parse_ttl, pin_id_of
from radixrt.mem_cache.radix_cache import RadixCache

pytest_plugins = ["server_fixtures"]


class FakeClock:
    """The pins' clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    budget: int = 1 << 20, page_size: int = 1, policy: str = "priority", slots: int = 1024
) -> tuple[TokenSlotAllocator, RadixCache, FakeClock]:
    clock = FakeClock()
    alloc = TokenSlotAllocator(slots, page_size=page_size)
    cache = RadixCache(alloc, page_size, policy, max_pinned_tokens=budget, clock=clock)
    return alloc, cache, clock


def put(alloc: TokenSlotAllocator, cache: RadixCache, key: list[int], priority: int | None = None) -> None:
    """Insert ``key`` with fresh slots (freeing our duplicates and the partial page)."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    prefix_len = cache.insert(key, slots, priority=priority)
    aligned = len(key) // cache.page_size * cache.page_size
    alloc.free(slots[:prefix_len])
    alloc.free(slots[aligned:])


def cached(cache: RadixCache, key: list[int]) -> int:
    return len(cache.match_prefix(key).slots)


# ---- priority eviction against a reference -------------------------------------------------------


class RefPriority:
    """Every cached page-aligned prefix -> [priority, last access]; what the tree computes per node."""

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.pages: dict[tuple[int, ...], list[int]] = {}
        self.clock = 0

    def cached_len(self, key: tuple[int, ...]) -> int:
        i = 0
        while i + self.ps <= len(key) and key[: i + self.ps] in self.pages:
            i += self.ps
        return i

    def access(self, key: tuple[int, ...], priority: int | None, insert: bool) -> None:
        self.clock += 1
        n = self.cached_len(key)
        bump = 0 if insert and priority is None else priority
        for j in range(self.ps, n + 1, self.ps):
            page = self.pages[key[:j]]
            page[1] = self.clock
            if bump is not None:
                page[0] = max(page[0], bump)
        if insert:
            for j in range(n + self.ps, len(key) // self.ps * self.ps + 1, self.ps):
                self.pages[key[:j]] = [0 if priority is None else priority, self.clock]

    def rank(self, prefix: tuple[int, ...]) -> tuple[int, int]:
        prio, at = self.pages[prefix]
        return (prio, at)


def tree_prefixes(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix of the default namespace -> its node's priority (no access)."""
    out: dict[tuple[int, ...], int] = {}
    ps = cache.page_size
    stack: list[tuple[Any, tuple[int, ...]]] = [(cache.match_prefix([]).last_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + tuple(child.key)
            for j in range(ps, len(child.key) + 1, ps):
                out[full[: len(path) + j]] = child.priority
            stack.append((child, full))
    return out


@pytest.mark.parametrize("page_size", [1, 2])
@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_priority_order_matches_reference(page_size: int, data: st.DataObject) -> None:
    """Inserts and matches at random priorities, then evictions: what goes is always the lowest
    (priority, last access) among the evictable leaves, and no more than needed."""
    ps = page_size
    alloc = TokenSlotAllocator(512 * ps, page_size=ps)
    cache = RadixCache(alloc, ps, "priority")
    ref = RefPriority(ps)
    keys = st.lists(st.integers(0, 2), max_size=8).map(tuple)
    prios = st.sampled_from([None, -1, 0, 1, 3])
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["insert", "insert", "match", "evict"]), label="op")
        key, prio = data.draw(keys, label="key"), data.draw(prios, label="priority")
        if op == "insert":
            slots = alloc.alloc(len(key))
            assert slots is not None
            n = cache.insert(list(key), slots, priority=prio)
            alloc.free(slots[:n])
            alloc.free(slots[len(key) // ps * ps :])
            ref.access(key, prio, insert=True)
        elif op == "match":
            cache.match_prefix(list(key), priority=prio)
            ref.access(key, prio, insert=False)
        else:
            want = data.draw(st.integers(1, 5 * ps), label="want")
            before = set(ref.pages)
            freed = cache.evict(want)
            after = set(tree_prefixes(cache))
            gone = before - after
            assert after <= before and freed == len(gone) * ps
            if gone:
                leaves = after - {p[:-ps] for p in after}
                worst = max(ref.rank(p) for p in gone)
                assert all(ref.rank(p) >= worst for p in leaves), "evicted out of priority order"
                last = sum(1 for p in gone if ref.rank(p) == worst)
                assert (len(gone) - last) * ps < want
            for p in gone:
                del ref.pages[p]
        cache.check_integrity()
        assert tree_prefixes(cache) == {p: v[0] for p, v in ref.pages.items()}  # content and priorities


def test_lower_priority_goes_first_lru_within_a_priority() -> None:
    alloc, cache, _ = make()
    put(alloc, cache, [1, 1, 1], priority=2)  # oldest, but the highest priority
    put(alloc, cache, [2, 2, 2])  # priority 0 (default)
    put(alloc, cache, [3, 3, 3], priority=0)
    put(alloc, cache, [4, 4, 4], priority=-1)  # newest, the lowest priority
    cache.match_prefix([2, 2, 2])  # [2] now more recent than [3]
    order: list[int] = []
    while cache.total_size():
        assert cache.evict(1) == 3
        left = {p[0] for p in tree_prefixes(cache)}
        order += [k for k in (1, 2, 3, 4) if k not in left and k not in order]
    assert order == [4, 3, 2, 1]


def test_plain_lru_ignores_priority_and_matches_raise_it() -> None:
    alloc, cache, _ = make(policy="lru")
    put(alloc, cache, [1, 1], priority=5)
    put(alloc, cache, [2, 2])
    assert cache.evict(1) == 2 and cached(cache, [1, 1]) == 0  # LRU: the older one, priority or not
    alloc, cache, _ = make()
    put(alloc, cache, [1, 1, 1, 1])
    put(alloc, cache, [5, 5])
    cache.match_prefix([1, 1, 7], priority=4)  # splits [1,1] | [1,1]: only the matched part is raised
    cache.check_integrity()
    assert cache.evict(1) == 2 and cached(cache, [1, 1, 1, 1]) == 2  # the unraised tail [1,1] first
    assert cache.evict(1) == 2 and cached(cache, [5, 5]) == 0  # then [5,5] (priority 0)
    assert cached(cache, [1, 1]) == 2


# ---- TTL pins -------------------------------------------------------------------------------------


def test_pins_survive_eviction_pressure_and_count_as_locked() -> None:
    alloc, cache, _ = make(slots=64)
    put(alloc, cache, list(range(10)), priority=-5)  # would be the first victim
    pid, tokens = cache.pin(list(range(10)), None, 60)
    assert tokens == 10 and pid == pin_id_of(None, tuple(range(10)))
    assert (cache.pins.pinned_size(), cache.protected_size(), cache.evictable_size()) == (10, 10, 0)
    rng = random.Random(0)
    for _ in range(30):  # far more than the pool: everything else churns
        cache.evict(64)
        put(alloc, cache, [100 + rng.randrange(50) for _ in range(12)])
        cache.check_integrity()
    assert cached(cache, list(range(10))) == 10
    cache.evict(10_000)
    assert cache.total_size() == 10 and alloc.available_size() == alloc.total_slots - 10
    assert cache.pins.drop(pid) and not cache.pins.drop(pid)
    assert (cache.pins.pinned_size(), cache.protected_size()) == (0, 0)
    assert cache.evict(100) == 10 and alloc.available_size() == alloc.total_slots


def test_ttl_expiry_is_lazy_and_hits_refresh() -> None:
    alloc, cache, clock = make()
    put(alloc, cache, [1, 2, 3, 4, 5, 6])
    put(alloc, cache, [9, 9])
    cache.pin([1, 2, 3, 4], None, 10.0)
    clock.now = 9.9
    assert cache.evict(100) == 4  # [5,6] and [9,9]; the pinned [1..4] stays
    assert cached(cache, [1, 2, 3, 4]) == 4  # a full hit at 9.9: lives until 19.9
    clock.now = 15.0
    assert cache.pins.expire() == 0 and cache.pins.pinned_size() == 4
    cache.match_prefix([1, 2, 7])  # covers only part of the pin: no refresh
    (view,) = cache.pins.live()
    assert view.tokens == 4 and view.expires_in_s == pytest.approx(4.9) and view.tenant is None
    clock.now = 20.0
    assert cache.pins.pinned_size() == 4  # expiry is lazy: nothing released until a sweep or an eviction
    assert cache.evict(100) == 4 and cache.pins.pinned_size() == 0 and cache.total_size() == 0
    assert cache.pins.live() == []
    cache.check_integrity()


def test_repinning_extends_one_pin_and_overlapping_pins_share_tokens() -> None:
    alloc, cache, clock = make()
    put(alloc, cache, [1, 2, 3, 4, 5, 6])
    put(alloc, cache, [1, 2, 3, 7, 8])
    a = cache.pin([1, 2, 3, 4, 5, 6], None, 5)
    assert cache.pin([1, 2, 3, 4, 5, 6], None, 50).pin_id == a.pin_id  # same prefix: one pin, later expiry
    b = cache.pin([1, 2, 3, 7, 8], None, 5)
    assert b.pin_id != a.pin_id and cache.pins.pinned_size() == 8  # the union: [1,2,3] counted once
    cache.check_integrity()
    clock.now = 6
    assert cache.pins.expire() == 1 and cache.pins.pinned_size() == 6
    assert [v.pin_id for v in cache.pins.live()] == [a.pin_id]
    assert cache.evict(100) == 2 and cached(cache, [1, 2, 3, 7, 8]) == 3
    assert cache.pins.drop_all() == 1 and cache.protected_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_budget_holds_and_a_pin_that_does_not_fit_is_partial(page_size: int) -> None:
    ps = page_size
    alloc, cache, _ = make(budget=10, page_size=ps)
    first = list(range(8))
    second = list(range(8)) + [50 + i for i in range(8)]
    put(alloc, cache, first)
    put(alloc, cache, second)
    put(alloc, cache, [90] * 8)
    assert cache.pin(first, None, 60).tokens == 8
    # 8 of second's 16 tokens are pinned already: 2 more fit (a page of 4 does not)
    res = cache.pin(second, None, 60)
    assert res.tokens == (10 if ps == 1 else 8) and res.pin_id == pin_id_of(None, tuple(second[: res.tokens]))
    assert cache.pins.pinned_size() <= 10
    assert cache.pin([90] * 8, None, 60) == (None, 0)  # nothing left for an unpinned prefix
    assert cache.pin([77] * 8, None, 60) == (None, 0)  # not cached at all
    cache.check_integrity()
    assert cache.evict(1000) == 8 + 16 - res.tokens
    assert cached(cache, second) == res.tokens


class Shares:
    """Two tenants' quotas (the TenantShares the pin budget reads)."""

    total = 100

    def quota_tokens(self, tenant: str | None) -> int:
        return {"a": 50, "b": 20}.get(tenant or "", self.total)

    def reserved_tokens(self, tenant: str | None) -> int:
        return 0

    def running_tokens(self) -> dict[str | None, int]:
        return {}


def test_tenant_pins_are_capped_by_their_quota_share_and_held_by_them() -> None:
    alloc, cache, _ = make(budget=50, slots=128)
    cache.shares = Shares()
    for salt, tenant in (("A", "a"), ("B", "b")):
        slots = alloc.alloc(40)
        assert slots is not None
        cache.insert(list(range(40)), slots, cache_salt=salt, tenant=tenant)
    # budget 50 of 100: tenant b (quota 20) may pin 10, tenant a (quota 50) 25
    assert cache.pin(list(range(40)), "B", 60).tokens == 10
    assert cache.pin(list(range(40)), "A", 60).tokens == 25
    assert (cache.pins.tenant_pinned_size("a"), cache.pins.tenant_pinned_size("b")) == (25, 10)
    assert sorted((v.tenant, v.tokens) for v in cache.pins.live()) == [("a", 25), ("b", 10)]
    cache.evict(1000)
    assert (cache.tenant_size("a"), cache.tenant_size("b")) == (25, 10)  # pinned tokens stay held
    cache.check_integrity()
    cache.reset()  # a flush drops the pins too
    assert cache.total_size() == 0 and cache.pins.pinned_size() == 0
    assert alloc.available_size() == alloc.total_slots


def test_hierarchical_cache_keeps_pins_on_the_device_and_orders_the_host_tier() -> None:
    ps, layers = 1, 1
    clock = FakeClock()
    alloc = TokenSlotAllocator(24, page_size=ps)
    pool = KVPool(alloc.num_pages * ps, layers, 1, 2, torch.float32)
    host = HostPool(pool, 8, ps)
    cache = HiRadixCache(alloc, pool, ps, "priority", host, None, "write_back", 100, clock)
    put(alloc, cache, [1] * 4)
    put(alloc, cache, [2] * 4, priority=3)
    put(alloc, cache, [3] * 4)
    cache.pin([1] * 4, None, 10)
    assert cache.evict(100) == 8  # [2] and [3] move to the host; the pinned [1] stays on the device
    assert cache.match_prefix([1] * 4).slots.numel() == 4 and cache.host_size() == 8
    put(alloc, cache, [4] * 4)
    cache.evict(4)  # the host is full: its lowest priority copy ([3], priority 0) is forgotten first
    assert cache.match_prefix([3] * 4).host_len == 0 and cache.match_prefix([2] * 4).host_len == 4
    cache.check_integrity()
    clock.now = 11
    assert cache.evict(4) == 4 and cache.match_prefix([1] * 4).slots.numel() == 0  # expired: it may go
    cache.check_integrity()


def test_parse_ttl_and_cache_control() -> None:
    assert [parse_ttl(v) for v in (600, 1.5, "600", "30s", "5m", "1h", " 2.5m ")] == [
        600, 1.5, 600, 30, 300, 3600, 150,
    ]  # fmt: skip
    assert parse_cache_control(None) is None
    assert parse_cache_control({"type": "ephemeral"}) == DEFAULT_TTL_S
    assert parse_cache_control({"type": "ephemeral", "ttl": "1h"}) == 3600
    for bad, field in [
        ({"type": "persistent"}, "cache_control.type"), ({"type": "ephemeral", "ttl": "5 days"}, "cache_control.ttl"),
        ({"type": "ephemeral", "ttl": 0}, "cache_control.ttl"), ({"type": "ephemeral", "ttl": True}, "cache_control.ttl"),
        ({"type": "ephemeral", "ttl": "48h"}, "cache_control.ttl"), ({"type": "ephemeral", "x": 1}, "cache_control.x"),
        ("5m", "cache_control"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field}:"):
            parse_cache_control(bad)


# ---- the server ------------------------------------------------------------------------------------

ADMIN = "sk-admin"
KEYS = {"alpha": "sk-alpha", "beta": "sk-beta"}
POOL = 1024
PINNED_RATIO = 0.2  # 204 tokens; a tenant (quota 0.5) may pin 102 of them
BUDGET, TENANT_SHARE = int(POOL * PINNED_RATIO), int(POOL * PINNED_RATIO) // 2
GEN = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def pin_server(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("pins")
    tenants = [{"name": n, "api_keys": [k]} for n, k in KEYS.items()]
    (d / "tenants.json").write_text(json.dumps({"tenants": tenants}))
    flags = ["--max-total-tokens", str(POOL), "--tenants", str(d / "tenants.json"),
             "--radix-eviction-policy", "priority", "--max-pinned-ratio", str(PINNED_RATIO),
             "--disable-compile"]  # fmt: skip
    srv = ServerProcess(server_model, d / "server.log", flags, ADMIN, cli=False)
    srv.wait_ready()
    yield srv
    srv.stop()


def post(srv: ServerProcess, route: str, body: dict[str, Any], key: str = ADMIN) -> httpx.Response:
    return httpx.post(srv.url + route, json=body, headers=auth(key), timeout=60)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(n)]


def test_server_pins_survive_a_flood_and_admin_routes_manage_them(pin_server: ServerProcess) -> None:
    srv = pin_server
    with httpx.Client(base_url=srv.url, headers=auth(ADMIN), timeout=60) as admin:
        assert admin.delete("/pins").status_code == 200
        prompt = ids(80, 1)
        body = {"input_ids": prompt, "sampling_params": GEN, "priority": 3,
                "cache_control": {"type": "ephemeral", "ttl": "1h"}}  # fmt: skip
        r = post(srv, "/generate", body, KEYS["alpha"])
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["pinned_tokens"] == 80 + GEN["max_new_tokens"] - 1 and meta["pin_id"]
        plain = post(srv, "/generate", {"input_ids": ids(20, 2), "sampling_params": GEN}, KEYS["beta"])
        assert plain.json()["meta_info"]["pinned_tokens"] == 0 and "pin_id" not in plain.json()["meta_info"]
        # a request over the tenant's pin share (102) is pinned partially; OpenAI extra body fields work
        comp = {"model": "m", "prompt": ids(300, 3), "max_tokens": 2, "temperature": 0, "priority": 1,
                "cache_control": {"type": "ephemeral", "ttl": 600}}  # fmt: skip
        assert post(srv, "/v1/completions", comp, KEYS["beta"]).status_code == 200
        pins = {p["tenant"]: p for p in admin.get("/pins").json()}
        assert set(pins) == {"alpha", "beta"} and pins["beta"]["tokens"] == TENANT_SHARE
        assert (
            pins["alpha"]["tokens"] == meta["pinned_tokens"] and 3590 < pins["alpha"]["expires_in_s"] <= 3600
        )
        # the admin pins a prefix of its own: the global budget caps it (204 - 83 - 102 = 19 left)
        r = admin.post("/pin_prefix", json={"input_ids": ids(100, 4), "ttl": "5m"})
        assert r.status_code == 200 and r.json()["pinned_tokens"] == BUDGET - 83 - TENANT_SHARE
        # flood: far more distinct tokens than the pool holds, at a higher priority
        for i in range(3):
            flood = {
                "input_ids": ids(500, 100 + i),
                "sampling_params": {**GEN, "max_new_tokens": 1},
                "priority": 9,
            }
            assert post(srv, "/generate", flood, KEYS["beta"]).status_code == 200
        again = post(srv, "/generate", {"input_ids": prompt + [7], "sampling_params": GEN}, KEYS["alpha"])
        assert again.json()["meta_info"]["cached_tokens"] >= 80  # the pinned prefix survived
        evicted = post(srv, "/generate", {"input_ids": ids(20, 2), "sampling_params": GEN}, KEYS["beta"])
        assert evicted.json()["meta_info"]["cached_tokens"] == 0  # ... while an unpinned one did not
        info = wait_idle_with_pins(admin)
        assert info["kv_pinned_tokens"] == BUDGET and info["max_total_num_tokens"] == POOL
        # releasing
        assert admin.delete(f"/pins/{meta['pin_id']}").json() == {"dropped": 1}
        r = admin.delete(f"/pins/{meta['pin_id']}")
        assert r.status_code == 404 and r.json()["error"]["param"] == "pin_id"
        assert admin.delete("/pins").json() == {"dropped": 2}
        assert admin.get("/pins").json() == []
        wait_idle(admin)  # nothing pinned, nothing locked: the plain idle invariant


def wait_idle_with_pins(c: httpx.Client) -> dict[str, Any]:
    """Idle with pins held: the KV invariant holds and only pinned tokens are in use."""
    deadline = time.monotonic() + 10
    while True:
        info: dict[str, Any] = c.get("/get_server_info").json()
        if info["idle"] == 1.0 and info["num_http_requests_in_flight"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["idle"] == 1.0 and info["kv_invariant_ok"] == 1.0, info["kv_invariant_message"]
    assert info["kv_used_tokens"] == info["kv_pinned_tokens"]
    return info


def test_server_ttl_expiry_bad_fields_and_tenant_keys(pin_server: ServerProcess) -> None:
    srv = pin_server
    with httpx.Client(base_url=srv.url, headers=auth(ADMIN), timeout=60) as admin:
        admin.delete("/pins")
        r = admin.post("/pin_prefix", json={"text": "a system prompt to keep", "ttl": 0.5})
        assert r.status_code == 200 and r.json()["pinned_tokens"] > 0
        assert [p["pin_id"] for p in admin.get("/pins").json()] == [r.json()["pin_id"]]
        time.sleep(0.6)
        assert admin.get("/pins").json() == []  # expired
        wait_idle(admin)
        for body, field in [
            ({"cache_control": {"type": "ephemeral", "ttl": "soon"}}, "cache_control.ttl"),
            ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
            ({"priority": "high"}, "priority"),
        ]:
            r = post(srv, "/generate", {"text": "hi", "sampling_params": GEN, **body}, KEYS["alpha"])
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ":"), r.text
        r = admin.post("/pin_prefix", json={"text": "x", "ttl": "forever"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"
        r = admin.post("/pin_prefix", json={"text": "x", "tenant": "nobody"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    for method, route in [
        ("POST", "/pin_prefix"),
        ("GET", "/pins"),
        ("DELETE", "/pins"),
        ("DELETE", "/pins/x"),
    ]:
        r = httpx.request(method, srv.url + route, json={"text": "x"}, headers=auth(KEYS["alpha"]))
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", (route, r.text)


def test_engine_takes_priority_and_cache_control(tiny_llama: Path, engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The in-process Engine carries both retention fields (so frontend_lang's EngineBackend sends its
    priorities): a pin is reported, the bad values are ValueErrors naming the field."""
    from frontend_lang.backends.engine import EngineBackend

    eng = engine_factory(tiny_llama, max_total_tokens=1024, radix_eviction_policy="priority")
    params = {"temperature": 0, "max_new_tokens": 2}
    out = eng.generate(input_ids=list(range(5, 45)), sampling_params=params, priority=3,
                       cache_control={"type": "ephemeral", "ttl": 60})  # fmt: skip
    assert out["meta_info"]["pinned_tokens"] >= 40
    with pytest.raises(ValueError, match="priority"):
        eng.generate(input_ids=[5, 6], sampling_params=params, priority="high")
    with pytest.raises(ValueError, match="cache_control"):
        eng.generate(input_ids=[5, 6], sampling_params=params, cache_control={"type": "forever"})
    assert EngineBackend(eng).retention is True
    assert eng.flush_cache()  # drops the pin: the engine is idle with nothing pinned at teardown
