"""An earlier radixrt as a benchmark mode: its HTTP server, started from another source tree, behind the few
`Engine` methods the speculative benchmarks call (``generate``, ``get_server_info``, ``shutdown``).

``benchmarks.spec_react --baseline DIR`` runs the tree in DIR (``git archive <commit> | tar -x -C DIR``) next
to this one's engines, modes interleaved, so that before and after are measured under the same load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd import free_port, stop, wait_http


class BaselineServer:
    """``python -m radixrt.entrypoints.launch_server`` from ``tree`` with ``flags``, on a free local port."""

    def __init__(self, tree: Path, flags: list[str]) -> None:
        self.tree, self.flags = tree, flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start()

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--port", str(port), *self.flags]
        self.proc = subprocess.Popen(
            cmd, cwd=self.tree, env=env, stdout=subprocess.DEVNULL, start_new_session=True
        )
        wait_http(self.url + "/health", timeout=600)

    def restart(self) -> None:
        """A fresh server: empties what it learned (SUFFIX's global index) and its cache."""
        self.shutdown()
        self.start()

    def generate(self, prompt: list[str], sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        r = httpx.post(
            self.url + "/generate", json={"text": prompt, "sampling_params": sampling_params}, timeout=3600
        )
        r.raise_for_status()
        out: list[dict[str, Any]] = r.json()
        return out

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(self.url + "/get_server_info", timeout=60).json()
        return info

    def shutdown(self) -> None:
        """Stop the server and its processes (its own session: SIGTERM to the group, SIGKILL after 30 s)."""
        if self.proc is not None:
            stop([self.proc])
        self.proc = None
