"""A bounded pool of grammar-compile threads, shared fairly between clients.

Each client (a tenant, or ``"default"``) may have at most ``per_client`` compiles unfinished (queued,
running, or abandoned after a timeout but still running: xgrammar cannot be interrupted), so one
client cannot fill the queue. Free threads take the next job round-robin over clients, and with
``reserve_thread`` a client never occupies the last free thread while others may need it, so a flood
of slow grammars from one client delays another's by at most one slot.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import xgrammar as xgr

from radixrt.constrained.cache import GrammarKey

CompileFn = Callable[[GrammarKey], xgr.CompiledGrammar]


class GrammarBusy(RuntimeError):
    """The client already has its share of grammar compilations in flight (HTTP 429)."""

    status_code = 429


@dataclass(eq=False)
class CompileJob:
    """One compilation: its result arrives in ``future``; ``started_at`` is set when a thread takes it."""

    key: GrammarKey
    client: str
    future: Future[xgr.CompiledGrammar] = field(default_factory=Future)
    started_at: float | None = None


class CompilePool:
    """``threads`` compile threads; jobs queue per client, at most ``per_client`` unfinished each."""

    def __init__(self, compile_fn: CompileFn, threads: int, per_client: int, reserve_thread: bool) -> None:
        self.compile_fn = compile_fn
        self.threads = threads
        self.per_client = per_client
        # Most threads one client may occupy at once: all but one when others must never starve.
        self.client_threads = threads - 1 if reserve_thread and threads > 1 else threads
        self.queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()
        self.running: dict[str, int] = {}
        self.unfinished: dict[str, int] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.workers = [
            threading.Thread(target=self._work, name=f"radixrt-grammar-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self.workers:
            w.start()

    def submit(self, key: GrammarKey, client: str, exempt: bool = False) -> CompileJob:
        """Queue a compilation for ``client``; GrammarBusy when it already has ``per_client`` unfinished
        (unless ``exempt``: a recompilation for a request already admitted)."""
        with self.cond:
            if not exempt and self.unfinished.get(client, 0) >= self.per_client:
                raise GrammarBusy(
                    f"too many grammar compilations in flight for client {client!r} "
                    f"({self.per_client} allowed); retry later"
                )
            job = CompileJob(key, client)
            self.unfinished[client] = self.unfinished.get(client, 0) + 1
            self.queues.setdefault(client, deque()).append(job)
            self.cond.notify()
            return job

    def in_flight(self, client: str) -> int:
        """The client's unfinished compilations (queued, running, or abandoned but still running)."""
        with self.cond:
            return self.unfinished.get(client, 0)

    def _next_job(self) -> CompileJob | None:
        """The next job, round-robin over clients with room for one more running job (lock held)."""
        for client, queue in self.queues.items():
            if queue and self.running.get(client, 0) < self.client_threads:
                job = queue.popleft()
                self.queues.move_to_end(client)
                if not queue:
                    del self.queues[client]
                self.running[client] = self.running.get(client, 0) + 1
                return job
        return None

    def _work(self) -> None:
        while True:
            with self.cond:
                job = self._next_job()
                while job is None and not self.stopped:
                    self.cond.wait()
                    job = self._next_job()
                if job is None:
                    return
                job.started_at = time.monotonic()
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self.compile_fn(job.key))
                except Exception as exc:  # delivered to the requests through the future
                    job.future.set_exception(exc)
            with self.cond:
                self.running[job.client] -= 1
                self.unfinished[job.client] -= 1
                self.cond.notify_all()

    def shutdown(self) -> None:
        """Stop taking jobs; queued ones are cancelled, running ones finish in their daemon threads."""
        with self.cond:
            self.stopped = True
            for queue in self.queues.values():
                for job in queue:
                    job.future.cancel()
            self.queues.clear()
            self.cond.notify_all()
