"""scripts/gpu_check.sh --dry-run end to end on CPU: the device check's plumbing works before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "RADIXRT_CACHE_DIR": os.environ.get("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    tests = summary["tests"]
    assert tests["failures"] == 0 and tests["errors"] == 0
    if not torch.cuda.is_available():
        assert tests["skipped"] == tests["tests"] > 0  # every CUDA case skipped, with its reason
    bench = summary["bench"]
    assert bench["device"] == "cpu"
    (model,) = bench["results"].values()
    assert all(v > 0 for s in model["systems"].values() for v in s["decode"].values())
    assert "of the floor" in (out / "summary.md").read_text()
    assert "torch" in (out / "versions.txt").read_text()
