"""Tensor parallelism (gloo, CPU) for Gemma 3, Phi-3 and the mixture-of-experts families: TP=2 gives transformers'
greedy ids, batched and chunked, with cached-prefix extends. Experts are sharded within experts (each rank
holds every expert's half of the intermediate width, the router whole; radixrt.distributed.tensor_parallel);
Gemma 3's scaled embedding and local/global layers run sharded by heads like Llama's; OLMoE's q/k norms over
every head sum their squares across the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.distributed.tensor_parallel import AllReducedOutput
from radixrt.models.moe import SparseMoE
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
ARCHS = ["gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {a: make_checkpoint(root / a, arch=a, size="tiny", seed=70 + i) for i, a in enumerate(ARCHS)}


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_transformers(checkpoints: dict[str, Path], engine_factory, arch: str) -> None:
    path = checkpoints[arch]
    eng = engine_factory(path, tp_size=2, chunked_prefill_size=16, page_size=16 if arch == "gemma3" else 1)
    runner = eng.worker.scheduler.runner
    cfg = runner.config
    assert runner.kv_pool.k_buffers[0].shape[1] == cfg.num_kv_heads // 2  # rank 0 holds its KV heads only
    if cfg.moe is not None:
        layer = runner.model.layers[0]
        assert isinstance(layer.mlp, AllReducedOutput) and isinstance(layer.mlp.inner, SparseMoE)
        moe = layer.mlp.inner
        assert moe.w_down.shape == (
            cfg.moe.num_experts,
            cfg.hidden_size,
            cfg.moe.expert_intermediate_size // 2,
        )
    prompts = prompts_of([5, 37, 18, 3], seed=6)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [prompts[1] + p for p in prompts_of([4, 21], seed=8)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    expect = [hf_greedy(path, ids, GREEDY["max_new_tokens"]) for ids in prompts + followups]
    assert [o["output_ids"] for o in outs] == expect


def test_tp_refuses_an_indivisible_expert_width(tmp_path: Path, engine_factory) -> None:
    odd = make_checkpoint(tmp_path / "odd", arch="qwen3_moe", size="tiny", seed=3, moe_intermediate_size=171)
    with pytest.raises(ValueError, match="tp_size: 2 does not divide the model's 171 expert width"):
        engine_factory(odd, tp_size=2)
