"""What a forward through the compiled decode step costs, measured: what speculative decoding asks before it
turns a decode step of B tokens into a verify step of B + n (``radixrt.speculative.policy``).

A compiled forward of ``tokens`` new tokens runs in the smallest bucket that holds them, so its time is

    seconds = scale * base[bucket] + alpha * single + verify_scale * (per_position * positions + per_pair * pairs)

- ``base[bucket]``: the bucket's time at warm-up, where every row is a padding row at position 0: the
  weights, the fused layers and the step's fixed work, with next to no attention;
- the attention work (`Work`): ``single``, the positions attended by the requests with one new token (a
  decode row at context L: L + 1); for the requests with several (a verify of q = k + 1 tokens after L),
  ``positions`` (L + q: what a kernel reads once per request, e.g. a gather) and ``pairs`` (q (L + q):
  query-key products). A backend may run the latter through another kernel (``verify_kernels``), so they
  have rates of their own: on the CPU's gather + SDPA a request's positions cost ~1/3 of its pairs' time at
  a full draft, so one draft token costs much more per token than four;
- calibrated at warm-up (`calibrate`: every bucket, then one request at a 1k-token context as a decode and
  as verifies of 2 and k + 1 tokens per verify kernel, keeping the fastest kernel), then followed by every
  compiled forward (moving averages): the attention op times its own calls, so a forward splits into
  attention seconds (``alpha`` from forwards with single-token requests only, ``verify_scale`` from the
  others) and the rest (``scale = rest / base[bucket]``, which follows the machine's load).

Why measured: on a 2-core CPU a bucket of 40 rows costs about what 40 single rows do (the GEMMs are
compute-bound) and attention at a 1.6k-token context is half a decode step, while on a GPU both are nearly
free: a constant ratio cannot say where a verify pays.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

from radixrt.kernels.base import ForwardMode

EMA_WEIGHT = 0.1  # weight of the newest forward in the moving averages

# One forward of a request at a context (mode, cached tokens, new tokens) -> (seconds, attention seconds).
Probe = Callable[[ForwardMode, int, int], tuple[float, float]]


class Work(NamedTuple):
    """A forward's attention work (see the module doc)."""

    single: int  # positions attended by the requests with one new token
    positions: int  # the same for the requests with several: context + new tokens, once per request
    pairs: int  # their query-key pairs: new tokens x (context + new tokens)

    def add_token(self, context: int, new: int) -> Work:
        """The work after a request at ``context`` with ``new`` tokens gets one more."""
        if new == 1:
            return Work(
                self.single - (context + 1), self.positions + context + 2, self.pairs + 2 * (context + 2)
            )
        return Work(self.single, self.positions + 1, self.pairs + context + 2 * new + 1)


def attention_work(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> Work:
    """The attention work of a batch of requests (cached tokens, new tokens)."""
    single = positions = pairs = 0
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        if e == 1:
            single += p + 1
        else:
            positions += p + e
            pairs += e * (p + e)
    return Work(single, positions, pairs)


class StepCost:
    """Predicted seconds of a compiled forward by bucket and attention work (see the module doc)."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = sorted(buckets)
        self.base: dict[int, float] = {}
        self.scale = 1.0
        self.alpha: float | None = None  # seconds per position of a single-token request
        self.per_position = 0.0  # seconds per position of a multi-token request (at calibration)
        self.per_pair = 0.0  # seconds per query-key pair of a multi-token request (at calibration)
        self.verify_scale = 1.0  # multi-token attention now over at calibration

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def calibrate(
        self,
        run_bucket: Callable[[int], float],
        probe: Probe,
        context: int,
        draft_tokens: int,
        kernels: Sequence[str] = (),
        use_kernel: Callable[[str], None] | None = None,
        repeats: int = 5,
    ) -> str | None:
        """Measure at warm-up: every bucket (``run_bucket(bucket)`` -> seconds of a padding forward), then one
        request at ``context`` tokens as a decode and as verifies of 2 and ``1 + draft_tokens`` tokens with
        each of the backend's verify ``kernels`` (set by ``use_kernel``), keeping the one fastest at a full
        draft, which it returns (None: no choice). Medians of ``repeats`` runs."""
        for b in self.buckets:
            self.base[b] = statistics.median(run_bucket(b) for _ in range(repeats))

        def attention(mode: ForwardMode, n: int) -> float:
            return statistics.median(probe(mode, context, n)[1] for _ in range(repeats))

        self.alpha = attention(ForwardMode.DECODE, 1) / (context + 1)
        n = 1 + draft_tokens
        fits: dict[str | None, tuple[float, float, float]] = {}  # kernel -> (full draft's seconds, rates)
        names: list[str | None] = [*kernels] or [None]
        for name in names:
            if name is not None and use_kernel is not None:
                use_kernel(name)
            full = attention(ForwardMode.TARGET_VERIFY, n)
            two = attention(ForwardMode.TARGET_VERIFY, 2) if n > 2 else full
            fits[name] = (full, *fit_rates(context, two, n, full))
        best = min(fits, key=lambda k: fits[k][0])
        if best is not None and use_kernel is not None:
            use_kernel(best)
        _, self.per_position, self.per_pair = fits[best]
        self.verify_scale = 1.0
        return best

    def ready(self) -> bool:
        """Whether predictions are measured: buckets timed and a decode's attention seen."""
        return len(self.base) == len(self.buckets) and self.alpha is not None

    def _multi(self, work: Work) -> float:
        return self.per_position * work.positions + self.per_pair * work.pairs

    def predict(self, tokens: int, work: Work) -> float | None:
        """Seconds of a forward of ``tokens`` new tokens with this attention work; None when no bucket holds
        it (it would run eagerly) or before calibration."""
        b = self.bucket(tokens)
        if b is None or b not in self.base:
            return None
        return (
            self.scale * self.base[b]
            + (self.alpha or 0.0) * work.single
            + self.verify_scale * self._multi(work)
        )

    def observe(self, bucket: int, work: Work, seconds: float, attention: float) -> None:
        """A compiled forward of ``bucket`` tokens took ``seconds``, ``attention`` of them in attention."""
        base = self.base.get(bucket)
        if base is None or base <= 0:
            return
        self.scale += EMA_WEIGHT * (max(seconds - attention, 0.0) / base - self.scale)
        a, multi = self.alpha, self._multi(work)
        if multi == 0 and work.single > 0:
            per = attention / work.single
            self.alpha = per if a is None else a + EMA_WEIGHT * (per - a)
        elif multi > 0 and a is not None:
            ratio = max(attention - a * work.single, 0.0) / multi
            self.verify_scale += EMA_WEIGHT * (ratio - self.verify_scale)


def fit_rates(context: int, two: float, n: int, full: float) -> tuple[float, float]:
    """(per position, per pair) from a request's attention seconds at ``context`` with 2 and ``n`` new tokens:
    ``t(q) = per_position (L + q) + per_pair q (L + q)``; both kept >= 0."""
    if n <= 2:
        return 0.0, full / (n * (context + n))
    r2, rn = two / (context + 2), full / (context + n)  # per_position + q per_pair, at q = 2 and n
    per_pair = max((rn - r2) / (n - 2), 0.0)
    per_position = r2 - 2 * per_pair
    if per_position < 0:
        return 0.0, full / (n * (context + n))
    return per_position, per_pair
