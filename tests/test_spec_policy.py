"""When speculation backs off: the policy's rules by counts, and the engine under many concurrent requests.

Issue 26, item 8: 48 concurrent requests with NGRAM ran far slower than without speculation, because
every step verified drafts of the whole batch. Now a batch above --speculative-max-batch-size decodes
plainly (counted in spec_skipped_batch_steps), which the engine tests check by the counters and by
recording the batch size of every verify step, never by the clock.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from radixrt import Engine
from radixrt.config.server_args import ServerArgs
from radixrt.kernels.base import ForwardMode
from radixrt.speculative.policy import (
    DECAY,
    MARGIN,
    POOL_DECAY,
    PRIOR_P,
    PRIOR_WEIGHT,
    RECOVER_STEPS,
    SpecPolicy,
)
from radixrt.speculative.suffix_worker import SuffixSpeculator
from radixrt.speculative.worker import DecodeTarget, NgramSpeculator, Speculator
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats
from radixrt.worker.step_cost import StepCost, Work, attention_work, fit_rates
from tests.engine_fixtures import prompts_of


# -- the policy by itself ------------------------------------------------------------------------------------
def test_batch_limit_is_counted() -> None:
    stats, pol = SchedulerStats(), SpecPolicy(max_batch_size=4, verify_cost=2.0)
    assert pol.batch_allows(4, stats) and not pol.batch_allows(5, stats) and not pol.batch_allows(48, stats)
    assert stats.spec_skipped_batch_steps == 2
    assert not SpecPolicy(0, 2.0).batch_allows(1, stats)  # 0: never speculate


def test_acceptance_estimate_and_recovery() -> None:
    pol = SpecPolicy(max_batch_size=8, verify_cost=None)
    assert pol.accept_prob("a") == pytest.approx(PRIOR_P)
    pol.record("a", 4, 4)  # all accepted: 4 successes, no rejection
    pol.record("a", 4, 1)  # one accepted, then a rejection
    acc, rej = DECAY * 4 + 1, 1.0
    pooled = POOL_DECAY * 4 + 1  # every request's verifies, decaying slower: the prior of a request
    prior = (pooled + PRIOR_P * PRIOR_WEIGHT) / (pooled + rej + PRIOR_WEIGHT)
    assert pol.prior() == pytest.approx(prior)
    assert pol.accept_prob("a") == pytest.approx((acc + prior * PRIOR_WEIGHT) / (acc + rej + PRIOR_WEIGHT))
    for _ in range(10):
        pol.record("b", 3, 0)
    low = pol.accept_prob("b")
    assert low < 0.2
    stats, cost = SchedulerStats(), LinearCost(1.0, 0.1, 0.0, list(range(1, 41)))
    steps = 0
    while pol.choose(["a", "b"], [10, 10], [[1, 2], [3]], stats, cost) == [[1, 2], []]:
        steps += 1  # left out while "a" verifies: drifts back toward the prior, then probed again
        assert steps <= 2 * RECOVER_STEPS, "a backed-off request is never probed again"
    assert steps > 0 and stats.spec_backoff_req_steps == steps
    assert low < pol.accept_prob("b") < PRIOR_P
    pol.prune({"b"})
    assert pol.accept_prob("a") == pytest.approx(pol.prior())  # forgotten: a new request's prior
    assert pol.prior() < PRIOR_P  # pooled: the verifies above rejected more than the prior expects


def test_constant_cost_verifies_all_drafts_or_none() -> None:
    stats, pol = SchedulerStats(), SpecPolicy(max_batch_size=8, verify_cost=2.0)
    p = PRIOR_P
    # B + sum p^j >= 2 B: one request with 4 draft tokens (1 + 1.30) passes, with 2 (1 + 0.96) does not
    assert pol.choose(["a"], [5], [[1, 2, 3, 4]], stats) == [[1, 2, 3, 4]]
    assert p + p**2 < 1.0 and pol.choose(["a"], [5], [[1, 2]], stats) == [[]]
    assert stats.spec_skipped_cost_steps == 1
    one = SpecPolicy(max_batch_size=64, verify_cost=1.0)
    for _ in range(20):
        one.record("a", 1, 0)
    assert one.choose(["a", "b"], [5, 5], [[1], [2]], stats) == [[1], [2]]  # 1: every draft verified
    # no measured cost given: the constant applies even with verify_cost unset
    assert SpecPolicy(8, None).choose(["a"], [5], [[1, 2]], stats) == [[]]


class FlatCost:
    """Every forward costs the same (memory-bound): verifying is free."""

    max_tokens = 64

    def ready(self) -> bool:
        return True

    def predict(self, tokens: int, work: Work) -> float | None:
        return 1.0 if tokens <= self.max_tokens else None


class LinearCost(FlatCost):
    """A fixed part plus a part per token and per attention position or pair (a multi-token request's pairs at
    ``ratio`` times a single token's, its positions at ``gather``), bucketed like the compiled step."""

    def __init__(
        self,
        fixed: float,
        per_token: float,
        per_pair: float,
        buckets: list[int],
        ratio: float = 1.0,
        gather: float = 0.0,
    ) -> None:
        self.fixed, self.per_token, self.per_pair, self.buckets = fixed, per_token, per_pair, buckets
        self.ratio, self.gather = ratio, gather
        self.max_tokens = buckets[-1]

    def predict(self, tokens: int, work: Work) -> float | None:
        b = next((b for b in self.buckets if b >= tokens), None)
        attention = self.per_pair * (work.single + self.ratio * work.pairs + self.gather * work.positions)
        return None if b is None else self.fixed + self.per_token * b + attention


def _rate(drafts: list[list[int]], probs: list[float], kv_lens: list[int], cost: LinearCost) -> float:
    """Expected tokens per second of a step verifying ``drafts`` (plain decoding: all empty)."""
    n = sum(len(d) for d in drafts)
    gain = sum(p**j for d, p in zip(drafts, probs, strict=True) for j in range(1, len(d) + 1))
    t = cost.predict(len(drafts) + n, attention_work(kv_lens, [1 + len(d) for d in drafts]))
    assert t is not None
    return (len(drafts) + gain) / t


def test_measured_cost_picks_the_fastest_step() -> None:
    """The chosen drafts are within 3% of the best expected tokens per second (brute force over every
    combination of per-request draft lengths), and never predicted slower than plain decoding."""
    rng = random.Random(3)
    buckets = [1, 2, 4, 5, 8, 10, 16, 20, 40]
    for trial in range(200):
        ratio = rng.uniform(0.2, 1.5)
        gather = rng.choice([0.0, rng.uniform(0, 3)])
        cost = LinearCost(
            rng.uniform(0, 1), rng.uniform(0.01, 0.3), rng.uniform(0, 1e-4), buckets, ratio, gather
        )
        b = rng.randint(1, 4)
        rids = [f"r{trial}-{i}" for i in range(b)]
        pol = SpecPolicy(max_batch_size=8, verify_cost=None)
        for rid in rids:
            for _ in range(rng.randint(0, 6)):
                d = rng.randint(1, 4)
                pol.record(rid, d, rng.randint(0, d))
        drafts = [list(range(rng.randint(0, 4))) for _ in rids]
        kv_lens = [rng.randint(1, 3000) for _ in rids]
        probs = [pol.accept_prob(r) for r in rids]
        got = pol.choose(rids, kv_lens, drafts, SchedulerStats(), cost)
        assert all(g == d[: len(g)] for g, d in zip(got, drafts, strict=True))
        plain = _rate([[] for _ in rids], probs, kv_lens, cost)
        best = max(
            _rate([d[:k] for d, k in zip(drafts, ks, strict=True)], probs, kv_lens, cost)
            for ks in itertools.product(*(range(len(d) + 1) for d in drafts))
        )
        rate = _rate(got, probs, kv_lens, cost)
        if any(got):
            assert rate >= plain * (1 + MARGIN) - 1e-12
            assert rate >= 0.97 * best  # one token at a time: near the optimum
        else:
            assert best <= 1.03 * plain * (1 + MARGIN)


def test_measured_cost_follows_batch_and_context() -> None:
    """Costly rows or a long context: only confident drafts pay; with rows nearly free, every draft is
    verified; the bucket budget is kept; purely per-row costs (no fixed part) never pay."""
    pol = SpecPolicy(max_batch_size=8, verify_cost=None)
    for _ in range(5):
        pol.record("hot", 4, 4)  # p ~ 0.94
        pol.record("cold", 4, 0)  # p ~ 0.1
    rids, drafts = ["hot", "cold"], [[1, 2, 3, 4], [5, 6, 7, 8]]
    per_row = LinearCost(1.0, 0.5, 0.0, list(range(1, 41)))  # a row costs half the step's fixed part
    got = pol.choose(rids, [100, 100], drafts, SchedulerStats(), per_row)
    assert got == [[1, 2, 3, 4], []]
    assert pol.choose(
        rids, [100, 100], drafts, SchedulerStats(), LinearCost(0.0, 1.0, 0.0, list(range(1, 41)))
    ) == [[], []]
    cheap = LinearCost(1.0, 1e-5, 0.0, list(range(1, 41)))
    assert pol.choose(rids, [100, 100], drafts, SchedulerStats(), cheap) == drafts
    attention = LinearCost(1.0, 1e-3, 1e-3, list(range(1, 41)))  # 1k-token contexts: attention dominates
    assert pol.choose(rids, [1000, 1000], drafts, SchedulerStats(), attention)[1] == []
    small = LinearCost(1.0, 1e-3, 0.0, [1, 2, 4])  # budget: 4 tokens in all
    got = pol.choose(rids, [100, 100], drafts, SchedulerStats(), small)
    assert sum(1 + len(d) for d in got) <= 4 and got[0] == [1, 2]


def test_step_cost_calibrates_then_follows_the_load() -> None:
    """Warm-up: buckets timed, a decode's attention per position, each verify kernel's rates per position and
    per pair from verifies of 2 and 5 tokens, the kernel faster at a full draft kept; afterwards every forward
    moves the scale (the machine's load) and the attention rates."""
    rates = {"slow": (0.0, 2e-6), "gather": (1e-6, 0.25e-6)}  # (per position, per pair)
    used: list[str] = []

    def probe(mode: ForwardMode, context: int, n: int) -> tuple[float, float]:
        if mode == ForwardMode.DECODE:
            return 0.0, 1e-6 * (context + 1)
        pos, pair = rates[used[-1]]
        return 0.0, pos * (context + n) + pair * n * (context + n)

    cost = StepCost([1, 2, 4, 5, 8])
    assert not cost.ready() and cost.predict(1, Work(10, 0, 0)) is None
    kernel = cost.calibrate(lambda b: 0.01 * b, probe, 1000, 4, ["slow", "gather"], used.append)
    assert kernel == "gather" and used[-1] == "gather" and cost.ready()
    assert cost.per_position == pytest.approx(1e-6) and cost.per_pair == pytest.approx(0.25e-6)
    assert cost.predict(3, Work(1000, 0, 0)) == pytest.approx(0.04 + 1e-3)
    assert cost.predict(5, Work(0, 1000, 4000)) == pytest.approx(0.05 + 1e-3 + 1e-3)
    assert cost.predict(9, Work(1, 0, 0)) is None  # no bucket: it would run eagerly
    for _ in range(200):  # the machine got twice as slow, attention three times
        cost.observe(4, Work(4000, 0, 0), 2 * 0.04 + 12e-3, 12e-3)
        cost.observe(8, Work(2000, 1000, 4000), 2 * 0.08 + 12e-3, 12e-3)  # 6 ms single, 6 ms multi
    assert cost.predict(2, Work(1000, 0, 0)) == pytest.approx(2 * 0.02 + 3e-3, rel=1e-3)
    assert cost.predict(5, Work(0, 1000, 4000)) == pytest.approx(2 * 0.05 + 6e-3, rel=1e-3)
    assert attention_work([10, 20, 30], [1, 3, 1]) == Work(11 + 31, 23, 3 * 23)
    assert Work(11, 0, 0).add_token(10, 1) == attention_work([10], [2])
    assert attention_work([10], [3]).add_token(10, 3) == attention_work([10], [4])
    assert fit_rates(100, 0.0, 2, 1.0) == (0.0, 1.0 / 204)  # a draft of 1: pairs only


# -- the engine under concurrency ----------------------------------------------------------------------------
class Recorder:
    """Wraps a speculator's step: records the batch size of every step and whether it verified."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.steps: list[tuple[int, bool]] = []

    def step(self, reqs: list[Req], target: DecodeTarget) -> bool:
        did = self.inner.step(reqs, target)
        self.steps.append((len(reqs), did))
        return did


class AlwaysNgram(NgramSpeculator):
    """NGRAM that always has a draft (the n-gram proposal, else the last token repeated), so that every
    step with few enough requests verifies: the test is about when drafts are verified, not found."""

    def propose(self, req: Req, max_len: int) -> list[int]:
        return super().propose(req, max_len) or [req.output_ids[-1]] * max_len


def _workload(eng: Engine, n: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    phone = eng.tokenizer.encode("Phone: ")
    prompts, params = [], []
    for i, p in enumerate(prompts_of([12 + i % 9 for i in range(n)], seed=61)):
        if i % 4 == 3:
            prompts.append(phone)
            params.append({"regex": r"\(\d{3}\) \d{3}-\d{4}", "temperature": 0, "max_new_tokens": 24})
        else:
            prompts.append(p + p)  # self-repeating: the n-gram and suffix drafters find matches
            new = 60 if i < 3 else 12 + i % 13  # a few long ones: the tail runs under the batch limit
            params.append(
                {"temperature": 0 if i % 4 else 0.8, "seed": i, "max_new_tokens": new, "ignore_eos": True}
            )
    return prompts, params


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_many_concurrent_requests_decode_plainly_above_the_batch_limit(
    algorithm: str, tiny_qwen2: Path, engine_factory
) -> None:
    n, limit = 48, 4
    plain = engine_factory(tiny_qwen2)
    prompts, params = _workload(plain, n)
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    eng = engine_factory(
        tiny_qwen2,
        speculative_algorithm=algorithm,
        speculative_max_batch_size=limit,
        speculative_verify_cost=1.0,
    )
    cls = AlwaysNgram if algorithm == "NGRAM" else SuffixSpeculator
    eng.worker.call(lambda s: setattr(s, "_spec", Recorder(cls(s.args))))
    for _ in range(2):  # the second round: SUFFIX's global index is warm
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        got = [o["output_ids"] for o in outs]
        greedy = [i for i, p in enumerate(params) if p["temperature"] == 0]
        assert [got[i] for i in greedy] == [want[i] for i in greedy]
    steps = eng.worker.call(lambda s: list(s._spec.steps))
    info = eng.get_server_info()
    over = sum(1 for b, _ in steps if b > limit)
    assert over > 0 and info["spec_skipped_batch_steps"] == over
    assert all(b <= limit for b, did in steps if did), "a verify step ran above the batch limit"
    assert (
        info["spec_verify_steps"] == sum(did for _, did in steps) > 0
    )  # the tail of each round still drafts


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("speculative_max_batch_size", -1),
        ("speculative_verify_cost", 0.5),
        ("speculative_suffix_max_depth", 1),
        ("speculative_suffix_min_prob", 1.5),
        ("speculative_suffix_cache_tokens", 0),
    ],
)
def test_flags_out_of_range_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServerArgs(speculative_algorithm="SUFFIX", **{field: value})
