"""libgomp's spin-waiting: radixrt keeps the default (faster on a machine of its own) and advises
GOMP_SPINCOUNT when the machine is oversubscribed at start; a user's setting is never overridden."""

from __future__ import annotations

import os
import subprocess
import sys

from radixrt.worker.threads import SHARED_MACHINE_SPIN_COUNT, spin_advice


def test_advice_only_when_oversubscribed_and_unset() -> None:
    advice = spin_advice(5.0, 2, {})
    assert advice is not None and f"GOMP_SPINCOUNT={SHARED_MACHINE_SPIN_COUNT}" in advice
    assert "load average 5.0 on 2 cores" in advice
    assert spin_advice(1.5, 2, {}) is None
    assert spin_advice(2.0, 2, {}) is None
    assert spin_advice(5.0, 2, {"GOMP_SPINCOUNT": "300000"}) is None
    assert spin_advice(5.0, 2, {"OMP_WAIT_POLICY": "PASSIVE"}) is None


def test_importing_radixrt_leaves_the_environment_alone() -> None:
    probe = "import os, radixrt; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=clean, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "unset"
    kept = subprocess.run(
        [sys.executable, "-c", probe],
        env=clean | {"GOMP_SPINCOUNT": "50"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert kept.stdout.strip() == "50"
