"""Tensor parallelism on gloo (CPU): TP=2 gives TP=1's greedy ids (HF's), batched and chunked, for every
architecture; the shards hold their heads only; bad settings are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.config.server_args import ServerArgs
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_tp2_matches_hf(arch: str, request: pytest.FixtureRequest, engine_factory) -> None:
    path: Path = request.getfixturevalue(arch)
    eng = engine_factory(
        path, tp_size=2, chunked_prefill_size=16, page_size=16 if arch == "tiny_qwen2" else 1
    )
    runner = eng.worker.scheduler.runner
    cfg = runner.config
    assert runner.kv_pool.k_buffers[0].shape[1] == cfg.num_kv_heads // 2  # rank 0 holds its KV heads only
    prompts = prompts_of([5, 37, 18, 3], seed=6)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
    # A second round reuses the RadixCache (bookkeeping lives on rank 0 only) and logprobs gather the vocab.
    again = eng.generate(
        input_ids=prompts[1], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
    )
    assert again["output_ids"] == outs[1]["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    assert len(again["meta_info"]["output_top_logprobs"][0]) == 3


def test_tp_settings_are_checked(tiny_llama: Path, engine_factory) -> None:
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="nnodes"):
        ServerArgs(tp_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="tp_size: 3 does not divide"):
        engine_factory(tiny_llama, tp_size=3)
    with pytest.raises(ValueError, match="quantization: 'int8' with tp_size > 1"):
        engine_factory(tiny_llama, tp_size=2, quantization="int8")
