"""libgomp's spin-waiting: radixrt keeps the default (faster on a machine of its own) and advises
GOMP_SPINCOUNT when the machine is oversubscribed at start; a user's setting is never overridden. And the
GIL switch interval an in-process Engine holds short while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixrt.worker.threads import (
    ENGINE_SWITCH_INTERVAL_S,
    SHARED_MACHINE_SPIN_COUNT,
    hold_short_switch_interval,
    release_short_switch_interval,
    spin_advice,
)
from tests.engine_fixtures import make_engine


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


@pytest.fixture
def fresh_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No holder (engines of other tests may still be alive in this process) and Python's default 5 ms."""
    from radixrt.worker import threads

    monkeypatch.setattr(threads, "_switch_users", 0)
    monkeypatch.setattr(threads, "_switch_saved", None)
    outer = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(outer)


@pytest.mark.usefixtures("fresh_interval")
def test_switch_interval_held_short_until_the_last_release() -> None:
    before = sys.getswitchinterval()
    hold_short_switch_interval()
    hold_short_switch_interval()
    assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S
    release_short_switch_interval()
    assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S  # one holder left
    release_short_switch_interval()
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError, match="without a hold"):
        release_short_switch_interval()


@pytest.mark.usefixtures("fresh_interval")
def test_switch_interval_a_user_shortened_further_is_kept() -> None:
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S / 4)
    hold_short_switch_interval()
    assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S / 4
    release_short_switch_interval()
    assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S / 4


@pytest.mark.usefixtures("fresh_interval")
def test_engine_holds_the_short_interval_while_it_runs(tiny_llama: Path) -> None:
    before = sys.getswitchinterval()
    eng = make_engine(tiny_llama)
    try:
        assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert len(out["output_ids"]) == 2
    finally:
        eng.shutdown()
    assert sys.getswitchinterval() == before
    eng.shutdown()  # a second shutdown releases nothing twice
    assert sys.getswitchinterval() == before
