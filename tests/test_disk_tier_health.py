"""The disk tier when its storage directory is deleted under the running server (issue 26's probe).

Before: requests went on, every write failed (``disk_write_errors`` climbing), the directory stayed gone and
``/server_info`` kept reporting the vanished chunks, ``/health`` said nothing. Now the tier recreates the
directory and forgets the lost chunks; when it cannot (a file stands where the directory was) it is marked
failed: logged, ``disk_tier_failed`` in the stats and ``/metrics``, a warning in ``/health``.
Oracles: the files actually on disk (``check_integrity(files=True)``), the tier's counters, the HTTP answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_until

from radixrt import Engine
from radixrt.mem_cache.disk_store import DiskStore
from tests.engine_fixtures import prompts_of

pytest_plugins = ["server_fixtures"]

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def disk_of(eng: Engine) -> DiskStore:
    disk = eng.worker.scheduler.tree.disk
    assert disk is not None
    return disk


def generate_and_flush(eng: Engine, ids: list[int]) -> dict[str, Any]:
    """One request; its chunks written (or failed); the worker's stats after."""
    out = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    disk_of(eng).flush()
    return eng.get_server_info()


def test_a_deleted_storage_directory_is_recreated_and_the_counters_stay_true(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    store = tmp_path / "store"
    eng = engine_factory(tiny_llama, enable_hierarchical_cache=True, hicache_storage_dir=str(store))
    disk = disk_of(eng)
    first, second = prompts_of([200, 100], seed=41)
    info = generate_and_flush(eng, first)
    assert info["disk_chunks"] == 12 and info["disk_bytes"] > 0 and info["disk_write_errors"] == 0

    shutil.rmtree(store)
    info = eng.get_server_info()  # the stats see the directory gone: recreated, its chunks forgotten
    assert disk.dir.is_dir()
    assert info["disk_chunks"] == 0 and info["disk_bytes"] == 0
    assert info["disk_dir_recreations"] == 1 and info["disk_lost_chunks"] == 12
    assert info["disk_tier_failed"] == 0
    disk.check_integrity(files=True)

    info = generate_and_flush(eng, second)  # writes land in the new directory
    assert info["disk_chunks"] == 6 and info["disk_write_errors"] == 0
    assert info["disk_bytes"] == sum(p.stat().st_size for p in disk.dir.glob("*.safetensors"))
    disk.check_integrity(files=True)

    shutil.rmtree(store)  # deleted between two writes, no stats read in between: the writer recreates it
    info = generate_and_flush(eng, prompts_of([64], seed=42)[0])
    assert info["disk_chunks"] == 4 and info["disk_write_errors"] == 0 and info["disk_dir_recreations"] == 2
    disk.check_integrity(files=True)


def test_a_directory_that_cannot_be_recreated_marks_the_tier_failed_until_it_can(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    store = tmp_path / "store"
    eng = engine_factory(tiny_llama, enable_hierarchical_cache=True, hicache_storage_dir=str(store))
    first, second, third = prompts_of([100, 100, 100], seed=43)
    generate_and_flush(eng, first)
    shutil.rmtree(store)
    store.write_text("not a directory")  # even root cannot mkdir here
    info = generate_and_flush(eng, second)  # still served, without the tier
    assert info["disk_tier_failed"] == 1 and info["disk_write_errors"] >= 6
    assert info["disk_chunks"] == 0 and info["disk_bytes"] == 0

    store.unlink()
    info = generate_and_flush(eng, third)
    assert info["disk_tier_failed"] == 0 and info["disk_chunks"] == 6
    disk_of(eng).check_integrity(files=True)


def metric(c: httpx.Client, name: str) -> float:
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"{name} not in /metrics")


def test_health_and_metrics_report_a_failed_disk_tier(launch_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "store"
    srv: ServerProcess = launch_server(
        "--enable-hierarchical-cache", "--hicache-storage-dir", str(store), "--max-total-tokens", "2048"
    )
    with srv.client() as c:

        def generate(seed: int) -> dict[str, Any]:
            (ids,) = prompts_of([100], seed=seed)
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            wait_until(lambda: c.get("/server_info").json()["disk_pending_chunks"] == 0, timeout=30)
            return dict(c.get("/server_info").json())

        assert generate(44)["disk_chunks"] >= 6  # and the warm-up request's
        assert c.get("/health").json() == {"status": "ok"}
        assert metric(c, "radixrt:disk_tier_failed") == 0

        shutil.rmtree(store)
        store.write_text("not a directory")
        info = generate(45)
        assert info["disk_tier_failed"] == 1 and info["disk_chunks"] == 0
        assert metric(c, "radixrt:disk_tier_failed") == 1
        assert metric(c, "radixrt:disk_write_errors_total") >= 6
        health = c.get("/health")  # still serving: 200, with the warning
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["status"] == "ok" and any("disk tier" in w for w in body["warnings"]), body

        store.unlink()
        assert generate(46)["disk_tier_failed"] == 0
        assert c.get("/health").json() == {"status": "ok"}
    assert "disk tier failed" in srv.log_tail(400)
