"""What the runtime logs: ``--log-requests`` (one line per finished request, no text) and the worker's
interval load line (fake clocks: nothing here waits on the machine's speed)."""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixrt import Engine
from radixrt.server.request_log import log_request
from radixrt.worker.interval_log import IntervalLog, LoadCounters, load_line

REQUEST_LINE = re.compile(
    r"request rid=(?P<rid>\S+) tenant=(?P<tenant>\S+) prompt_tokens=(?P<prompt>\d+) "
    r"cached_tokens=(?P<cached>\d+) generated_tokens=(?P<generated>\d+) finish=(?P<finish>\S+) "
    r"latency=\d+\.\d{3}s ttft=(?P<ttft>\d+\.\d{3}s|-)"
)


def _counters(**kw: int) -> LoadCounters:
    base = dict(running=0, queued=0, kv_used=0, kv_total=4096, cached_tokens=0, prefill_tokens=0,
                generated_tokens=0)  # fmt: skip
    return LoadCounters(**{**base, **kw})


# -- the interval log, with a fake clock -----------------------------------------------------------------
class _Script:
    """A fake clock and a counter source the test sets by hand, and the lines emitted."""

    def __init__(self, interval_s: float) -> None:
        self.now = 0.0
        self.counters = _counters()
        self.reads = 0
        self.lines: list[str] = []
        self.log = IntervalLog(interval_s, self.read, clock=lambda: self.now, emit=self.lines.append)

    def read(self) -> LoadCounters:
        self.reads += 1
        return self.counters

    def at(self, t: float, busy: bool, **counters: int) -> None:
        """At time ``t``, after a step that left these counters: tick."""
        self.now = t
        self.counters = _counters(**counters) if counters else self.counters
        self.log.tick(busy)


def test_load_line_rates_over_the_interval() -> None:
    before = _counters(cached_tokens=100, prefill_tokens=50, generated_tokens=10)
    now = _counters(running=3, queued=1, kv_used=512, cached_tokens=400, prefill_tokens=150,
                    generated_tokens=65)  # fmt: skip
    assert load_line(before, now, 5.5) == (
        "running 3 req, queued 1 req, KV 512/4096 tokens (12.5%), cache hit 75.0%, prefill 18 tok/s, "
        "decode 10.0 tok/s (last 5.5s)"
    )
    assert "cache hit -," in load_line(now, now, 2.0)  # nothing admitted: no hit rate


def test_one_line_per_interval_while_busy_and_none_while_idle() -> None:
    s = _Script(interval_s=5.0)
    for t in (0.0, 1.0, 30.0):  # idle: nothing logged, the counters read once
        s.at(t, busy=False)
    assert (s.lines, s.reads) == ([], 1)
    s.at(31.0, busy=True, running=1, prefill_tokens=100, generated_tokens=1)  # work begins: window opens
    s.at(33.0, busy=True, running=1, prefill_tokens=100, generated_tokens=20)
    assert s.lines == []
    s.at(36.0, busy=True, running=2, prefill_tokens=160, cached_tokens=40, generated_tokens=50)
    assert len(s.lines) == 1
    assert "running 2 req" in s.lines[0] and "prefill 32 tok/s" in s.lines[0]
    assert "decode 10.0 tok/s (last 5.0s)" in s.lines[0] and "cache hit 20.0%" in s.lines[0]
    s.at(40.0, busy=True, running=2, prefill_tokens=160, cached_tokens=40, generated_tokens=90)
    s.at(41.0, busy=False, prefill_tokens=160, cached_tokens=40, generated_tokens=100)  # done: closes
    assert len(s.lines) == 2
    assert "running 0 req" in s.lines[1] and "decode 10.0 tok/s (last 5.0s)" in s.lines[1]
    assert "cache hit -" in s.lines[1] and "prefill 0 tok/s" in s.lines[1]
    reads = s.reads
    for t in (42.0, 50.0, 500.0):  # idle again: nothing logged, nothing read
        s.at(t, busy=False)
    assert (len(s.lines), s.reads) == (2, reads)
    s.at(501.0, busy=True, generated_tokens=104)  # the next window counts from the last reading
    s.at(507.0, busy=False, generated_tokens=112)
    assert len(s.lines) == 3 and "decode 2.0 tok/s (last 6.0s)" in s.lines[2]


def test_interval_zero_is_off() -> None:
    s = _Script(interval_s=0.0)
    for t in range(0, 100, 7):
        s.at(float(t), busy=True, generated_tokens=t)
    assert (s.lines, s.reads) == ([], 0)


def test_interval_log_in_the_scheduler(engine_factory: Callable[..., Engine], tiny_llama: Path) -> None:
    """The hook in the scheduler loop, with a clock that advances one second per look: every busy step
    ends an interval, so the readings follow the requests step by step (live ones included)."""
    eng = engine_factory(tiny_llama, log_interval=0.5)
    ticks = itertools.count()
    readings: list[LoadCounters] = []
    lines: list[str] = []

    def install(s: Any) -> None:
        log: IntervalLog = s.interval_log
        read = log.read

        def record() -> LoadCounters:
            readings.append(read())
            return readings[-1]

        log.read, log.clock, log.emit, log.base, log.start = (
            record,
            lambda: float(next(ticks)),
            lines.append,
            None,
            None,
        )

    eng.worker.call(install)
    shared = [(7 * i) % 300 + 10 for i in range(48)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first = eng.generate(input_ids=shared, sampling_params=params)["meta_info"]
    second = eng.generate(input_ids=shared + [11, 12, 13, 14], sampling_params=params)["meta_info"]
    eng.worker.call(lambda s: None)  # a step boundary: the tick after the last step has run
    assert second["cached_tokens"] > 0
    total, start = readings[-1], readings[0]
    assert total.generated_tokens - start.generated_tokens == 12
    assert total.cached_tokens - start.cached_tokens == first["cached_tokens"] + second["cached_tokens"]
    computed = sum(m["prompt_tokens"] - m["cached_tokens"] for m in (first, second))
    assert total.prefill_tokens - start.prefill_tokens == computed
    # while a request decodes, its tokens count before it finishes: one more per step
    live = [r for r in readings if r.running == 1]
    assert len(live) >= 8 and all(r.kv_used > 0 for r in live)
    gen = [r.generated_tokens for r in readings]
    assert gen == sorted(gen) and len(set(gen)) >= 10
    assert len(lines) == len(readings) - 1 and all(line.startswith("running ") for line in lines)
    idle = (total.running, total.queued, total.kv_used)
    assert idle == (0, 0, 0)
    n = len(lines)
    for _ in range(3):  # idle steps log nothing
        eng.worker.call(lambda s: None)
    assert len(lines) == n


# -- --log-requests ----------------------------------------------------------------------------------------
def test_request_log_lines_hold_counts_never_text(
    engine_factory: Callable[..., Engine], tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng = engine_factory(tiny_llama, max_total_tokens=64)  # small: a long prompt is the worker's 400
    eng.tokenizer_manager.listeners.append(log_request)
    caplog.set_level(logging.INFO, logger="radixrt.server.request_log")
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    out = eng.generate(prompt="SECRET-PROMPT alpha beta gamma", sampling_params=params, rid="r-one")
    again = eng.generate(prompt="SECRET-PROMPT alpha beta gamma", sampling_params=params, rid="r-two")
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        eng.generate(input_ids=list(range(10, 110)), sampling_params={"max_new_tokens": 1}, rid="r-bad")
    records = [r for r in caplog.records if r.name == "radixrt.server.request_log"]
    assert len(records) == 3
    for record, result in zip(records[:2], (out, again), strict=True):
        message = record.getMessage()
        m = REQUEST_LINE.fullmatch(message)
        assert m is not None, message
        meta = result["meta_info"]
        assert m["rid"] == meta["id"] and m["tenant"] == "-" and m["finish"] == "length"
        assert (int(m["prompt"]), int(m["cached"]), int(m["generated"])) == (
            meta["prompt_tokens"], meta["cached_tokens"], 5
        )  # fmt: skip
        assert m["ttft"] != "-" and "SECRET" not in message
    assert int(REQUEST_LINE.fullmatch(records[1].getMessage())["cached"]) > 0  # type: ignore[index]
    bad = REQUEST_LINE.fullmatch(records[2].getMessage())
    assert bad is not None and (bad["rid"], bad["finish"], bad["generated"], bad["ttft"]) == (
        "r-bad", "abort/400", "0", "-"
    )  # fmt: skip
    assert all(r.levelno == logging.INFO for r in records)
