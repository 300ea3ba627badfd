"""--enable-mixed-chunk: running requests decode inside prefill forwards, with the same greedy ids as HF
transformers (fp32), the same sampled ids as without mixing (seeded), and the KV invariant after every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.config.server_args import ServerArgs
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_while_prompts_prefill(tiny_llama: Path, page_size: int, engine_factory) -> None:
    """Short prompts finish prefill first and decode while a long one is prefilled in 16-token chunks."""
    eng = engine_factory(tiny_llama, enable_mixed_chunk=True, chunked_prefill_size=16, page_size=page_size)
    prompts = prompts_of([5, 90, 3, 60, 7], seed=11)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    assert eng.get_server_info()["mixed_decode_tokens"] > 0


def test_sampled_and_retracted_as_without_mixing(tiny_llama: Path, engine_factory) -> None:
    """Seeded sampling under a pool small enough to retract: mixing changes no token."""
    kw = {"max_total_tokens": 220, "chunked_prefill_size": 24, "disable_radix_cache": True}
    prompts = prompts_of([30, 70, 12, 45], seed=12)
    params = [
        {"temperature": 0.8, "top_k": 20, "max_new_tokens": 30, "seed": s, "ignore_eos": True}
        for s in range(4)
    ]
    plain = engine_factory(tiny_llama, **kw).generate(input_ids=prompts, sampling_params=params)
    mixed_eng = engine_factory(tiny_llama, enable_mixed_chunk=True, **kw)
    mixed = mixed_eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in mixed] == [o["output_ids"] for o in plain]
    assert mixed_eng.get_server_info()["mixed_decode_tokens"] > 0


def test_off_by_default_and_never_mixed(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama, chunked_prefill_size=16)
    eng.generate(input_ids=prompts_of([5, 90], seed=13), sampling_params=GREEDY)
    assert eng.get_server_info()["mixed_decode_tokens"] == 0


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"speculative_algorithm": "NGRAM"}, "speculative-algorithm"),
        ({"disaggregation_mode": "prefill"}, "disaggregation-mode"),
    ],
)
def test_refused_combinations(kw: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"enable_mixed_chunk: not with --{flag}"):
        ServerArgs(model_path="m", enable_mixed_chunk=True, **kw)
