"""The fair tail (issue 26 item 7): a lighter tenant's request that arrives while a heavier tenant's long
prompt is being prefilled in chunks takes the next round without that prompt's chunk beside it, and the
heavier tenant's prefill goes on when no lighter request can be admitted.

The scenarios run on the scheduler thread, stepping the scheduler by hand, so which request meets which
round is exact (no timing)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixrt.sampling.sampling_params import SamplingParams
from radixrt.transport.protocol import TokenizedGenerateReq
from radixrt.worker.tenant_ledger import CONTENDED_ROUND_TOKENS
from tests.engine_fixtures import prompts_of

NOISY_CAP = -(-3 * CONTENDED_ROUND_TOKENS // 10)  # ceil(0.3 x 512): noisy's contended round


def _tenants(tmp_path: Path, quiet_quota: float = 0.4) -> str:
    doc = {"tenants": [{"name": "quiet", "api_keys": ["q"], "kv_quota": quiet_quota},
                       {"name": "noisy", "api_keys": ["n"], "kv_quota": 0.3}]}  # fmt: skip
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(doc))
    return str(path)


class Driver:
    """Adds requests and steps the scheduler by hand, recording every prefill round as (rid, tokens)."""

    def __init__(self, s: Any, now: list[float]) -> None:
        self.s = s
        self.rounds: list[list[tuple[str, int]]] = []
        self.reqs: dict[str, Any] = {}
        s.ledger.clock = lambda: now[0]
        real = s._run_extend

        def recording(batch: list[Any], mixed: list[Any]) -> None:
            self.rounds.append([(r.rid, r.extend_len) for r in batch])
            real(batch, mixed)

        s._run_extend = recording

    def add(self, rid: str, ids: list[int], tenant: str, new_tokens: int = 4) -> None:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        self.s.add_request(
            TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=params, seed=0, tenant=tenant)
        )
        self.reqs[rid] = self.s.by_rid[rid]

    def step_until(self, done: Callable[[], bool], limit: int = 200) -> None:
        for _ in range(limit):
            if done():
                return
            self.s.step()
        raise AssertionError(f"not done after {limit} steps; rounds {self.rounds}")

    def first_token_round(self, rid: str) -> int:
        """The index of the round that finished ``rid``'s prefill (its first token)."""
        return max(i for i, r in enumerate(self.rounds) if any(x == rid for x, _ in r))


def test_a_lighter_request_takes_the_next_round_alone(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Noisy's 600-token prompt is chunked to its contended cap; quiet's request arrives after the first
    chunk: the next round is quiet's alone (noisy's chunk waits one round), so the prefill tokens quiet waits
    behind from arrival to first token are its own. Noisy's prompt still goes through whole, and both
    outputs are what they are with no contention."""
    eng = engine_factory(tiny_llama, max_total_tokens=4096, tenants=_tenants(tmp_path))
    first, quiet, noisy = prompts_of([40, 40, 600], seed=7)

    def scenario(s: Any) -> dict[str, Any]:
        d = Driver(s, [1000.0])
        d.add("q0", first, "quiet")  # quiet is active: noisy's rounds are chunked small
        d.step_until(s.is_idle)
        d.rounds.clear()
        d.add("n0", noisy, "noisy")
        s.step()  # noisy's first chunk
        d.add("q1", quiet, "quiet")  # arrives while noisy's prompt is chunking
        d.step_until(s.is_idle)
        return {"rounds": d.rounds, "first": d.first_token_round("q1"),
                "out": {rid: list(r.output_ids) for rid, r in d.reqs.items()}}  # fmt: skip

    got = eng.worker.call(scenario, timeout=120)
    rounds = got["rounds"]
    assert rounds[0] == [("n0", NOISY_CAP)], rounds
    assert rounds[1] == [("q1", 40)], rounds  # the next round, alone
    assert got["first"] == 1
    waited = sum(n for r in rounds[1 : got["first"] + 1] for _, n in r)  # after arrival, to its first token
    assert waited == 40
    noisy_sizes = [n for r in rounds for rid, n in r if rid == "n0"]
    assert sum(noisy_sizes) == 600 and max(noisy_sizes) <= NOISY_CAP, rounds
    assert eng.flush_cache()

    def alone(s: Any) -> dict[str, list[int]]:
        d = Driver(s, [2000.0])
        out = {}
        for rid, ids, tenant in (("q1", quiet, "quiet"), ("n0", noisy, "noisy")):
            d.add(rid, ids, tenant)
            d.step_until(s.is_idle)
            out[rid] = list(d.reqs[rid].output_ids)
        return out

    assert got["out"]["q1"] == eng.worker.call(alone, timeout=120)["q1"]
    assert eng.flush_cache()
    assert got["out"]["n0"] == eng.worker.call(alone, timeout=120)["n0"]


def test_the_heavier_prefill_goes_on_when_the_lighter_request_cannot_be_admitted(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Quiet (lighter: one request) waits at its quota (a 300-token prompt, a 0.05 quota of 4096) while
    noisy (heavier: eight requests) prefills: noisy's chunk is not deferred for a request that cannot get
    in, so every round holds noisy tokens; once noisy is done and its activity window has lapsed, quiet runs."""
    eng = engine_factory(tiny_llama, max_total_tokens=4096, tenants=_tenants(tmp_path, quiet_quota=0.05))
    prompts = prompts_of([300] + [400] * 8, seed=8)
    now = [1000.0]

    def scenario(s: Any) -> list[list[tuple[str, int]]]:
        d = Driver(s, now)
        for i, ids in enumerate(prompts[1:]):
            d.add(f"n{i}", ids, "noisy", new_tokens=1)
        s.step()
        d.add("q", prompts[0], "quiet")
        d.step_until(lambda: all(d.reqs[f"n{i}"].finish_reason is not None for i in range(8)))
        assert d.reqs["q"].finish_reason is None and d.reqs["q"].extend_len == 0
        now[0] += 3.0  # noisy's activity window lapses: quiet is alone
        d.step_until(s.is_idle)
        return d.rounds

    rounds = eng.worker.call(scenario, timeout=120)
    q_round = next(i for i, r in enumerate(rounds) if any(rid == "q" for rid, _ in r))
    assert all(any(rid.startswith("n") for rid, _ in r) for r in rounds[:q_round]), rounds
    assert sum(n for r in rounds for rid, n in r if rid.startswith("n")) == 8 * 400
    assert [n for r in rounds for rid, n in r if rid == "q"] == [300]
