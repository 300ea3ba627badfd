"""The one place that decides torch's intra-op threads for the worker, and how long they spin."""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

# libgomp's spin-wait iterations before a thread waiting at a barrier (or for work) sleeps. Its default,
# 300,000 (~10 ms of `pause`), is right on a machine whose cores the server has to itself: a quiet 2-core
# machine decoded 2x faster with it than with 1,000. When other processes keep the cores busy, a 2-thread
# team collapses with it instead (one thread spins its time slice away at every parallel region while its
# partner is descheduled: a decode step of ~200 regions took 10 s instead of 50 ms at load ~17, with 1,000:
# 48-84 ms). radixrt leaves the default and names the bound in a warning when the machine is oversubscribed
# at start (docs/cpu.md); libgomp reads the variable once, when torch loads, so it must be set beforehand.
SHARED_MACHINE_SPIN_COUNT = 1000


def spin_advice(load_1min: float, cores: int, env: dict[str, str]) -> str | None:
    """The warning to log when the machine's run queue (``load_1min``) exceeds its ``cores`` and neither
    ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` is set in ``env``; None otherwise."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env or load_1min <= cores:
        return None
    return (
        f"load average {load_1min:.1f} on {cores} cores: OpenMP threads spinning at barriers (libgomp's "
        f"default GOMP_SPINCOUNT=300000) can slow decode many-fold while other processes share the cores; "
        f"on a shared machine start radixrt with GOMP_SPINCOUNT={SHARED_MACHINE_SPIN_COUNT} (docs/cpu.md)"
    )


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

    advice = spin_advice(os.getloadavg()[0], os.cpu_count() or 1, dict(os.environ))
    if advice is not None:
        logger.warning(advice)
    torch.set_num_threads(compute_threads(reserve_one))
    return torch.get_num_threads()


# The interpreter's GIL switch interval while an in-process Engine runs. The Engine's scheduler thread shares
# the GIL with the caller's threads (a frontend's program threads, the Engine's event loop); at Python's
# default, 5 ms, the scheduler waits up to that long for the GIL between the torch calls of a step, while its
# OpenMP team spins. Measured on the ReAct replay (8 programs in parallel, one Engine, the interval switched
# between runs, 4 alternated pairs): 1 ms gave +15% programs/s in 3 of 4 pairs (equal in the 4th) and ~10% less
# CPU per program. The server's worker process runs the scheduler without the frontend's threads.
ENGINE_SWITCH_INTERVAL_S = 0.001

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved: float | None = None


def hold_short_switch_interval() -> None:
    """Lower the GIL switch interval to `ENGINE_SWITCH_INTERVAL_S` (if it is longer) while at least one
    holder is alive; pair every call with `release_short_switch_interval`."""
    global _switch_users, _switch_saved
    with _switch_lock:
        _switch_users += 1
        if _switch_users == 1 and sys.getswitchinterval() > ENGINE_SWITCH_INTERVAL_S:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)


def release_short_switch_interval() -> None:
    """Drop one hold; the last restores the interval the first found (unless someone changed it since)."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            raise RuntimeError("release_short_switch_interval without a hold")
        _switch_users -= 1
        if _switch_users == 0 and _switch_saved is not None:
            if sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S:
                sys.setswitchinterval(_switch_saved)
            _switch_saved = None
