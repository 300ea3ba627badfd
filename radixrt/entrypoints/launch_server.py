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
any of them, stops them all (`radixrt.entrypoints.data_parallel`).

Tensor parallelism over several nodes (``--tp-size N --nnodes M --dist-init-addr HOST:PORT``, the same
flags on every node): node 0 (``--node-rank 0``) serves as above; on the other nodes this command runs
only that node's tensor-parallel ranks, in the foreground, until rank 0 stops them
(`radixrt.entrypoints.tp_node`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

import uvicorn

from radixrt import __version__
from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.data_parallel import launch_dp
from radixrt.entrypoints.startup import WARMUP_TIMEOUT_S, setup_logging
from radixrt.server.http.app import build_app
from radixrt.server.http.context import ServerContext
from radixrt.server.http.errors import APIError
from radixrt.transport.zmq_client import API_KEY_ENV, WorkerStartupError

logger = logging.getLogger("radixrt.server")

WARMUP_PROMPT = "The capital of France is"
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
    if args.pd:
        from radixrt.disaggregation.launch import launch_pd

        return launch_pd(args)
    if args.node_rank > 0:
        # NOTE: imported here: it loads the model runner, which the HTTP process never needs.
        from radixrt.entrypoints.tp_node import launch_node_followers

        return launch_node_followers(args)
    return launch_server(args)


if __name__ == "__main__":
    raise SystemExit(main())
