"""Phi-3 against transformers' Phi3ForCausalLM on random weights: fused qkv_proj and gate_up_proj split at load,
LongRoPE (short factors and attention factor), greedy fp32 ids equal, batched, chunked, page sizes 1 and 16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.models.config import ModelConfig
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_prompt_logprobs

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("phi3") / "tiny", arch="phi3", size="tiny", seed=4)


def test_config_longrope_and_limits() -> None:
    base = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
    }
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = ModelConfig.from_dict({**base, "rope_scaling": su}, dtype="float32")
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.max_position_embeddings == 4096  # capped at the original context: short factors only
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)).item() / torch.log(torch.tensor(4096.0)).item()) ** 0.5
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**base, "partial_rotary_factor": 0.75})
    assert cfg.rope_scaling["use_long_factors"] is False
    within = ModelConfig.from_dict({**base, "rope_scaling": su}, dtype="float32", context_length=4096)
    assert within.max_position_embeddings == 4096 and not within.rope_scaling["use_long_factors"]
    long = ModelConfig.from_dict({**base, "rope_scaling": su}, dtype="float32", context_length=8192)
    assert long.max_position_embeddings == 131072 and long.rope_scaling["use_long_factors"]
    assert long.rope_scaling["attention_factor"] == cfg.rope_scaling["attention_factor"]
    with pytest.raises(ValueError, match="context_length: 8192 .* no long_factor"):
        no_long = {"type": "su", "short_factor": [1.0] * 8}
        ModelConfig.from_dict({**base, "rope_scaling": no_long}, context_length=8192)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(phi3: Path, engine_factory, page_size: int) -> None:
    eng = engine_factory(phi3, page_size=page_size, chunked_prefill_size=32)
    prompts = prompts_of([4, 40, 130], seed=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [prompts[2] + p for p in prompts_of([6, 25], seed=12)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    expect = [hf_greedy(phi3, ids, GREEDY["max_new_tokens"]) for ids in prompts + followups]
    assert [o["output_ids"] for o in outs] == expect


def test_prompt_logprobs_close_to_transformers(phi3: Path, engine_factory) -> None:
    eng = engine_factory(phi3)
    ids = prompts_of([80], seed=8)[0]
    out = eng.generate(
        input_ids=[ids],
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )[0]
    ours = torch.tensor([lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]])
    theirs = hf_prompt_logprobs(phi3, ids)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_long_factors_past_the_original_context(tmp_path: Path, engine_factory) -> None:
    """``--context-length`` beyond the original context selects the long factors for every position (one
    rotation for the whole cache, as vLLM does); prompts past the original context then equal transformers,
    which switches a sequence to the long factors once it passes the original context."""
    half = 256 // 8 // 2  # the tiny size: hidden 256, 8 heads
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.7 * i for i in range(half)],
        "original_max_position_embeddings": 48,
    }
    path = make_checkpoint(
        tmp_path / "phi3_long", arch="phi3", size="tiny", seed=5, max_position_embeddings=256,
        original_max_position_embeddings=48, rope_parameters=rope,
    )  # fmt: skip
    short_eng = engine_factory(path)
    with pytest.raises(ValueError, match="the context length is 48"):
        short_eng.generate(input_ids=prompts_of([60], seed=1), sampling_params=GREEDY)
    eng = engine_factory(path, context_length=256, chunked_prefill_size=32, page_size=16)
    prompts = prompts_of([49, 70, 150], seed=3)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [prompts[1] + p for p in prompts_of([9, 40], seed=4)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    expect = [hf_greedy(path, ids, GREEDY["max_new_tokens"]) for ids in prompts + followups]
    assert [o["output_ids"] for o in outs] == expect
