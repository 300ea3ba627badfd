"""The decode server's request flow: reserve KV slots for the prompt (less the prefix its own RadixCache
holds), send their indices to the prefill worker, wait for the pages and the first token, then decode."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from radixrt.disaggregation.backends import build_backend
from radixrt.disaggregation.bootstrap import lookup
from radixrt.disaggregation.channel import Channel
from radixrt.disaggregation.messages import KVDone, KVRequest
from radixrt.disaggregation.stats import PDStats
from radixrt.disaggregation.transfer import TransferBackend
from radixrt.worker.req import Req

if TYPE_CHECKING:
    from radixrt.worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class DecodeSide:
    """``pending``: requests waiting for KV slots here; ``awaiting``: slots reserved, KV on its way."""

    def __init__(self, sched: Scheduler) -> None:
        args = sched.args
        self.sched = sched
        self.timeout = args.disaggregation_timeout
        self.channel = Channel(args.host)
        self.backend: TransferBackend = build_backend(
            args.disaggregation_transfer_backend,
            sched.runner.kv_pool,
            self.channel.ip,
            args.disaggregation_ib_device,
        )
        self.pending: list[tuple[Req, float]] = []
        # room -> (request, since, prefill endpoint, start): its kv_len covers the reserved slots already,
        # ``start`` is where its locally cached prefix ends (the transferred part begins)
        self.awaiting: dict[int, tuple[Req, float, str, int]] = {}
        self.endpoints: dict[tuple[str, int], str] = {}  # bootstrap host:port -> prefill control endpoint
        self.stats = PDStats()
        logger.info("decode side: control channel %s", self.channel.endpoint)

    # -- scheduler hooks ------------------------------------------------------------------------
    def take(self, req: Req) -> bool:
        """Requests with a bootstrap room (and tokens to generate) wait here for their KV."""
        if req.bootstrap_room is None or req.params.max_new_tokens == 0:
            return False
        self.pending.append((req, time.monotonic()))
        return True

    def hold(self, done: list[Req]) -> list[Req]:
        """Prefill-side hook: a decode server computes only what it recomputes after a retraction."""
        return done

    def live(self) -> list[Req]:
        """Requests holding slots here (counted by the KV invariant)."""
        return [entry[0] for entry in self.awaiting.values()]

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.awaiting)

    def drop(self, req: Req, status: int, why: str) -> None:
        """``req`` ends before its KV arrived: free the slots reserved for it (the scheduler releases the rest)."""
        self.pending = [(r, t) for r, t in self.pending if r is not req]
        room = req.bootstrap_room
        if room is not None and room in self.awaiting and self.awaiting[room][0] is req:
            self._free_reserved(req, self.awaiting.pop(room)[3])

    def step(self) -> None:
        """Land arrived KV, reserve slots for pending requests, expire the overdue."""
        for msg in self.channel.recv_all():
            if isinstance(msg, KVDone):
                self._land(msg)
        self._reserve()
        now = time.monotonic()
        for req, since, endpoint, _ in list(self.awaiting.values()):
            if now - since > self.timeout:
                self.stats.failures += 1
                self._forget(req, endpoint)
                why = f"the KV did not arrive from the prefill server within {self.timeout:g}s"
                self.sched.abort(req.rid, why, 504)
        for req, since in list(self.pending):
            if now - since > self.timeout:
                self.stats.failures += 1
                self.sched.abort(req.rid, f"no KV room on the decode server within {self.timeout:g}s", 503)

    # -- reservation ----------------------------------------------------------------------------
    def _reserve(self) -> None:
        sched = self.sched
        kv = sched.kv
        while self.pending:
            if len(sched.running) + len(self.awaiting) >= sched.args.max_running_requests:
                return
            req, since = self.pending[0]
            if not kv.admit(req):
                return
            prompt = len(req.origin_input_ids)
            start = req.kv_len
            if not kv.alloc(req, prompt - start):
                kv.release(req)
                return
            req.kv_len = prompt  # the reserved slots are the request's (the invariant counts them)
            self.pending.pop(0)
            assert req.bootstrap_host is not None and req.bootstrap_port is not None
            key = (req.bootstrap_host, req.bootstrap_port)
            try:
                endpoint = self.endpoints.get(key) or lookup(*key)
            except ConnectionError as exc:
                self._free_reserved(req, start)
                self.stats.failures += 1
                sched.abort(req.rid, str(exc), 503)
                continue
            self.endpoints[key] = endpoint
            assert req.req_pool_idx is not None
            row = kv.req_pool.req_to_token[req.req_pool_idx]
            msg = KVRequest(
                room=req.bootstrap_room or 0,
                reply_to=self.channel.endpoint,
                start=start,
                dst_slots=row[start:prompt].tolist(),
                dst_ptrs=self.backend.dst_ptrs(),
                session=self.backend.session,
                layout=self.backend.layout,
            )
            if not self.channel.send(endpoint, msg):
                self._free_reserved(req, start)
                self._forget(req, endpoint)
                self.stats.failures += 1
                sched.abort(req.rid, f"the prefill worker at {endpoint} does not take requests", 503)
                continue
            self.awaiting[msg.room] = (req, since, endpoint, start)
            self.stats.local_prefix_tokens += start
            if req.retractions == 0:
                req.cached_tokens = start

    def _free_reserved(self, req: Req, start: int) -> None:
        """Return the slots reserved past the locally cached prefix (their KV never arrived, so ``release``
        must not cache them): ``kv_len`` goes back to ``start``."""
        if req.req_pool_idx is None:
            return
        kv = self.sched.kv
        if req.kv_len > start:
            row = kv.req_pool.req_to_token[req.req_pool_idx]
            kv.allocator.free(row[start : req.kv_len].clone())
            row[start : req.kv_len] = 0
        req.kv_len = start

    def _forget(self, req: Req, endpoint: str) -> None:
        """The prefill worker behind ``endpoint`` did not answer: ask its bootstrap server again next time."""
        key = (req.bootstrap_host or "", req.bootstrap_port or 0)
        if self.endpoints.get(key) == endpoint:
            del self.endpoints[key]
        self.channel.forget(endpoint)

    # -- arrival --------------------------------------------------------------------------------
    def _land(self, msg: KVDone) -> None:
        entry = self.awaiting.pop(msg.room, None)
        if entry is None:
            return  # the request ended here already (aborted, timed out)
        req, _, _, start = entry
        sched = self.sched
        if msg.ok:
            assert req.req_pool_idx is not None
            prompt = len(req.origin_input_ids)
            row = sched.kv.req_pool.req_to_token[req.req_pool_idx]
            t0 = time.perf_counter()
            try:
                self.backend.accept(row[start:prompt].tolist(), msg.payload)
            except OSError as exc:
                msg = KVDone(msg.room, False, 503, f"KV transfer failed: {exc}")
            else:
                n = prompt - start
                nbytes = n * self.backend.row_bytes * 2 * self.backend.pool.num_layers
                self.stats.on_transfer(n, nbytes, time.perf_counter() - t0)
        if not msg.ok:
            self.stats.failures += 1
            self._free_reserved(req, start)
            sched.abort(req.rid, f"prefill server: {msg.error}", msg.status_code)
            return
        req.cached_tokens = max(req.cached_tokens, msg.cached_tokens)
        if req.return_logprob and msg.first_logprob is not None:
            req.pending_logprobs.append((msg.first_logprob, msg.first_token))
        sched.out.append_tokens([req], torch.tensor([msg.first_token]))
        sched.admit_transferred(req)

    def close(self) -> None:
        self.backend.close()
        self.channel.close()
