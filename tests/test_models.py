"""Model loading: config spellings, sharded safetensors, dtypes, unsupported architectures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixrt.models.config import ModelConfig
from radixrt.models.rope import inv_frequencies
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_prompt_logprobs


def test_config_v4_and_v5_spellings_agree() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = ModelConfig.from_dict(
        {**base, "torch_dtype": "bfloat16", "rope_theta": 5e5, "rope_scaling": scaling}
    )
    v5 = ModelConfig.from_dict(
        {**base, "dtype": "bfloat16", "rope_parameters": {**scaling, "rope_theta": 5e5}}
    )
    for cfg in (v4, v5):
        assert cfg.rope_theta == 5e5 and cfg.head_dim == 16
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    # same inverse frequencies as transformers' own llama3 rule, and really different from plain RoPE
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters={**scaling, "rope_theta": 5e5}
    )
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    scaled = inv_frequencies(16, 5e5, v5.rope_scaling)
    assert torch.equal(scaled, hf_inv)
    assert not torch.equal(inv_frequencies(16, 5e5, None), scaled)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type .yarn. is not supported"):
        ModelConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
            }
        )


def test_sharded_checkpoint_loads(tiny_llama: Path, tmp_path: Path, engine_factory) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for f in tiny_llama.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("generation"):
            shutil.copy(f, sharded / f.name)
    eng = engine_factory(sharded)
    ids = prompts_of([20], seed=30)[0]
    out = eng.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    )
    assert out["output_ids"] == hf_greedy(tiny_llama, ids, 8)


def test_bf16_close_to_fp32(tiny_qwen2: Path, engine_factory) -> None:
    eng = engine_factory(tiny_qwen2, dtype="bfloat16")
    assert eng.worker.scheduler.runner.kv_pool.dtype == torch.bfloat16
    ids = prompts_of([24], seed=31)[0]
    out = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
    )
    got = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(hf16(torch.tensor([ids])).logits[0].float(), dim=-1)
    ref16 = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    ref32 = hf_prompt_logprobs(tiny_qwen2, ids)
    # as close to HF's bf16 as HF's bf16 is to fp32 (bf16 keeps ~3 significant digits)
    assert (got - ref16).abs().mean() <= max(0.05, 1.5 * float((ref16 - ref32).abs().mean()))


def test_missing_weights_is_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (broken / "config.json").write_text(json.dumps(cfg))
    from radixrt import Engine

    with pytest.raises(ValueError, match="lacks weights"):
        Engine(model_path=str(broken))
