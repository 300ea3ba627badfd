"""Worker-side counters (feed /metrics, /get_server_info and the benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixrt.mem_cache.hiradix_cache import HiRadixCache
from radixrt.worker.req import Req

if TYPE_CHECKING:
    from radixrt.worker.kv_manager import KVManager
    from radixrt.worker.tenant_ledger import TenantLedger


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counts since start (or since the last ``reset``).

    Every request the worker accepts counts once in ``num_requests`` and, once it ends for any reason
    (finished, aborted, timed out, failed grammar, out of memory), once in ``num_finished``; at idle the
    two are equal. A request refused on arrival (queue full, does not fit, unknown tenant) counts only in
    ``num_refused``.
    """

    num_requests: int = 0
    num_finished: int = 0
    num_refused: int = 0
    num_timed_out: int = 0  # of num_finished: aborted by --request-timeout
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0  # of cached_tokens: loaded from the host tier
    cached_disk_tokens: int = 0  # of cached_tokens: loaded from the disk tier
    computed_prefill_tokens: int = 0
    generation_tokens: int = 0
    retractions: int = 0
    jump_forward_tokens: int = 0
    mixed_decode_tokens: int = 0  # --enable-mixed-chunk: decode tokens computed inside prefill forwards
    grammar_mask_seconds: float = 0.0
    grammar_masked_rows: int = 0
    # Speculative decoding: verify forwards, drafted (request, step) pairs, draft tokens proposed and
    # draft tokens that ended up in the output (the bonus token of each verify is not counted).
    spec_verify_steps: int = 0
    spec_verify_reqs: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Why drafts were not verified (radixrt.speculative.policy): steps over the batch limit, steps whose
    # drafts would not pay for the verify, request-steps backed off for low acceptance.
    spec_skipped_batch_steps: int = 0
    spec_skipped_cost_steps: int = 0
    spec_backoff_req_steps: int = 0
    spec_index_tokens: int = 0  # SUFFIX: tokens and trie nodes of the global index now
    spec_index_nodes: int = 0
    tenants: TenantLedger | None = None  # per-tenant counters, when the server has tenants

    def on_arrival(self, req: Req) -> None:
        self.num_requests += 1
        self.prompt_tokens += len(req.origin_input_ids)
        if self.tenants is not None:
            self.tenants.on_arrival(req)

    def on_finish(self, req: Req) -> None:
        self.num_finished += 1
        self.cached_tokens += req.cached_tokens
        self.cached_host_tokens += req.cached_host_tokens
        self.cached_disk_tokens += req.cached_disk_tokens
        self.generation_tokens += len(req.output_ids)
        if self.tenants is not None:
            self.tenants.on_finish(req)

    def snapshot(self, kv: KVManager, num_running: int, num_queued: int) -> dict[str, float]:
        """The counters with the KV pool's occupancy and the scheduler's queue lengths now (``num_running``
        includes a request in the middle of a chunked prefill; ``num_queued`` those compiling a grammar)."""
        total = kv.allocator.total_slots
        used = total - kv.allocator.available_size() - kv.tree.evictable_size()
        tiers = kv.tree.tier_snapshot() if isinstance(kv.tree, HiRadixCache) else {}
        swa = kv.swa_tree  # --enable-swa-cache: the local layers' pool, tokens whose window was freed
        windows = {} if swa is None else {
            "kv_swa_total_tokens": swa.swa.swa_total_slots,
            "kv_swa_cached_tokens": swa.swa_evictable_size() + swa.swa_protected_size(),
            "swa_evicted_tokens": swa.swa_evicted_tokens,
            "swa_recomputed_tokens": kv.swa_recomputed_tokens,
        }  # fmt: skip
        return {
            **tiers,
            **windows,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_refused": self.num_refused,
            "num_timed_out": self.num_timed_out,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_device": self.cached_tokens - self.cached_host_tokens - self.cached_disk_tokens,
            "cached_tokens_host": self.cached_host_tokens,
            "cached_tokens_disk": self.cached_disk_tokens,
            "computed_prefill_tokens": self.computed_prefill_tokens,
            "generation_tokens": self.generation_tokens,
            "retractions": self.retractions,
            "jump_forward_tokens": self.jump_forward_tokens,
            "mixed_decode_tokens": self.mixed_decode_tokens,
            "grammar_mask_seconds": self.grammar_mask_seconds,
            "grammar_masked_rows": self.grammar_masked_rows,
            "spec_verify_steps": self.spec_verify_steps,
            "spec_verify_reqs": self.spec_verify_reqs,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_skipped_batch_steps": self.spec_skipped_batch_steps,
            "spec_skipped_cost_steps": self.spec_skipped_cost_steps,
            "spec_backoff_req_steps": self.spec_backoff_req_steps,
            "spec_index_tokens": self.spec_index_tokens,
            "spec_index_nodes": self.spec_index_nodes,
            # tokens emitted per drafted request per verify forward (accepted drafts + 1), SGLang's
            # "accept length"; 0 before any verify
            "spec_accept_length": (
                1 + self.spec_accepted_tokens / self.spec_verify_reqs if self.spec_verify_reqs else 0.0
            ),
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "num_running_reqs": num_running,
            "num_queue_reqs": num_queued,
            "kv_total_tokens": total,
            "kv_used_tokens": used,
            "kv_cached_tokens": kv.tree.total_size(),
            "kv_token_usage": used / total if total else 0.0,
            "evicted_tokens": kv.tree.stats.evicted_tokens,
        }
