"""The tensor-parallel group: joining it, and rank 0's side (start the node's followers, broadcast steps).

Rank 0 is the worker that owns the scheduler and every piece of bookkeeping (slot tables, RadixCache);
ranks 1..N-1 (``follower`` processes) hold only their model shard and KV-pool shard. Each forward rank 0
broadcasts the batch it built (metadata, token ids, positions) and all ranks run the same layers, meeting
in the all-reduces; when the scheduler wants logits, rank 0 broadcasts the hidden rows and every rank
computes its vocabulary slice for the all-gather. One command per collective step, so ranks can never
disagree about what comes next.

Single node: rank 0 spawns its followers. Several nodes (``--nnodes``, ``--node-rank``,
``--dist-init-addr``, SGLang's names): every node runs ``radixrt serve`` with the same flags; node 0 hosts
rank 0 (the server), the other nodes only run their followers. A follower's process (it builds a model
runner, so it lives with the worker: `radixrt.worker.tp_follower`) reaches this module as the
``follower`` entry its builder hands to `TPGroup`; this package never imports the worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixrt.config.server_args import ServerArgs

logger = logging.getLogger(__name__)
INIT_TIMEOUT = timedelta(minutes=5)

# A follower rank's process entry: (ServerArgs.to_dict(), model path, global rank, parent pid or None).
# Spawned processes pickle it, so it must be a module-level function.
FollowerEntry = Callable[[dict[str, Any], str, int, int | None], None]


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
    """Rank 0's side of the group: it starts this node's followers (running ``follower``) and broadcasts
    each step."""

    def __init__(self, args: ServerArgs, model_path: str, follower: FollowerEntry) -> None:
        if args.dist_init_addr is None:
            if args.nnodes > 1:
                raise ValueError("dist_init_addr: several nodes need --dist-init-addr HOST:PORT")
            args.dist_init_addr = f"127.0.0.1:{_free_port()}"
        self.size = args.tp_size
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=follower, args=(args.to_dict(), model_path, r, os.getpid()), daemon=True)
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
