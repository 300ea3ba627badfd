"""SUFFIX speculation in the engine: greedy ids equal HF's cold and warm (batched, chunked, stop tokens,
constrained rows alongside), the warm global index gets its drafts accepted, and namespaces stay apart.

A request served before (same namespace, same prompt) is continued greedily the same way, so the global
index drafts the whole continuation: the warm run must accept nearly every draft token. Verify cost 1
makes every draft verified (the policy is tested in test_spec_policy.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from radixrt import Engine
from radixrt.speculative.suffix_worker import SuffixSpeculator
from radixrt.worker.req import Req
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

SUFFIX = {"speculative_algorithm": "SUFFIX", "speculative_verify_cost": 1.0, "speculative_max_batch_size": 64}
GREEDY = {"temperature": 0, "ignore_eos": True}


def spec_stats(eng: Engine) -> dict[str, float]:
    return {k: v for k, v in eng.get_server_info().items() if k.startswith("spec_")}


def test_greedy_parity_cold_and_warm(tiny_llama: Path, engine_factory) -> None:
    prompts = prompts_of([40, 9, 70, 23], seed=31)
    n = 24
    refs = [hf_greedy(tiny_llama, p, n) for p in prompts]
    stop = refs[1][12]
    params = [
        {**GREEDY, "max_new_tokens": n},
        {**GREEDY, "max_new_tokens": n, "stop_token_ids": [stop]},
        {**GREEDY, "max_new_tokens": 11},
        {**GREEDY, "max_new_tokens": n},
    ]
    want = [refs[0], refs[1][: refs[1].index(stop) + 1], refs[2][:11], refs[3]]
    eng = engine_factory(tiny_llama, page_size=16, chunked_prefill_size=32, **SUFFIX)
    cold = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in cold] == want
    before = spec_stats(eng)
    warm = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in warm] == want
    after = spec_stats(eng)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted)
    # one at a time too (batch 1), and a prefix of a served prompt still drafts from the index
    solo = eng.generate(input_ids=prompts[2][:60], sampling_params={**GREEDY, "max_new_tokens": n})
    assert solo["output_ids"] == hf_greedy(tiny_llama, prompts[2][:60], n)


def test_constrained_and_logprob_rows_share_suffix_steps(tiny_qwen2: Path, engine_factory) -> None:
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    plain = engine_factory(tiny_qwen2)
    phone = plain.tokenizer.encode("Phone: ")
    free = prompts_of([18, 30], seed=41)
    prompts = [free[0], phone, phone, free[1]]
    params: list[dict[str, Any]] = [
        {**GREEDY, "max_new_tokens": 30},
        {"regex": regex, "temperature": 1.0, "max_new_tokens": 30, "seed": 3},
        {"regex": regex, "temperature": 0.0, "max_new_tokens": 30},
        {**GREEDY, "max_new_tokens": 30},
    ]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    eng = engine_factory(tiny_qwen2, **SUFFIX)
    for _ in range(2):  # cold, then warm
        outs = eng.generate(
            input_ids=prompts, sampling_params=params, return_logprob=[False, False, False, True]
        )
        assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
        assert all(re.fullmatch(regex, o["text"]) for o in outs[1:3])
        assert len(outs[3]["meta_info"]["output_token_logprobs"]) == 30
    assert spec_stats(eng)["spec_accepted_tokens"] > 0


class SpySpeculator(SuffixSpeculator):
    """Records, per drafted request, its namespace and the draft the global index offered."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.shared: list[tuple[str | None, list[int]]] = []

    def propose(self, req: Req, max_len: int) -> list[int]:
        trie = self.cache.trie(req.cache_salt)
        seq = req.origin_input_ids + req.output_ids
        d = trie.draft(seq, max(1, self.depth - max_len), max_len, self.min_prob)[0] if trie else []
        self.shared.append((req.cache_salt, d))
        return super().propose(req, max_len)


def test_namespaces_isolate_the_global_index(tiny_llama: Path, engine_factory) -> None:
    prompt = prompts_of([30], seed=51)[0]
    n = 20
    ref = hf_greedy(tiny_llama, prompt, n)
    eng = engine_factory(tiny_llama, **SUFFIX)
    eng.worker.call(lambda s: setattr(s, "_spec", SpySpeculator(s.args)))
    p = {**GREEDY, "max_new_tokens": n}
    for salt in ("alpha", "beta", "alpha"):
        assert eng.generate(input_ids=prompt, sampling_params=p, cache_salt=salt)["output_ids"] == ref
    eng.generate(input_ids=[1, 2], sampling_params={**GREEDY, "max_new_tokens": 2})  # retire the last one
    shared = eng.worker.call(lambda s: list(s._spec.shared))
    by_salt: dict[str | None, list[list[int]]] = {}
    for salt, d in shared:
        by_salt.setdefault(salt, []).append(d)
    # beta ran the same prompt after alpha had served it: alpha's text never reached beta's drafts
    assert by_salt["beta"] and not any(by_salt["beta"])
    # alpha's second run drafted from alpha's first (the whole greedy continuation)
    assert sum(len(d) for d in by_salt["alpha"]) >= n - 5  # 4 + 4 + 4 + 3: all but prefill and bonus tokens
    tries = eng.worker.call(lambda s: {ns: s._spec.cache.trie(ns) is not None for ns in ("alpha", "beta")})
    assert tries == {"alpha": True, "beta": True}
