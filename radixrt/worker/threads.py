"""The one place that decides torch's intra-op threads for the worker, and how long they spin."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

# libgomp's spin-wait iterations before a thread waiting at a barrier (or for work) sleeps. Its default,
# 300,000 (~10 ms of `pause` on current x86), makes a 2-thread team collapse on a shared machine: while
# one thread is descheduled, the other spins its whole time slice away at every parallel region, and a
# decode step of ~200 small regions took 10 s instead of 50 ms (2 cores, load ~17; 1,000: 48-84 ms;
# 10,000: ~1 s; 0, i.e. OMP_WAIT_POLICY=PASSIVE: 150-290 ms). 1,000 (tens of microseconds) still spans
# the gaps between the regions of one step on a quiet machine. libgomp reads it once, when it loads.
OPENMP_SPIN_COUNT = 1000
_spin_bound_late = False  # the bound was set after torch (and libgomp) had loaded: it does not apply


def bound_openmp_spinning() -> None:
    """Set ``GOMP_SPINCOUNT`` to `OPENMP_SPIN_COUNT` unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is
    set. Runs when ``radixrt`` is imported, so it applies when that comes before ``import torch`` (every
    radixrt process, and a program that imports radixrt first); worker processes inherit it."""
    global _spin_bound_late
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
    _spin_bound_late = "torch" in sys.modules


def compute_threads(reserve_one: bool) -> int:
    """Intra-op threads for the model: ``OMP_NUM_THREADS`` if set, else all cores, less one when
    ``reserve_one`` (the server: its HTTP process needs a core of its own).

    NOTE: with the HTTP process busy on the same cores, an OpenMP team as large as the machine gets
    descheduled mid-barrier and decode slows down several-fold (measured: 2 cores, 5x).
    """
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1) if reserve_one else max(1, cores)


def set_worker_threads(reserve_one: bool) -> int:
    """Apply `compute_threads` to torch (call it on the thread that will run the model)."""
    import torch

    if _spin_bound_late:
        logger.warning(
            "torch was imported before radixrt: its OpenMP threads spin up to 300,000 iterations at each "
            "barrier, which slows decode many-fold when other processes share the cores; import radixrt "
            "first or set GOMP_SPINCOUNT=%d (docs/cpu.md)",
            OPENMP_SPIN_COUNT,
        )
    torch.set_num_threads(compute_threads(reserve_one))
    return torch.get_num_threads()
