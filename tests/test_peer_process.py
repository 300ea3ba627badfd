"""benchmarks.peer_process: a peer built and run in a child process, its results and errors forwarded."""

from __future__ import annotations

import os

import pytest

from benchmarks.peer_process import ProcessPeer


class FakePeer:
    """Answers ``run`` with the pid of the process it runs in; fails on request."""

    max_batch = 1

    def __init__(self, name: str, fail: bool = False) -> None:
        if fail:
            raise ValueError("cannot load the file")
        self.name = name
        self.flushed = 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        if new_tokens < 0:
            raise ValueError("new_tokens must be >= 0")
        return float(os.getpid() + self.flushed)

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        """Nothing to free."""


def test_runs_in_another_process_and_forwards_calls() -> None:
    peer = ProcessPeer(FakePeer, "fake")
    try:
        assert (peer.name, peer.max_batch) == ("fake", 1)
        pid = peer.run([[1, 2]], 3)
        assert pid != os.getpid()
        peer.flush()
        assert peer.run([[1]], 1) == pid + 1  # the same child, its state kept
        with pytest.raises(RuntimeError, match="new_tokens must be >= 0"):
            peer.run([[1]], -1)
        assert peer.run([[1]], 1) == pid + 1  # an error does not end the child
    finally:
        peer.close()
    assert not peer._proc.is_alive()


def test_a_failed_build_raises() -> None:
    with pytest.raises(RuntimeError, match="ValueError: cannot load the file"):
        ProcessPeer(FakePeer, "fake", True)
