"""radixrt bounds libgomp's spin-waiting (GOMP_SPINCOUNT) when it is imported before torch, keeps a
user's setting, and warns when torch loaded first (the bound cannot apply then)."""

from __future__ import annotations

import os
import subprocess
import sys

from radixrt.worker.threads import OPENMP_SPIN_COUNT

PROBE = """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
if sys.argv[1] == "torch-first":
    import torch
import radixrt
from radixrt.worker.threads import set_worker_threads
set_worker_threads(reserve_one=False)
print("GOMP_SPINCOUNT=" + os.environ.get("GOMP_SPINCOUNT", "unset"))
"""


def _probe(order: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, order], env=clean | env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_radixrt_first_bounds_spinning_without_warning() -> None:
    out = _probe("radixrt-first")
    assert f"GOMP_SPINCOUNT={OPENMP_SPIN_COUNT}" in out
    assert "imported before radixrt" not in out


def test_user_setting_is_kept() -> None:
    assert "GOMP_SPINCOUNT=50" in _probe("radixrt-first", GOMP_SPINCOUNT="50")
    out = _probe("torch-first", OMP_WAIT_POLICY="ACTIVE")
    assert "GOMP_SPINCOUNT=unset" in out
    assert "imported before radixrt" not in out


def test_torch_first_warns() -> None:
    out = _probe("torch-first")
    assert "torch was imported before radixrt" in out
    assert f"GOMP_SPINCOUNT={OPENMP_SPIN_COUNT}" in out  # still inherited by worker processes
