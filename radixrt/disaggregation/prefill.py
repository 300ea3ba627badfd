"""The prefill server's request flow: compute the prompt, write its KV into the decode server's slots,
send the first token, then finish (the prompt stays in this server's RadixCache)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from radixrt.disaggregation.backends import build_backend
from radixrt.disaggregation.bootstrap import BootstrapServer
from radixrt.disaggregation.channel import Channel
from radixrt.disaggregation.messages import KVDone, KVRequest
from radixrt.disaggregation.stats import PDStats
from radixrt.disaggregation.transfer import TransferBackend
from radixrt.worker.req import Req

if TYPE_CHECKING:
    from radixrt.worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PrefillSide:
    """Held requests (prompt computed, first token sampled) wait here for their decode side's KVRequest."""

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
        self.bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
        self.bootstrap.register(
            {"role": "Prefill", "rank_ip": self.channel.ip, "rank_port": self.channel.port}
        )
        self.held: dict[int, tuple[Req, float, float | None]] = {}  # room -> (request, since, first logprob)
        self.targets: dict[int, tuple[KVRequest, float]] = {}  # room -> (decode side's slots, since)
        self.failed: dict[int, tuple[int, str, float]] = {}  # room -> (status, why, since)
        self.stats = PDStats()
        logger.info(
            "prefill side: bootstrap on port %d, control channel %s, backend %s",
            args.disaggregation_bootstrap_port, self.channel.endpoint, args.disaggregation_transfer_backend,
        )  # fmt: skip

    # -- scheduler hooks ------------------------------------------------------------------------
    def take(self, req: Req) -> bool:
        """Prefill requests queue like any other (False: the scheduler keeps them)."""
        return False

    def hold(self, done: list[Req]) -> list[Req]:
        """Of the requests whose prefill just finished, keep those a decode server waits for (their KV
        stays locked until written); returns the rest."""
        rest = []
        now = time.monotonic()
        for req in done:
            room = req.bootstrap_room
            if room is None or not req.output_ids:
                rest.append(req)
                continue
            self.sched.kv.cache_unfinished(req)
            first_lp = req.pending_logprobs[0][0] if req.pending_logprobs else None
            self.held[room] = (req, now, first_lp)
        return rest

    def live(self) -> list[Req]:
        return [held[0] for held in self.held.values()]

    @property
    def busy(self) -> bool:
        return bool(self.held or self.targets)

    def drop(self, req: Req, status: int, why: str) -> None:
        """``req`` ends on this side (aborted, refused): tell its decode side when it asks."""
        room = req.bootstrap_room
        if room is None:
            return
        self.held.pop(room, None)
        target = self.targets.pop(room, None)
        if target is not None:
            self._reply(target[0], KVDone(room, False, status, why))
        else:
            self.failed[room] = (status, why, time.monotonic())

    def step(self) -> None:
        """Take new KVRequests, transfer every held request whose slots are known, expire the overdue."""
        now = time.monotonic()
        for msg in self.channel.recv_all():
            if not isinstance(msg, KVRequest):
                continue
            fail = self.failed.pop(msg.room, None)
            if fail is not None:
                self._reply(msg, KVDone(msg.room, False, fail[0], fail[1]))
            else:
                self.targets[msg.room] = (msg, now)
        for room in [r for r in self.held if r in self.targets]:
            req, _, first_lp = self.held.pop(room)
            target, _ = self.targets.pop(room)
            self._transfer(req, target, first_lp)
        for req, since, _ in list(self.held.values()):
            if now - since > self.timeout:
                self.stats.failures += 1
                why = f"the decode server did not ask for this request's KV within {self.timeout:g}s"
                self.sched.abort(req.rid, why, 504)  # drop() records the failure for a late KVRequest
        for room, (target, since) in list(self.targets.items()):
            if now - since > self.timeout:
                del self.targets[room]
                why = f"the prefill server has no request with bootstrap_room {room} after {self.timeout:g}s"
                self._reply(target, KVDone(room, False, 503, why))
        for room, (_, _, since) in list(self.failed.items()):
            if now - since > self.timeout:
                del self.failed[room]

    # -- the transfer ---------------------------------------------------------------------------
    def _transfer(self, req: Req, target: KVRequest, first_lp: float | None) -> None:
        sched = self.sched
        prompt = len(req.origin_input_ids)
        assert req.req_pool_idx is not None
        row = sched.kv.req_pool.req_to_token[req.req_pool_idx]
        src = row[target.start : prompt].tolist()
        room = target.room
        done = KVDone(
            room, True, first_token=req.output_ids[0], first_logprob=first_lp, cached_tokens=req.cached_tokens
        )
        if target.layout != self.backend.layout:
            why = f"the servers' KV layouts differ: decode {target.layout}, prefill {self.backend.layout}"
            done = KVDone(room, False, 500, why)
        elif not 0 <= target.start < prompt or len(target.dst_slots) != prompt - target.start:
            why = f"bad KV request: start {target.start}, {len(target.dst_slots)} slots for a {prompt}-token prompt"
            done = KVDone(room, False, 500, why)
        else:
            t0 = time.perf_counter()
            try:
                done.payload = self.backend.write(target.session, target.dst_ptrs, src, target.dst_slots)
            except OSError as exc:
                done = KVDone(target.room, False, 503, f"KV transfer failed: {exc}")
            else:
                nbytes = len(src) * self.backend.row_bytes * len(target.dst_ptrs)
                self.stats.on_transfer(len(src), nbytes, time.perf_counter() - t0)
        self._reply(target, done)
        if not done.ok:
            self.stats.failures += 1
            self.failed.pop(room, None)
            sched.abort(req.rid, done.error, done.status_code)
            self.failed.pop(room, None)  # the decode side has its answer already
            return
        if req.finish_reason is None:
            req.finish_reason = {"type": "length", "length": 1}
        sched.out.finish([req])
        sched.out.emit([req])

    def _reply(self, target: KVRequest, msg: KVDone) -> None:
        if not self.channel.send(target.reply_to, msg):
            logger.warning("could not send the KV answer of room %d to %s", target.room, target.reply_to)

    def close(self) -> None:
        self.bootstrap.close()
        self.backend.close()
        self.channel.close()
