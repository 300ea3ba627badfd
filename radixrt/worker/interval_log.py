"""The worker's load line, once per ``--log-interval`` seconds while it is busy (SGLang's decode log, in time
rather than in steps)::

    running 12 req, queued 3 req, KV 5120/16384 tokens (31.2%), cache hit 84.0%, prefill 1830 tok/s,
    decode 412.5 tok/s (last 5.0s)

Rates and the hit rate cover the interval since the previous line; running, queued and KV usage are the
state now. A window opens at the first busy tick and closes with its line; a window that ends with the
worker idle closes for good, so an idle worker logs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixrt.worker.kv_manager import KVManager
    from radixrt.worker.req import Req
    from radixrt.worker.stats import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadCounters:
    """One reading of the worker: gauges now, cumulative token counts since start."""

    running: int  # requests holding KV (decoding, being prefilled, between jump-forward extends)
    queued: int  # requests waiting for admission or for their grammar
    kv_used: int  # device KV slots held by requests or locked (what eviction cannot free)
    kv_total: int
    cached_tokens: int  # prompt tokens found in the cache at admission
    prefill_tokens: int  # tokens computed by prefill (extend) forwards
    generated_tokens: int  # tokens appended to outputs


def load_line(before: LoadCounters, now: LoadCounters, seconds: float) -> str:
    """The load line for the interval from ``before`` to ``now`` (``seconds`` long)."""
    cached = now.cached_tokens - before.cached_tokens
    prefill = now.prefill_tokens - before.prefill_tokens
    generated = now.generated_tokens - before.generated_tokens
    # NOTE: the hit rate is of the prompt tokens admitted: cached / (cached + computed), as SGLang's
    # prefill log counts it; "-" when nothing was admitted.
    hit = f"{cached / (cached + prefill):.1%}" if cached + prefill else "-"
    usage = now.kv_used / now.kv_total if now.kv_total else 0.0
    span = max(seconds, 1e-9)
    return (
        f"running {now.running} req, queued {now.queued} req, KV {now.kv_used}/{now.kv_total} tokens "
        f"({usage:.1%}), cache hit {hit}, prefill {prefill / span:.0f} tok/s, "
        f"decode {generated / span:.1f} tok/s (last {seconds:.1f}s)"
    )


class IntervalLog:
    """Logs `load_line` every ``interval_s`` seconds while busy. ``read`` takes a reading, ``clock`` tells
    the time, ``emit`` writes a line (default: this module's logger at INFO).

    ``tick(busy)`` goes after every scheduler step, and after every idle poll. It reads the counters only
    when a window opens or ends, and once while idle: a busy tick costs a clock call. ``interval_s`` 0
    turns it off.
    """

    def __init__(
        self,
        interval_s: float,
        read: Callable[[], LoadCounters],
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.read = read
        self.clock = clock
        self.emit = emit if emit is not None else _log_info
        self.start: float | None = None  # when the open window began (None: no window open)
        self.base: LoadCounters | None = None  # the reading the next or open window counts from

    def tick(self, busy: bool) -> None:
        """Open a window when work begins; when it has lasted ``interval_s``, log it and open the next
        one, or none if the worker is idle by then."""
        if self.interval_s <= 0:
            return
        if self.start is None:
            if self.base is None:
                # NOTE: taken while idle, this reading is where the next window starts: the counters
                # do not move until work arrives. The first reading of a busy start is the only late one.
                self.base = self.read()
            if busy:
                self.start = self.clock()
            return
        now = self.clock()
        if now - self.start < self.interval_s:
            return
        reading = self.read()
        assert self.base is not None
        self.emit(load_line(self.base, reading, now - self.start))
        self.base = reading
        self.start = now if busy else None


def _log_info(line: str) -> None:
    logger.info("%s", line)


def read_load(
    kv: KVManager, stats: SchedulerStats, live: list[Req], running: int, queued: int
) -> LoadCounters:
    """The counters of a running worker: finished requests from its stats, live ones (``live``: every
    request the scheduler tracks) from their own counts; ``running`` / ``queued`` are the gauges."""
    total = kv.allocator.total_slots
    return LoadCounters(
        running=running,
        queued=queued,
        kv_used=total - kv.allocator.available_size() - kv.tree.evictable_size(),
        kv_total=total,
        cached_tokens=stats.cached_tokens + sum(r.cached_tokens for r in live),
        prefill_tokens=stats.computed_prefill_tokens,
        generated_tokens=stats.generation_tokens + sum(len(r.output_ids) for r in live),
    )
