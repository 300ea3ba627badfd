"""Admission of waiting requests into a prefill round: policy and fairness order, in-batch dedup, decode
headroom, tenant quotas and per-round caps, and the long prompts of heavier tenants that step aside.

The scheduler decides what continues (a chunked prompt, jump-forward extends) and calls ``admit_waiting``
for the rest of the round's budget; it reads the scheduler through the narrow ``AdmissionHost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from radixrt.worker.schedule_policy import order_waiting, shared_uncached_prefix

if TYPE_CHECKING:
    from radixrt.config.server_args import ServerArgs
    from radixrt.mem_cache.radix_cache import RadixCache
    from radixrt.worker.kv_manager import KVManager
    from radixrt.worker.output import OutputProcessor
    from radixrt.worker.req import Req
    from radixrt.worker.tenant_ledger import TenantLedger

# In-batch dedup: a waiting request sharing at least this many uncached (cacheable) tokens with one
# already admitted this round waits a round, so it hits the cache instead of recomputing the prefix.
# Any shared token: the wait is one forward (prefill goes first), and fork siblings / select choices
# share short fresh tails ("Step 2 (") that a perfect cache computes once.
DEDUP_MIN_SHARED = 1
CLIP_MAX_NEW_TOKENS = 1024  # at most this many of a request's max_new_tokens are reserved for its decode


class AdmissionHost(Protocol):
    """What admission reads and moves in the scheduler."""

    args: ServerArgs
    waiting: list[Req]
    running: list[Req]
    jumped: list[Req]
    chunked: Req | None
    kv: KVManager
    tree: RadixCache
    ledger: TenantLedger | None
    out: OutputProcessor
    new_token_ratio: float

    def reserved_decode(self) -> float: ...


def admit_waiting(
    s: AdmissionHost,
    batch: list[Req],
    budget: int,
    caps: dict[str | None, int] | None,
    step_aside: set[str | None] | frozenset[str | None] = frozenset(),
    whole: bool = False,
    only: set[int] | None = None,
) -> list[Req]:
    """Admit waiting requests into ``batch`` (allocating their slots) within ``budget`` prefill tokens and
    each tenant's ``caps``. The requests of ``step_aside`` tenants whose uncached prompt is longer than their
    cap are not admitted (the other tenants' are not capped then): they are returned, for a second call with ``only`` their ids when no lighter
    request got in. ``whole``: only requests whose prefill completes this round (a deferred chunk still holds the one
    chunked place)."""
    aside: list[Req] = []
    args = s.args
    if not s.waiting or budget <= 0:
        return aside
    if len(s.running) + len(batch) >= args.max_running_requests or not s.kv.req_pool.available_size():
        return aside  # no room: skip ordering (lpm probes the tree for every waiting request)
    # one chunked prefill at a time: while a request of the batch stays unfinished, the rest must finish
    whole = whole or any(r.kv_len + r.extend_len < len(r.fill_ids) for r in batch)
    headroom = s.kv.available() - s.reserved_decode()
    ordered = order_waiting(s.waiting, args.schedule_policy, s.tree)
    if s.ledger is not None:
        ordered = s.ledger.fair_order(ordered)
    for req in ordered:
        if len(s.running) + len(batch) >= args.max_running_requests or budget <= 0:
            break
        if only is not None and id(req) not in only:
            continue
        if caps is not None and caps[req.tenant] <= 0 and batch:
            continue  # its tenant took its share of this round while another tenant waits
        if not s.kv.admit(req):
            break
        extend = len(req.fill_ids) - req.kv_len
        dedup = batch and extend > 1 and not s.tree.disable
        if dedup and shared_uncached_prefix(req, batch, req.kv_len) >= DEDUP_MIN_SHARED:
            s.kv.release(req)  # wait one round: the prefix will be cached by then
            continue
        cap = caps[req.tenant] if caps is not None else budget
        if step_aside and req.tenant not in step_aside:
            cap = budget  # the lightest tenants take the round the heavier ones stepped aside from
        if req.tenant in step_aside and extend > cap:
            s.kv.release(req)  # a heavier tenant's long prompt: a lighter one's request goes first
            aside.append(req)
            continue
        take = min(extend, budget, cap)
        if whole and take < extend:
            s.kv.release(req)  # one chunked prefill at a time: another's continues after this round
            continue
        reserve = min(req.params.max_new_tokens, CLIP_MAX_NEW_TOKENS) * s.new_token_ratio
        if req.bootstrap_room is not None and args.disaggregation_mode == "prefill":
            reserve = 1  # a prefill server samples one token; the decode server generates the rest
        need = s.kv.pages_needed(req, take) + (reserve if take == extend else 0)
        if need > headroom and (batch or s.running):
            s.kv.release(req)
            break
        if s.ledger is not None and not s.ledger.may_admit(
            req, s.kv.pages_needed(req, take), s.waiting, batch
        ):
            s.kv.release(req)  # its tenant is at its quota while others have work: it waits
            continue
        headroom += s.kv.yield_pins(req, len(req.fill_ids))  # before its first chunk, not after
        if not s.kv.alloc(req, take):
            s.kv.release(req)
            if (
                not batch and not s.running and not s.jumped and s.chunked is None
            ):  # nothing else holds memory
                s.waiting.remove(req)
                total, pinned = s.kv.allocator.total_slots, s.tree.pins.pinned_size()
                fit = f"the prompt ({len(req.fill_ids)} tokens) does not fit the KV pool ({total} tokens"
                s.out.end_with_abort(req, f"out of KV memory: {fit}, {pinned} of them pinned)", 400)
            break
        headroom -= need
        if req.retractions == 0 and not req.output_ids:
            req.cached_tokens = req.kv_len
            req.cached_disk_tokens = min(req.cached_disk_tokens, req.kv_len)
            req.cached_host_tokens = min(req.cached_host_tokens, req.kv_len - req.cached_disk_tokens)
        req.extend_len = take
        s.waiting.remove(req)
        batch.append(req)
        budget -= take
        if caps is not None:
            caps[req.tenant] -= take
        if take < extend:
            break
    return aside
