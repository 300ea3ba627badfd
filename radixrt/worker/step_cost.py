"""What a forward through the compiled decode step costs, measured: what speculative decoding asks before it
turns a decode step of B tokens into a verify step of B + n (``radixrt.speculative.policy``).

A compiled forward of ``tokens`` new tokens runs in the smallest bucket that holds them, so its time is

    seconds = scale * base[bucket] + alpha * (single + ratio * multi)

- ``base[bucket]``: the bucket's time at warm-up, where every row is a padding row at position 0: the
  weights, the fused layers and the step's fixed work, with next to no attention;
- ``single``, ``multi``: the attention work in query-key pairs, over requests their new tokens times the
  positions the last one attends, for requests with one new token (a decode row at context L: L + 1) and
  for those with several (a verify of k + 1 tokens after L: (k + 1) (L + k + 1)), whose attention a backend
  may run through another kernel (``ratio``: its seconds per pair over a decode's);
- ``scale``, ``alpha`` and ``ratio``: measured at warm-up (`calibrate`), then learned from every compiled
  forward (moving averages). The attention op times its own calls, so each forward splits into attention
  seconds (``alpha`` from forwards without multi-token requests, then ``ratio`` from the others) and the
  rest (``scale = rest / base[bucket]``, which follows the machine's load).

Why measured: on a 2-core CPU a bucket of 40 rows costs about what 40 single rows do (the GEMMs are
compute-bound) and attention at a 1.6k-token context is half a decode step, while on a GPU both are nearly
free: a constant ratio cannot say where a verify pays.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence

from radixrt.kernels.base import ForwardMode

EMA_WEIGHT = 0.1  # weight of the newest forward in the moving averages

# One forward of a request at a context (mode, cached tokens, new tokens) -> (seconds, attention seconds).
Probe = Callable[[ForwardMode, int, int], tuple[float, float]]


def attention_pairs(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> tuple[int, int]:
    """Attention work of a batch (single, multi): per request, new tokens x the positions the last of them
    attends, summed over the requests with one new token and over those with several."""
    single = multi = 0
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        if e == 1:
            single += p + 1
        else:
            multi += e * (p + e)
    return single, multi


class StepCost:
    """Predicted seconds of a compiled forward by bucket and attention work (see the module doc)."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = sorted(buckets)
        self.base: dict[int, float] = {}
        self.scale = 1.0
        self.alpha_decode: float | None = None  # seconds per attention pair of a decode
        self.verify_ratio = 1.0  # a verify's seconds per pair over a decode's

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
        repeats: int = 3,
    ) -> str | None:
        """Measure the model at warm-up: every bucket's time (``run_bucket(bucket)`` -> seconds of a padding
        forward), then one request at ``context`` tokens: a decode (``alpha`` of a decode) and a verify of
        ``1 + draft_tokens`` tokens with each of the backend's verify ``kernels`` (set by ``use_kernel``),
        keeping the fastest, which it returns (None: no choice). Medians of ``repeats`` runs."""
        for b in self.buckets:
            self.base[b] = statistics.median(run_bucket(b) for _ in range(repeats))

        def attention(mode: ForwardMode, n: int) -> float:
            return statistics.median(probe(mode, context, n)[1] for _ in range(repeats))

        self.alpha_decode = attention(ForwardMode.DECODE, 1) / (context + 1)
        n = 1 + draft_tokens
        per_kernel: dict[str | None, float] = {}
        names: list[str | None] = [*kernels] or [None]
        for name in names:
            if name is not None and use_kernel is not None:
                use_kernel(name)
            per_kernel[name] = attention(ForwardMode.TARGET_VERIFY, n) / (n * (context + n))
        best = min(per_kernel, key=lambda k: per_kernel[k])
        if best is not None and use_kernel is not None:
            use_kernel(best)
        if self.alpha_decode > 0:
            self.verify_ratio = per_kernel[best] / self.alpha_decode
        return best

    def ready(self) -> bool:
        """Whether predictions are measured: buckets timed and at least one decode's attention seen."""
        return len(self.base) == len(self.buckets) and self.alpha_decode is not None

    def predict(self, tokens: int, single: int, multi: int) -> float | None:
        """Seconds of a forward of ``tokens`` new tokens with this attention work; None when no bucket holds
        it (it would run eagerly) or before calibration."""
        b = self.bucket(tokens)
        if b is None or b not in self.base:
            return None
        return self.scale * self.base[b] + (self.alpha_decode or 0.0) * (single + self.verify_ratio * multi)

    def observe(self, bucket: int, single: int, multi: int, seconds: float, attention: float) -> None:
        """A compiled forward of ``bucket`` tokens took ``seconds``, ``attention`` of them in attention."""
        base = self.base.get(bucket)
        if base is None or base <= 0:
            return
        rest = max(seconds - attention, 0.0)
        self.scale += EMA_WEIGHT * (rest / base - self.scale)
        a = self.alpha_decode
        if multi == 0 and single > 0:
            per_pair = attention / single
            self.alpha_decode = per_pair if a is None else a + EMA_WEIGHT * (per_pair - a)
        elif multi > 0 and a:
            ratio = max(attention - a * single, 0.0) / (a * multi)
            self.verify_ratio += EMA_WEIGHT * (ratio - self.verify_ratio)
