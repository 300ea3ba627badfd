"""The worker process: the Scheduler behind two ZeroMQ ``ipc://`` sockets.

Started by ``radixrt.zmq_client.ZmqWorkerClient`` as ``python -m radixrt.worker.zmq_worker CONFIG_JSON``.
The HTTP process has already bound both sockets; this process connects a PULL socket (its inbox of
``WorkerInput`` messages) and a PUSH socket (its ``WorkerOutput`` messages), all msgpack-encoded
msgspec Structs. The first message out is the handshake: ``WorkerReady`` with the model facts, or
``WorkerStartupFailed``. SIGTERM (or the parent process going away) stops the loop between steps.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from radixrt.protocol import (
    BatchTokenOut,
    ReqOut,
    StatsOut,
    WorkerInput,
    WorkerOutput,
    WorkerReady,
    WorkerStartupFailed,
)
from radixrt.server_args import ServerArgs
from radixrt.worker.threads import set_worker_threads

logger = logging.getLogger("radixrt.worker")

POLL_MS = 200  # how long an idle worker blocks on its inbox before re-checking stop / parent
PARENT_CHECK_S = 1.0


@dataclass(slots=True)
class WorkerConfig:
    """Everything the worker process needs, passed as one JSON argument."""

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


class ZmqInbox:
    """The scheduler's ``Inbox`` over a PULL socket; also tells the loop when to stop."""

    def __init__(self, sock: zmq.Socket[bytes], parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(WorkerInput)
        self.stop = False
        self._next_parent_check = 0.0

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self.parent_pid:  # orphaned: the HTTP process is gone
                logger.warning("parent process %d is gone; stopping", self.parent_pid)
                self.stop = True
        return self.stop

    def poll(self, block: bool) -> list[WorkerInput]:
        """Every message waiting now; when ``block``, wait up to POLL_MS for the first one."""
        out: list[WorkerInput] = []
        if block and not self.sock.poll(POLL_MS):
            return out
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(self.decoder.decode(frame))
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable message (%d bytes)", len(frame))


class WorkerProcess:
    """Owns the sockets and the scheduler of this process."""

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
        self.inbox = ZmqInbox(self.pull, cfg.parent_pid)
        self.scheduler: Any = None

    def send(self, msg: WorkerOutput | WorkerReady | WorkerStartupFailed) -> None:
        if isinstance(msg, StatsOut) and self.scheduler is not None:
            self._annotate(msg)
        self.push.send(self.encoder.encode(msg))

    def _annotate(self, msg: StatsOut) -> None:
        """Stats answers carry the KV accounting invariant, checked here between two steps."""
        sched = self.scheduler
        idle = sched.is_idle()
        msg.stats["idle"] = float(idle)
        try:
            sched.kv.check_invariant(sched.live_reqs(), idle=idle)
            msg.stats["kv_invariant_ok"] = 1.0
        except AssertionError as exc:
            msg.stats["kv_invariant_ok"] = 0.0
            msg.message = (msg.message + "; " if msg.message else "") + f"KV invariant violated: {exc}"
            logger.error("KV invariant violated: %s", exc)

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
        self.send(ready)
        try:
            self.scheduler.run_forever(self.inbox, self.inbox.should_stop)
        except BaseException as exc:  # noqa: BLE001 - fail the live requests, then exit non-zero
            logger.exception("scheduler crashed")
            rids = list(self.scheduler.by_rid)
            reason = {"type": "abort", "message": f"worker error: {type(exc).__name__}: {exc}"}
            if rids:
                self.push.send(
                    self.encoder.encode(BatchTokenOut([ReqOut(r, [], 0, 0, reason) for r in rids]))
                )
            return 1
        logger.info("worker stopped")
        return 0

    def close(self) -> None:
        self.pull.close()
        self.push.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = WorkerConfig.from_json(argv[0])
    level = str(cfg.server_args.get("log_level", "info")).upper()
    logging.basicConfig(level=level, format="%(asctime)s [worker] %(levelname)s %(name)s: %(message)s")
    if cfg.server_args.get("device", "cpu") == "cpu":
        logger.info("torch intra-op threads: %d", set_worker_threads(reserve_one=True))
    worker = WorkerProcess(cfg)
    # NOTE: Ctrl-C reaches the whole process group; the HTTP process decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker.inbox, "stop", True))
    try:
        return worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
