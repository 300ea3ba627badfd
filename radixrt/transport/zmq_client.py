"""The HTTP process's end of the worker link: spawn the worker process, talk to it over ZeroMQ.

``ZmqWorkerClient.spawn`` binds a PUSH socket (requests out) and a PULL socket (token outputs in) in a
fresh temporary directory, starts ``python -m radixrt.transport.zmq_worker`` and waits for its
``WorkerReady`` handshake. A receiver thread hands every output to the TokenizerManager and watches the
process: when it exits, ``on_death`` is called within ``POLL_S`` and every later ``send`` raises
``WorkerDeadError``. ``shutdown`` stops the process and removes the socket files.

The worker's settings travel over its stdin pipe, never on its command line (``ps`` shows that to every
local user), and without the API key, which the worker does not need. The socket directory is named
``radixrt-<owner pid>-XXXX``: ``remove_stale_ipc_dirs`` deletes those whose owner process is gone (an
HTTP process killed with SIGKILL cannot remove its own).
"""

from __future__ import annotations

import logging
import os
import re
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

from radixrt.config.server_args import ServerArgs
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.protocol import (
    WorkerHandshake,
    WorkerInput,
    WorkerOutput,
    WorkerReady,
    WorkerStartupFailed,
)
from radixrt.transport.zmq_worker import WorkerConfig

logger = logging.getLogger(__name__)

POLL_S = 0.2  # receiver poll period: also the bound on how late a worker's death is noticed
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
IPC_PREFIX = "radixrt-"
API_KEY_ENV = "RADIXRT_API_KEY"  # read by the server's CLI; kept out of the worker's environment
_IPC_DIR = re.compile(r"radixrt-(\d+)-")


def make_ipc_dir() -> str:
    """A fresh private (0700) directory for one worker's sockets, named after this process."""
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_ipc_dirs(root: str | None = None) -> list[Path]:
    """Delete this user's socket directories under ``root`` (the temp dir) whose owner process is
    gone; returns them. Directories of live processes and names not made by ``make_ipc_dir`` stay."""
    base = Path(root if root is not None else tempfile.gettempdir())
    removed: list[Path] = []
    for entry in base.glob(IPC_PREFIX + "*"):
        match = _IPC_DIR.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if entry.lstat().st_uid != os.getuid() or _pid_alive(int(match.group(1))):
                continue
        except FileNotFoundError:  # another server starting now removed it first
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


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
        cls,
        args: ServerArgs,
        model_path: str,
        eos_token_ids: list[int],
        timeout: float = STARTUP_TIMEOUT_S,
        cancel: threading.Event | None = None,
    ) -> ZmqWorkerClient:
        """Start the worker process and wait until it has loaded the model (or failed to, or ``cancel``
        was set: WorkerStartupError, the process stopped)."""
        ipc_dir = make_ipc_dir()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        for sock in (push, pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        inbox, outbox = f"ipc://{ipc_dir}/worker_in", f"ipc://{ipc_dir}/worker_out"
        push.bind(inbox)
        pull.bind(outbox)
        settings = {**args.to_dict(), "api_key": None, "api_key_file": None}  # HTTP-only secrets
        cfg = WorkerConfig(settings, model_path, eos_token_ids, inbox, outbox, os.getpid())
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixrt.transport.zmq_worker"],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        client = cls(ipc_dir, ctx, push, pull, proc)
        try:
            assert proc.stdin is not None
            try:
                with proc.stdin:
                    proc.stdin.write(cfg.to_json().encode())
            except BrokenPipeError:
                pass  # it exited before reading: the handshake reports its exit code
            client.info = client._handshake(timeout, cancel)
        except BaseException:
            client.shutdown()
            raise
        client._alive = True
        return client

    def _handshake(self, timeout: float, cancel: threading.Event | None) -> WorkerReady:
        decoder = msgspec.msgpack.Decoder(WorkerHandshake)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise WorkerStartupError("the worker's startup was cancelled")
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
        data = self._encoder.encode(msg)
        # NOTE: checked under the lock that `shutdown` closes the socket under: a ZeroMQ socket used by
        # one thread while another closes it aborts the process (an assertion inside libzmq).
        with self._send_lock:
            if not self._alive:
                raise WorkerDeadError("the worker process is not running")
            try:
                # NOBLOCK: with no high-water mark a connected worker never makes this wait; a PUSH socket
                # without a peer (the worker just died) would block the caller, the event loop, forever.
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise WorkerDeadError("the worker process is not connected") from None

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
        with self._send_lock:
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
        with self._send_lock:
            self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
