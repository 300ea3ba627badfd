"""The tensor-parallel group: process start-up, rank 0's step broadcast, and the followers' loop.

Rank 0 is the worker that owns the scheduler and every piece of bookkeeping (slot tables, RadixCache);
ranks 1..N-1 (``follower`` processes) hold only their model shard and KV-pool shard. Each forward rank 0
broadcasts the batch it built (metadata, token ids, positions) and all ranks run the same layers, meeting
in the all-reduces; when the scheduler wants logits, rank 0 broadcasts the hidden rows and every rank
computes its vocabulary slice for the all-gather. One command per collective step, so ranks can never
disagree about what comes next.

Single node: rank 0 spawns its followers. Several nodes (``--nnodes``, ``--node-rank``,
``--dist-init-addr``, SGLang's names): every node runs ``radixrt serve`` with the same flags; node 0 hosts
rank 0 (the server), the other nodes only run their followers (`run_node_followers`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from radixrt.config.server_args import ServerArgs

logger = logging.getLogger(__name__)
INIT_TIMEOUT = timedelta(minutes=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks_of_node(args: ServerArgs) -> list[int]:
    """The global ranks a node hosts: ``tp_size / nnodes`` consecutive ranks."""
    per_node = args.tp_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def init_group(args: ServerArgs, rank: int) -> None:
    """Join the group (``gloo`` on CPU, NCCL on CUDA); blocks until every rank has joined."""
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    assert args.dist_init_addr is not None
    dist.init_process_group(backend, init_method=f"tcp://{args.dist_init_addr}", rank=rank,
                            world_size=args.tp_size, timeout=INIT_TIMEOUT)  # fmt: skip


class TPGroup:
    """Rank 0's side of the group: it starts this node's followers and broadcasts each step."""

    def __init__(self, args: ServerArgs, model_path: str) -> None:
        if args.dist_init_addr is None:
            if args.nnodes > 1:
                raise ValueError("dist_init_addr: several nodes need --dist-init-addr HOST:PORT")
            args.dist_init_addr = f"127.0.0.1:{_free_port()}"
        self.size = args.tp_size
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=follower_main, args=(args.to_dict(), model_path, r, os.getpid()), daemon=True)
            for r in ranks_of_node(args)
            if r != 0
        ]
        for p in self.procs:
            p.start()
        init_group(args, 0)
        logger.info("tensor parallel: %d ranks joined (%s)", self.size, dist.get_backend())

    def forward(self, md: Any, ids: torch.Tensor, positions: torch.Tensor) -> None:
        _send(("forward", (md, ids, positions)))

    def logits(self, hidden: torch.Tensor) -> None:
        _send(("logits", hidden))

    def close(self) -> None:
        """Stop the followers and leave the group."""
        if not dist.is_initialized():
            return
        _send(("stop", None))
        for p in self.procs:
            p.join(timeout=30)
        dist.destroy_process_group()


def _send(cmd: tuple[str, Any]) -> None:
    dist.broadcast_object_list([cmd], src=0)


def _exit_with_parent(parent_pid: int) -> None:
    """A follower whose rank 0 is gone (killed, crashed) must not linger in a collective forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def follower_main(args_dict: dict[str, Any], model_path: str, rank: int, parent_pid: int | None) -> None:
    """A follower rank's process: build its shard (joining the group), then run rank 0's commands."""
    from radixrt.worker.model_runner import ModelRunner

    logging.basicConfig(level=args_dict.get("log_level", "info").upper())
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    args = ServerArgs(**args_dict)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, len(ranks_of_node(args)))))
    runner = ModelRunner(args, model_path, tp_rank=rank)
    follow(runner)


@torch.inference_mode()
def follow(runner: Any) -> None:
    """Run rank 0's commands until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        kind, payload = box[0]
        if kind == "forward":
            md, ids, positions = payload
            runner.backend.init_forward_metadata(md)
            runner.model(ids, positions, runner.backend, md)
        elif kind == "logits":
            runner.model.logits(payload)
        elif kind == "stop":
            break
        else:
            raise RuntimeError(f"tensor parallel: unknown command {kind!r}")
    dist.destroy_process_group()


def run_node_followers(args: ServerArgs, model_path: str) -> int:
    """``--node-rank > 0``: run this node's followers in the foreground until rank 0 stops them.

    Returns 0 when they stopped on rank 0's command or on SIGTERM / SIGINT here (which ends them), else
    the worst exit code. The followers exit on their own if this process dies."""
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=follower_main, args=(args.to_dict(), model_path, r, os.getpid()))
        for r in ranks_of_node(args)
    ]
    stopped = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.set()
        for p in procs:
            if p.is_alive():
                p.terminate()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0 if stopped.is_set() else max(abs(p.exitcode or 0) for p in procs)
