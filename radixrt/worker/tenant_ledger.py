"""Per-tenant KV accounting in the worker: quotas and reserves in tokens, what each tenant holds, and
whether a tenant's request may be admitted now (quota under contention).

A tenant *holds* its cached tokens (its namespaces in the RadixCache) plus the slots its live requests
own outside the tree. Under contention — another tenant has requests waiting or running, or had one within
the last ``ACTIVE_WINDOW_S`` (between two turns of a chat) — a request is
admitted only if its tenant stays within its ``kv_quota`` after the admission; first the tenant's own
least recently used cached prefixes are evicted to make room (LRU inside the quota). Otherwise it waits
in the queue (never fails for the quota). Alone on the server a tenant may use the whole pool.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from radixrt.config.tenants import ADMIN_TENANT, TenantConfig
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.worker.kv_manager import KVManager
from radixrt.worker.req import Req

ACTIVE_WINDOW_S = 2.0  # a tenant with a request this recent still has work (quotas hold against others)
# While a lighter tenant is active, a tenant's prefill per round is its share of this many tokens: a
# request of the lighter tenant arriving mid-round waits for at most such a round, not a long prompt's.
CONTENDED_ROUND_TOKENS = 512


@dataclass(slots=True)
class TenantCounters:
    """Cumulative per-tenant counts (tokens), reported with label ``tenant``."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    quota_waits: int = 0  # admissions deferred because the tenant was at its quota


@dataclass
class TenantLedger:
    """Implements the RadixCache's `TenantShares` and the scheduler's quota gate."""

    config: TenantConfig
    kv: KVManager
    live: Callable[[], list[Req]]
    counters: dict[str, TenantCounters] = field(default_factory=dict)
    # tenant -> monotonic time its last request arrived or finished: a tenant between the turns of a
    # conversation (think time) still counts as having work for ACTIVE_WINDOW_S
    last_active: dict[str | None, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        for t in self.config.tenants:
            self.counters[t.name] = TenantCounters()
        self.counters[ADMIN_TENANT] = TenantCounters()

    @property
    def tree(self) -> RadixCache:
        return self.kv.tree

    @property
    def total(self) -> int:
        return self.kv.allocator.total_slots

    # -- TenantShares -------------------------------------------------------------------------------
    def quota_tokens(self, tenant: str | None) -> int:
        if tenant is None or tenant == ADMIN_TENANT:
            return self.total
        return int(self.config.get(tenant).kv_quota * self.total)

    def reserved_tokens(self, tenant: str | None) -> int:
        if tenant is None or tenant == ADMIN_TENANT:
            return 0
        return int(self.config.get(tenant).reserved * self.total)

    def running_tokens(self) -> dict[str | None, int]:
        held: Counter[str | None] = Counter()
        for r in self.live():
            held[r.tenant] += self.kv.owned_slots(r)
        return dict(held)

    def queue_share(self, tenant: str | None, bound: int) -> int:
        """The most waiting requests ``tenant`` may have in a queue of ``bound``: its ``kv_quota`` of it
        (at least one), so that a flooding tenant meets 429s while the others still get in."""
        if tenant is None or tenant == ADMIN_TENANT:
            return bound
        return max(1, math.ceil(self.config.get(tenant).kv_quota * bound))

    # -- admission --------------------------------------------------------------------------------
    def admission_rank(self, req: Req) -> int:
        """Sort key: higher tenant priority first (the admin's requests rank with priority 0)."""
        if req.tenant is None or req.tenant == ADMIN_TENANT:
            return 0
        return -self.config.get(req.tenant).priority

    def held(self, tenant: str | None, batch: list[Req]) -> int:
        """Tokens ``tenant`` holds: cached, live, and admitted into the prefill batch being formed."""
        # NOTE: a batch member's kv_len moves only after the forward; its new slots are its extend_len.
        in_batch = sum(self.kv.owned_slots(r) + r.extend_len for r in batch if r.tenant == tenant)
        return self.tree.tenant_size(tenant) + self.running_tokens().get(tenant, 0) + in_batch

    def share(self, tenant: str | None) -> float:
        """The tenant's ``kv_quota``: its share of the pool, and of compute under contention (the admin: 1)."""
        if tenant is None or tenant == ADMIN_TENANT:
            return 1.0
        return self.config.get(tenant).kv_quota

    def fair_order(self, ordered: list[Req]) -> list[Req]:
        """Waiting requests in admission order: higher tenant priority first, then the tenant that runs the
        fewest requests for its share (so a flooding tenant's queue does not go ahead of a quiet tenant's
        next turn), then ``ordered``'s own (policy) order."""
        running = Counter(r.tenant for r in self.live())
        rank = {id(r): i for i, r in enumerate(ordered)}
        return sorted(
            ordered,
            key=lambda r: (self.admission_rank(r), running[r.tenant] / self.share(r.tenant), rank[id(r)]),
        )

    def _load(self, waiting: list[Req]) -> Callable[[str | None], float]:
        """A tenant's load: its live and waiting requests per unit of its share."""
        demand = Counter(r.tenant for r in self.live()) + Counter(r.tenant for r in waiting)
        return lambda t: demand[t] / self.share(t)

    def prefill_caps(
        self, waiting: list[Req], budget: int, chunked: Req | None = None
    ) -> dict[str | None, int] | None:
        """Per tenant, the most prefill tokens one round may take (a longer prompt is chunked to it): its
        share of ``budget`` while several tenants wait (short rounds for everyone's first token instead of
        one tenant's long prompts), and its share of CONTENDED_ROUND_TOKENS while a lighter tenant (fewer
        live and waiting requests for its share) is active, so that tenant's next request, arriving mid-round, does
        not wait for a round of long prompts. ``chunked``: the request whose prefill continues this round.
        None when no tenant is capped."""
        tenants = {r.tenant for r in waiting} | ({chunked.tenant} if chunked is not None else set())
        load = self._load(waiting)
        since = self.clock() - ACTIVE_WINDOW_S
        active = tenants | {r.tenant for r in self.live()}
        active |= {t for t, at in self.last_active.items() if at >= since}
        caps: dict[str | None, int] = {}
        for t in tenants:
            cap = math.ceil(self.share(t) * budget) if len({r.tenant for r in waiting}) >= 2 else budget
            if any(u != t and load(u) < load(t) for u in active):
                cap = min(cap, math.ceil(self.share(t) * min(budget, CONTENDED_ROUND_TOKENS)))
            caps[t] = max(1, cap)
        return caps if any(c < budget for c in caps.values()) else None

    def yielding(self, waiting: list[Req]) -> set[str | None]:
        """The tenants whose long prefills step aside this round: every tenant heavier (more live and waiting
        requests for its share) than the lightest tenant with a request waiting. The scheduler defers their
        continuing chunk and their prompts longer than their cap, so the lighter request takes the round
        without a long prompt beside it; when no lighter request could be admitted, nobody steps aside."""
        if not waiting:
            return set()
        load = self._load(waiting)
        lightest = min(load(r.tenant) for r in waiting)
        tenants = {r.tenant for r in self.live()} | {r.tenant for r in waiting}
        return {t for t in tenants if load(t) > lightest}

    def contended(self, tenant: str | None, waiting: list[Req]) -> bool:
        """Whether another tenant has work: waiting or live requests, or one that arrived or finished
        within the last ACTIVE_WINDOW_S (an interactive tenant between turns keeps its share)."""
        if any(r.tenant != tenant for r in waiting) or any(r.tenant != tenant for r in self.live()):
            return True
        since = self.clock() - ACTIVE_WINDOW_S
        return any(t != tenant and at >= since for t, at in self.last_active.items())

    def may_admit(self, req: Req, need: int, waiting: list[Req], batch: list[Req]) -> bool:
        """True when ``req`` (already holding its cached prefix) may take ``need`` more slots now, next to
        the requests already in this round's prefill ``batch``."""
        quota = self.quota_tokens(req.tenant)
        over = self.held(req.tenant, batch) + need - quota
        if over <= 0 or not self.contended(req.tenant, waiting + batch):
            return True
        self.tree.evict(over, requester=req.tenant, only=req.tenant)
        if self.held(req.tenant, batch) + need <= quota:
            return True
        self.counters[req.tenant or ADMIN_TENANT].quota_waits += 1
        return False

    # -- reporting ---------------------------------------------------------------------------------
    def on_arrival(self, req: Req) -> None:
        self.last_active[req.tenant] = self.clock()
        c = self.counters[req.tenant or ADMIN_TENANT]
        c.requests += 1
        c.prompt_tokens += len(req.origin_input_ids)

    def on_finish(self, req: Req) -> None:
        self.last_active[req.tenant] = self.clock()
        c = self.counters[req.tenant or ADMIN_TENANT]
        c.cached_tokens += req.cached_tokens
        c.generated_tokens += len(req.output_ids)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tenant: cumulative counters, evicted tokens, KV tokens held now and the quota (tokens)."""
        running = self.running_tokens()
        out: dict[str, dict[str, float]] = {}
        for name, c in self.counters.items():
            held = self.tree.tenant_size(name) + running.get(name, 0)
            out[name] = {
                "requests": c.requests,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "generated_tokens": c.generated_tokens,
                "quota_waits": c.quota_waits,
                "evicted_tokens": self.tree.tenant_evicted.get(name, 0),
                "kv_tokens_held": held,
                "kv_quota_tokens": self.quota_tokens(name),
                "hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            }
        return out
