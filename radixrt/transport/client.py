"""The interface the TokenizerManager talks to the worker through, and the error of a worker that is gone.

Two implementations: ``InProcessWorker`` (the Engine: the scheduler on a thread of this process) and
``ZmqWorkerClient`` (the server: a worker process behind two ZeroMQ sockets), wrapped by the server's
``WorkerSupervisor``, which restarts a dead worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from radixrt.transport.protocol import WorkerInput, WorkerOutput


class WorkerClient(Protocol):
    """Transport to the worker: ``send`` a message; outputs go to the callback given at ``start``."""

    def start(self, on_output: Callable[[WorkerOutput], None]) -> None: ...

    def send(self, msg: WorkerInput) -> None: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class WorkerDeadError(RuntimeError):
    """The worker process (or thread) is gone; in-flight requests fail with this."""
