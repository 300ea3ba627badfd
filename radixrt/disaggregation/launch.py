"""``radixrt serve --pd``: one prefill server, one decode server and sglang-router in PD mode on this machine.

The router listens on ``--port``; the prefill server takes ``--port + 1`` and the bootstrap port
``--disaggregation-bootstrap-port``, the decode server ``--port + 2``, the router's metrics ``--port + 3``.
Each server gets every flag that differs from its default (as ``--dp-size`` does) plus its mode, and half of
the cores (``OMP_NUM_THREADS``, unless set). A stop signal, or the exit of any of them, stops them all, the
router first. Several machines: start the servers by hand (docs/pd.md).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.data_parallel import (
    ROUTER_READY_TIMEOUT_S,
    _healthy,
    _port_taken,
    _router_ready,
    _spawn,
    _stop_all,
    _wait,
    dp_server_env,
    dp_server_flags,
)
from radixrt.entrypoints.startup import WARMUP_TIMEOUT_S, setup_logging

logger = logging.getLogger("radixrt.server")


def pd_server_flags(args: ServerArgs, port: int, mode: str) -> list[str]:
    """One side's flags: the non-default settings (without ``--pd``), its port and its mode."""
    flags = [f for f in dp_server_flags(args, port) if f != "--pd"]
    return [*flags, "--disaggregation-mode", mode]


def router_command(args: ServerArgs, prefill: str, decode: str, metrics_port: int) -> list[str]:
    """``sglang_router.launch_router --pd-disaggregation`` in front of the two servers."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--prefill", prefill, str(args.disaggregation_bootstrap_port), "--decode", decode,
           "--policy", args.router_policy, "--host", args.host, "--port", str(args.port),
           "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
           "--shutdown-grace-period-secs", "5"]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def launch_pd(args: ServerArgs) -> int:
    """Start the three processes, wait for a stop signal or an exit; returns the exit code (0 after a stop
    signal, 1 when a process failed, 2 without sglang-router)."""
    setup_logging(args.log_level)
    if importlib.util.find_spec("sglang_router") is None:
        logger.error("--pd needs sglang-router in front of the servers: pip install sglang-router")
        return 2
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    pport, dport, metrics = args.port + 1, args.port + 2, args.port + 3
    boot = args.disaggregation_bootstrap_port
    busy = [p for p in (args.port, pport, dport, metrics, boot) if _port_taken(args.host, p)]
    if busy:
        logger.error("port(s) %s in use (router %d, prefill %d, decode %d, metrics %d, bootstrap %d)",
                     busy, args.port, pport, dport, metrics, boot)  # fmt: skip
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    env = dp_server_env(args)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    entry = [sys.executable, "-m", "radixrt.entrypoints.launch_server"]
    servers = [_spawn([*entry, *pd_server_flags(args, pport, "prefill")], env),
               _spawn([*entry, *pd_server_flags(args, dport, "decode")], env)]  # fmt: skip
    names = [f"prefill server on port {pport}", f"decode server on port {dport}"]
    procs, router = list(servers), None
    urls = [f"http://{host}:{pport}", f"http://{host}:{dport}"]
    try:
        up = _wait(
            lambda: all(_healthy(u) for u in urls), procs, names, stop, time.monotonic() + WARMUP_TIMEOUT_S
        )
        if up:
            router = _spawn(router_command(args, urls[0], urls[1], metrics))
            procs.insert(0, router)
            names.insert(0, f"sglang-router on port {args.port}")
            ready = functools.partial(_router_ready, f"http://{host}:{args.port}", 2, args.api_key)
            if _wait(ready, procs, names, stop, time.monotonic() + ROUTER_READY_TIMEOUT_S):
                logger.info("ready: sglang-router (PD mode) at http://%s:%d; prefill server %s (bootstrap port "
                            "%d), decode server %s; KV moved by %s", host, args.port, urls[0], boot, urls[1],
                            args.disaggregation_transfer_backend)  # fmt: skip
                _wait(lambda: False, procs, names, stop, None)
    finally:
        _stop_all([router] if router else [])
        _stop_all(servers)
        logger.info("shut down")
    return 0 if stop.is_set() else 1
