"""``radixrt serve --dp-size N`` (N > 1): N servers on consecutive ports behind the real sglang-router.

The router (``python -m sglang_router.launch_router``) listens on ``--port``; each server is a
``python -m radixrt.entrypoints.launch_server`` of its own with every flag that differs from its default
(so KV budgets and the like apply per server). A stop signal, or the exit of any of them, stops them all:
the router first, so that no new request reaches a stopping server.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from types import FrameType

from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.startup import WARMUP_TIMEOUT_S, setup_logging
from radixrt.transport.zmq_client import API_KEY_ENV

logger = logging.getLogger("radixrt.server")

DP_FLAGS = ("dp_size", "router_policy", "router_dp_worker_base_port", "port", "api_key", "api_key_file")
ROUTER_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def dp_server_flags(args: ServerArgs, port: int) -> list[str]:
    """The command-line flags of one data-parallel server: every setting that differs from its
    default (so KV budgets and the like apply per server), its own port, no DP flags and no API key
    (that travels in the environment, `dp_server_env`)."""
    out = ["--port", str(port)]
    for f in fields(ServerArgs):
        value = getattr(args, f.name)
        if f.name in DP_FLAGS or value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        out += [flag] if isinstance(value, bool) else [flag, str(value)]
    return out


def dp_server_env(args: ServerArgs) -> dict[str, str]:
    """The environment of a data-parallel server: ours, with the API key in ``$RADIXRT_API_KEY``."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # NOTE: a session of its own, so that a terminal's Ctrl-C reaches only the supervisor, which then
    # stops the router before the servers behind it.
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, env=env)


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return int(resp.status) == 200
    except Exception:
        return False


def _router_ready(url: str, n: int, api_key: str | None) -> bool:
    """The router lists all ``n`` servers as healthy (its /health answers before they are registered)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + "/workers", headers=headers), timeout=2
        ) as resp:
            workers = json.loads(resp.read()).get("workers", [])
    except Exception:
        return False
    return sum(1 for w in workers if w.get("is_healthy")) == n


def launch_dp(args: ServerArgs) -> int:
    """``--dp-size N``: N servers on consecutive ports, sglang-router on ``--port``; returns the exit code
    (0 after a stop signal, 1 when a process failed or exited on its own)."""
    setup_logging(args.log_level)
    if importlib.util.find_spec("sglang_router") is None:
        logger.error(
            "--dp-size %d needs sglang-router in front of the servers: pip install sglang-router",
            args.dp_size,
        )
        return 2
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = args.router_dp_worker_base_port or args.port + 1
    ports = [base + i for i in range(args.dp_size)]
    metrics_port = base + args.dp_size
    busy = [p for p in (args.port, *ports, metrics_port) if _port_taken(args.host, p)]
    if busy:
        logger.error(
            "port(s) %s in use (router %d, servers %s, metrics %d)", busy, args.port, ports, metrics_port
        )
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    names = [f"server on port {p}" for p in ports]
    env = dp_server_env(args)
    servers = [
        _spawn([sys.executable, "-m", "radixrt.entrypoints.launch_server", *dp_server_flags(args, p)], env)
        for p in ports
    ]
    procs, router = list(servers), None  # procs: every process watched, the router first once started
    urls = [f"http://{host}:{p}" for p in ports]

    def servers_up() -> bool:
        return all(_healthy(u) for u in urls)

    try:
        if _wait(servers_up, procs, names, stop, time.monotonic() + WARMUP_TIMEOUT_S):
            router = _spawn(_router_command(args, urls, metrics_port))
            procs.insert(0, router)
            names.insert(0, f"sglang-router on port {args.port}")
            router_up = functools.partial(
                _router_ready, f"http://{host}:{args.port}", args.dp_size, args.api_key
            )
            if _wait(router_up, procs, names, stop, time.monotonic() + ROUTER_READY_TIMEOUT_S):
                logger.info(
                    "ready: sglang-router (policy %s) at http://%s:%d in front of %d radixrt servers on "
                    "ports %s; router metrics on port %d",
                    args.router_policy, host, args.port, args.dp_size, ", ".join(map(str, ports)), metrics_port,
                )  # fmt: skip
                _wait(lambda: False, procs, names, stop, None)  # until a stop signal or an exit
    finally:
        _stop_all([router] if router else [])  # the router first: no new requests reach a stopping server
        _stop_all(servers)
        logger.info("shut down")
    return 0 if stop.is_set() else 1


def _router_command(args: ServerArgs, urls: list[str], metrics_port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
           "--policy", args.router_policy, "--host", args.host, "--port", str(args.port),
           "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
           "--shutdown-grace-period-secs", "5"]  # fmt: skip
    if args.log_level.lower() in ("debug", "info", "warn", "error"):
        cmd += ["--log-level", args.log_level.lower()]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def _wait(
    done: Callable[[], bool],
    procs: list[subprocess.Popen[bytes]],
    names: list[str],
    stop: threading.Event,
    deadline: float | None,
) -> bool:
    """Poll until ``done()``; False on a stop signal, on the exit of any process, or at ``deadline``."""
    while not stop.is_set():
        for proc, name in zip(procs, names, strict=True):
            if proc.poll() is not None:
                logger.error("%s exited with code %s; stopping the others", name, proc.returncode)
                return False
        if done():
            return True
        if deadline is not None and time.monotonic() > deadline:
            logger.error("not ready in time; stopping")
            return False
        stop.wait(0.5)
    logger.info("stop signal received")
    return False


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, SIGKILL what outlives the timeout."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
