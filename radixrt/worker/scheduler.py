"""The worker's scheduler loop: admit (prefill first, chunked) or decode, forward, sample, report.

Transport-agnostic: requests come from an ``Inbox`` (a thread queue in-process, a ZeroMQ socket in
the server) and every step's outputs go to ``send`` as one BatchTokenOut.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from radixrt.config.server_args import ServerArgs
from radixrt.config.tenants import TenantConfig
from radixrt.constrained.grammar import GrammarBusy, GrammarError, grammar_key
from radixrt.disaggregation.sides import build_side
from radixrt.transport.protocol import (
    AbortReq,
    BatchTokenOut,
    DropPinsReq,
    FlushCacheReq,
    GetStatsReq,
    ListPinsReq,
    ReqOut,
    StatsOut,
    TokenizedGenerateReq,
    WorkerInput,
    WorkerOutput,
)
from radixrt.worker.admission import CLIP_MAX_NEW_TOKENS, admit_waiting
from radixrt.worker.arrival import RequestTimeouts, refusal
from radixrt.worker.decode_step import decode_forward
from radixrt.worker.extend_step import extend_forward
from radixrt.worker.grammar_queue import GrammarQueue
from radixrt.worker.interval_log import IntervalLog, LoadCounters, read_load
from radixrt.worker.kv_manager import KVManager, build_tree
from radixrt.worker.model_runner import ModelRunner
from radixrt.worker.output import OutputProcessor
from radixrt.worker.pooling import pool_chunk
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats
from radixrt.worker.tenant_ledger import TenantLedger
from radixrt.worker.tp_follower import follower_main

if TYPE_CHECKING:
    from radixrt.speculative.worker import Speculator

logger = logging.getLogger(__name__)

# Decode growth reserved at admission per running request: ratio x remaining max_new_tokens (clipped).
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.7, 0.15, 0.002


class Inbox(Protocol):
    """Where the scheduler reads requests from."""

    def poll(self, block: bool) -> list[WorkerInput]: ...


class Scheduler:
    """Continuous batching over the RadixCache; one ``step`` is one forward (or none when idle).

    What a step produces (sampled tokens, finishes, the messages to the client) goes through ``out``,
    the `OutputProcessor` it owns.
    """

    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        eos_token_ids: list[int],
        send: Callable[[WorkerOutput], None],
    ) -> None:
        self.args = args
        self.model_path = model_path
        self.runner = ModelRunner(args, model_path, tp_follower=follower_main)
        self.vocab_size = self.runner.config.vocab_size
        self.eos_ids = set(eos_token_ids) | set(self.runner.config.eos_token_ids)
        self.tree = build_tree(args, self.runner, model_path)
        self.kv = KVManager(self.runner.allocator, self.runner.req_to_token_pool, self.tree)
        self.ledger: TenantLedger | None = None
        if args.tenants is not None:
            self.ledger = TenantLedger(TenantConfig.load(args.tenants), self.kv, self.live_reqs)
            self.tree.shares = self.ledger
        self.send = send
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.by_rid: dict[str, Req] = {}
        self.arrivals = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self.stats = SchedulerStats(tenants=self.ledger)
        self.check_invariant_each_step = False
        self.interval_log = IntervalLog(args.log_interval, self.load_counters)  # --log-interval
        # Constrained requests whose grammar is compiling (``grammar_waiting``), and the grammar backend.
        self.grammars = GrammarQueue(args, model_path, self.vocab_size, self.eos_ids, self.ledger is not None)
        self.jumped: list[Req] = []  # jump-forward tokens appended, waiting for their extend
        self.timeouts = RequestTimeouts(args.request_timeout) if args.request_timeout is not None else None
        self._spec: Speculator | None = None  # built on the first decode with --speculative-algorithm
        self.out = OutputProcessor(
            args, self.runner, self.kv, self.stats, self.eos_ids, self.by_rid, send, self.grammars
        )
        self.pd = build_side(self)  # --disaggregation-mode prefill / decode

    # -- loop -----------------------------------------------------------------------------------
    def run_forever(self, inbox: Inbox, should_stop: Callable[[], bool]) -> None:
        """Poll, step, repeat; block on the inbox while idle."""
        try:
            while not should_stop():
                msgs = inbox.poll(block=self.is_idle())
                for msg in msgs:
                    self.handle(msg)
                self.step()
                self.interval_log.tick(busy=not self.is_idle())
        finally:
            if self.pd is not None:
                self.pd.close()
            self.runner.close()
            self.kv.close()

    def is_idle(self) -> bool:
        busy = self.waiting or self.running or self.chunked or self.grammar_waiting or self.jumped
        return not (busy or (self.pd is not None and self.pd.busy))

    def live_reqs(self) -> list[Req]:
        live = self.running + self.jumped + ([self.chunked] if self.chunked is not None else [])
        return live + self.pd.live() if self.pd is not None else live

    def load_counters(self) -> LoadCounters:
        """What the interval log reads (``--log-interval``)."""
        queued = len(self.waiting) + len(self.grammar_waiting)
        return read_load(self.kv, self.stats, list(self.by_rid.values()), len(self.live_reqs()), queued)

    @property
    def grammar_waiting(self) -> list[Req]:
        """Constrained requests whose grammar is compiling (they wait outside ``waiting``)."""
        return self.grammars.compiling

    def handle(self, msg: WorkerInput) -> None:
        """Apply one incoming message."""
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.reason)
        elif isinstance(msg, FlushCacheReq):
            self.send(self.flush_cache())
        elif isinstance(msg, GetStatsReq):
            tenants = self.ledger.snapshot() if self.ledger is not None else None
            self.send(StatsOut(stats=self.snapshot(), tenants=tenants))
        elif isinstance(msg, ListPinsReq | DropPinsReq):
            self.send(self.kv.pins(msg))

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(msg, self.arrivals)
        self.arrivals += 1
        queued = [*self.waiting, *self.grammar_waiting]
        context_len, total_slots = self.runner.context_len, self.kv.allocator.total_slots
        refused = refusal(req, context_len, total_slots, self.ledger, self.args.max_queued_requests, queued)
        req.grammar_key = grammar_key(req.params)
        if refused is None and req.grammar_key is not None:
            try:  # last check: it may start a compilation
                self.grammars.submit(req)
            except (GrammarError, GrammarBusy) as exc:  # too large (400) / client's share in flight (429)
                refused = str(exc), exc.status_code
        if refused is not None:  # never counted in num_requests, its reason carries the HTTP status
            error, status = refused
            self.stats.num_refused += 1
            reason = {"type": "abort", "message": error, "status_code": status}
            self.send(BatchTokenOut([ReqOut(req.rid, [], len(req.origin_input_ids), 0, reason)]))
            return
        self.by_rid[req.rid] = req
        if self.timeouts is not None:
            self.timeouts.on_arrival(req.rid)
        self.stats.on_arrival(req)
        if req.grammar_key is not None:
            self.grammars.add(req)
        elif self.pd is None or not self.pd.take(req):  # a decode server's request waits for its KV there
            self.waiting.append(req)

    def abort(self, rid: str, reason: str, status_code: int | None = None) -> None:
        """End a request wherever it is and free its KV; ``status_code`` tells the client why (HTTP)."""
        req = self.by_rid.get(rid)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.grammar_waiting:
            self.grammar_waiting.remove(req)
        elif req in self.jumped:
            self.jumped.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        if self.pd is not None:
            self.pd.drop(req, status_code or 500, reason)
        if reason == "stop":  # the client matched a stop string: a normal end (a cache_control pin applies)
            req.finish_reason = {"type": "stop"}
        else:
            req.finish_reason = {"type": "abort", "message": reason}
            if status_code is not None:
                req.finish_reason["status_code"] = status_code
        self.kv.release(req)
        self.stats.on_finish(req)
        self.out.emit([req])

    def flush_cache(self) -> StatsOut:
        if not self.is_idle():
            return StatsOut(ok=False, message="cannot flush the cache while requests are running")
        self.tree.reset()
        self.kv.check_invariant([], idle=True)
        return StatsOut(ok=True, message="cache flushed")

    def admit_transferred(self, req: Req) -> None:
        """Decode side: ``req``'s prompt KV arrived and its first token is appended: decode it from now on."""
        if req.finish_reason is not None:
            self.out.finish([req])
        else:
            self.kv.cache_unfinished(req)
            (self.jumped if req.jumped else self.running).append(req)
        self.out.emit([req])

    def snapshot(self) -> dict[str, float]:
        running = len(self.running) + (1 if self.chunked else 0)
        queued = len(self.waiting) + len(self.grammar_waiting)
        return {
            **self.stats.snapshot(self.kv, running, queued),
            "kv_pinned_tokens": self.tree.pins.pinned_size(),
            "kv_pins_yielded": self.tree.pins.yielded,
            **(self.pd.stats.snapshot(self.args.disaggregation_mode) if self.pd is not None else {}),
        }

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> None:
        """One forward: a prefill batch if anything can be admitted, else one decode step."""
        self.tree.pins.expire()  # cheap unless a pin is due
        if self.timeouts is not None:
            self._abort_overdue(self.timeouts)
        if self.grammar_waiting:
            self._poll_grammars()
        if self.pd is not None:
            self.pd.step()
            if self.is_idle() is False and not (self.waiting or self.running or self.chunked or self.jumped):
                time.sleep(0.0005)  # only transfers in flight: do not spin at full speed
        batch = self._admit()
        if batch:
            self._run_extend(batch, self._mixed_decode() if self.args.enable_mixed_chunk else [])
        elif self.running:
            self._run_decode()
        if self.check_invariant_each_step:
            self.kv.check_invariant(self.live_reqs(), idle=self.is_idle())

    def _abort_overdue(self, timeouts: RequestTimeouts) -> None:
        """Abort the requests older than --request-timeout (queued or running): KV freed, 504 to the client."""
        for rid in timeouts.overdue(self.by_rid):
            self.stats.num_timed_out += 1
            why = f"request timed out after {timeouts.limit_s:g}s (--request-timeout)"
            self.abort(rid, why, status_code=504)

    def _poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose did not."""
        compiled, failed = self.grammars.poll()
        for req in failed:
            self.stats.on_finish(req)
            self.out.emit([req])
        self.waiting.extend(r for r in compiled if self.pd is None or not self.pd.take(r))
        if self.grammar_waiting and not (self.waiting or self.running or self.chunked or self.jumped):
            time.sleep(0.001)  # only compiling: do not spin at full speed

    def reserved_decode(self) -> float:
        """KV tokens to keep free for the running requests' expected decode growth."""
        total = 0.0
        for r in self.running:
            remaining = max(r.params.max_new_tokens - len(r.output_ids), 0)
            total += min(remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        return total

    def _admit(self) -> list[Req]:
        """Choose this round's prefill batch, give each request its prefix and slots.

        With tenants, the long prefills of tenants heavier than a waiting lighter one step aside first
        (``TenantLedger.yielding``): the continuing chunk is deferred a round, their long prompts wait, so
        the lighter request's round holds its own tokens; when no lighter request is admitted, they go."""
        args = self.args
        budget = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
        batch: list[Req] = []
        caps: dict[str | None, int] | None = None  # per tenant prefill tokens this round (tenants)
        yielding: set[str | None] = set()
        if self.ledger is not None and (self.waiting or self.chunked is not None):
            caps = self.ledger.prefill_caps(self.waiting, budget, self.chunked)
            yielding = self.ledger.yielding(self.waiting) if caps is not None else set()
        deferred = self.chunked is not None and self.chunked.tenant in yielding
        if self.chunked is not None and not deferred:
            budget = self._continue_chunk(batch, budget, caps)
            if budget < 0:
                return []
        while self.jumped and budget > 0 and len(batch) < args.max_running_requests:
            req = self.jumped[0]
            take = len(req.fill_ids) - req.kv_len
            if take > budget or not self.kv.alloc(req, take):
                break
            self.jumped.pop(0)
            req.extend_len = take
            batch.append(req)
            budget -= take
        if not yielding:
            admit_waiting(self, batch, budget, caps)
            return batch
        n = len(batch)
        aside = admit_waiting(self, batch, budget, caps, step_aside=yielding, whole=deferred)
        if any(r.tenant not in yielding for r in batch[n:]):
            return batch  # a lighter request took the round; the deferred chunk (still self.chunked) waits
        budget -= sum(r.extend_len for r in batch[n:])
        if deferred and budget > 0:
            budget = self._continue_chunk(batch, budget, caps)
        if aside and budget > 0:
            admit_waiting(self, batch, budget, caps, only={id(r) for r in aside})
        return batch

    def _continue_chunk(self, batch: list[Req], budget: int, caps: dict[str | None, int] | None) -> int:
        """Add the next chunk of ``self.chunked`` to ``batch``; the budget left, or -1 when it was retracted."""
        assert self.chunked is not None
        req, self.chunked = self.chunked, None
        take = min(len(req.fill_ids) - req.kv_len, budget)
        if caps is not None:
            take = min(take, caps[req.tenant])
            caps[req.tenant] -= take
        self.kv.yield_pins(req, len(req.fill_ids))
        if not self.kv.alloc(req, take):
            self._retract(req)
            return -1
        req.extend_len = take
        batch.append(req)
        return budget - take

    def _mixed_decode(self) -> list[Req]:
        """The running requests that decode inside this round's prefill forward (``--enable-mixed-chunk``),
        each with its next slot allocated; room is made first as a decode step would."""
        if not self.running:
            return []
        self._ensure_decode_memory()
        reqs = list(self.running)
        ok = self.kv.alloc_decode(reqs)
        assert ok, "decode slot allocation failed after retraction"
        return reqs

    def _run_extend(self, batch: list[Req], decoding: list[Req]) -> None:
        """One prefill forward over ``batch``; ``decoding`` (mixed chunk) add one token row each, after it."""
        hidden = extend_forward(self.runner, self.out, batch, decoding)
        if decoding:
            self.stats.mixed_decode_tokens += len(decoding)
            self._settle_decode(decoding)
        offset = 0
        done: list[Req] = []
        for req in batch:
            start = req.kv_len
            req.kv_len += req.extend_len
            self.stats.computed_prefill_tokens += req.extend_len
            if not req.input_logprobs_done:
                self.out.input_logprobs(req, hidden[offset : offset + req.extend_len], start)
            if req.embed is not None:
                pool_chunk(req, hidden[offset : offset + req.extend_len])
            offset += req.extend_len
            if req.prefill_done:
                done.append(req)
            else:
                self.chunked = req
                self.kv.cache_unfinished(req)
        if done:
            last_rows = []
            acc = 0
            for req in batch:
                acc += req.extend_len
                if req.prefill_done:
                    last_rows.append(acc - 1)
            to_sample = [r for r in done if r.params.max_new_tokens > 0]
            for req in done:
                if req.params.max_new_tokens == 0:
                    req.finish_reason = {"type": "length", "length": 0}
            if to_sample:
                rows = [row for row, r in zip(last_rows, done, strict=True) if r.params.max_new_tokens > 0]
                self.out.sample_and_append(to_sample, self.runner.logits(hidden[rows]))
            if self.pd is not None:  # a prefill server holds its requests' KV until the decode side takes it
                done = self.pd.hold(done)
            for req in done:
                if req.finish_reason is None:
                    self.kv.cache_unfinished(req)
                    (self.jumped if req.jumped else self.running).append(req)
            self.out.finish([r for r in done if r.finish_reason is not None])
        # a request between prefill chunks has nothing to say unless it streams prompt logprobs: a streamed
        # client's first event stays its first token
        self.out.emit([r for r in batch if r is not self.chunked or r.return_logprob])

    def _run_decode(self) -> None:
        if self.args.speculative_algorithm is not None and self._run_speculative():
            return
        self._ensure_decode_memory()
        reqs = list(self.running)
        if not reqs:
            return
        ok = self.kv.alloc_decode(reqs)
        assert ok, "decode slot allocation failed after retraction"
        decode_forward(self.runner, self.out, reqs)
        self._settle_decode(reqs)

    def _settle_decode(self, reqs: list[Req]) -> None:
        """After a decode (or speculative) step: finish, move jumped requests, report, decay the reserve."""
        finished = [r for r in reqs if r.finish_reason is not None]
        jumped = [r for r in reqs if r.jumped and r.finish_reason is None]
        if finished or jumped:
            self.running = [r for r in self.running if r.finish_reason is None and not r.jumped]
            self.jumped.extend(jumped)
            self.out.finish(finished)
        self.out.emit(reqs)
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, NEW_TOKEN_RATIO_MIN)

    def _run_speculative(self) -> bool:
        """One speculative step (draft, verify in one forward) instead of a decode; False: decode plainly."""
        from radixrt.speculative import build_speculator

        if self._spec is None:
            self._spec = build_speculator(self.args)
        reqs = list(self.running)
        if not self._spec.step(reqs, self.out):
            return False
        self._settle_decode(reqs)
        return True

    def _ensure_decode_memory(self) -> None:
        """Make room for one more token per running request, retracting the least advanced if needed."""
        while self.running:
            need = sum(self.kv.pages_needed(r, 1) for r in self.running)
            if need <= self.kv.available():
                return
            if len(self.running) == 1:  # even alone it does not fit: pins yield, else the pool is too small
                if self.kv.yield_pins(self.running[0], self.running[0].kv_len + 1):
                    continue
                self.out.end_with_abort(self.running.pop(), "out of KV memory: sequence exceeds the KV pool")
                return
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        """Free a running (or chunked) request's KV, keeping its computed prefix cached, and requeue it."""
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        req.retractions += 1
        req.reset_fill()
        self.waiting.append(req)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.debug("retracted %s after %d tokens", req.rid, len(req.output_ids))
