"""N-gram speculative decoding: the drafter, the acceptance rule and the engine against HF / plain decoding.

Random checkpoints almost never repeat themselves, so most engine tests install an *oracle drafter*
(the true continuation with one token corrupted per step) to exercise accept, reject, bonus, stop and KV
paths on the fixture models; a sliding-window Mistral (whose output depends only on the last 13
tokens) makes the real n-gram drafter hit and be accepted on a prompt that repeats itself.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from radixrt import Engine
from radixrt.config.server_args import ServerArgs
from radixrt.config.speculative_args import draft_tokens
from radixrt.sampling.sampling_batch import SamplingBatchInfo
from radixrt.sampling.sampling_params import SamplingParams
from radixrt.speculative.ngram import NgramIndex, propose_naive
from radixrt.speculative.verify import verify
from radixrt.speculative.worker import NgramSpeculator
from radixrt.testing.random_checkpoint import make_checkpoint
from radixrt.worker.req import Req
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_model

SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_verify_cost": 1.0,
    "speculative_max_batch_size": 1024,
}  # verify every draft
GREEDY = {"temperature": 0, "ignore_eos": True}


def spec_stats(eng: Engine) -> dict[str, float]:
    return {k: v for k, v in eng.get_server_info().items() if k.startswith("spec_")}


def assert_drafts_accepted_and_rejected(eng: Engine) -> None:
    s = spec_stats(eng)
    assert s["spec_draft_tokens"] > s["spec_accepted_tokens"] > 0, s
    assert s["spec_accept_length"] > 1.0


class OracleSpeculator(NgramSpeculator):
    """Drafts from a table instead of the n-gram index: ``table(req, max_len)`` -> draft."""

    def __init__(self, args: ServerArgs, table: Callable[[Req, int], list[int]]) -> None:
        super().__init__(args)
        self.table = table

    def propose(self, req: Req, max_len: int) -> list[int]:
        return self.table(req, max_len)


def install(eng: Engine, table: Callable[[Req, int], list[int]]) -> None:
    eng.worker.call(lambda s: setattr(s, "_spec", OracleSpeculator(s.args, table)))


def corrupted_truth(refs: dict[tuple[int, ...], list[int]]) -> Callable[[Req, int], list[int]]:
    """Draft the true continuation with one wrong token whose place cycles with the step (or none)."""

    def table(req: Req, max_len: int) -> list[int]:
        ref = refs[tuple(req.origin_input_ids)]
        i = len(req.output_ids)
        if req.output_ids != ref[:i]:
            return []  # off the reference path: the test's comparison reports it
        draft = ref[i : i + max_len]
        bad = i % (max_len + 2)
        if bad < len(draft):
            draft[bad] = (draft[bad] + 1) % 8192
        return draft

    return table


# -- the drafter ---------------------------------------------------------------------------------------------
def test_ngram_index_examples() -> None:
    idx = NgramIndex(3)
    assert idx.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # 3-gram hit
    assert NgramIndex(3).propose([7, 2, 3, 9, 5, 1, 3], 3) == [9, 5, 1]  # falls back to the 1-gram
    assert NgramIndex(3).propose([1, 5, 1, 6, 1], 2) == [6, 1]  # the most recent occurrence
    assert NgramIndex(2).propose([4, 4, 4], 3) == [4]  # continuation cut by the sequence end
    assert NgramIndex(3).propose([1, 2, 3], 4) == []  # nothing repeats


def test_ngram_index_matches_naive_scan() -> None:
    rng = random.Random(0)
    for trial in range(60):
        max_n, k = rng.randint(1, 4), rng.randint(1, 5)
        idx = NgramIndex(max_n)
        seq = [rng.randrange(4 + trial % 5) for _ in range(rng.randint(0, 3))]
        for _ in range(40):
            assert idx.propose(seq, k) == propose_naive(seq, max_n, k), (seq, max_n, k)
            seq += [rng.randrange(4 + trial % 5) for _ in range(rng.randint(1, 3))]


def test_server_args_validation() -> None:
    with pytest.raises(ValueError, match="speculative_algorithm.*NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_ngram_max_match_window_size"):
        ServerArgs(speculative_ngram_max_match_window_size=0)


def test_draft_cap_defaults_per_algorithm() -> None:
    """Unset, the draft cap is the algorithm's own (SUFFIX drafts adaptively, so it gets the larger one);
    set, it wins for every algorithm."""
    assert draft_tokens(ServerArgs(speculative_algorithm="NGRAM")) == 4
    assert draft_tokens(ServerArgs(speculative_algorithm="SUFFIX")) == 8
    assert draft_tokens(ServerArgs(speculative_algorithm="SUFFIX", speculative_num_draft_tokens=3)) == 3
    assert draft_tokens(ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)) == 6


# -- the acceptance rule, against exact probabilities ----------------------------------------------------------
def _verify_many(rows: list[torch.Tensor], draft: list[int], n: int, **params: Any) -> list[list[int]]:
    """``n`` seeded requests with the same verify logits ``rows`` (1 + len(draft)) and draft."""
    sp = SamplingParams(**params)
    info = SamplingBatchInfo.build(
        [sp] * (n * len(rows)),
        [s for s in range(n) for _ in rows],
        [j for _ in range(n) for j in range(len(rows))],
        [[]] * (n * len(rows)),
        [[0]] * (n * len(rows)),
        [[]] * (n * len(rows)),
        rows[0].shape[0],
    )
    return verify(torch.stack(rows * n), info, [draft] * n)


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, generator=g) * 1.5 for _ in range(3)]
    probs = [torch.softmax(r, -1) for r in rows]
    x, y = int(probs[0].argsort()[-2]), int(probs[1].argmax())  # plausible, not certain, drafts
    n = 6000
    outs = _verify_many(rows, [x, y], n, temperature=1.0)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=8).double() / n
    sigma = (probs[0] * (1 - probs[0]) / n).sqrt()
    assert ((first - probs[0]).abs() <= 4 * sigma + 1e-3).all(), (first, probs[0])
    accepted = [o for o in outs if len(o) > 1]
    assert abs(len(accepted) / n - float(probs[0][x])) <= 4 * math.sqrt(0.25 / n)
    second = torch.bincount(torch.tensor([o[1] for o in accepted]), minlength=8).double() / len(accepted)
    sigma2 = (probs[1] * (1 - probs[1]) / len(accepted)).sqrt()
    assert ((second - probs[1]).abs() <= 4 * sigma2 + 1e-3).all(), (second, probs[1])
    assert all(o[:2] == [x, y] for o in outs if len(o) == 3)
    # greedy: exactly the argmax chain, stopping at the first mismatch
    assert _verify_many(rows, [int(probs[0].argmax()), y], 1, temperature=0.0)[0] == [
        int(probs[0].argmax()),
        y,
        int(probs[2].argmax()),
    ]
    # a draft outside the top-k is never accepted
    outside = int(probs[0].argmin())
    assert all(len(o) == 1 for o in _verify_many(rows[:2], [outside], 500, temperature=1.0, top_k=3))


# -- engine: greedy parity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_greedy_with_drafts_matches_hf(
    arch: str, page_size: int, request: pytest.FixtureRequest, engine_factory
) -> None:
    path = request.getfixturevalue(arch)
    prompts = prompts_of([5, 33, 17, 48], seed=21)
    n = 20
    refs = {tuple(p): hf_greedy(path, p, n) for p in prompts}
    eng = engine_factory(path, page_size=page_size, **SPEC)
    install(eng, corrupted_truth(refs))
    stop = refs[tuple(prompts[2])][9]
    params = [
        {**GREEDY, "max_new_tokens": n},
        {**GREEDY, "max_new_tokens": 7},
        {**GREEDY, "max_new_tokens": n, "stop_token_ids": [stop]},
        {**GREEDY, "max_new_tokens": n},
    ]
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=[False, False, False, True])
    want = [refs[tuple(p)] for p in prompts]
    assert outs[0]["output_ids"] == want[0]
    assert outs[1]["output_ids"] == want[1][:7]
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert outs[2]["output_ids"] == want[2][: want[2].index(stop) + 1]
    assert outs[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert outs[3]["output_ids"] == want[3]  # logprobs requested: never drafted, still exact
    assert len(outs[3]["meta_info"]["output_token_logprobs"]) == n
    assert_drafts_accepted_and_rejected(eng)


def test_penalties_and_min_new_tokens_match_plain_decoding(tiny_llama: Path, engine_factory) -> None:
    prompts = prompts_of([9, 26], seed=22)
    params = [
        {**GREEDY, "max_new_tokens": 16, "frequency_penalty": -2.0, "repetition_penalty": 0.5},
        {"temperature": 0, "max_new_tokens": 16, "presence_penalty": 1.0},
    ]
    plain = engine_factory(tiny_llama).generate(input_ids=prompts, sampling_params=params)
    refs = {tuple(p): o["output_ids"] for p, o in zip(prompts, plain, strict=True)}
    # min_new_tokens bans the stop token until reached: drafted before then, it must be rejected
    stop = refs[tuple(prompts[1])][2]
    params[1] |= {"stop_token_ids": [stop], "min_new_tokens": 6}
    banned = engine_factory(tiny_llama).generate(input_ids=prompts[1], sampling_params=params[1])
    refs[tuple(prompts[1])] = banned["output_ids"] + [0] * 16
    truth = corrupted_truth(refs)

    def table(req: Req, max_len: int) -> list[int]:
        draft = truth(req, max_len)
        j = 2 - len(req.output_ids)  # the unbanned argmax at output index 2 is the stop token
        if req.origin_input_ids == prompts[1] and 0 <= j < len(draft):
            draft[j] = stop
        return draft

    eng = engine_factory(tiny_llama, **SPEC)
    install(eng, table)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert outs[0]["output_ids"] == plain[0]["output_ids"]
    assert outs[1]["output_ids"] == banned["output_ids"]
    assert_drafts_accepted_and_rejected(eng)


def test_small_pool_falls_back_and_matches_hf(tiny_llama: Path, engine_factory) -> None:
    prompts = prompts_of([30, 25, 35, 20], seed=5)
    refs = {tuple(p): hf_greedy(tiny_llama, p, 40) for p in prompts}
    eng = engine_factory(
        tiny_llama, max_total_tokens=200, chunked_prefill_size=64, disable_radix_cache=True, **SPEC
    )
    install(eng, corrupted_truth(refs))
    outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40})
    assert [o["output_ids"] for o in outs] == [refs[tuple(p)] for p in prompts]
    assert eng.get_server_info()["retractions"] > 0
    assert_drafts_accepted_and_rejected(eng)


def test_constrained_rows_decode_plainly_in_speculative_steps(tiny_qwen2: Path, engine_factory) -> None:
    """Grammar rows (with jump-forward) share verify forwards with drafted rows and are never drafted."""
    free = prompts_of([18, 7], seed=40)
    refs = {tuple(p): hf_greedy(tiny_qwen2, p, 30) for p in free}
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    constrained = {"regex": regex, "temperature": 1.0, "max_new_tokens": 30}
    params = [
        {**GREEDY, "max_new_tokens": 30},
        {**constrained, "seed": 3},
        {**constrained, "seed": 4},
        {**GREEDY, "max_new_tokens": 30},
    ]
    plain = engine_factory(tiny_qwen2)
    phone = plain.tokenizer.encode("Phone: ")
    prompts = [free[0], phone, phone, free[1]]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    eng = engine_factory(tiny_qwen2, **SPEC)
    install(eng, corrupted_truth(refs))
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert outs[0]["output_ids"] == refs[tuple(free[0])] and outs[3]["output_ids"] == refs[tuple(free[1])]
    for o, w in zip(outs[1:3], want[1:3], strict=True):
        assert re.fullmatch(regex, o["text"]) and o["output_ids"] == w["output_ids"]
    assert eng.get_server_info()["jump_forward_tokens"] > 0
    assert_drafts_accepted_and_rejected(eng)


# -- engine: the real n-gram drafter ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sliding_mistral(checkpoints_dir: Path) -> Path:
    """Mistral with a 4-token sliding window over 4 layers: the next token depends on the last 13 only."""
    return make_checkpoint(
        checkpoints_dir / "spec_swa", arch="mistral", size="tiny", seed=5, sliding_window=4
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_drafts_accepted_on_a_self_repeating_prompt(
    sliding_mistral: Path, page_size: int, engine_factory
) -> None:
    n = 24
    heads = prompts_of([20, 16], seed=3)
    junk = prompts_of([7], seed=4)[0]
    # head + (its first 8 greedy tokens) + junk + head's last 14 tokens: the model then continues as
    # after head, the drafter finds head's tail earlier and proposes the 8 copied tokens, then junk.
    prompts = [h + hf_greedy(sliding_mistral, h, 8) + junk + h[-14:] for h in heads]
    prompts.append(prompts_of([12], seed=6)[0])
    eng = engine_factory(sliding_mistral, page_size=page_size, **SPEC)
    outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n})
    for p, o in zip(prompts, outs, strict=True):
        assert o["output_ids"] == hf_greedy(sliding_mistral, p, n)
    assert_drafts_accepted_and_rejected(eng)


# -- engine: sampling ---------------------------------------------------------------------------------------
@torch.inference_mode()
def _top_k_probs(path: Path, ids: Sequence[int], k: int) -> torch.Tensor:
    logits = hf_model(str(path))(torch.tensor([list(ids)])).logits[0, -1].float()
    kth = logits.topk(k).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)


def test_sampled_drafts_keep_the_distribution(tiny_llama: Path, engine_factory) -> None:
    """Seeded top-k sampling: the tokens decided by verification follow the target model's law (checked
    against HF's probabilities), and, the uniforms being per output index, equal plain decoding."""
    k, n = 4, 200
    prompt = prompts_of([14], seed=10)[0]
    firsts = _top_k_probs(tiny_llama, prompt, k).nonzero().flatten().tolist()
    # draft: the greedy chain after each possible first token (what a draft model would propose)
    chains = {t: hf_greedy(tiny_llama, prompt + [t], 2) for t in firsts}
    p1 = {t: _top_k_probs(tiny_llama, prompt + [t], k) for t in firsts}
    p2 = {t: _top_k_probs(tiny_llama, prompt + [t, chains[t][0]], k) for t in firsts}

    def table(req: Req, max_len: int) -> list[int]:
        return chains[req.output_ids[0]][:max_len] if len(req.output_ids) == 1 else []

    params = [
        {"temperature": 1.0, "top_k": k, "max_new_tokens": 4, "seed": s, "ignore_eos": True} for s in range(n)
    ]
    plain = [
        o["output_ids"]
        for o in engine_factory(tiny_llama).generate(input_ids=[prompt] * n, sampling_params=params)
    ]
    eng = engine_factory(tiny_llama, **SPEC)
    install(eng, table)
    outs = [o["output_ids"] for o in eng.generate(input_ids=[prompt] * n, sampling_params=params)]
    # acceptance of each draft position vs its exact probability, summed over the seeds that reach it
    for pos, dist in ((1, p1), (2, p2)):
        reach = [o for o in outs if pos == 1 or o[1] == chains[o[0]][0]]
        probs = [float(dist[o[0]][chains[o[0]][pos - 1]]) for o in reach]
        hits = sum(o[pos] == chains[o[0]][pos - 1] for o in reach)
        sigma = math.sqrt(sum(p * (1 - p) for p in probs))
        assert abs(hits - sum(probs)) <= 4 * sigma + 1, (pos, hits, sum(probs))
    assert sum(a == b for a, b in zip(outs, plain, strict=True)) >= n - 2
    assert_drafts_accepted_and_rejected(eng)
