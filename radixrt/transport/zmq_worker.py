"""The worker process: the Scheduler behind two ZeroMQ ``ipc://`` sockets.

Started by ``radixrt.transport.zmq_client.ZmqWorkerClient`` as ``python -m radixrt.transport.zmq_worker``, its
``WorkerConfig`` as JSON on stdin (a command line is visible to every local user). The HTTP process has
already bound both sockets; this process connects a PULL socket (its inbox of ``WorkerInput`` messages)
and a PUSH socket (its ``WorkerOutput`` messages), all msgpack-encoded msgspec Structs. The first message
out is the handshake: ``WorkerReady`` with the model facts, or ``WorkerStartupFailed``. SIGTERM (or the
parent process going away) stops the loop between steps.

A receiver thread owns the PULL socket and queues every message for the scheduler's thread, which
applies them in order between steps. Control messages are answered there too, so that an answer sees the
messages before it. A stats request still unanswered after ``STALE_AFTER_S`` (one long step) is answered
by the receiver thread from the last snapshot, marked ``idle = 0`` with its age in ``stats_age_s``: a
long step never makes the worker look dead.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixrt.config.server_args import ServerArgs
from radixrt.transport.protocol import (
    BatchTokenOut,
    FlushCacheReq,
    GetStatsReq,
    ReqOut,
    StatsOut,
    WorkerInput,
    WorkerOutput,
    WorkerReady,
    WorkerStartupFailed,
)
from radixrt.worker.threads import set_worker_threads

logger = logging.getLogger("radixrt.worker")

POLL_MS = 200  # how long an idle worker blocks on its inbox before re-checking stop / parent
RECV_POLL_MS = 50  # the receiver thread's poll period: also how often it looks for overdue stats
PARENT_CHECK_S = 1.0
STALE_AFTER_S = 0.5  # a stats request waits this long for the scheduler before the snapshot answers
SNAPSHOT_EVERY_S = 1.0  # the scheduler refreshes the snapshot at least this often while busy
# Test hook: a file holding the seconds every busy step sleeps (slow steps without a big model; no file:
# no delay). Unset in production.
STEP_DELAY_ENV = "RADIXRT_TEST_STEP_DELAY_FILE"


@dataclass(slots=True)
class WorkerConfig:
    """Everything the worker process needs, passed as one JSON document on its stdin."""

    server_args: dict[str, Any]
    model_path: str
    eos_token_ids: list[int]
    inbox_addr: str
    outbox_addr: str
    parent_pid: int

    def to_json(self) -> str:
        return json.dumps({f: getattr(self, f) for f in self.__slots__})  # type: ignore[attr-defined]

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))


class _Control:
    """One control message waiting for its answer; ``answered`` once either thread sent it."""

    __slots__ = ("msg", "arrived", "answered")

    def __init__(self, msg: WorkerInput) -> None:
        self.msg, self.arrived, self.answered = msg, time.monotonic(), False


class WorkerProcess:
    """Owns the sockets, the receiver thread and the scheduler of this process; also the scheduler's
    ``Inbox``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.push = self.ctx.socket(zmq.PUSH)
        for sock in (self.pull, self.push):
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.pull.connect(cfg.inbox_addr)
        self.push.connect(cfg.outbox_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.scheduler: Any = None
        self.stop = False
        self._next_parent_check = 0.0
        self._queue: queue.Queue[WorkerInput | _Control] = queue.Queue()
        # NOTE: both threads send on the PUSH socket; this lock also keeps control answers in order.
        self._lock = threading.Lock()
        self._owed: deque[_Control] = deque()  # control messages not answered yet, in arrival order
        self._snapshot: StatsOut | None = None
        self._snapshot_at = 0.0
        self._receiver: threading.Thread | None = None
        self._delay_file = os.environ.get(STEP_DELAY_ENV)

    # -- output ---------------------------------------------------------------------------------
    def send(self, msg: WorkerOutput | WorkerReady | WorkerStartupFailed) -> None:
        data = self.encoder.encode(msg)
        with self._lock:
            self.push.send(data)

    def _fresh_stats(self) -> StatsOut:
        """The scheduler's stats with the KV accounting invariant, checked here between two steps."""
        sched = self.scheduler
        tenants = sched.ledger.snapshot() if sched.ledger is not None else None
        msg = StatsOut(stats=sched.snapshot(), tenants=tenants)
        idle = sched.is_idle()
        msg.stats["idle"] = float(idle)
        try:
            sched.kv.check_invariant(sched.live_reqs(), idle=idle)
            msg.stats["kv_invariant_ok"] = 1.0
        except AssertionError as exc:
            msg.stats["kv_invariant_ok"] = 0.0
            msg.message = f"KV invariant violated: {exc}"
            logger.error("KV invariant violated: %s", exc)
        return msg

    def _keep_snapshot(self, msg: StatsOut) -> None:
        with self._lock:
            self._snapshot, self._snapshot_at = msg, time.monotonic()

    def _snapshot_due(self) -> bool:
        """While busy: refresh the snapshot every SNAPSHOT_EVERY_S, and at once when it shows idle."""
        snap = self._snapshot
        return (
            snap is None
            or snap.stats["idle"] == 1.0
            or time.monotonic() - self._snapshot_at > SNAPSHOT_EVERY_S
        )

    def _answer(self, entry: _Control) -> None:
        """Answer a control message on the scheduler's thread (unless the snapshot already did)."""
        if isinstance(entry.msg, FlushCacheReq):
            answer = self.scheduler.flush_cache()
        else:
            answer = self._fresh_stats()
            self._keep_snapshot(answer)
        data = self.encoder.encode(answer)
        with self._lock:
            if entry.answered:
                return
            entry.answered = True
            assert self._owed[0] is entry, "control answers out of order"
            self._owed.popleft()
            self.push.send(data)

    def _answer_overdue(self) -> None:
        """On the receiver thread: answer the stats requests at the head of the line that waited longer
        than STALE_AFTER_S from the snapshot (a flush waits for the scheduler: it changes state)."""
        now = time.monotonic()
        with self._lock:
            while self._owed and self._snapshot is not None:
                head = self._owed[0]
                if not isinstance(head.msg, GetStatsReq) or now - head.arrived < STALE_AFTER_S:
                    return
                stats = {**self._snapshot.stats, "idle": 0.0, "stats_age_s": now - self._snapshot_at}
                answer = StatsOut(message=self._snapshot.message, stats=stats, tenants=self._snapshot.tenants)
                head.answered = True
                self._owed.popleft()
                self.push.send(self.encoder.encode(answer))

    # -- input ----------------------------------------------------------------------------------
    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(WorkerInput)
        while not self.stop:
            if self.pull.poll(RECV_POLL_MS):
                while True:
                    try:
                        frame = self.pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = decoder.decode(frame)
                    except msgspec.DecodeError:
                        logger.exception("dropping an undecodable message (%d bytes)", len(frame))
                        continue
                    if isinstance(msg, GetStatsReq | FlushCacheReq):
                        entry = _Control(msg)
                        with self._lock:
                            self._owed.append(entry)
                        self._queue.put(entry)
                    else:
                        self._queue.put(msg)
            self._answer_overdue()

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self.cfg.parent_pid:  # orphaned: the HTTP process is gone
                logger.warning("parent process %d is gone; stopping", self.cfg.parent_pid)
                self.stop = True
        return self.stop

    def poll(self, block: bool) -> list[WorkerInput]:
        """``Inbox.poll``: apply every message waiting now, in order (when ``block``, wait up to POLL_MS
        for the first one); returns nothing left for the scheduler to handle."""
        sched = self.scheduler
        if not block and self._snapshot_due():
            self._keep_snapshot(self._fresh_stats())  # the state after the step that just ended
        if not block and self._delay_file:
            time.sleep(_step_delay(self._delay_file))
        try:
            item = self._queue.get(timeout=POLL_MS / 1000) if block else self._queue.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            if isinstance(item, _Control):
                self._answer(item)
            else:
                sched.handle(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                item = None
        return []

    # -- lifetime -------------------------------------------------------------------------------
    def load(self) -> WorkerReady:
        from radixrt.worker.scheduler import Scheduler

        args = ServerArgs(**self.cfg.server_args)
        self.scheduler = Scheduler(args, self.cfg.model_path, self.cfg.eos_token_ids, self.send)
        runner = self.scheduler.runner
        cfg = runner.config
        return WorkerReady(
            pid=os.getpid(),
            architecture=cfg.architecture,
            dtype=str(cfg.dtype).removeprefix("torch."),
            context_len=runner.context_len,
            vocab_size=cfg.vocab_size,
            kv_total_tokens=runner.allocator.total_slots,
            kv_bytes=runner.kv_pool.size_bytes,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
        )

    def run(self) -> int:
        try:
            ready = self.load()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we exit
            logger.exception("worker failed to start")
            self.send(WorkerStartupFailed(f"{type(exc).__name__}: {exc}"))
            return 1
        self._keep_snapshot(self._fresh_stats())
        self._receiver = threading.Thread(target=self._receive, name="radixrt-worker-recv", daemon=True)
        self._receiver.start()
        self.send(ready)
        try:
            self.scheduler.run_forever(self, self.should_stop)
        except BaseException as exc:  # noqa: BLE001 - fail the live requests, then exit non-zero
            logger.exception("scheduler crashed")
            rids = list(self.scheduler.by_rid)
            reason = {"type": "abort", "message": f"worker error: {type(exc).__name__}: {exc}"}
            if rids:
                self.send(BatchTokenOut([ReqOut(r, [], 0, 0, reason) for r in rids]))
            return 1
        logger.info("worker stopped")
        return 0

    def close(self) -> None:
        self.stop = True
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        self.pull.close()
        self.push.close()
        self.ctx.term()


def _step_delay(path: str) -> float:
    try:
        return float(Path(path).read_text())
    except FileNotFoundError:
        return 0.0


def main() -> int:
    """Entry point of the worker process (its WorkerConfig on stdin)."""
    cfg = WorkerConfig.from_json(sys.stdin.read())
    level = str(cfg.server_args.get("log_level", "info")).upper()
    logging.basicConfig(level=level, format="%(asctime)s [worker] %(levelname)s %(name)s: %(message)s")
    if cfg.server_args.get("device", "cpu") == "cpu":
        logger.info("torch intra-op threads: %d", set_worker_threads(reserve_one=True))
    worker = WorkerProcess(cfg)
    # NOTE: Ctrl-C reaches the whole process group; the HTTP process decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "stop", True))
    try:
        return worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
