"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on random weights: greedy fp32 ids equal, batched,
chunked, page sizes 1 and 16, prompts and outputs far past the 8-token sliding window, cached-prefix extends,
the C kernels and the gather reference path, compiled decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.kernels.layer_windows import LayerWindowBackend
from radixrt.models.config import ModelConfig
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_prompt_logprobs

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
LENGTHS = [3, 9, 40, 150]  # below, at and far past the window


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny", arch="gemma3", size="tiny", seed=7)


def _expect(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(path, ids, GREEDY["max_new_tokens"]) for ids in prompts]


def test_config_reads_both_spellings() -> None:
    base = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 512,
        "query_pre_attn_scalar": 64,
    }
    v4 = {
        **base,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
    }
    v5 = {
        **base,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    for spelling in (v4, v5):
        cfg = ModelConfig.from_dict(spelling, dtype="float32")
        assert [cfg.window_of(i) for i in range(7)] == [512] * 5 + [None, 512]
        assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4 and cfg.local_rope_scaling is None
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0
        assert cfg.softmax_scale == 64**-0.5 and cfg.qk_norm and cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**v5, "attn_logit_softcapping": 50.0})


def test_window_changes_the_reference(gemma3: Path, tmp_path: Path) -> None:
    """The oracle is sensitive to the window: the same weights without it continue differently."""
    wide = make_checkpoint(tmp_path / "wide", arch="gemma3", size="tiny", seed=7, sliding_window=4096)
    ids = prompts_of([150], seed=3)[0]
    assert hf_greedy(gemma3, ids, 12) != hf_greedy(wide, ids, 12)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(gemma3: Path, engine_factory, page_size: int) -> None:
    eng = engine_factory(gemma3, page_size=page_size, chunked_prefill_size=32)
    assert eng.worker.call(lambda s: isinstance(s.runner.backend, LayerWindowBackend))
    prompts = prompts_of(LENGTHS, seed=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)  # one batch
    # cached-prefix extends: the same 150-token prompt plus new text, the prefix served from the cache
    followups = [prompts[3] + p for p in prompts_of([5, 30], seed=9)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs[-2:]) >= 2 * (150 // page_size * page_size)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, prompts + followups)


def test_reference_gather_path_equals_transformers(gemma3: Path, engine_factory) -> None:
    """With the C kernels off (SDPA over gathered K/V with a per-layer mask) the ids are the same."""
    eng = engine_factory(gemma3, chunked_prefill_size=64)

    def no_kernels(s: object) -> None:
        for b in s.runner.backend.by_window.values():  # type: ignore[attr-defined]
            b.use_decode_kernel = b.use_extend_kernel = False

    eng.worker.call(no_kernels)
    prompts = prompts_of([20, 100], seed=5)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, prompts)


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_compiled_decode_equals_transformers(gemma3: Path, scope: str, engine_factory) -> None:
    eng = engine_factory(gemma3, disable_compile=False, compile_max_bs=2, compile_scope=scope)
    prompts = prompts_of([30, 70], seed=6)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, prompts)


def test_prompt_logprobs_close_to_transformers(gemma3: Path, engine_factory) -> None:
    eng = engine_factory(gemma3)
    ids = prompts_of([60], seed=8)[0]
    out = eng.generate(
        input_ids=[ids],
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )[0]
    ours = torch.tensor([lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]])
    theirs = hf_prompt_logprobs(gemma3, ids)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
