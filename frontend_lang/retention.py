"""Program-aware cache retention: what a program tells the runtime about the prefixes it will reuse.

Two hints, both on by default for the runtime backends (``RuntimeEndpoint``, ``Runtime``,
``EngineBackend``; ``retention=False`` turns them off):

- **priority**: every request of a program carries the program's rank (``n`` for the n-th program
  started in this process), then the fork level it comes from: ``n * LEVELS + LEVELS - 1 - depth``
  (the program's own state: depth 0; a branch of a fork: one more than the state it forked from), all
  above the runtime's default 0. Under ``--radix-eviction-policy priority`` a node takes the highest
  priority of the requests that inserted or matched it and lower priorities are evicted first, so
  what programs that started earlier left behind (mostly finished programs: their last output is
  never read again) goes before the scratchpad of a live program that is about to be extended; within
  a program, what only a branch used (a fork's scratch work, whose text the parent does not continue)
  goes before what its parent holds; and a header every program matches keeps the newest rank.
- **pins**: the prefix shared by ``run_batch`` (the traced common header) and by ``fork(n > 1)`` is
  pinned (``POST /pin_prefix``, which caches it; TTL ``pin_ttl`` seconds) before the runs start, and
  released (``DELETE /pins/{id}``) when the batch ends, or when the forking state and its branches have
  finished. The TTL only matters for a client that dies holding a pin. Pins are the server's: two
  programs pinning the same tokens share one pin, and the first release ends it for both.
"""

from __future__ import annotations

import itertools
import threading

DEFAULT_PRIORITY = 0  # the runtime's priority for a request that names none
LEVELS = 16  # fork levels told apart within a program (deeper ones share the last)
# NOTE: a pin is released explicitly; the TTL is the safety net for a client that dies. A hit
# refreshes it only when it covers the whole pinned prefix, which a prompt continuing the prefix's text
# often does not (BPE merges across the boundary), so the TTL must outlast the batch.
DEFAULT_PIN_TTL = 300.0

_lock = threading.Lock()
_program_counter = itertools.count(DEFAULT_PRIORITY + 1)


def next_program_priority() -> int:
    """The rank of the next program to start: above the default and above every earlier program."""
    with _lock:
        return next(_program_counter)


def branch_priority(rank: int, depth: int) -> int:
    """The priority of a request of program ``rank`` made ``depth`` forks below the program's state:
    every level of a later program is above every level of an earlier one; deeper is lower."""
    return rank * LEVELS + LEVELS - 1 - min(depth, LEVELS - 1)


def check_pin_ttl(pin_ttl: float) -> float:
    """``pin_ttl`` if it is a positive number of seconds, else ValueError naming the field."""
    if not isinstance(pin_ttl, int | float) or isinstance(pin_ttl, bool) or pin_ttl <= 0:
        raise ValueError(f"pin_ttl: expected a positive number of seconds, got {pin_ttl!r}")
    return float(pin_ttl)
