"""The one place that decides torch's intra-op threads for the worker."""

from __future__ import annotations

import os


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

    torch.set_num_threads(compute_threads(reserve_one))
    return torch.get_num_threads()
