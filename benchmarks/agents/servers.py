"""Server processes for the suite: start a command on a free port, wait until a URL answers, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            if p == pid:
                return None
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``cmd`` (stdout and stderr to ``log``) until ``stop``; ``ready`` is polled until it answers 200."""

    def __init__(self, cmd: list[str], log: Path, ready: str, env: dict[str, str] | None = None,
                 timeout: float = 300.0) -> None:  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._out.close()
                raise RuntimeError(f"{cmd[:4]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(ready, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{cmd[:4]} not ready within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
