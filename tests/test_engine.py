"""Engine core against HF transformers: greedy ids, batching, chunking, paging, logprobs, retraction."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_next_logprobs, hf_prompt_logprobs

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def assert_matches_hf(path: Path, prompts: list[list[int]], outs: list[dict], n: int) -> None:
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, ids, n)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_batch_matches_hf(arch: str, request: pytest.FixtureRequest, engine_factory) -> None:
    path = request.getfixturevalue(arch)
    eng = engine_factory(path)
    prompts = prompts_of([5, 33, 17, 64])
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert_matches_hf(path, prompts, outs, GREEDY["max_new_tokens"])
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [7, 40, -1])
def test_chunked_and_paged_match_hf(tiny_llama: Path, page_size: int, chunk: int, engine_factory) -> None:
    eng = engine_factory(tiny_llama, page_size=page_size, chunked_prefill_size=chunk)
    prompts = prompts_of([45, 3, 90, 21], seed=1)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert_matches_hf(tiny_llama, prompts, outs, GREEDY["max_new_tokens"])


def test_text_prompt_and_stream(tiny_qwen2: Path, engine_factory) -> None:
    eng = engine_factory(tiny_qwen2)
    full = eng.generate(prompt="The radix tree stores", sampling_params=GREEDY)
    ids = eng.tokenizer.encode("The radix tree stores")
    assert full["output_ids"] == hf_greedy(tiny_qwen2, ids, GREEDY["max_new_tokens"])
    assert full["text"] == eng.tokenizer.decode(full["output_ids"], skip_special_tokens=True)
    chunks = list(eng.generate(prompt="The radix tree stores", sampling_params=GREEDY, stream=True))
    assert len(chunks) == GREEDY["max_new_tokens"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))

    async def run() -> tuple[dict, list[dict]]:
        one = await eng.async_generate(prompt="The radix tree stores", sampling_params=GREEDY)
        stream = [
            c
            async for c in await eng.async_generate(
                prompt="The radix tree stores", sampling_params=GREEDY, stream=True
            )
        ]
        return one, stream

    one, stream = asyncio.run(run())
    assert one["output_ids"] == full["output_ids"] and stream[-1]["text"] == full["text"]


def test_prompt_and_output_logprobs_match_hf(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama, chunked_prefill_size=9)
    ids = prompts_of([30], seed=3)[0]
    out = eng.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and [e[1] for e in inp] == ids
    ref = hf_prompt_logprobs(tiny_llama, ids)
    torch.testing.assert_close(torch.tensor([e[0] for e in inp[1:]]), ref, atol=1e-4, rtol=1e-4)
    nxt = hf_next_logprobs(tiny_llama, ids)
    first = meta["output_token_logprobs"][0]
    assert first[1] == out["output_ids"][0] == int(nxt.argmax())
    assert abs(first[0] - float(nxt.max())) < 1e-4
    top = meta["output_top_logprobs"][0]
    assert [t[1] for t in top] == nxt.topk(3).indices.tolist()
    # From a later start only the tail is returned; the cache may not serve those positions.
    eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 1})
    tail = eng.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=20,
    )["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in tail] == ids[20:]
    torch.testing.assert_close(torch.tensor([e[0] for e in tail]), ref[19:], atol=1e-4, rtol=1e-4)


def test_prefill_only_request(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([20], seed=4)[0]
    out = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert len(out["meta_info"]["input_token_logprobs"]) == 20


def test_retraction_under_tiny_pool_matches_hf(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama, max_total_tokens=200, chunked_prefill_size=64, disable_radix_cache=True)
    prompts = prompts_of([30, 25, 35, 20], seed=5)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert_matches_hf(tiny_llama, prompts, outs, 40)
    assert eng.get_server_info()["retractions"] > 0


def test_seeded_sampling_reproducible_alone_and_batched(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([12], seed=6)[0]
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 10, "seed": 1234, "ignore_eos": True}
    alone = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
    others = prompts_of([7, 19], seed=7)
    batched = eng.generate(
        input_ids=[others[0], ids, others[1]],
        sampling_params=[{**params, "seed": 1}, params, {**params, "seed": 2}],
    )
    assert batched[1]["output_ids"] == alone
    other_seed = eng.generate(input_ids=ids, sampling_params={**params, "seed": 99})["output_ids"]
    assert other_seed != alone


def test_n_samples_and_stops(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([15], seed=8)[0]
    greedy = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10})
    many = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10, "n": 3})
    assert [m["output_ids"] for m in many] == [greedy["output_ids"]] * 3
    sampled = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 10, "n": 3, "seed": 5, "ignore_eos": True}
    )
    assert len({tuple(m["output_ids"]) for m in sampled}) > 1
    # stop_token_ids: stop at the 4th greedy token (included in output_ids).
    stop_tok = greedy["output_ids"][3]
    first = greedy["output_ids"].index(stop_tok)
    out = eng.generate(input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == greedy["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # min_new_tokens bans the stop token until reached.
    out = eng.generate(
        input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [stop_tok], "min_new_tokens": first + 3}
    )
    assert len(out["output_ids"]) >= first + 3
    assert stop_tok not in out["output_ids"][: first + 2]


def test_stop_string_truncates_text(tiny_qwen2: Path, engine_factory) -> None:
    eng = engine_factory(tiny_qwen2)
    params = {**GREEDY, "max_new_tokens": 16}
    text = eng.generate(prompt="Once upon a time", sampling_params=params)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and len(text) > 6
    out = eng.generate(prompt="Once upon a time", sampling_params={**params, "stop": stop})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = eng.generate(
        prompt="Once upon a time", sampling_params={**params, "stop": [stop], "no_stop_trim": True}
    )
    assert kept["text"] == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n"),
        ({"temprature": 0.5}, "temprature"),
        ({"max_new_tokens": 5000}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_raise(tiny_llama: Path, engine_factory, params: dict, field: str) -> None:
    eng = engine_factory(tiny_llama)
    with pytest.raises(ValueError, match=field):
        eng.generate(input_ids=[1, 2, 3], sampling_params=params)


def test_bad_prompts_raise(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    with pytest.raises(ValueError, match="text"):
        eng.generate(prompt="", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="input_ids"):
        eng.generate(input_ids=[1, 10**9], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="text"):
        eng.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="text"):
        eng.generate(sampling_params=GREEDY)
    # the engine still serves after bad input
    assert len(eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]) == 12
