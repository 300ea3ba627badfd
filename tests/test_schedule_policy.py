"""Schedule policies against hand-built trees; the Engine fails (never hangs) when its scheduler dies."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.sampling.sampling_params import SamplingParams
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.protocol import TokenizedGenerateReq
from radixrt.worker.req import Req
from radixrt.worker.schedule_policy import order_waiting, shared_uncached_prefix
from tests.engine_fixtures import make_engine


def req(rid: str, ids: list[int], arrival: int) -> Req:
    msg = TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=SamplingParams(), seed=0)
    return Req(msg, arrival)


@pytest.fixture
def tree() -> RadixCache:
    alloc = TokenSlotAllocator(1024)
    t = RadixCache(alloc)
    hot = list(range(100, 140))
    slots = alloc.alloc(len(hot))
    assert slots is not None
    t.insert(hot, slots)
    return t


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cached_requests_go_first(tree: RadixCache, policy: str) -> None:
    cold = req("cold", [1, 2, 3, 4, 5], 0)
    hot_a = req("hot-a", list(range(100, 140)) + [7, 8], 1)
    hot_b = req("hot-b", list(range(100, 130)) + [9], 2)
    order = [r.rid for r in order_waiting([cold, hot_a, hot_b], policy, tree)]
    assert order[-1] == "cold"
    if policy == "lpm":
        assert order == ["hot-a", "hot-b", "cold"]
    assert hot_a.prefix_probe_len == 40 and hot_b.prefix_probe_len == 30


def test_fcfs_keeps_arrival_order(tree: RadixCache) -> None:
    reqs = [req("c", [1, 2], 2), req("a", list(range(100, 140)) + [1], 0), req("b", [5], 1)]
    assert [r.rid for r in order_waiting(reqs, "fcfs", tree)] == ["a", "b", "c"]


def test_shared_uncached_prefix() -> None:
    a = req("a", [1, 2, 3, 4, 5, 6], 0)
    b = req("b", [1, 2, 3, 4, 9], 1)
    c = req("c", [7, 8], 2)
    assert shared_uncached_prefix(b, [a, c], cached_len=0) == 4
    assert shared_uncached_prefix(b, [a, c], cached_len=2) == 2
    assert shared_uncached_prefix(c, [a, b], cached_len=0) == 0
    # only what d may take from the cache counts: its last token is always computed
    d = req("d", [1, 2, 3], 3)
    assert shared_uncached_prefix(d, [a], cached_len=0) == 2
    assert shared_uncached_prefix(d, [a], cached_len=2) == 0


def test_engine_fails_requests_when_the_scheduler_dies(tiny_llama: Path) -> None:
    eng = make_engine(tiny_llama)
    try:

        def boom() -> None:
            raise RuntimeError("injected failure")

        eng.worker.scheduler._run_decode = boom  # type: ignore[method-assign]
        result: list[object] = []

        def run() -> None:
            try:
                result.append(eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4}))
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
                result.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=30)
        assert result, "generate hung after the scheduler died"
        out = result[0]
        if isinstance(out, dict):  # finished in the worker's last breath: aborted with the cause
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert "injected failure" in out["meta_info"]["finish_reason"]["message"]
        else:
            assert isinstance(out, WorkerDeadError), out
        with pytest.raises(WorkerDeadError):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    finally:
        eng.shutdown()
