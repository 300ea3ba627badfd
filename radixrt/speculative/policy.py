"""When a speculative step pays, and which draft tokens it verifies: acceptance history, batch and cost.

A verify step replaces a plain decode step for the whole running batch: B requests, of which some carry
draft tokens, run as B + n tokens through one forward. Each draft token is worth its chance of being
accepted, and the step's worth is its expected tokens per second.

- Acceptance: greedy verification accepts a draft's longest agreeing prefix, so request r's draft token j
  is emitted with probability ``p_r^j`` (a geometric model). ``p_r`` is estimated from the request's
  verifies: accepted draft tokens over accepted tokens plus rejections (the geometric maximum-likelihood
  estimate, counts decaying by ``DECAY`` per verify), with a prior worth ``PRIOR_WEIGHT`` observations: the
  same estimate pooled over every request's recent verifies (``PRIOR_P`` before any), so on a workload
  whose drafts miss, new requests start out pessimistic. Each step a request's draft is left out, its counts
  decay by ``1 / RECOVER_STEPS``: its estimate drifts back to the prior and it is probed again later.
- Cost (`Cost`): measured (the compiled step's `StepCost`: seconds by bucket and attention work, so the
  batch size, the bucket padding and the context length all count) or, with ``--speculative-verify-cost C``
  or off the compiled path, a constant: a verify costs C decode steps whatever it holds.
- Choice: the draft tokens, most likely first, are added one at a time; the step verifies the prefix of
  them with the highest expected tokens per second, if that beats plain decoding by ``MARGIN`` (measured
  costs) or at all (a constant cost: then all drafts, if ``B + sum of p_r^j >= C x B``).
- Above ``--speculative-max-batch-size`` running requests nothing is drafted (the compiled buckets hold a
  verify of that many requests' full drafts; more would run eagerly).

Counters (the scheduler's): ``spec_skipped_batch_steps`` (over the batch limit), ``spec_skipped_cost_steps``
(drafts found, plain decoding predicted faster), ``spec_backoff_req_steps`` (a request's draft left out of a
verify step that others' drafts made).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixrt.worker.step_cost import Work

PRIOR_P = 0.6  # per-token acceptance assumed before anything was verified
PRIOR_WEIGHT = 2.0  # observations a prior is worth
DECAY = 0.8  # weight of a request's history at each new verify of it
POOL_DECAY = 0.98  # weight of the pooled history (all requests) at each new verify
RECOVER_STEPS = 16  # steps for a left-out request's counts to decay most of the way back to the prior
MARGIN = 0.05  # measured costs: a verify must promise this much more throughput than plain decoding
DEFAULT_VERIFY_COST = 2.0  # off the compiled path: a verify step costs this many decode steps


class SpecCounters(Protocol):
    """Where the policy counts its decisions (the scheduler's `SchedulerStats`)."""

    spec_skipped_batch_steps: int
    spec_skipped_cost_steps: int
    spec_backoff_req_steps: int


class Cost(Protocol):
    """Predicted seconds of a forward (`radixrt.worker.step_cost.StepCost`)."""

    @property
    def max_tokens(self) -> int: ...

    def ready(self) -> bool: ...

    def predict(self, tokens: int, work: Work) -> float | None: ...


class SpecPolicy:
    """Decides, per step, which draft tokens are verified (see the module doc). ``verify_cost``: None for
    measured costs where a `Cost` is given, else `DEFAULT_VERIFY_COST`; a number fixes the constant."""

    def __init__(self, max_batch_size: int, verify_cost: float | None) -> None:
        self.max_batch_size = max_batch_size
        self.verify_cost = verify_cost
        self._acc: dict[str, float] = {}  # rid -> decayed accepted draft tokens
        self._rej: dict[str, float] = {}  # rid -> decayed rejections
        self._pool = (0.0, 0.0)  # the same over every request's verifies: the prior of a new request

    def batch_allows(self, batch_size: int, counters: SpecCounters) -> bool:
        """False (and counted) when the running batch is too large to speculate at all."""
        if batch_size > self.max_batch_size:
            counters.spec_skipped_batch_steps += 1
            return False
        return True

    def prior(self) -> float:
        """A new request's acceptance: the pooled estimate over recent verifies (`PRIOR_P` before any)."""
        acc, rej = self._pool
        return (acc + PRIOR_P * PRIOR_WEIGHT) / (acc + rej + PRIOR_WEIGHT)

    def accept_prob(self, rid: str) -> float:
        """Estimated chance that the request's next draft token is accepted (given its previous one was)."""
        acc, rej = self._acc.get(rid, 0.0), self._rej.get(rid, 0.0)
        return (acc + self.prior() * PRIOR_WEIGHT) / (acc + rej + PRIOR_WEIGHT)

    def choose(
        self,
        rids: Sequence[str],
        kv_lens: Sequence[int],
        drafts: Sequence[list[int]],
        counters: SpecCounters,
        cost: Cost | None = None,
    ) -> list[list[int]]:
        """The draft prefixes to verify this step (``[]`` for a request decoding plainly in it; all ``[]``:
        decode plainly). ``kv_lens``: each request's cached tokens (its context), ``cost``: measured costs."""
        probs = [self.accept_prob(rid) for rid in rids]
        measured = self.verify_cost is None and cost is not None and cost.ready()
        if measured:
            assert cost is not None
            taken = self._best_lengths(probs, kv_lens, drafts, cost)
        else:
            c = self.verify_cost if self.verify_cost is not None else DEFAULT_VERIFY_COST
            gain = sum(p**j for p, d in zip(probs, drafts, strict=True) for j in range(1, len(d) + 1))
            verify = len(rids) + gain >= c * len(rids)
            taken = [len(d) if verify else 0 for d in drafts]
        if any(drafts) and not any(taken):
            counters.spec_skipped_cost_steps += 1
        chosen = [list(d[:t]) for d, t in zip(drafts, taken, strict=True)]
        for rid, d, kept in zip(rids, drafts, chosen, strict=True):
            if d and not kept:
                if any(taken):
                    counters.spec_backoff_req_steps += 1
                self._recover(rid)
        return chosen

    @staticmethod
    def _best_lengths(
        probs: Sequence[float], kv_lens: Sequence[int], drafts: Sequence[list[int]], cost: Cost
    ) -> list[int]:
        """Draft tokens to verify per request (all 0: plain decoding) under measured costs: add, one at a
        time, the request's next draft token that gives the best expected tokens per second, up to the
        largest bucket, and keep the best of these steps if it beats plain decoding by `MARGIN`. (Adding
        goes on past a worse step: the tokens of a bucket past its first cost nothing more.)"""
        b = len(kv_lens)
        work = Work(sum(L + 1 for L in kv_lens), 0, 0)
        plain = cost.predict(b, work)
        if plain is None or plain <= 0:
            return [0] * b
        taken, best, best_rate = [0] * b, [0] * b, b / plain * (1.0 + MARGIN)
        gain = 0.0
        for n in range(1, min(sum(map(len, drafts)), cost.max_tokens - b) + 1):
            pick: tuple[float, float, int, Work] | None = None  # (rate, gain, -index, work)
            for i, (p, L, d) in enumerate(zip(probs, kv_lens, drafts, strict=True)):
                k = taken[i]
                if k == len(d):
                    continue
                g = p ** (k + 1)
                more = work.add_token(L, k + 1)
                t = cost.predict(b + n, more)
                if t is None or t <= 0:
                    return best
                cand = ((b + gain + g) / t, g, -i, more)
                if pick is None or cand[:3] > pick[:3]:
                    pick = cand
            assert pick is not None
            rate, g, neg_i, work = pick
            taken[-neg_i] += 1
            gain += g
            if rate > best_rate:
                best, best_rate = list(taken), rate
        return best

    def _recover(self, rid: str) -> None:
        """A draft left out: its counts decay, its estimate drifts back toward the prior."""
        f = 1.0 - 1.0 / RECOVER_STEPS
        if rid in self._acc:
            self._acc[rid] *= f
            self._rej[rid] *= f

    def record(self, rid: str, drafted: int, accepted: int) -> None:
        """After a verify: ``accepted`` of the request's ``drafted`` draft tokens were emitted."""
        rejected = 1.0 if accepted < drafted else 0.0
        self._acc[rid] = DECAY * self._acc.get(rid, 0.0) + accepted
        self._rej[rid] = DECAY * self._rej.get(rid, 0.0) + rejected
        acc, rej = self._pool
        self._pool = (POOL_DECAY * acc + accepted, POOL_DECAY * rej + rejected)

    def prune(self, live: set[str]) -> None:
        """Forget requests no longer running."""
        if len(self._acc) > len(live):
            self._acc = {rid: v for rid, v in self._acc.items() if rid in live}
            self._rej = {rid: v for rid, v in self._rej.items() if rid in live}
