"""A tensor-parallel follower rank: its process (build this rank's shard, run rank 0's commands) and, on
the nodes other than node 0, the foreground run of that node's ranks.

Rank 0's side of the group is `radixrt.distributed.tp_group`; it starts followers through the entry
`follower_main`, which it receives from whoever builds the model runner (the scheduler), so the
distributed package never imports the worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from radixrt.config.server_args import ServerArgs
from radixrt.distributed.tp_group import ranks_of_node
from radixrt.worker.model_runner import ModelRunner


def _exit_with_parent(parent_pid: int) -> None:
    """A follower whose rank 0 is gone (killed, crashed) must not linger in a collective forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def follower_main(args_dict: dict[str, Any], model_path: str, rank: int, parent_pid: int | None) -> None:
    """A follower rank's process (the `FollowerEntry` rank 0 hands to `TPGroup`): build its shard (joining
    the group), then run rank 0's commands."""
    logging.basicConfig(level=args_dict.get("log_level", "info").upper())
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    args = ServerArgs(**args_dict)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, len(ranks_of_node(args)))))
    runner = ModelRunner(args, model_path, tp_rank=rank)
    follow(runner)


@torch.inference_mode()
def follow(runner: ModelRunner) -> None:
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
        _terminate_started(procs)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    start_until_stopped(procs, stopped)
    for p in procs:
        if p.pid is not None:
            p.join()
    return 0 if stopped.is_set() else max(abs(p.exitcode or 0) for p in procs)


def _terminate_started(procs: Sequence[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()


def start_until_stopped(procs: Sequence[BaseProcess], stopped: threading.Event) -> None:
    """Start ``procs`` in order unless a stop signal arrived; one arriving while ``start()`` runs ends them.

    NOTE: a spawned child exists (and shows in /proc) before ``start()`` returns, but ``is_alive()`` is
    false until then, so a signal handler that fires inside ``start()`` cannot see that child; the check
    after each ``start()`` terminates it."""
    for p in procs:
        if stopped.is_set():
            break
        p.start()
        if stopped.is_set():
            _terminate_started(procs)
