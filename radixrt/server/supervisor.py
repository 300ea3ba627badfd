"""WorkerSupervisor: the HTTP process's ``WorkerClient`` that outlives its worker processes.

It holds the current ``ZmqWorkerClient``. When that worker process dies, the in-flight requests fail at
once (``on_death``: the TokenizerManager's ``fail_all``) and a fresh worker starts on a thread of its
own after an exponential backoff (1 s, 2 s, 4 s ..., at most ``BACKOFF_MAX_S``), each attempt logged and
counted (``on_restart``), then warmed up (``warm_up``) before ``health`` says "ok" again. A worker that
dies more than ``--max-worker-restarts`` times within ``--worker-restart-window`` seconds is given up on:
``on_give_up`` (the server then exits non-zero). ``begin_drain`` (SIGTERM) refuses new requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from radixrt.config.server_args import ServerArgs
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.protocol import (
    BatchTokenOut,
    TokenizedGenerateReq,
    WorkerInput,
    WorkerOutput,
    WorkerReady,
)
from radixrt.transport.zmq_client import (
    STOP_TIMEOUT_S,
    WorkerStartupError,
    ZmqWorkerClient,
    remove_stale_ipc_dirs,
)

logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0


class WorkerSupervisor:
    """Restarts the worker process when it dies; ``health`` says whether it serves now."""

    def __init__(self, args: ServerArgs, model_path: str, eos_token_ids: list[int], client: ZmqWorkerClient):
        self.args, self.model_path, self.eos_token_ids = args, model_path, eos_token_ids
        self.current = client
        self.restarts = 0  # restart attempts since the server started
        self.gave_up = False
        self.last_progress = 0.0  # monotonic time of the last token output (of any request)
        self.on_death: Callable[[WorkerDeadError], None] | None = None
        self.on_restart: Callable[[], None] | None = None
        self.warm_up: Callable[[], None] | None = None
        self.on_give_up: Callable[[str], None] | None = None
        self._draining: Callable[[], Exception] | None = None
        self._warming = False
        self._recent: deque[float] = deque()  # monotonic times of the restarts within the window
        self._on_output: Callable[[WorkerOutput], None] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        client.on_death = self._died

    @classmethod
    def spawn(cls, args: ServerArgs, model_path: str, eos_token_ids: list[int]) -> WorkerSupervisor:
        """Remove the socket directories of dead servers, start the first worker and wait for it."""
        for path in remove_stale_ipc_dirs():
            logger.info("removed %s: the server process that made it is gone", path)
        return cls(args, model_path, eos_token_ids, ZmqWorkerClient.spawn(args, model_path, eos_token_ids))

    # -- facts of the current worker ------------------------------------------------------------
    @property
    def info(self) -> WorkerReady:
        assert self.current.info is not None
        return self.current.info

    @property
    def pid(self) -> int:
        return self.current.pid

    @property
    def ipc_dir(self) -> str:
        return self.current.ipc_dir

    def socket_paths(self) -> list[Path]:
        return self.current.socket_paths()

    def health(self) -> str:
        """The state /health reports: ok (a warmed-up worker serves), draining, warming_up,
        restarting or worker_down (given up, or stopped)."""
        if self._draining is not None:
            return "draining"
        if self.gave_up or self._stop.is_set():
            return "worker_down"
        if not self.current.is_alive():
            return "restarting"
        return "warming_up" if self._warming else "ok"

    # -- WorkerClient ---------------------------------------------------------------------------
    def start(self, on_output: Callable[[WorkerOutput], None]) -> None:
        self._on_output = on_output
        self.current.start(self._output)

    def _output(self, msg: WorkerOutput) -> None:
        if isinstance(msg, BatchTokenOut):
            self.last_progress = time.monotonic()
        assert self._on_output is not None
        self._on_output(msg)

    def send(self, msg: WorkerInput) -> None:
        """To the current worker; a new request while draining raises the drain's error."""
        if self._draining is not None and isinstance(msg, TokenizedGenerateReq):
            raise self._draining()
        self.current.send(msg)

    def is_alive(self) -> bool:
        return self.current.is_alive()

    def begin_drain(self, refusal: Callable[[], Exception]) -> None:
        """From now on every new request fails with ``refusal()``; running ones go on."""
        self._draining = refusal

    def shutdown(self) -> None:
        """Stop restarting (a startup under way is cancelled), stop the current worker."""
        with self._lock:
            self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT_S + 5)
        self.current.shutdown()

    # -- restarts -------------------------------------------------------------------------------
    def _died(self, error: WorkerDeadError) -> None:
        """On the dead worker's receiver thread: fail the in-flight requests, restart or give up."""
        if self._stop.is_set():
            return
        dead = self.current
        over = self._over_limit()
        if self.on_death is not None:
            tail = "the server gives up on it" if over else "the server is restarting it"
            self.on_death(WorkerDeadError(f"{error}; {tail}"))
        if over:
            self._give_up(f"the worker process exited with code {dead.exit_code}")
            return
        self._thread = threading.Thread(
            target=self._restart, args=(dead,), name="radixrt-worker-restart", daemon=True
        )
        self._thread.start()

    def _over_limit(self) -> bool:
        now = time.monotonic()
        while self._recent and now - self._recent[0] > self.args.worker_restart_window:
            self._recent.popleft()
        return len(self._recent) >= self.args.max_worker_restarts

    def _give_up(self, what: str) -> None:
        self.gave_up = True
        reason = (
            f"{what}; it was restarted {len(self._recent)} time(s) within the last "
            f"{self.args.worker_restart_window:g}s (--max-worker-restarts {self.args.max_worker_restarts}): "
            "giving up on the worker"
        )
        logger.error("%s", reason)
        if self.on_give_up is not None:
            self.on_give_up(reason)

    def _restart(self, dead: ZmqWorkerClient) -> None:
        dead.shutdown()
        while True:
            attempt = len(self._recent) + 1
            delay = min(BACKOFF_BASE_S * 2 ** (attempt - 1), BACKOFF_MAX_S)
            logger.warning(
                "restarting the worker in %.0fs (restart %d of at most %d within %gs)",
                delay, attempt, self.args.max_worker_restarts, self.args.worker_restart_window,
            )  # fmt: skip
            if self._stop.wait(delay):
                return
            self._recent.append(time.monotonic())
            self.restarts += 1
            if self.on_restart is not None:
                self.on_restart()
            try:
                client = ZmqWorkerClient.spawn(
                    self.args, self.model_path, self.eos_token_ids, cancel=self._stop
                )
            except WorkerStartupError as exc:
                if self._stop.is_set():
                    return
                logger.error("worker restart %d failed: %s", attempt, exc)
                if self._over_limit():
                    self._give_up(f"the worker did not start again ({exc})")
                    return
                continue
            with self._lock:
                if self._stop.is_set():
                    client.shutdown()
                    return
                self._warming = True
                client.on_death = self._died
                self.current = client
                assert self._on_output is not None
                client.start(self._output)
            logger.info("worker restarted: pid %d, sockets in %s; warming up", client.pid, client.ipc_dir)
            self._warm(client)
            return

    def _warm(self, client: ZmqWorkerClient) -> None:
        start = time.perf_counter()
        try:
            if self.warm_up is not None:
                self.warm_up()
        except Exception as exc:  # noqa: BLE001 - logged; the worker serves (or its death is handled)
            logger.error("warm-up request after the restart failed: %s", exc)
        finally:
            self._warming = False
        if client.is_alive():
            logger.info("the restarted worker (pid %d) serves again (warm-up %.2fs)", client.pid,
                        time.perf_counter() - start)  # fmt: skip
