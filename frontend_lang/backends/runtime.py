"""Runtime: launch ``python -m radixrt.entrypoints.launch_server`` as a subprocess and talk to it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

from frontend_lang.backends.runtime_endpoint import RuntimeEndpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env() -> dict[str, str]:
    """This environment, with the directory holding the ``radixrt`` package importable (a checkout
    that is not installed still launches)."""
    import radixrt

    root = str(Path(radixrt.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def server_command(model_path: str | None, host: str, port: int, server_args: dict[str, Any]) -> list[str]:
    """The launch command: every keyword becomes ``--flag-name value`` (True: bare flag; False/None:
    omitted), as ``radixrt.config.server_args`` defines the flags."""
    cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--host", host, "--port", str(port)]
    if model_path is not None:
        cmd += ["--model-path", str(model_path)]
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not None and value is not False:
            cmd += [flag, str(value)]
    return cmd


class Runtime:
    """A server subprocess for this program: ``Runtime(model_path=..., max_total_tokens=...)``.

    Use it as a backend (``set_default_backend(runtime)``; calls go to ``runtime.endpoint``) and call
    ``shutdown()`` (or use ``with``) when done. The server's output goes to ``log_file`` (a temporary
    file by default; ``log_path`` tells where). ``retention`` is the endpoint's (program-aware
    retention hints, on by default).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_file: str | Path | None = None,
        startup_timeout: float = 300.0,
        chat_template: str | None = None,
        retention: bool = True,
        **server_args: Any,
    ) -> None:
        self.port = port or _free_port()
        self.url = f"http://{host}:{self.port}"
        self.api_key: str | None = server_args.get("api_key")
        if log_file is None:
            fd, name = tempfile.mkstemp(prefix="radixrt-server-", suffix=".log")
            os.close(fd)
            log_file = name
        self.log_path = Path(log_file)
        self._log: IO[bytes] = self.log_path.open("wb")
        cmd = server_command(model_path, host, self.port, server_args)
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=_server_env())
        try:
            self._wait_ready(startup_timeout)
            self.endpoint = RuntimeEndpoint(
                self.url, self.api_key, chat_template=chat_template, retention=retention
            )
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def shutdown(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s)."""
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.shutdown()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
