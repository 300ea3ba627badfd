"""Tensor parallelism over several nodes: what ``radixrt serve --node-rank R`` (R > 0) runs.

Every node runs the same command (``--tp-size N --nnodes M --dist-init-addr HOST:PORT``); node 0 serves
(`radixrt.entrypoints.launch_server`), the other nodes run only their tensor-parallel ranks, in the
foreground and without HTTP, until rank 0 stops them (`radixrt.worker.tp_follower`).
"""

from __future__ import annotations

import logging

from radixrt import __version__
from radixrt.config.server_args import ServerArgs
from radixrt.distributed.tp_group import ranks_of_node
from radixrt.entrypoints.startup import setup_logging
from radixrt.models.resolve import resolve_model
from radixrt.worker.tp_follower import run_node_followers

logger = logging.getLogger("radixrt.server")


def launch_node_followers(args: ServerArgs) -> int:
    """``--node-rank R`` (R > 0): this node's tensor-parallel ranks in the foreground, no HTTP server;
    returns 0 once rank 0 (node 0's server) stopped them or a stop signal arrived."""
    setup_logging(args.log_level, f"node {args.node_rank}")
    try:
        model_path = resolve_model(args.model_path, revision=args.revision).path
    except (FileNotFoundError, ValueError) as exc:
        logger.error("startup failed: %s", exc)
        return 1
    logger.info(
        "radixrt %s node %d of %d: tensor-parallel ranks %s of %d, rank 0 at %s (model %s)",
        __version__, args.node_rank, args.nnodes, ranks_of_node(args), args.tp_size, args.dist_init_addr,
        model_path,
    )  # fmt: skip
    code = run_node_followers(args, model_path)
    logger.info("node %d: ranks stopped (exit code %d)", args.node_rank, code)
    return code
