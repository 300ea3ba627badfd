"""``radixrt serve`` with tensor parallelism over two "nodes" on this machine: node 1 (``--node-rank 1``)
runs only its follower rank, in the foreground, no HTTP; node 0 serves; greedy ids over HTTP equal HF's;
stopping node 0 stops node 1. And the launch combinations that cannot work are clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import REPO, ServerProcess, free_port

from radixrt.config.server_args import ServerArgs
from radixrt.entrypoints.launch_server import check_launch_args, main
from radixrt.worker.tp_follower import start_until_stopped
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

NEW_TOKENS = 10


def _tp_flags(port: int, node_rank: int) -> list[str]:
    return ["--tp-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", f"127.0.0.1:{port}", "--disable-compile", "--dtype", "float32",
            "--max-total-tokens", "2048"]  # fmt: skip


def _start_node(model: Path, log: Path, port: int, node_rank: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "radixrt.entrypoints.cli", "serve", "--model-path", str(model)]
    cmd += _tp_flags(port, node_rank)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def _ranks(pid: int) -> list[int]:
    """The follower processes under ``pid`` (multiprocessing's resource tracker left out)."""
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    except FileNotFoundError:
        return []


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        tail = log.read_text(errors="replace")[-3000:]
        raise AssertionError(f"did not exit within {timeout}s:\n{tail}") from None


def test_two_nodes_serve_hf_greedy_and_stop_together(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    node1_log = tmp_path / "node1.log"
    node1 = _start_node(tiny_llama, node1_log, port, node_rank=1)
    node0 = ServerProcess(tiny_llama, tmp_path / "node0.log", _tp_flags(port, 0), None, cli=True)
    try:
        node0.wait_ready()
        assert node1.poll() is None, node1_log.read_text(errors="replace")
        followers = _ranks(node1.pid)
        assert len(followers) == 1  # rank 1, the only rank node 1 hosts
        ids = prompts_of([23], seed=11)[0]
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                      "ignore_eos": True}}  # fmt: skip
        r = httpx.post(node0.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(tiny_llama, ids, NEW_TOKENS)
        info = httpx.get(node0.url + "/get_server_info", timeout=10).json()
        assert info["tp_size"] == 2 and info["kv_invariant_ok"] == 1.0
    finally:
        code0 = node0.stop(signal.SIGTERM)
        code1 = _wait_exit(node1, 30, node1_log)  # rank 0 told its followers to stop
    text1 = node1_log.read_text(errors="replace")
    assert code0 == 0, node0.log_tail()
    assert code1 == 0, text1[-3000:]
    assert "node 1 of 2: tensor-parallel ranks [1] of 2, rank 0 at 127.0.0.1:" in text1
    assert "ready" not in text1 and "uvicorn" not in text1.lower()  # node 1 never served HTTP
    assert not [pid for pid in followers if os.path.exists(f"/proc/{pid}")]


def test_follower_node_stops_on_sigterm(tiny_llama: Path, tmp_path: Path) -> None:
    """Node 1 waiting for a rank 0 that never comes: SIGTERM ends it and its rank, exit code 0."""
    log = tmp_path / "node1.log"
    node1 = _start_node(tiny_llama, log, free_port(), node_rank=1)
    deadline = time.monotonic() + 30
    while not _ranks(node1.pid):
        assert node1.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)
    followers = _ranks(node1.pid)
    node1.send_signal(signal.SIGTERM)
    assert _wait_exit(node1, 20, log) == 0
    time.sleep(0.2)
    assert not [pid for pid in followers if os.path.exists(f"/proc/{pid}")]


class _Rank:
    """A stand-in follower process whose ``start()`` is interrupted by a stop signal, the way a SIGTERM
    lands while multiprocessing still writes a spawned child's data: the handler sees no live process."""

    def __init__(self, stopped: threading.Event, signal_inside_start: bool) -> None:
        self.stopped, self.signal_inside_start = stopped, signal_inside_start
        self.started = self.terminated = False

    def start(self) -> None:
        if self.signal_inside_start:
            self.stopped.set()  # the handler runs here and finds nothing alive to terminate
        self.started = True

    def is_alive(self) -> bool:
        return self.started and not self.terminated

    def terminate(self) -> None:
        self.terminated = True


def test_stop_signal_inside_start_still_ends_the_rank() -> None:
    stopped = threading.Event()
    ranks = [_Rank(stopped, signal_inside_start=True), _Rank(stopped, signal_inside_start=False)]
    start_until_stopped(ranks, stopped)  # type: ignore[arg-type]
    assert ranks[0].terminated  # started, then ended by the check after start()
    assert not ranks[1].started  # never started once the stop arrived
    calm = threading.Event()
    both = [_Rank(calm, signal_inside_start=False) for _ in range(2)]
    start_until_stopped(both, calm)  # type: ignore[arg-type]
    assert all(r.started and not r.terminated for r in both)


def test_launch_combinations_that_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    shared = ServerArgs(dp_size=2, tp_size=2, dist_init_addr="127.0.0.1:29500")
    with pytest.raises(ValueError, match="dist_init_addr: --dp-size 2 with --tp-size 2 would give every"):
        check_launch_args(shared)
    with pytest.raises(ValueError, match="dist_init_addr: --nnodes > 1 needs --dist-init-addr"):
        check_launch_args(ServerArgs(tp_size=2, nnodes=2, node_rank=1))
    check_launch_args(ServerArgs(dp_size=2, tp_size=2))  # each server picks its own rendezvous port
    check_launch_args(ServerArgs(tp_size=2, dist_init_addr="127.0.0.1:29500"))
    # the command line reports it as a usage error, before anything starts
    with pytest.raises(SystemExit) as exc:
        main(["--dp-size", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:29500"])
    assert exc.value.code == 2
    assert "dist_init_addr" in capsys.readouterr().err
