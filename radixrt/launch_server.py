"""``python -m radixrt.launch_server --model-path DIR --port 30000`` (the same as ``radixrt serve``).

Starts the worker process (model + scheduler) and serves the HTTP API with uvicorn in this process.
Logs the model, dtype and KV pool, the URL, a warm-up request and then a "ready" line. SIGINT and
SIGTERM stop both processes and remove the ipc socket files.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
import urllib.request
from types import FrameType

import uvicorn

from radixrt import __version__
from radixrt.http.app import build_app
from radixrt.http.context import ServerContext
from radixrt.server_args import ServerArgs
from radixrt.zmq_client import WorkerStartupError

logger = logging.getLogger("radixrt.server")

WARMUP_PROMPT = "The capital of France is"
WARMUP_TIMEOUT_S = 600.0


class _Stop(Exception):
    """SIGTERM received."""


def build_parser(prog: str = "python -m radixrt.launch_server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model with radixrt (SGLang-style API).")
    ServerArgs.add_cli_args(parser)
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s [http] %(levelname)s %(name)s: %(message)s", force=True
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
    server = uvicorn.Server(config)
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
        logger.info("shutting down the worker")
        ctx.shutdown()
        logger.info("shut down")
    return code


def main(argv: list[str] | None = None, prog: str = "python -m radixrt.launch_server") -> int:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli(ns)
    except ValueError as exc:
        parser.error(str(exc))
    return launch_server(args)


if __name__ == "__main__":
    raise SystemExit(main())
