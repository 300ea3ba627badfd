"""Mixture-of-experts models against transformers on random weights: Mixtral (top-2 of 8, renormalized),
Qwen2-MoE (top-3 of 8 unnormalized, gated shared expert, a dense last layer, q/k/v bias), Qwen3-MoE (top-3,
renormalized, q/k norm), OLMoE (top-3 unnormalized, whole-projection q/k norm, q/k/v clamped). Greedy fp32 ids equal, batched, chunked, page sizes 1 and 16, cached-prefix extends,
eager and compiled decode; the expert-grouped MoE block equals a naive per-token loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.models.config import ModelConfig
from radixrt.models.loader import load_model
from radixrt.models.moe import SparseMoE
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_model
from tests.test_compile import count_compiled

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {a: make_checkpoint(root / a, arch=a, size="tiny", seed=20 + i) for i, a in enumerate(ARCHS)}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(checkpoints: dict[str, Path], engine_factory, arch: str) -> None:
    path = checkpoints[arch]
    for page_size in (1, 16):
        eng = engine_factory(path, page_size=page_size, chunked_prefill_size=32)
        prompts = prompts_of([5, 37, 90], seed=page_size)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        followups = [prompts[2] + p for p in prompts_of([4, 20], seed=13)]
        outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
        expect = [hf_greedy(path, ids, GREEDY["max_new_tokens"]) for ids in prompts + followups]
        assert [o["output_ids"] for o in outs] == expect, (arch, page_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_block_equals_transformers_block_and_a_naive_loop(
    checkpoints: dict[str, Path], arch: str
) -> None:
    """Layer 0's MoE block on random hidden states: equal to transformers' block (routing normalization,
    shared expert) and to a per-token loop over the chosen experts (the grouping is only a reordering)."""
    path = checkpoints[arch]
    cfg = ModelConfig.from_dir(path, dtype="float32")
    ours = load_model(path, cfg).layers[0].mlp
    assert isinstance(ours, SparseMoE)
    theirs = hf_model(str(path)).model.layers[0]
    block = (
        theirs.block_sparse_moe if arch == "mixtral" and hasattr(theirs, "block_sparse_moe") else theirs.mlp
    )
    x = torch.randn(57, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = ours(x)
        ref = block(x[None])[0] if not isinstance(block(x[None]), tuple) else block(x[None])[0][0]
        weights, experts = ours.route(x)
        naive = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], experts[t], strict=True):
                gate, up = (ours.w_gate_up[e] @ x[t]).chunk(2)
                naive[t] += w * (ours.w_down[e] @ (torch.nn.functional.silu(gate) * up))
        if ours.shared_expert is not None and ours.shared_expert_gate is not None:
            naive += torch.sigmoid(ours.shared_expert_gate(x)) * ours.shared_expert(x)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert torch.allclose(got, naive, atol=1e-5), (got - naive).abs().max()
    summed = weights.sum(-1)
    if cfg.moe is not None and cfg.moe.norm_topk_prob:
        assert torch.allclose(summed, torch.ones_like(summed))
    else:
        assert bool((summed < 0.999).all())


def test_qwen2_moe_layout_from_config(checkpoints: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(checkpoints["qwen2_moe"], dtype="float32")
    assert cfg.moe is not None and cfg.moe.shared_expert_intermediate_size > 0
    assert cfg.moe.sparse_layers == [0, 1, 2] and cfg.attention_bias
    model = load_model(checkpoints["qwen2_moe"], cfg)
    assert not isinstance(model.layers[3].mlp, SparseMoE)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decode_equals_eager_and_transformers(
    checkpoints: dict[str, Path], engine_factory, arch: str
) -> None:
    """The default engine compiles MoE decode: per-layer graphs (attention, norms, router, shared expert)
    around the routed experts as one opaque op. Three requests finishing at different lengths decode at
    buckets 4, 2 and 1; greedy fp32 ids equal transformers' and the same engine's eager decode. Qwen2-MoE's
    dense last layer is a layer kind of its own."""
    path = checkpoints[arch]
    eng = engine_factory(path, disable_compile=False, compile_max_bs=4)
    gr = eng.worker.scheduler.runner.graph_runner
    assert gr is not None
    assert len(gr._experts) == sum(isinstance(layer.mlp, SparseMoE) for layer in gr.model.layers)
    assert gr._kind_of == ([0, 0, 0, 1] if arch == "qwen2_moe" else [0, 0, 0, 0])
    seen = count_compiled(eng)
    prompts = prompts_of([5, 37, 90], seed=3)
    params = [{**GREEDY, "max_new_tokens": n} for n in (3, 10, 6)]
    compiled = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert {1, 2, 4} <= set(seen)
    expect = [hf_greedy(path, ids, p["max_new_tokens"]) for ids, p in zip(prompts, params, strict=True)]
    assert compiled == expect

    def eager(s) -> None:  # type: ignore[no-untyped-def]
        s.runner.graph_runner = None

    eng.worker.call(eager)
    assert eng.flush_cache()
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)] == compiled
