"""A benchmark peer run in a child process of its own, driven over a pipe.

Why: llama-cpp-python's ggml and torch both run their thread teams on libgomp. In one process libgomp counts
both teams' threads, finds more of them than CPUs and drops to its throttled spin-wait, so every parallel
region of either side waits on futex wake-ups: on the 2-core AVX2 machine of 2026-12-06 that roughly halved
radixrt's decode while llama.cpp was loaded beside it. In its own process each runtime keeps its normal spin,
and the pause between systems (``cpu_peers.SETTLE_S``) lets the idle side's threads go to sleep, as two
separate programs on one machine would.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
from collections.abc import Callable
from typing import Any

__all__ = ["ProcessPeer"]


def _serve(conn: mpc.Connection, make: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The child: build the peer, then answer ``(method, args)`` messages until ``close``."""
    try:
        peer = make(*args)
    except Exception as exc:  # reported to the parent, which raises it as a RuntimeError
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", (peer.name, peer.max_batch)))
    while True:
        method, margs = conn.recv()
        try:
            result = getattr(peer, method)(*margs)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
        if method == "close":
            return


class ProcessPeer:
    """``make(*args)`` built and run in a spawned child process; ``run`` / ``flush`` / ``close`` are
    forwarded to it and its errors come back as ``RuntimeError``. ``make`` must be importable by name
    (a module-level class or function)."""

    def __init__(self, make: Callable[..., Any], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, make, args), daemon=True)
        self._proc.start()
        child.close()
        self.name, self.max_batch = self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"the peer's process ended (exit code {self._proc.exitcode})") from exc
        if status == "error":
            raise RuntimeError(value)
        return value

    def _call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._reply()

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        return float(self._call("run", prompts, new_tokens))

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        if self._proc.is_alive():
            self._call("close")
        self._proc.join(timeout=30)
