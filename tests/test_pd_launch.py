"""``radixrt serve --pd``: one command starts a prefill server, a decode server and sglang-router in PD mode;
a request through it is served by the pair (the decode server received the prompt's KV); SIGTERM stops all
three with exit code 0."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import free_port

pytest_plugins = ["server_fixtures"]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)


def free_run(n: int) -> int:
    """A port with the ``n - 1`` after it free too."""
    for _ in range(50):
        base = free_port()
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no run of free ports")


def test_serve_pd_starts_and_stops_the_three(server_model: Path, tmp_path: Path) -> None:
    port, boot = free_run(4), free_port()
    cmd = [sys.executable, "-m", "radixrt.entrypoints.cli", "serve", "--pd", "--model-path", str(server_model),
           "--port", str(port), "--dtype", "float32", "--max-total-tokens", "4096", "--disable-compile",
           "--disaggregation-transfer-backend", "fake", "--disaggregation-bootstrap-port", str(boot)]  # fmt: skip
    log = (tmp_path / "pd.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "pd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "pd.log").read_text()[-3000:]
            try:
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        body = {
            "text": "one command, three processes",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        }
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 5
        decode = httpx.get(f"http://127.0.0.1:{port + 2}/get_server_info", timeout=10).json()
        assert decode["pd_received_transfers"] >= 1
        prefill = httpx.get(f"http://127.0.0.1:{port + 1}/get_server_info", timeout=10).json()
        assert prefill["pd_sent_transfers"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        log.close()
    assert code == 0
    for p in (port, port + 1, port + 2):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
