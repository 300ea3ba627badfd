"""KV bookkeeping of requests: slot allocation with eviction, caching into the RadixCache, release.

The one place that moves slots between a request's ReqToTokenPool row, the allocator and the tree. With
the hierarchical cache it also moves a matched prefix from the host or disk tier into device slots at
admission (`HiRadixCache`), before the request's extend.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import torch

from radixrt.config.server_args import ServerArgs
from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.hiradix_cache import HiRadixCache
from radixrt.mem_cache.radix_cache import MatchResult, RadixCache
from radixrt.mem_cache.req_to_token import ReqToTokenPool
from radixrt.mem_cache.swa_pool import SWAAllocator
from radixrt.mem_cache.swa_radix_cache import SWARadixCache
from radixrt.transport.protocol import DropPinsReq, ListPinsReq, PinInfo, StatsOut
from radixrt.worker.req import Req
from radixrt.worker.swa_windows import SWAWindows

if TYPE_CHECKING:
    from radixrt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_tree(args: ServerArgs, runner: ModelRunner, model_path: str) -> RadixCache:
    """The RadixCache, or with ``--enable-hierarchical-cache`` the HiRadixCache with its host tier (and
    the disk tier with ``--hicache-storage-dir``)."""
    max_pinned = int(args.max_pinned_ratio * runner.allocator.total_slots)
    if isinstance(runner.allocator, SWAAllocator):
        assert runner.swa_window is not None
        return SWARadixCache(
            runner.allocator,
            runner.swa_window,
            args.page_size,
            args.radix_eviction_policy,
            disable=args.disable_radix_cache,
            max_pinned_tokens=max_pinned,
        )
    if not args.enable_hierarchical_cache:
        return RadixCache(
            runner.allocator,
            args.page_size,
            args.radix_eviction_policy,
            disable=args.disable_radix_cache,
            max_pinned_tokens=max_pinned,
        )
    from radixrt.mem_cache.disk_store import FORMAT, DiskStore, chunk_tokens_for, model_fingerprint
    from radixrt.mem_cache.host_pool import HostPool

    pool, ps = runner.kv_pool, args.page_size
    policy = args.hicache_write_policy
    if policy == "auto":  # NOTE: on CPU a write-through copy would duplicate the device pool for nothing
        policy = "write_through" if runner.device.type == "cuda" else "write_back"
    tokens = HostPool.size_tokens(pool, runner.allocator.total_slots, args.hicache_ratio, args.hicache_size)
    host = HostPool(pool, tokens, ps) if tokens >= ps else None
    disk = None
    if args.hicache_storage_dir is not None:
        cfg = runner.config
        identity = {
            "format": FORMAT,
            "model": model_fingerprint(model_path),
            "dtype": str(cfg.dtype),
            "kv_dtype": str(pool.dtype),
            "kv_scales": hashlib.blake2b(pool.scales_bytes(), digest_size=16).hexdigest(),
            "kv_shape": [pool.num_layers, pool.num_kv_heads, pool.head_dim],
            "page_size": ps,
            "quantization": str(runner.quantization),
            "tp": [getattr(args, "tp_size", 1), getattr(runner, "tp_rank", 0)],
        }
        disk = DiskStore(
            args.hicache_storage_dir,
            identity,
            chunk_tokens_for(ps),
            (pool.num_layers, pool.num_kv_heads, pool.head_dim),
            pool.dtype,
            int(args.hicache_storage_size * 2**30),
        )
    logger.info(
        "hierarchical cache: host tier %d tokens (%s), disk tier %s",
        host.total_slots if host is not None else 0,
        policy,
        disk.dir if disk is not None else "off",
    )
    return HiRadixCache(
        runner.allocator, pool, ps, args.radix_eviction_policy, host, disk, policy, max_pinned
    )


class KVManager:
    """Ties the allocator, the ReqToTokenPool and the RadixCache together for the scheduler.

    With the sliding-window cache (``--enable-swa-cache``: an `SWAAllocator` and an `SWARadixCache`) it also
    frees the local-layer K/V of a request's own tokens once they left its window (before every allocation),
    makes room in the local layers' pool as in the full one (`SWAWindows`), and counts
    ``swa_recomputed_tokens``.
    """

    def __init__(
        self, allocator: TokenSlotAllocator | SWAAllocator, req_pool: ReqToTokenPool, tree: RadixCache
    ) -> None:
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = tree
        self.page_size = allocator.page_size
        self.tiered = isinstance(tree, HiRadixCache)
        self.swa: SWAWindows | None = None  # the running requests' local-layer K/V (--enable-swa-cache)
        self.swa_tree: SWARadixCache | None = None
        if isinstance(allocator, SWAAllocator):
            assert isinstance(tree, SWARadixCache), "an SWAAllocator needs the SWARadixCache"
            self.swa, self.swa_tree = SWAWindows(allocator, tree, req_pool), tree

    @property
    def swa_recomputed_tokens(self) -> int:
        """Prompt tokens computed again because their window's local K/V was freed (0 without the cache)."""
        return self.swa.recomputed_tokens if self.swa is not None else 0

    # -- capacity -------------------------------------------------------------------------------
    def available(self) -> int:
        """Slots obtainable now: free plus evictable (in both pools with the sliding-window cache)."""
        full = self.allocator.available_size() + self.tree.evictable_size()
        return full if self.swa is None else min(full, self.swa.available())

    def pages_needed(self, req: Req, num_tokens: int) -> int:
        """Fresh slots (whole pages) that growing ``req`` by ``num_tokens`` takes."""
        ps = self.page_size
        room = (-req.kv_len) % ps
        extra = max(num_tokens - room, 0)
        return (extra + ps - 1) // ps * ps

    def alloc(self, req: Req, num_tokens: int) -> bool:
        """Give ``req`` slots for its next ``num_tokens`` tokens (after ``kv_len``), evicting if needed."""
        need = self.pages_needed(req, num_tokens)
        if self.swa is not None:
            self.swa.free_out_of_window(req)
        self._make_room(need, req.tenant)
        assert req.req_pool_idx is not None
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last = int(row[req.kv_len - 1]) if req.kv_len > 0 else 0
        slots = self.allocator.alloc_extend(last, req.kv_len, num_tokens)
        if slots is None:
            return False
        row[req.kv_len : req.kv_len + num_tokens] = slots
        return True

    def alloc_decode(self, reqs: list[Req]) -> bool:
        """One more slot for each request (callers made room first). Batched when pages are single tokens."""
        if self.page_size > 1:
            return all(self.alloc(r, 1) for r in reqs)
        if self.swa is not None:
            for r in reqs:
                self.swa.free_out_of_window(r)
        self._make_room(len(reqs), None)
        slots = self.allocator.alloc(len(reqs))
        if slots is None:
            return False
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_pool.req_to_token[rows, cols] = slots
        return True

    def _make_room(self, need: int, requester: str | None) -> None:
        """Evict until ``need`` slots are free: sparing other tenants' reserved shares, and only when that
        is not enough (running requests must progress) from those too."""
        for spare in (True, False):
            short = need - self.allocator.available_size()
            if short <= 0:
                break
            self.tree.evict(short, requester=requester, spare_reserved=spare, incoming=need)
        if self.swa is not None:
            self.swa.make_room(need)

    def yield_pins(self, req: Req, tokens: int) -> int:
        """Release the TTL pins that keep ``req`` from ever holding ``tokens`` tokens (the pool less the
        pinned tokens outside its prefix is too small): pins yield to a request that fits the pool rather
        than fail it. Returns the pinned tokens released (evictable now); 0 when none stands in the way."""
        pins = self.tree.pins
        if not pins.pinned_size() or req.last_node is None:
            return 0
        ps = self.page_size
        room = self.allocator.total_slots - pins.off_path_size(req.last_node)
        short = (tokens + ps - 1) // ps * ps - room
        if short <= 0:
            return 0
        before = pins.pinned_size()
        released = pins.yield_to(req.last_node, short, req.tenant)
        freed = before - pins.pinned_size()
        logger.warning(
            "released %d TTL pins (%d tokens) for request %s: %d tokens do not fit beside them in the %d-token "
            "KV pool",
            released, freed, req.rid, tokens, self.allocator.total_slots,
        )  # fmt: skip
        return freed

    # -- admission ------------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Give ``req`` a pool row and its cached prefix (locked). False when no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        ids = req.fill_ids[: req.max_prefix_len()]
        if self.swa is not None and self.swa_tree is not None:
            match, lost = self.swa_tree.match_prefix_swa(ids, req.cache_salt, req.priority)
            self.swa.on_admit(row, lost, req.retractions == 0 and not req.output_ids)
        else:
            match = self.tree.match_prefix(ids, req.cache_salt, req.priority)
        if isinstance(self.tree, HiRadixCache):
            match = self._load_tiers(req, ids, match, self.tree)
        n = len(match.slots)
        if n:
            self.req_pool.req_to_token[row, :n] = match.slots
        self.tree.inc_lock_ref(match.last_node)
        req.req_pool_idx, req.last_node, req.cached_len, req.kv_len = row, match.last_node, n, n
        return True

    def _load_tiers(self, req: Req, ids: list[int], match: MatchResult, tree: HiRadixCache) -> MatchResult:
        """Extend ``match`` on the device: first over its host-only nodes, then over disk chunks. Each
        move happens only if device room can be made for all of it (evicting, with the matched prefix
        locked); loaded tokens are counted on the request while it has not started."""
        first_admission = req.retractions == 0 and not req.output_ids
        if match.host_nodes:
            need = match.host_len
            tree.inc_lock_ref(match.last_node)
            if need <= self.available():
                with tree.pinned(match.host_nodes):
                    self._make_room(need, req.tenant)
            tree.dec_lock_ref(match.last_node)
            match = tree.load_back(match)
            if match.host_nodes:
                return match  # no device room: the request computes the rest
            if first_admission:
                req.cached_host_tokens += need
        plan = tree.disk_plan(ids, req.cache_salt, len(match.slots))
        if plan is not None:
            tree.inc_lock_ref(match.last_node)
            room = plan.tokens <= self.available()
            if room:
                self._make_room(plan.tokens, req.tenant)
            tree.dec_lock_ref(match.last_node)
            if room:
                match, loaded = tree.load_disk(ids, req.cache_salt, req.tenant, match, plan)
                if first_admission:
                    req.cached_disk_tokens += loaded
        return match

    # -- caching and release --------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """Insert the computed page-aligned part of a running request; keep it locked."""
        if self.tree.disable or req.req_pool_idx is None:
            return
        aligned = req.kv_len // self.page_size * self.page_size
        if aligned <= req.cached_len:
            return
        key = req.fill_ids[:aligned]
        row = self.req_pool.req_to_token[req.req_pool_idx]
        slots = row[:aligned].clone()
        prefix_len = self._insert(req, key, slots)
        if prefix_len > req.cached_len:
            self.allocator.free(slots[req.cached_len : prefix_len])
        match = self.tree.match_prefix(key, req.cache_salt)
        assert len(match.slots) == aligned, (len(match.slots), aligned)
        row[:aligned] = match.slots
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.cached_len = match.last_node, aligned

    def release(self, req: Req) -> None:
        """Finished, aborted or retracted: cache what was computed, unlock, free the rest and the row.
        A request that finished (not aborted) with a ``pin_ttl`` pins the prefix it cached."""
        if req.req_pool_idx is None:
            return
        row = self.req_pool.req_to_token[req.req_pool_idx]
        kv_len = req.kv_len
        slots = row[:kv_len].clone()
        own_from = req.cached_len
        if not self.tree.disable:
            aligned = kv_len // self.page_size * self.page_size
            if _reasoned(req):  # its output is dead once the client drops the reasoning: keep the prompt
                prompt = len(req.origin_input_ids) // self.page_size * self.page_size
                aligned = min(aligned, max(prompt, req.cached_len))
            all_ids = req.origin_input_ids + req.output_ids
            key = all_ids[:aligned]
            prefix_len = self._insert(req, key, slots[:aligned])
            if prefix_len > req.cached_len:
                self.allocator.free(slots[req.cached_len : prefix_len])
            own_from = aligned
            reason = req.finish_reason
            if req.pin_ttl is not None and reason is not None and reason.get("type") != "abort":
                req.pin_id, req.pinned_tokens = self.tree.pin(key, req.cache_salt, req.pin_ttl)
        self.allocator.free(slots[own_from:kv_len])
        self.tree.dec_lock_ref(req.last_node)
        if self.swa is not None:
            self.swa.on_release(req.req_pool_idx)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.cached_len, req.kv_len = None, None, 0, 0

    def _insert(self, req: Req, key: list[int], slots: torch.Tensor) -> int:
        """``tree.insert`` of ``req``'s tokens (telling the sliding-window tree which lost their local K/V)."""
        if self.swa is not None and self.swa_tree is not None and req.req_pool_idx is not None:
            freed_to = self.swa.freed_to(req.req_pool_idx)
            return self.swa_tree.insert(key, slots, req.cache_salt, req.tenant, req.priority, freed_to)
        return self.tree.insert(key, slots, req.cache_salt, req.tenant, req.priority)

    def pins(self, msg: ListPinsReq | DropPinsReq) -> StatsOut:
        """Answer an admin pin request: the live pins, or release one (ok False when unknown) or all."""
        tree = self.tree
        if isinstance(msg, ListPinsReq):
            pins = [PinInfo(p.pin_id, p.tokens, round(p.expires_in_s, 3), p.tenant) for p in tree.pins.live()]
            return StatsOut(pins=pins)
        if msg.pin_id is None:
            dropped = tree.pins.drop_all()
            return StatsOut(message=f"dropped {dropped} pins", stats={"dropped": float(dropped)})
        if not tree.pins.drop(msg.pin_id):
            return StatsOut(ok=False, message=f"pin_id: no pin {msg.pin_id!r}")
        return StatsOut(message="dropped 1 pin", stats={"dropped": 1.0})

    def close(self) -> None:
        """Finish the tiers' background work (the disk tier's queued writes)."""
        if isinstance(self.tree, HiRadixCache):
            self.tree.close()

    # -- accounting -----------------------------------------------------------------------------
    def owned_slots(self, req: Req) -> int:
        """Slots held by ``req`` outside the tree (its uncached pages)."""
        if req.req_pool_idx is None:
            return 0
        ps = self.page_size
        return (req.kv_len + ps - 1) // ps * ps - req.cached_len

    def check_invariant(self, live: list[Req], idle: bool) -> None:
        """Assert ``free + evictable + protected + in-use == total``; at idle nothing in use or locked."""
        tree = self.tree
        evictable, protected = tree.evictable_size(), tree.protected_size()
        assert evictable + protected == tree.total_size(), "tree sizes disagree"
        if isinstance(tree, HiRadixCache):
            tree.check_tiers(idle)
        pinned = tree.pins.pinned_size()
        assert pinned <= protected, f"pinned {pinned} > locked {protected}"
        in_use = sum(self.owned_slots(r) for r in live)
        free = self.allocator.available_size()
        total = self.allocator.total_slots
        assert free + evictable + protected + in_use == total, (
            f"KV leak: free {free} + evictable {evictable} + protected {protected} + in-use {in_use} != {total}"
        )
        if idle:
            assert not live, f"{len(live)} requests still live at idle"
            assert protected == pinned, f"{protected - pinned} tokens still locked (not by pins) at idle"
            assert self.req_pool.available_size() == self.req_pool.size, "ReqToTokenPool rows leaked"
        if self.swa is not None:
            self.swa.check(live, idle and not pinned)


def _reasoned(req: Req) -> bool:
    """Whether a finished request's output is reasoning a chat template will drop (``strip_thinking``)."""
    opens = req.strip_thinking
    if opens is None or req.finish_reason is None:  # a retracted request resumes: keep all it computed
        return False
    return req.output_ids[: len(opens)] == opens
