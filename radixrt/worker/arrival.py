"""A request at the worker's door: why it is refused on arrival, and the clock ``--request-timeout`` runs on.

A refused request never enters a queue; its reason reaches the client with an HTTP status (400: it can
never run here; 429: the queue, or its tenant's share of it, is full now). The scheduler asks `refusal`
first and the grammar backend last (that check may start a compilation).
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence

from radixrt.worker.req import Req
from radixrt.worker.tenant_ledger import TenantLedger

TIMEOUT_SWEEP_S = 0.05  # how often the scheduler looks for requests past --request-timeout


def refusal(
    req: Req,
    context_len: int,
    total_slots: int,
    ledger: TenantLedger | None,
    queue_bound: int | None,
    queued: Sequence[Req],
) -> tuple[str, int] | None:
    """Why ``req`` is refused on arrival and with which HTTP status, or None to accept it.

    ``queued`` are the requests waiting now (for admission or for their grammar), ``queue_bound`` is
    ``--max-queued-requests`` (0 or None: unbounded); with tenants (``ledger``) each tenant may hold only
    its share of the queue."""
    prompt = len(req.origin_input_ids)
    if prompt + req.params.max_new_tokens > context_len + 1:
        return (
            f"prompt ({prompt} tokens) + max_new_tokens ({req.params.max_new_tokens}) exceeds the context "
            f"length {context_len}",
            400,
        )
    if prompt + 1 > total_slots:
        return f"prompt ({prompt} tokens) + 1 generated does not fit the KV pool ({total_slots} tokens)", 400
    if req.tenant is not None and (ledger is None or req.tenant not in ledger.counters):
        return f"tenant: {req.tenant!r} is not a tenant of this server", 400
    if not queue_bound:
        return None
    if len(queued) >= queue_bound:
        return f"the request queue is full ({queue_bound} waiting requests); retry later", 429
    if ledger is not None:
        share = ledger.queue_share(req.tenant, queue_bound)
        if sum(r.tenant == req.tenant for r in queued) >= share:
            return (
                f"tenant {req.tenant!r} has its share of the request queue ({share} waiting); retry later",
                429,
            )
    return None


class RequestTimeouts:
    """``--request-timeout``: when each live request arrived, and which of them are overdue."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._arrived: dict[str, float] = {}  # rid -> monotonic arrival
        self._next_sweep = 0.0

    def on_arrival(self, rid: str) -> None:
        self._arrived[rid] = time.monotonic()

    def overdue(self, live: Container[str]) -> list[str]:
        """The rids in ``live`` older than the limit; at most one sweep per ``TIMEOUT_SWEEP_S`` (else [])."""
        now = time.monotonic()
        if now < self._next_sweep:
            return []
        self._next_sweep = now + TIMEOUT_SWEEP_S
        self._arrived = {rid: t for rid, t in self._arrived.items() if rid in live}
        return [rid for rid, t in self._arrived.items() if now - t > self.limit_s]
