"""The HTTP process's end of the worker link: spawn the worker process, talk to it over ZeroMQ.

``ZmqWorkerClient.spawn`` binds a PUSH socket (requests out) and a PULL socket (token outputs in) in a
fresh temporary directory, starts ``python -m radixrt.worker.zmq_worker`` and waits for its
``WorkerReady`` handshake. A receiver thread hands every output to the TokenizerManager and watches the
process: when it exits, ``on_death`` is called within ``POLL_S`` and every later ``send`` raises
``WorkerDeadError``. ``shutdown`` stops the process and removes the socket files.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from radixrt.protocol import (
    WorkerHandshake,
    WorkerInput,
    WorkerOutput,
    WorkerReady,
    WorkerStartupFailed,
)
from radixrt.server_args import ServerArgs
from radixrt.tokenizer_manager import WorkerDeadError
from radixrt.worker.zmq_worker import WorkerConfig

logger = logging.getLogger(__name__)

POLL_S = 0.2  # receiver poll period: also the bound on how late a worker's death is noticed
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


class WorkerStartupError(RuntimeError):
    """The worker process exited or reported a failure before it was ready."""


class ZmqWorkerClient:
    """``WorkerClient`` (see tokenizer_manager) for a worker process reached over two ipc sockets."""

    def __init__(
        self,
        ipc_dir: str,
        ctx: zmq.Context[zmq.Socket[bytes]],
        push: zmq.Socket[bytes],
        pull: zmq.Socket[bytes],
        proc: subprocess.Popen[bytes],
    ) -> None:
        self.ipc_dir = ipc_dir
        self._ctx, self._push, self._pull, self.proc = ctx, push, pull, proc
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()
        self._alive = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self.info: WorkerReady | None = None
        self.exit_code: int | None = None
        self.on_death: Callable[[WorkerDeadError], None] | None = None

    @classmethod
    def spawn(
        cls, args: ServerArgs, model_path: str, eos_token_ids: list[int], timeout: float = STARTUP_TIMEOUT_S
    ) -> ZmqWorkerClient:
        """Start the worker process and wait until it has loaded the model (or failed to)."""
        ipc_dir = tempfile.mkdtemp(prefix="radixrt-")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        for sock in (push, pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        inbox, outbox = f"ipc://{ipc_dir}/worker_in", f"ipc://{ipc_dir}/worker_out"
        push.bind(inbox)
        pull.bind(outbox)
        cfg = WorkerConfig(args.to_dict(), model_path, eos_token_ids, inbox, outbox, os.getpid())
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixrt.worker.zmq_worker", cfg.to_json()], start_new_session=True
        )
        client = cls(ipc_dir, ctx, push, pull, proc)
        try:
            client.info = client._handshake(timeout)
        except BaseException:
            client.shutdown()
            raise
        client._alive = True
        return client

    def _handshake(self, timeout: float) -> WorkerReady:
        decoder = msgspec.msgpack.Decoder(WorkerHandshake)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pull.poll(int(POLL_S * 1000)):
                msg = decoder.decode(self._pull.recv())
                if isinstance(msg, WorkerStartupFailed):
                    raise WorkerStartupError(f"the worker failed to start: {msg.message}")
                return msg
            code = self.proc.poll()
            if code is not None:
                raise WorkerStartupError(f"the worker process exited with code {code} before it was ready")
        raise WorkerStartupError(f"the worker was not ready within {timeout:.0f}s")

    # -- WorkerClient ---------------------------------------------------------------------------
    def start(self, on_output: Callable[[WorkerOutput], None]) -> None:
        self._thread = threading.Thread(
            target=self._receive, args=(on_output,), name="radixrt-zmq-recv", daemon=True
        )
        self._thread.start()

    def send(self, msg: WorkerInput) -> None:
        """Queue a message for the worker; raises WorkerDeadError once it is gone."""
        if not self._alive:
            raise WorkerDeadError("the worker process is not running")
        data = self._encoder.encode(msg)
        with self._send_lock:
            self._push.send(data)

    def is_alive(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int:
        return self.proc.pid

    def socket_paths(self) -> list[Path]:
        """The ipc socket files (present while the server runs)."""
        return [Path(self.ipc_dir) / "worker_in", Path(self.ipc_dir) / "worker_out"]

    def _receive(self, on_output: Callable[[WorkerOutput], None]) -> None:
        decoder = msgspec.msgpack.Decoder(WorkerOutput)
        next_check = 0.0
        while not self._closing:
            if self._pull.poll(int(POLL_S * 1000)):
                while True:
                    try:
                        frame = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        on_output(decoder.decode(frame))
                    except Exception:  # a bad message must not kill the receiver
                        logger.exception("failed to handle a worker output")
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + POLL_S
            code = self.proc.poll()
            if code is not None and not self._closing:
                self._died(code)
                return

    def _died(self, code: int) -> None:
        self._alive = False
        self.exit_code = code
        logger.error(
            "the worker process (pid %d) exited with code %d; failing all requests", self.proc.pid, code
        )
        if self.on_death is not None:
            self.on_death(WorkerDeadError(f"the worker process exited unexpectedly (exit code {code})"))

    def shutdown(self) -> None:
        """Stop the worker process (SIGTERM, then SIGKILL), close the sockets, remove the socket files."""
        if self._closing:
            return
        self._closing = True
        self._alive = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the worker did not stop within %.0fs; killing it", STOP_TIMEOUT_S)
                self.proc.kill()
                self.proc.wait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
