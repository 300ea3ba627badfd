"""Sampling: params validation, batched sampler against naive per-row references, penalties, logprobs."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from radixrt.sampling.logprobs import compute_logprobs
from radixrt.sampling.penalties import PenaltyInfo, apply_penalties
from radixrt.sampling.sampler import _inverse_cdf, row_uniforms, sample
from radixrt.sampling.sampling_batch import SamplingBatchInfo, row_keys
from radixrt.sampling.sampling_params import SamplingParams

V = 64


def build(
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    banned_ids: list[list[int]] | None = None,
    vocab_size: int = V,
) -> SamplingBatchInfo:
    b = len(params)
    return SamplingBatchInfo.build(
        params,
        seeds if seeds is not None else list(range(b)),
        steps if steps is not None else [0] * b,
        output_ids if output_ids is not None else [[] for _ in range(b)],
        prompt_ids if prompt_ids is not None else [[] for _ in range(b)],
        banned_ids if banned_ids is not None else [[] for _ in range(b)],
        vocab_size,
    )


# ---------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": [V]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"regex": "a+", "json_schema": "{}"}, "regex"),
        ({"json_schema": "{}", "ebnf": "root ::= 'a'"}, "json_schema"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_validate_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs).validate(vocab_size=V)


def test_validate_accepts_edges() -> None:
    cases: list[dict[str, Any]] = [
        {},
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 1.0, "max_new_tokens": 0},
        {"top_k": -1, "min_new_tokens": 5, "max_new_tokens": 5, "n": 3, "seed": 0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 0.5},
        {"stop_token_ids": [0, V - 1], "stop": ["\n"], "json_schema": "{}"},
    ]
    for kwargs in cases:
        SamplingParams(**kwargs).validate(vocab_size=V)


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="^temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("top_k", 2.0),
        ("stop", [1]),
        ("stop", 3),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", "1"),
        ("ignore_eos", 1),
        ("seed", 1.0),
        ("regex", 5),
        ("json_schema", 3),
    ],
)
def test_from_dict_rejects_wrong_types(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams.from_dict({field: value})


def test_from_dict_normalizes_and_round_trips() -> None:
    d = {
        "max_new_tokens": 7,
        "temperature": 1,  # int accepted for a float field
        "top_p": 0.9,
        "top_k": 20,
        "stop": "END",
        "stop_token_ids": [3, 4],
        "seed": 11,
        "json_schema": {"type": "object"},
        "min_p": None,  # null -> default
    }
    p = SamplingParams.from_dict(d)
    assert p.stop == ["END"] and p.json_schema == '{"type": "object"}'
    assert isinstance(p.temperature, float) and p.min_p == 0.0
    p.validate(vocab_size=V)
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams(stop="x").stop == ["x"]  # type: ignore[arg-type]
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(p), type=SamplingParams) == p
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


# ---------------------------------------------------------------- sampler


def ref_allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Naive per-row allowed set: top_k, then top_p on the renormalized rest, then min_p."""
    scaled = (logits.double() / p.temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda j: -scaled[j])
    if p.top_k > 0:
        order = order[: p.top_k]
    z = sum(math.exp(scaled[j] - scaled[order[0]]) for j in order)
    probs = {j: math.exp(scaled[j] - scaled[order[0]]) / z for j in order}
    kept, mass = [], 0.0
    for j in order:
        if mass >= p.top_p:
            break
        kept.append(j)
        mass += probs[j]
    return {j for j in kept if probs[j] >= p.min_p * probs[order[0]]}


def test_greedy_rows_equal_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g) * 3
    greedy = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.8)] * 4
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(sample(logits, build(greedy)), expected)
    mixed = [p if i % 2 == 0 else SamplingParams(temperature=1.5) for i, p in enumerate(greedy)]
    out = sample(logits.clone(), build(mixed))
    assert torch.equal(out[0::2], expected[0::2])
    # ties: exactly torch.argmax's choice (first maximum)
    tied = torch.zeros(2, V)
    assert torch.equal(sample(tied, build(greedy[:2])), torch.argmax(tied, dim=-1))
    assert int(sample(tied, build(mixed[:2]))[0]) == 0  # greedy row inside a sampled batch


def test_sample_does_not_modify_logits() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.3, top_p=0.5), SamplingParams(frequency_penalty=1.0)]
    sample(logits, build(params, output_ids=[[1, 2], [3]], banned_ids=[[4], [5]]))
    assert torch.equal(logits, before)


FILTER_CASES = [
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.1),
    SamplingParams(top_k=10, top_p=0.7, temperature=0.7),
    SamplingParams(top_k=8, min_p=0.2, temperature=1.3),
    SamplingParams(top_p=0.9, min_p=0.05, temperature=2.0),
    SamplingParams(),
]


def test_filters_only_draw_allowed_tokens() -> None:
    steps = 400
    g = torch.Generator().manual_seed(1)
    row_logits = torch.randn(len(FILTER_CASES), V, generator=g) * 2
    params = [p for p in FILTER_CASES for _ in range(steps)]
    logits = row_logits.repeat_interleave(steps, dim=0)
    seeds = [7] * len(params)
    step_ids = [s for _ in FILTER_CASES for s in range(steps)]
    out = sample(logits, build(params, seeds=seeds, steps=step_ids)).view(len(FILTER_CASES), steps)
    for i, p in enumerate(FILTER_CASES):
        allowed = ref_allowed(row_logits[i], p)
        drawn = set(out[i].tolist())
        assert drawn <= allowed, (p, drawn - allowed)
        # and nothing allowed is filtered away: every allowed token with prob >= 2% shows up
        probs = torch.softmax(row_logits[i].double() / p.temperature, dim=-1)
        mass = float(probs[sorted(allowed)].sum())
        likely = {j for j in allowed if probs[j] / mass >= 0.02}
        assert likely <= drawn, (p, likely - drawn)


def test_banned_ids_never_drawn() -> None:
    steps = 300
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, V, generator=g) * 2
    banned = torch.topk(row[0], 3).indices.tolist()
    params = [SamplingParams(temperature=1.0)] * steps + [SamplingParams(temperature=0.0)]
    info = build(params, steps=list(range(steps + 1)), banned_ids=[banned] * (steps + 1))
    out = sample(row.expand(steps + 1, V).contiguous(), info)
    assert not set(out.tolist()) & set(banned)
    assert int(out[-1]) == int(torch.topk(row[0], 4).indices[3])  # greedy skips the banned top 3


def test_seeded_draws_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(3)
    target = SamplingParams(temperature=0.9, top_p=0.95)
    others = [SamplingParams(temperature=1.2, top_k=7), SamplingParams(temperature=0.0), SamplingParams()]
    alone, batched = [], []
    for step in range(40):
        row = torch.randn(1, V, generator=g)
        noise = torch.randn(3, V, generator=g)
        alone.append(int(sample(row, build([target], seeds=[1234], steps=[step]))[0]))
        batch_logits = torch.cat([noise[:2], row, noise[2:]])
        info = build(others[:2] + [target] + others[2:], seeds=[5, 6, 1234, 8], steps=[0, 9, step, 3])
        batched.append(int(sample(batch_logits, info)[2]))
    assert alone == batched
    # reproducible, and a different seed gives a different sequence
    flat = torch.zeros(40, V)
    a = sample(flat, build([SamplingParams()] * 40, seeds=[1] * 40, steps=list(range(40))))
    b = sample(flat, build([SamplingParams()] * 40, seeds=[1] * 40, steps=list(range(40))))
    c = sample(flat, build([SamplingParams()] * 40, seeds=[2] * 40, steps=list(range(40))))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) > 10  # different steps draw different tokens


def test_row_uniforms_are_uniform() -> None:
    n = 20000
    keys = row_keys(torch.full((n,), 5), torch.arange(n))
    u = row_uniforms(keys)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / n
    assert float((hist - 0.1).abs().max()) < 0.01


def test_inverse_cdf_never_picks_zero_weight() -> None:
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert _inverse_cdf(w, u).squeeze(1).tolist() == [1, 1, 3, 3]


def tv_of_draws(probs: torch.Tensor, params: SamplingParams, expected: torch.Tensor, n: int = 20000) -> float:
    logits = probs.log().float().expand(n, -1).contiguous()
    out = sample(logits, build([params] * n, seeds=[99] * n, steps=list(range(n)), vocab_size=len(probs)))
    empirical = torch.bincount(out, minlength=len(probs)).double() / n
    return 0.5 * float((empirical - expected).abs().sum())


def test_empirical_distribution_matches() -> None:
    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01], dtype=torch.float64)
    assert tv_of_draws(probs, SamplingParams(), probs) < 0.03
    # temperature 0.5 squares the probabilities
    sq = probs**2 / (probs**2).sum()
    assert tv_of_draws(probs, SamplingParams(temperature=0.5), sq) < 0.03
    # top_k=3 renormalizes over the three largest
    top3 = torch.where(torch.arange(8) < 3, probs, 0.0)
    assert tv_of_draws(probs, SamplingParams(top_k=3), top3 / top3.sum()) < 0.03
    # top_p=0.6: 0.3 + 0.2 = 0.5 < 0.6, so 0.15 is needed too
    assert tv_of_draws(probs, SamplingParams(top_p=0.6), top3 / top3.sum()) < 0.03
    # the wrong reference is far away (the test can tell)
    assert tv_of_draws(probs, SamplingParams(), sq) > 0.05


# ---------------------------------------------------------------- penalties


def ref_penalize(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    row = logits.tolist()
    for t in set(prompt) | set(out):
        x = row[t]
        row[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return torch.tensor(row)


def test_penalties_match_naive_reference() -> None:
    g = torch.Generator().manual_seed(4)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.2),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 0, 9, 12, 4)]
    outs = [torch.randint(0, 12, (n,), generator=g).tolist() for n in (6, 15, 20, 25, 8)]
    logits = torch.randn(len(params), V, generator=g) * 3
    info = PenaltyInfo.build(params, outs, prompts, V, "cpu")
    assert info is not None
    got = apply_penalties(logits, info)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], ref_penalize(logits[i], p, prompts[i], outs[i]))
    assert PenaltyInfo.build([SamplingParams()] * 2, outs[:2], prompts[:2], V, "cpu") is None
    # greedy sampling uses the penalized logits
    greedy = [SamplingParams(temperature=0.0, **{k: getattr(p, k) for k in _PEN}) for p in params]
    picked = sample(logits, build(greedy, output_ids=outs, prompt_ids=prompts))
    assert torch.equal(picked, torch.argmax(got, dim=-1))


_PEN = ("repetition_penalty", "frequency_penalty", "presence_penalty")


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    g = torch.Generator().manual_seed(5)
    b, n_prompt, n_out = 4, 10, 6
    ids = torch.randint(0, V, (b, n_prompt + n_out), generator=g)
    logits = torch.randn(b, V, generator=g) * 3
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    params = [SamplingParams(repetition_penalty=penalty)] * b
    prompts = ids[:, :n_prompt].tolist()
    outs = ids[:, n_prompt:].tolist()
    info = PenaltyInfo.build(params, outs, prompts, V, "cpu")
    assert info is not None
    torch.testing.assert_close(apply_penalties(logits, info), expected)


# ---------------------------------------------------------------- logprobs


def test_compute_logprobs_matches_log_softmax() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, V, generator=g) * 4
    ids = torch.randint(0, V, (5,), generator=g)
    res = compute_logprobs(logits, ids, top_k=3)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(res.token_logprobs, ref[torch.arange(5), ids])
    top = torch.topk(ref, 3, dim=-1)
    torch.testing.assert_close(res.top_logprobs, top.values)
    assert torch.equal(res.top_ids, top.indices)
    empty = compute_logprobs(logits, ids, top_k=0)
    assert empty.top_logprobs.shape == (5, 0) and empty.top_ids.shape == (5, 0)
    torch.testing.assert_close(empty.token_logprobs, res.token_logprobs)
    assert compute_logprobs(logits, ids, top_k=V + 10).top_ids.shape == (5, V)
