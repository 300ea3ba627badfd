"""``python -m radixrt.entrypoints.launch_server --model-path DIR --port 30000`` (the same as ``radixrt serve``).

Starts the worker process (model + scheduler) and serves the HTTP API with uvicorn in this process.
Logs the model, dtype and KV pool, the URL, a warm-up request and then a "ready" line. A worker that
dies is restarted (`radixrt.server.supervisor`); one that keeps dying is given up on and the server
exits with code 1. The first SIGTERM or SIGINT drains: new requests get a 503, running ones get
``--graceful-shutdown-timeout`` seconds to finish, the rest end with a 503 (JSON, or an SSE error event
and [DONE]); then both processes stop and the ipc socket files are removed (exit code 0). A second
signal stops at once. The API key may come from ``--api-key-file`` or ``$RADIXRT_API_KEY`` instead of
``--api-key`` (which every local user sees in ``ps``).

``--dp-size N`` (N > 1) instead supervises N such servers on consecutive ports and the real sglang-router
(``python -m sglang_router.launch_router``) in front of them on ``--port``; a stop signal, or the exit of
any of them, stops them all.

Tensor parallelism over several nodes (``--tp-size N --nnodes M --dist-init-addr HOST:PORT``, the same
flags on every node): node 0 (``--node-rank 0``) serves as above; on the other nodes this command runs
only that node's tensor-parallel ranks, in the foreground, until rank 0 stops them.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from types import FrameType

import uvicorn

from radixrt import __version__
from radixrt.config.server_args import ServerArgs
from radixrt.models.resolve import resolve_model
from radixrt.server.http.app import build_app
from radixrt.server.http.context import ServerContext
from radixrt.server.http.errors import APIError
from radixrt.transport.zmq_client import API_KEY_ENV, WorkerStartupError

logger = logging.getLogger("radixrt.server")

WARMUP_PROMPT = "The capital of France is"
WARMUP_TIMEOUT_S = 600.0
DRAIN_POLL_S = 0.05
FAILED_FLUSH_S = 5.0  # after failing the requests left at the drain's end: time for their answers


def resolve_api_key(args: ServerArgs, environ: Mapping[str, str] = os.environ) -> None:
    """Set ``args.api_key`` from ``--api-key-file``, else from ``$RADIXRT_API_KEY`` when no
    ``--api-key`` was given (ValueError naming the flag for a bad file)."""
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise ValueError("api_key_file: give --api-key or --api-key-file, not both")
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"api_key_file: cannot read {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file: {args.api_key_file} is empty")
        args.api_key = key
    elif args.api_key is None and environ.get(API_KEY_ENV):
        args.api_key = environ[API_KEY_ENV]


def _shutting_down(message: str) -> APIError:
    return APIError(503, f"the server is shutting down{message}", code="server_shutting_down")


def drain(ctx: ServerContext, timeout: float, hurry: threading.Event) -> None:
    """Refuse new requests, wait up to ``timeout`` s (or until ``hurry``) for the running ones, end those
    left with a 503."""
    ctx.client.begin_drain(lambda: _shutting_down(""))
    tm = ctx.tm
    logger.info("draining: new requests get 503; %d running get up to %gs to finish", len(tm.states), timeout)
    deadline = time.monotonic() + timeout
    while tm.states and time.monotonic() < deadline and not hurry.is_set():
        time.sleep(DRAIN_POLL_S)
    if tm.states:
        hurried = hurry.is_set()
        why = "a second stop signal" if hurried else f"--graceful-shutdown-timeout {timeout:g}s"
        logger.warning("%d request(s) still running after %s: ending them with 503", len(tm.states), why)
        tm.fail_all(
            _shutting_down(f": {why} ended the request" if hurried else f": not finished within {why}")
        )
        deadline = time.monotonic() + FAILED_FLUSH_S
        while tm.states and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
    logger.info("drained")


class _DrainingServer(uvicorn.Server):
    """uvicorn whose first stop signal drains (`drain`) before it stops; a second one ends the drain's
    wait (the running requests get their 503 now); a third stops at once."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.draining: threading.Thread | None = None
        self.hurry = threading.Event()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if not self.started or self.should_exit or self.hurry.is_set():
            super().handle_exit(sig, frame)
        elif self.draining is not None:
            logger.info("stop signal %s received again: ending the running requests now", name)
            self.hurry.set()
        else:
            logger.info("stop signal %s received", name)
            self.draining = threading.Thread(target=self._drain, name="radixrt-drain", daemon=True)
            self.draining.start()

    def _drain(self) -> None:
        drain(self.ctx, self.ctx.args.graceful_shutdown_timeout, self.hurry)
        self.should_exit = True


class _Stop(Exception):
    """SIGTERM received."""


def build_parser(prog: str = "python -m radixrt.entrypoints.launch_server") -> argparse.ArgumentParser:
    """The server's flags (one per ServerArgs field; docs/flags.md lists the same)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [--model-path PATH] [--port PORT] [--flag VALUE ...]",
        description="Serve a model over HTTP with radixrt: SGLang's native API (/generate) and OpenAI's "
        "(/v1/completions, /v1/chat/completions). Without --model-path: the embedded SmolLM2-135M-Instruct.",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def setup_logging(level: str, tag: str = "http") -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s", force=True
    )


def _warm_up(server: uvicorn.Server, ctx: ServerContext, url: str) -> None:
    """Once uvicorn listens: one real request through HTTP, tokenizer, ZMQ and worker; then "ready"."""
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while not server.started:
        if server.should_exit or time.monotonic() > deadline:
            return
        time.sleep(0.05)
    body = json.dumps({"text": WARMUP_PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    headers = {"Content-Type": "application/json"}
    if ctx.args.api_key:
        headers["Authorization"] = f"Bearer {ctx.args.api_key}"
    req = urllib.request.Request(f"{url}/generate", data=body.encode(), headers=headers, method="POST")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=WARMUP_TIMEOUT_S) as resp:
            out = json.loads(resp.read())
    except Exception as exc:
        logger.error("warm-up request failed: %s; the server stays unhealthy", exc)
        return
    logger.info(
        "warm-up request: %d prompt + %d generated tokens in %.2fs",
        out["meta_info"]["prompt_tokens"],
        out["meta_info"]["completion_tokens"],
        time.perf_counter() - start,
    )
    ctx.ready = True
    logger.info("ready: radixrt %s is serving %r at %s", __version__, ctx.model_name, url)


def launch_server(args: ServerArgs) -> int:
    """Run the server until SIGINT / SIGTERM; returns the process exit code."""
    setup_logging(args.log_level)
    logger.info("radixrt %s starting (model %s)", __version__, args.model_path or "<embedded demo model>")
    try:
        ctx = ServerContext.start(args)
    except (WorkerStartupError, FileNotFoundError, ValueError) as exc:
        logger.error("startup failed: %s", exc)
        return 1
    logger.info("%s", ctx.startup_summary())
    logger.info("worker sockets in %s", ctx.client.ipc_dir)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    config = uvicorn.Config(
        build_app(ctx),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    server = _DrainingServer(config, ctx)
    ctx.client.on_give_up = lambda reason: setattr(server, "should_exit", True)
    threading.Thread(target=_warm_up, args=(server, ctx, url), name="radixrt-warmup", daemon=True).start()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    # NOTE: uvicorn catches SIGINT/SIGTERM for its graceful shutdown, then re-raises them with the
    # handlers found at start: these, so that we always get to stop the worker below.
    signal.signal(signal.SIGTERM, on_sigterm)
    code = 0
    try:
        server.run()
        code = 0 if server.started else 1
    except (KeyboardInterrupt, _Stop):
        logger.info("stop signal received")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a repeated stop signal must not cut this short
            signal.signal(sig, signal.SIG_IGN)
        logger.info("shutting down the worker")
        ctx.shutdown()
        logger.info("shut down")
    if ctx.client.gave_up:
        logger.error("exiting with code 1: the worker kept dying")
        code = 1
    return code


# --- data parallelism: N servers behind sglang-router ------------------------------------------------

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


# --- launch checks; tensor parallelism over several nodes: the ranks of the nodes other than node 0 ---


def check_launch_args(args: ServerArgs) -> None:
    """What one launch cannot run, as a ValueError naming the flag (ServerArgs checks each flag alone)."""
    if args.nnodes > 1 and args.dist_init_addr is None:
        raise ValueError("dist_init_addr: --nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's node)")
    if args.dp_size > 1 and args.tp_size > 1 and args.dist_init_addr is not None:
        # NOTE: dp_server_flags would hand every server the same rendezvous: the second server's ranks
        # would join the first one's group. Without the flag each server picks a free local port.
        raise ValueError(
            f"dist_init_addr: --dp-size {args.dp_size} with --tp-size {args.tp_size} would give every "
            "data-parallel server the same rendezvous address; drop --dist-init-addr (each server then "
            "picks a free local port)"
        )


def launch_node_followers(args: ServerArgs) -> int:
    """``--node-rank R`` (R > 0): this node's tensor-parallel ranks in the foreground, no HTTP server;
    returns 0 once rank 0 (node 0's server) stopped them or a stop signal arrived."""
    setup_logging(args.log_level, f"node {args.node_rank}")
    from radixrt.distributed.tp_group import ranks_of_node, run_node_followers

    try:
        model_path = resolve_model(args.model_path).path
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


def main(argv: list[str] | None = None, prog: str = "python -m radixrt.entrypoints.launch_server") -> int:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli(ns)
        resolve_api_key(args)
        check_launch_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.dp_size > 1:
        return launch_dp(args)
    return launch_node_followers(args) if args.node_rank > 0 else launch_server(args)


if __name__ == "__main__":
    raise SystemExit(main())
