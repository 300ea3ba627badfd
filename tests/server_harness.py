"""Server processes for the tests: launch ``python -m radixrt.entrypoints.launch_server`` on a free port, wait
until /health answers, stop it with a signal; plus the idle / KV-invariant check over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 120.0
REPO = Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond()`` held; fails after ``timeout``."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A launched server: its URL, process, log file; ``stop`` sends a signal and waits."""

    def __init__(self, model: Path, log: Path, extra: list[str], api_key: str | None, cli: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        entry = (
            ["-m", "radixrt.entrypoints.cli", "serve"] if cli else ["-m", "radixrt.entrypoints.launch_server"]
        )
        cmd = [sys.executable, *entry, "--model-path", str(model), "--port", str(self.port), *extra]
        if "--dtype" not in extra:
            cmd += ["--dtype", "float32"]  # the HF-parity oracles are exact in fp32 (auto picks bf16 here)
        if "--disable-compile" not in extra and "--compile-max-bs" not in extra:
            cmd += ["--compile-max-bs", "2"]  # compiled decode for batches of 1-2, eager above: both paths
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.info: dict[str, Any] = {}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60.0), **kw)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    with self.client() as c:
                        self.info = c.get("/get_server_info").json()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready within {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig``, wait for the exit code (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return int(self.proc.returncode)


def wait_idle(c: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /get_server_info until the worker is idle; assert the KV accounting invariant then."""
    deadline = time.monotonic() + timeout
    while True:
        info: dict[str, Any] = c.get("/get_server_info").json()
        if (info["idle"] == 1.0 and info["num_http_requests_in_flight"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["idle"] == 1.0, (
        f"worker still busy: {info['num_running_reqs']} running, {info['num_queue_reqs']} queued"
    )
    assert info["kv_invariant_ok"] == 1.0, info["kv_invariant_message"]
    assert info["kv_used_tokens"] == 0 and info["num_http_requests_in_flight"] == 0
    return info
