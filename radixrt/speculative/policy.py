"""When a speculative step pays: per-request acceptance history, the batch size and the verify cost.

A verify step replaces a plain decode step for the whole running batch. It emits ``B + sum(a_r)`` tokens
(``a_r`` the draft tokens request ``r`` gets accepted) and costs about ``C`` plain decode steps at that
batch (``--speculative-verify-cost``: the verify is an eager extend of ``1 + d`` rows per request while
plain decode runs compiled), so it pays when ``sum(a_r) >= (C - 1) * B``. The policy predicts ``a_r``
by an exponential moving average of each request's accepted tokens per verify (prior
``PRIOR_ACCEPT`` for a request not yet verified), and:

- above ``--speculative-max-batch-size`` running requests it drafts nothing (the batch is compute-bound:
  extra rows cost about what they save; drafting itself is skipped too);
- a request whose average is under ``(C - 1) / 2`` is not drafted;
- when the kept drafts' predicted gain is under ``(C - 1) * B`` the step decodes plainly;
- every step a request's draft sits out (either rule), its average moves ``1 / RECOVER_STEPS`` of the
  way back to the prior, so it is probed again later (each failed probe pulls it down again).

Every decision is a function of counts only (no clocks), so runs are reproducible; the scheduler's
counters (``spec_skipped_batch_steps``, ``spec_skipped_cost_steps``, ``spec_backoff_req_steps``) say why
drafts were not verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

PRIOR_ACCEPT = 1.5  # accepted tokens per verify assumed for a request not yet verified
EMA_WEIGHT = 0.3  # weight of the newest verify in the average
RECOVER_STEPS = 16  # steps for a sat-out request's average to recover most of the way to the prior


class SpecCounters(Protocol):
    """Where the policy counts its decisions (the scheduler's `SchedulerStats`)."""

    spec_skipped_batch_steps: int  # steps over --speculative-max-batch-size: no drafting at all
    spec_skipped_cost_steps: int  # steps whose drafts were predicted not to pay for the verify
    spec_backoff_req_steps: int  # request-steps with a draft dropped for the request's low average


class SpecPolicy:
    """Decides, per step, which drafts are verified (see the module doc)."""

    def __init__(self, max_batch_size: int, verify_cost: float) -> None:
        self.max_batch_size = max_batch_size
        self.verify_cost = verify_cost
        self.min_req_accept = (verify_cost - 1.0) / 2  # a request predicted to accept fewer is not drafted
        self._ema: dict[str, float] = {}

    def batch_allows(self, batch_size: int, counters: SpecCounters) -> bool:
        """False (and counted) when the running batch is too large to speculate at all."""
        if batch_size > self.max_batch_size:
            counters.spec_skipped_batch_steps += 1
            return False
        return True

    def expected(self, rid: str) -> float:
        """Predicted accepted draft tokens of the request's next verify."""
        return self._ema.get(rid, PRIOR_ACCEPT)

    def choose(
        self, rids: Sequence[str], drafts: Sequence[list[int]], counters: SpecCounters
    ) -> list[list[int]]:
        """The drafts to verify this step (a request's draft, or [] for plain decoding in the step)."""
        kept: list[list[int]] = []
        for rid, d in zip(rids, drafts, strict=True):
            if d and self.expected(rid) < self.min_req_accept:
                counters.spec_backoff_req_steps += 1
                d = []
            kept.append(d)
        gain = sum(self.expected(rid) for rid, d in zip(rids, kept, strict=True) if d)
        if any(kept) and gain < (self.verify_cost - 1.0) * len(rids):
            counters.spec_skipped_cost_steps += 1
            kept = [[] for _ in kept]
        for rid, d, k in zip(rids, drafts, kept, strict=True):
            if d and not k:  # sat out: recover toward the prior, so the request is probed again later
                ema = self.expected(rid)
                self._ema[rid] = ema + (PRIOR_ACCEPT - ema) / RECOVER_STEPS
        return kept

    def record(self, rid: str, accepted: int) -> None:
        """After a verify: ``accepted`` of the request's draft tokens were emitted."""
        ema = self.expected(rid)
        self._ema[rid] = (1.0 - EMA_WEIGHT) * ema + EMA_WEIGHT * accepted

    def prune(self, live: set[str]) -> None:
        """Forget requests no longer running."""
        if len(self._ema) > len(live):
            self._ema = {rid: v for rid, v in self._ema.items() if rid in live}
