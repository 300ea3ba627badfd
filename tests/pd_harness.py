"""A prefill server, a decode server and sglang-router in PD mode in front of them (tests/test_pd_*.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from server_harness import ServerProcess, free_port

ROUTER_START_TIMEOUT_S = 90.0
PD_TIMEOUT_S = 4.0  # --disaggregation-timeout of the test servers: the fault tests wait this long
SMALL = ["--max-total-tokens", "4096", "--disable-compile", "--disaggregation-timeout", str(PD_TIMEOUT_S)]


def pd_flags(mode: str, backend: str, bootstrap_port: int) -> list[str]:
    """The flags of one side (the bootstrap port matters to the prefill side only)."""
    return [*SMALL, "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(bootstrap_port)]  # fmt: skip


class PDPair:
    """One prefill and one decode server on free ports (started together)."""

    def __init__(self, model: Path, logs: Path, backend: str) -> None:
        self.bootstrap_port = free_port()
        self.prefill = ServerProcess(
            model, logs / "prefill.log", pd_flags("prefill", backend, self.bootstrap_port), None, False
        )
        self.decode = ServerProcess(
            model, logs / "decode.log", pd_flags("decode", backend, free_port()), None, False
        )
        try:
            for p in (self.prefill, self.decode):
                p.wait_ready()
        except BaseException:
            self.stop()  # the fixture's teardown never runs when its setup raises
            raise

    def boot(self, room: int) -> dict[str, Any]:
        """The fields the router adds to a request."""
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}

    def stop(self) -> None:
        for p in (self.prefill, self.decode):
            p.stop()


class PDRouter:
    """``sglang_router.launch_router --pd-disaggregation --prefill URL PORT --decode URL``."""

    def __init__(self, pair: PDPair, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", pair.prefill.url, str(pair.bootstrap_port), "--decode", pair.decode.url,
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1"]  # fmt: skip
        self._log = log.open("wb")
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while not self.ready():
            assert time.monotonic() < deadline, "router not up:\n" + log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        try:
            workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w["is_healthy"] for w in workers)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stats(server: ServerProcess) -> dict[str, float]:
    """The worker's counters (``/get_server_info``)."""
    out: dict[str, float] = httpx.get(server.url + "/get_server_info", timeout=10).json()
    return out
