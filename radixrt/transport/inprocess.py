"""Run the Scheduler on a thread of this process (the Engine's transport; no sockets)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from radixrt.config.server_args import ServerArgs
from radixrt.transport.protocol import BatchTokenOut, ReqOut, WorkerInput, WorkerOutput
from radixrt.worker.scheduler import Scheduler
from radixrt.worker.threads import set_worker_threads

logger = logging.getLogger(__name__)


class _Call:
    """Run a function on the scheduler thread between steps and hand back its result."""

    def __init__(self, fn: Callable[[Scheduler], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class InProcessWorker:
    """WorkerClient whose scheduler runs on a daemon thread, fed by a thread-safe queue."""

    scheduler: Scheduler

    def __init__(self, args: ServerArgs, model_path: str, eos_token_ids: list[int]) -> None:
        self._queue: queue.Queue[WorkerInput | _Call | None] = queue.Queue()
        self._stop = False
        self._alive = False
        self._on_output: Callable[[WorkerOutput], None] | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        # NOTE: the scheduler is built on its own thread, which then runs it: torch's OpenMP pool belongs
        # to the thread that first runs parallel ops, and a second thread's pool competing with it on a
        # 2-core CPU measured a compiled decode step at 28 ms instead of 16 ms.
        self._built = threading.Event()
        self._started = threading.Event()
        self._build_error: BaseException | None = None
        self._build = (args, model_path, eos_token_ids)
        self._thread = threading.Thread(target=self._run, name="radixrt-scheduler", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def start(self, on_output: Callable[[WorkerOutput], None]) -> None:
        self._on_output = on_output
        self._alive = True
        self._started.set()

    def _send(self, msg: WorkerOutput) -> None:
        if self._on_output is not None:
            self._on_output(msg)

    def send(self, msg: WorkerInput) -> None:
        self._queue.put(msg)

    def is_alive(self) -> bool:
        return self._alive

    def call(self, fn: Callable[[Scheduler], Any], timeout: float = 60.0) -> Any:
        """Run ``fn(scheduler)`` on the scheduler thread at a step boundary and return its result."""
        c = _Call(fn)
        self._queue.put(c)
        if not c.done.wait(timeout):
            raise TimeoutError("scheduler did not answer")
        if c.error is not None:
            raise c.error
        return c.result

    def poll(self, block: bool) -> list[WorkerInput]:
        out: list[WorkerInput] = []
        try:
            item = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
        except queue.Empty:
            return out
        while True:
            if item is None:
                self._stop = True
            elif isinstance(item, _Call):
                try:
                    item.result = item.fn(self.scheduler)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    item.error = exc
                item.done.set()
            else:
                out.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out

    def _run(self) -> None:
        try:
            set_worker_threads(reserve_one=False)
            self.scheduler = Scheduler(*self._build, self._send)
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__ in the caller's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._started.wait()
        try:
            self.scheduler.run_forever(self, lambda: self._stop)
        except BaseException as exc:
            logger.exception("scheduler crashed")
            self._alive = False
            self._fail_live(exc)
            if self.on_death is not None:
                self.on_death(exc)
        self._alive = False

    def _fail_live(self, exc: BaseException) -> None:
        rids = list(self.scheduler.by_rid)
        outs = [ReqOut(rid, [], 0, 0, {"type": "abort", "message": f"worker error: {exc}"}) for rid in rids]
        if outs:
            self._send(BatchTokenOut(outs))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._started.set()  # a worker that was never started still exits
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._alive = False
