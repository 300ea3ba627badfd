"""SIGTERM drains: new requests get a JSON 503, running ones get --graceful-shutdown-timeout seconds to
finish, the rest end with a JSON 503 (non-stream) or an SSE error event and [DONE] (stream); the process
exits 0 without a traceback and removes its sockets."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, pid_alive, wait_until

pytest_plugins = ["server_fixtures"]


class Clients:
    """One non-streamed and one streamed /generate of ``n`` tokens, each on a thread of its own."""

    def __init__(self, srv: ServerProcess, n: int) -> None:
        self.srv = srv
        self.plain: httpx.Response | None = None
        self.events: list[str] = []
        body = {"text": "drain me", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        self.threads = [
            threading.Thread(target=self._plain, args=(body,)),
            threading.Thread(target=self._stream, args=({**body, "stream": True},)),
        ]
        for t in self.threads:
            t.start()

    def _plain(self, body: dict[str, Any]) -> None:
        self.plain = httpx.post(self.srv.url + "/generate", json=body, timeout=60)

    def _stream(self, body: dict[str, Any]) -> None:
        with httpx.stream("POST", self.srv.url + "/generate", json=body, timeout=60) as r:
            self.events = [ln for ln in r.iter_lines() if ln.startswith("data:")]

    def join(self) -> None:
        for t in self.threads:
            t.join(60)
            assert not t.is_alive()


def start_draining(srv: ServerProcess, n: int) -> tuple[Clients, dict[str, Any]]:
    """Two requests running, then SIGTERM; returns them and the answer to a request sent while draining."""
    with srv.client() as c:
        info = c.get("/server_info").json()
        clients = Clients(srv, n)
        wait_until(lambda: c.get("/server_info").json()["num_running_reqs"] == 2, timeout=20)
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: c.get("/health").json() == {"status": "draining"}, timeout=5)
        late = c.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}})
        assert late.status_code == 503
        info["late"] = late.json()
    return clients, info


def assert_clean_exit(srv: ServerProcess, info: dict[str, Any]) -> None:
    assert srv.stop(timeout=30) == 0
    log = srv.log.read_text()
    assert "Traceback" not in log and "aclose()" not in log, srv.log_tail(80)
    assert not Path(info["ipc_dir"]).exists()
    wait_until(lambda: not pid_alive(info["worker_pid"]), timeout=5)


@pytest.fixture
def slow_steps(tmp_path: Path) -> Path:
    """The step-delay test hook's file (the worker sleeps this many seconds per busy step)."""
    path = tmp_path / "step_delay"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXRT_TEST_STEP_DELAY_FILE", str(path))
        yield path


def test_sigterm_ends_what_outlives_the_timeout(
    launch_server: Callable[..., ServerProcess], slow_steps: Path
) -> None:
    srv = launch_server("--max-total-tokens", "8192", "--disable-compile", "--graceful-shutdown-timeout", "1")
    slow_steps.write_text("0.05")  # 1000 tokens: about 50 s, far beyond the 1 s drain
    clients, info = start_draining(srv, 1000)
    assert info["late"]["error"]["code"] == "server_shutting_down"
    clients.join()
    assert clients.plain is not None and clients.plain.status_code == 503
    assert clients.plain.headers["content-type"] == "application/json"
    error = clients.plain.json()["error"]
    assert (
        error["code"] == "server_shutting_down"
        and "not finished within --graceful-shutdown-timeout 1s" in error["message"]
    )
    assert clients.events[-1] == "data: [DONE]"
    last = json.loads(clients.events[-2][len("data: ") :])
    assert last["error"]["code"] == "server_shutting_down", last
    assert len(clients.events) > 3  # tokens were streamed before the error
    assert_clean_exit(srv, info)


def test_sigterm_lets_running_requests_finish(
    launch_server: Callable[..., ServerProcess], slow_steps: Path
) -> None:
    srv = launch_server(
        "--max-total-tokens", "8192", "--disable-compile", "--graceful-shutdown-timeout", "30"
    )
    slow_steps.write_text("0.05")  # 40 tokens: about 2 s
    clients, info = start_draining(srv, 40)
    assert info["late"]["error"]["code"] == "server_shutting_down"
    clients.join()
    assert clients.plain is not None and clients.plain.status_code == 200
    assert clients.plain.json()["meta_info"]["completion_tokens"] == 40
    assert clients.events[-1] == "data: [DONE]"
    last = json.loads(clients.events[-2][len("data: ") :])
    assert (
        last["meta_info"]["completion_tokens"] == 40
        and last["meta_info"]["finish_reason"]["type"] == "length"
    )
    assert_clean_exit(srv, info)
