"""The real sglang-router (0.3.2) in front of radixrt servers: it discovers them through SGLang's worker
routes, serves /generate and the OpenAI routes through them, keeps a conversation on the worker that
caches it (``cache_aware``), drops a killed worker; and ``radixrt serve --dp-size 2`` launches all of
it in one command and stops it as one."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, free_port, wait_idle

from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.data_parallel import dp_server_flags

pytest_plugins = ["server_fixtures"]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)

ROUTER_START_TIMEOUT_S = 60.0
# The private servers decode eagerly: the shared server runs the compiled decode, and compiling here
# would double these servers' start on two cores.
EAGER_SMALL = ["--max-total-tokens", "4096", "--disable-compile"]
SYSTEM = "You are a helpful assistant who explains radix trees, prefix caches and eviction in detail. " * 3


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached within {timeout}s: {what}"
        time.sleep(0.1)


class RouterProcess:
    """``python -m sglang_router.launch_router`` on free ports, health-checking its workers every second."""

    def __init__(self, worker_urls: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
               "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1"]  # fmt: skip
        self._log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log
        wait_until(lambda: self.healthy_workers() == set(worker_urls), ROUTER_START_TIMEOUT_S, "router up")

    def healthy_workers(self) -> set[str]:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        try:
            workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["url"] for w in workers if w["is_healthy"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def workers(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Two private servers (started together); a test below kills one."""
    logs = tmp_path_factory.mktemp("router_workers")
    procs = [ServerProcess(server_model, logs / f"w{i}.log", EAGER_SMALL, None, False) for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def router(workers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    r = RouterProcess([w.url for w in workers], tmp_path_factory.mktemp("router") / "router.log")
    yield r
    r.stop()


def served(workers: list[ServerProcess]) -> list[float]:
    """Requests each worker has received (its own counter)."""
    return [httpx.get(w.url + "/get_server_info").json()["num_requests"] for w in workers]


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_router_serves_through_radixrt_workers(router: RouterProcess, workers: list[ServerProcess]) -> None:
    """The router's own /generate and chat bodies (it adds ``model``, ``return_hidden_states``, ...)
    answer exactly as a worker asked directly does (greedy; same weights)."""
    gen = {"text": "The radix tree keeps", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    direct = httpx.post(workers[0].url + "/generate", json=gen).json()
    routed = httpx.post(router.url + "/generate", json=gen, timeout=60)
    assert routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == direct["output_ids"]
    with httpx.stream("POST", router.url + "/generate", json={**gen, "stream": True}, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and '"completion_tokens":6' in events[-2]
    messages = [{"role": "user", "content": "What is a radix tree?"}]
    assert chat(router.url, messages)["choices"][0] == chat(workers[1].url, messages)["choices"][0]
    comp = {"model": "tiny", "prompt": "The radix tree keeps", "max_tokens": 4, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=comp, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    # the router read each worker's /get_load (load -1 when it cannot)
    loads = httpx.get(router.url + "/get_loads").json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(w.url for w in workers)
    assert all(w["load"] >= 0 for w in loads), loads
    # and labelled each from /server_info and /model_info
    listed = httpx.get(router.url + "/workers").json()["workers"]
    assert {w["metadata"]["model_type"] for w in listed} == {"llama"}


def test_conversation_sticks_to_its_worker_then_survives_it(
    router: RouterProcess, workers: list[ServerProcess]
) -> None:
    """cache_aware: both turns of a conversation land on one worker, whose cache then holds the second
    turn's prefix. Then that worker is killed: the router marks it unhealthy and its traffic, the
    conversation's next turn included, goes to the other one."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain LRU eviction."}]
    before = served(workers)
    first = chat(router.url, messages)
    middle = served(workers)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And how does it compare with LFU?"}]  # fmt: skip
    second = chat(router.url, messages)
    after = served(workers)
    turn1 = [m - b for m, b in zip(middle, before, strict=True)]
    turn2 = [a - m for a, m in zip(after, middle, strict=True)]
    assert sorted(turn1) == [0, 1] and turn2 == turn1, (turn1, turn2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 4
    # kill the worker holding the conversation
    doomed, survivor = workers[turn1.index(1)], workers[turn1.index(0)]
    doomed.stop(signal.SIGKILL)
    wait_until(lambda: router.healthy_workers() == {survivor.url}, 20, "the killed worker dropped")
    before_survivor = served([survivor])[0]
    messages += [{"role": "assistant", "content": second["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Thanks. Which one would you pick?"}]  # fmt: skip
    chat(router.url, messages)
    for i in range(3):
        body = {"text": f"prompt {i} after the failure", "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(router.url + "/generate", json=body, timeout=60).status_code == 200
    with survivor.client() as c:
        assert wait_idle(c)["num_requests"] == before_survivor + 4


def _dp_base_port(n: int) -> int:
    """A port p with p .. p + n free (n servers, then the router's metrics port)."""
    for _ in range(50):
        base = free_port()
        free = True
        for p in range(base, base + n + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    free = False
        if free:
            return base
    raise RuntimeError("no run of free ports")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _refused(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def _launch_dp(server_model: Path, log: Path, *extra: str) -> tuple[ServerProcess, list[int]]:
    base = _dp_base_port(2)
    flags = ["--dp-size", "2", "--router-dp-worker-base-port", str(base), *EAGER_SMALL, *extra]
    srv = ServerProcess(server_model, log, flags, None, cli=True)
    try:
        srv.wait_ready()
        wait_until(lambda: "ready: sglang-router" in log.read_text(errors="replace"), 30, "the ready line")
    except BaseException:
        srv.stop()
        raise
    return srv, [base, base + 1]


def test_dp_size_launch_serves_and_stops_on_sigterm(server_model: Path, tmp_path: Path) -> None:
    srv, ports = _launch_dp(server_model, tmp_path / "dp.log")
    ready = [line for line in srv.log.read_text().splitlines() if "ready: sglang-router" in line][0]
    assert f"ports {ports[0]}, {ports[1]}" in ready and f"http://127.0.0.1:{srv.port}" in ready
    try:
        for port in ports:  # each server answers on its own port, with the per-server KV budget
            info = httpx.get(f"http://127.0.0.1:{port}/get_server_info").json()
            assert info["max_total_tokens"] == 4096 and info["dp_size"] == 1
        gen = {"text": "The radix tree", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(srv.url + "/generate", json=gen, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        assert chat(srv.url, [{"role": "user", "content": "hi"}])["usage"]["completion_tokens"] == 6
        children = _children(srv.proc.pid)
        assert len(children) == 3  # two servers and the router
    finally:
        code = srv.stop(signal.SIGTERM)
    assert code == 0, srv.log_tail()
    assert all(_refused(p) for p in (srv.port, *ports))
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


def test_dp_size_launch_stops_all_when_one_server_dies(server_model: Path, tmp_path: Path) -> None:
    srv, ports = _launch_dp(server_model, tmp_path / "dp.log")
    try:
        servers = [
            pid
            for pid in _children(srv.proc.pid)
            if "radixrt.entrypoints.launch_server" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        assert len(servers) == 2
        os.kill(servers[0], signal.SIGKILL)
        srv.proc.wait(45)
    finally:
        code = srv.stop()
    assert code == 1, srv.log_tail()
    assert "exited with code -9; stopping the others" in srv.log.read_text()
    assert all(_refused(p) for p in (srv.port, *ports))


def test_dp_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="dp_size: must be >= 1"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="router_policy"):
        ServerArgs(router_policy="manual")
    flags = dp_server_flags(ServerArgs(dp_size=2, max_total_tokens=4096, disable_compile=True, port=1), 7)
    assert flags == ["--port", "7", "--max-total-tokens", "4096", "--disable-compile"]
