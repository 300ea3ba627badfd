"""When speculation backs off: the policy's rules by counts, and the engine under many concurrent requests.

Issue 26, item 8: 48 concurrent requests with NGRAM ran far slower than without speculation, because
every step verified drafts of the whole batch. Now a batch above --speculative-max-batch-size decodes
plainly (counted in spec_skipped_batch_steps), which the engine tests check by the counters and by
recording the batch size of every verify step, never by the clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixrt import Engine
from radixrt.config.server_args import ServerArgs
from radixrt.speculative.policy import EMA_WEIGHT, PRIOR_ACCEPT, RECOVER_STEPS, SpecPolicy
from radixrt.speculative.suffix_worker import SuffixSpeculator
from radixrt.speculative.worker import DecodeTarget, NgramSpeculator, Speculator
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats
from tests.engine_fixtures import prompts_of


# -- the policy by itself ------------------------------------------------------------------------------------
def test_batch_limit_is_counted() -> None:
    stats, pol = SchedulerStats(), SpecPolicy(max_batch_size=4, verify_cost=2.0)
    assert pol.batch_allows(4, stats) and not pol.batch_allows(5, stats) and not pol.batch_allows(48, stats)
    assert stats.spec_skipped_batch_steps == 2
    assert not SpecPolicy(0, 2.0).batch_allows(1, stats)  # 0: never speculate


def test_cost_rule_and_per_request_backoff() -> None:
    stats, pol = SchedulerStats(), SpecPolicy(max_batch_size=8, verify_cost=2.0)
    # prior 1.5 per drafted request; the step needs (2 - 1) * batch
    assert pol.choose(["a"], [[1, 2]], stats) == [[1, 2]]
    assert pol.choose(["a", "b", "c"], [[1], [], [2]], stats) == [[1], [], [2]]  # 3.0 >= 3
    assert pol.choose(["a", "b", "c", "d"], [[1], [], [], [2]], stats) == [[], [], [], []]  # 3.0 < 4
    assert stats.spec_skipped_cost_steps == 1
    for _ in range(6):  # "a" keeps getting nothing accepted: its average falls under (2 - 1) / 2
        pol.record("a", 0)
    assert pol.expected("a") == pytest.approx(PRIOR_ACCEPT * (1 - EMA_WEIGHT) ** 6)
    assert pol.expected("a") < 0.5
    steps = 0
    while pol.choose(["a"], [[1]], stats) == [[]]:  # backed off, recovering toward the prior, probed again
        steps += 1
        assert steps <= 2 * RECOVER_STEPS, "a backed-off request is never probed again"
    assert stats.spec_backoff_req_steps > 0 and pol.expected("a") >= 1.0
    assert stats.spec_backoff_req_steps + stats.spec_skipped_cost_steps == steps + 1
    pol.record("b", 4)
    assert pol.expected("b") == pytest.approx((1 - EMA_WEIGHT) * PRIOR_ACCEPT + EMA_WEIGHT * 4)
    pol.prune({"b"})
    assert pol.expected("a") == PRIOR_ACCEPT  # forgotten


def test_verify_cost_one_verifies_everything() -> None:
    stats, pol = SchedulerStats(), SpecPolicy(max_batch_size=64, verify_cost=1.0)
    for _ in range(20):
        pol.record("a", 0)
    assert pol.choose(["a", "b"], [[1], [2]], stats) == [[1], [2]]
    assert stats.spec_backoff_req_steps == stats.spec_skipped_cost_steps == 0


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
