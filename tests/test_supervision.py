"""Worker supervision: a killed worker fails its requests at once and is restarted, one that keeps dying
is given up on (exit code 1); the API key stays off the worker's command line and environment; socket
directories of dead servers are removed; liveness (/metrics, /health_generate) holds while steps are slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, pid_alive, wait_idle, wait_until

from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.launch_server import resolve_api_key
from radixrt.transport.zmq_client import remove_stale_ipc_dirs

pytest_plugins = ["server_fixtures"]

KEY = "sk-supervision-secret-4711"
GREEDY = {"text": "the same prompt", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def metric(text: str, name: str) -> float:
    """The value of the one series ``name`` in a Prometheus exposition."""
    (value,) = [ln.rsplit(" ", 1)[1] for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(value)


def assert_no_key(pid: int) -> None:
    assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes()


def test_kill_restart_then_give_up(server_model: Path, tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXRT_API_KEY", KEY)  # the key from the environment, not --api-key
        flags = ["--max-total-tokens", "8192", "--disable-compile", "--max-worker-restarts", "2"]
        srv = ServerProcess(server_model, tmp_path / "server.log", flags, None, cli=False)
    srv.api_key = KEY
    try:
        srv.wait_ready()
        assert httpx.post(srv.url + "/generate", json=GREEDY).status_code == 401
        worker = srv.info["worker_pid"]
        assert KEY.encode() not in Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes()
        assert_no_key(worker)
        old_ipc = Path(srv.info["ipc_dir"])
        with srv.client() as c:
            before = c.post("/generate", json=GREEDY).json()["output_ids"]
            result: dict[str, Any] = {}
            body = {"text": "long", "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
            t = threading.Thread(target=lambda: result.update(r=c.post("/generate", json=body)))
            t.start()
            wait_until(lambda: c.get("/server_info").json()["num_running_reqs"] == 1, timeout=10)
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            t.join(10)
            failed_after = time.monotonic() - killed
            r = result["r"]
            assert r.status_code == 503 and failed_after < 2, (r.status_code, failed_after)
            error = r.json()["error"]
            assert error["code"] == "worker_unavailable"
            assert "exited" in error["message"] and "restarting" in error["message"], error
            assert c.get("/health").json() == {"status": "restarting"}
            wait_until(lambda: c.get("/health").status_code == 200, timeout=90)
            info = c.get("/server_info").json()
            new = info["worker_pid"]
            assert new != worker and pid_alive(new) and info["worker_restarts"] == 1
            assert not old_ipc.exists() and Path(info["ipc_dir"]).is_dir()
            assert_no_key(new)
            assert c.post("/generate", json=GREEDY).json()["output_ids"] == before  # same greedy output
            wait_idle(c)
            assert metric(c.get("/metrics").text, "radixrt:worker_restarts_total") == 1.0
        log = srv.log.read_text()
        assert "restarting the worker in 1s (restart 1 of at most 2" in log
        # a death under a flood of concurrent requests: each gets an answer (never a hang), the HTTP
        # process survives sends racing the death (a PUSH socket without a peer used to block the event
        # loop forever) and the worker comes back
        statuses: list[int] = []
        stop = threading.Event()

        def flood() -> None:
            with srv.client(timeout=30) as fc:
                while not stop.is_set():
                    body = {"text": "flood", "sampling_params": {"max_new_tokens": 4}}
                    statuses.append(fc.post("/generate", json=body).status_code)

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for th in threads:
            th.start()
        wait_until(lambda: len(statuses) >= 16, timeout=30)
        os.kill(new, signal.SIGKILL)
        with srv.client() as c:
            wait_until(lambda: c.get("/health").status_code == 503, timeout=10)
            wait_until(lambda: c.get("/health").status_code == 200, timeout=90)
            stop.set()
            for th in threads:
                th.join(40)
            assert not any(th.is_alive() for th in threads), "a request hung"
            assert set(statuses) <= {200, 503} and 503 in statuses and statuses[-1] == 200, set(statuses)
            info = c.get("/server_info").json()
            assert info["worker_restarts"] == 2
            wait_idle(c)
            new = info["worker_pid"]
        # the third death is one beyond --max-worker-restarts 2: the server gives up, exit code 1
        new_ipc = Path(info["ipc_dir"])
        os.kill(new, signal.SIGKILL)
        assert srv.proc.wait(30) == 1
        log = srv.log.read_text()
        assert "giving up on the worker" in log and "exiting with code 1" in log
        assert not new_ipc.exists()
    finally:
        srv.stop()


def test_stale_socket_dirs(tmp_path: Path) -> None:
    """A server killed by SIGKILL leaves its socket dir; only dirs whose owner is gone are removed."""
    code = "from radixrt.transport.zmq_client import make_ipc_dir; import time; print(make_ipc_dir(), flush=True); time.sleep(60)"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    stale = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.wait()
    assert stale.parent == tmp_path and stale.is_dir()
    live = Path(tempfile.mkdtemp(prefix=f"radixrt-{os.getpid()}-", dir=tmp_path))
    foreign = tmp_path / "radixrt-abc"
    foreign.mkdir()
    assert remove_stale_ipc_dirs(str(tmp_path)) == [stale]
    assert not stale.exists() and live.is_dir() and foreign.is_dir()


def test_liveness_during_slow_steps(launch_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """Steps of 3 s (test hook), one running request at a time: stats answer within 0.5 s from the last
    snapshot, /health_generate is 200 from the busy request's progress although its ping cannot start."""
    stale = Path(tempfile.gettempdir()) / f"radixrt-{dead_pid()}-left-by-a-killed-server"
    stale.mkdir()
    delay = tmp_path / "step_delay"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXRT_TEST_STEP_DELAY_FILE", str(delay))
        srv = launch_server("--max-total-tokens", "8192", "--disable-compile", "--max-running-requests", "1")
    # NOTE: not the log line: any radixrt server starting meanwhile on this machine may remove it first
    assert not stale.exists()
    delay.write_text("3")
    body = {"text": "slow", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "stream": True}
    with srv.client() as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()  # NOTE: keep a reference: a collected iterator closes the stream
        next(ln for ln in lines if ln.startswith("data:"))
        for _ in range(3):
            start = time.monotonic()
            text = c.get("/metrics").text
            assert time.monotonic() - start < 1.5
            assert metric(text, "radixrt:worker_up") == 1.0
        info = c.get("/server_info").json()
        assert info["idle"] == 0.0 and info["num_running_reqs"] == 1 and "stats_age_s" in info
        start = time.monotonic()
        h = c.get("/health_generate")
        assert h.status_code == 200 and h.json() == {"status": "ok", "output_ids": None}
        assert time.monotonic() - start < 8
        delay.write_text("0")
    with srv.client() as c:
        wait_idle(c, timeout=15)
        assert c.get("/health_generate").json()["output_ids"] is not None  # idle: the ping itself answers


def test_api_key_sources(tmp_path: Path) -> None:
    """--api-key-file, else $RADIXRT_API_KEY when no --api-key; a bad file is an error naming the flag."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    args = ServerArgs(api_key_file=str(key_file))
    resolve_api_key(args, {"RADIXRT_API_KEY": "from-env"})
    assert args.api_key == KEY
    args = ServerArgs()
    resolve_api_key(args, {"RADIXRT_API_KEY": "from-env"})
    assert args.api_key == "from-env"
    args = ServerArgs(api_key="from-flag")
    resolve_api_key(args, {"RADIXRT_API_KEY": "from-env"})
    assert args.api_key == "from-flag"
    with pytest.raises(ValueError, match="api_key_file: give --api-key or --api-key-file"):
        resolve_api_key(ServerArgs(api_key="k", api_key_file=str(key_file)), {})
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        resolve_api_key(ServerArgs(api_key_file=str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(ServerArgs(api_key_file=str(tmp_path / "empty")), {})
