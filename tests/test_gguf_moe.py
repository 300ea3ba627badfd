"""GGUF files of the mixture-of-experts families (Mixtral as llama with experts, Qwen2-MoE with its shared
expert, Qwen3-MoE) and Phi-3 (fused attn_qkv / ffn_up, LongRoPE factors as tensors), written the way
llama.cpp lays them out (experts stacked ``[E, out, in]``, routers in float32).

The oracle is transformers on the same weights: the original random checkpoint with every matrix the file
quantizes replaced by its Q8_0 round trip (Q8_0 is per 32-column block of a row, so llama.cpp's row
permutations and the expert stacking do not change it). Greedy fp32 ids equal for the dequantized
conversion (``--quantization none``) and for the file's own blocks kept quantized (``gguf``: exact in fp32),
batched, chunked, page sizes 1 and 16, and for prompts extended from a cached prefix; a Q4_0 file through the
int4 layouts too. transformers' own GGUF load cannot be the oracle for these files: its config mapping drops
the expert sizes (``expert_feed_forward_length``), so it refuses them with a shape mismatch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf as gguf_pkg
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from radixrt.layers import QuantLinearBase
from radixrt.models import gguf
from radixrt.models.moe import SparseMoE
from radixrt.testing.gguf_writer import write_gguf
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
HALF_HEAD = 16  # tiny: hidden 256 / 8 heads / 2
# Sizes whose every matrix row is whole 32-blocks; LongRoPE factors exact in float32 (GGUF stores them so).
OVERRIDES: dict[str, dict[str, object]] = {
    "mixtral": {"intermediate_size": 128},
    "qwen2_moe": {
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "mlp_only_layers": [],
    },
    "qwen3_moe": {"moe_intermediate_size": 128},
    "phi3": {
        "intermediate_size": 704,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + i / 32 for i in range(HALF_HEAD)],
            "long_factor": [1.0 + i / 2 for i in range(HALF_HEAD)],
            "original_max_position_embeddings": 1024,
        },
    },
}
ARCHS = list(OVERRIDES)
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    old = os.environ.get("RADIXRT_CACHE_DIR")
    os.environ["RADIXRT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield None
    if old is None:
        os.environ.pop("RADIXRT_CACHE_DIR")
    else:
        os.environ["RADIXRT_CACHE_DIR"] = old


def round_trip_reference(src: Path, dst: Path, qtype: str = "Q8_0") -> Path:
    """``src`` with every matrix the writer stores as ``qtype`` (rows of whole blocks, not a router) replaced
    by its dequantized values."""
    shutil.copytree(src, dst)
    t = gguf_pkg.GGMLQuantizationType[qtype]
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if w.ndim == 2 and w.shape[1] % 32 == 0 and not name.endswith(ROUTERS):
            tensors[name] = gguf_pkg.quants.dequantize(gguf_pkg.quants.quantize(w, t), t).astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """arch -> (its Q8_0 GGUF file, the HF reference checkpoint of the same weights)."""
    root = tmp_path_factory.mktemp("gguf_moe")
    out = {}
    for i, arch in enumerate(ARCHS):
        ckpt = make_checkpoint(root / arch, arch=arch, seed=40 + i, num_hidden_layers=2, **OVERRIDES[arch])
        out[arch] = (
            write_gguf(ckpt, root / "gguf" / arch / f"{arch}-q8_0.gguf"),
            round_trip_reference(ckpt, root / f"{arch}-ref"),
        )
    return out


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_on_the_files_weights(
    files: dict[str, tuple[Path, Path]], engine_factory, arch: str, quantization: str
) -> None:
    path, ref = files[arch]
    page_size = 16 if quantization == "gguf" else 1
    eng = engine_factory(path, quantization=quantization, page_size=page_size, chunked_prefill_size=9)
    model = eng.worker.scheduler.runner.model
    experts = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert bool(experts) == (arch != "phi3")
    if quantization == "gguf":  # the file's blocks, experts included
        assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinearBase)
        assert all(m.experts is not None for m in experts)
    prompts = prompts_of([5, 40, 17], seed=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [prompts[1] + p for p in prompts_of([4, 11], seed=9)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    expect = [hf_greedy(ref, ids, GREEDY["max_new_tokens"]) for ids in prompts + followups]
    assert [o["output_ids"] for o in outs] == expect


def test_q4_0_experts_kept_quantized(tmp_path: Path, engine_factory) -> None:
    """Q4_0 blocks (one int4 plane per 32 columns) for every expert, the shared expert and attention."""
    ckpt = make_checkpoint(
        tmp_path / "ck", arch="qwen2_moe", seed=50, num_hidden_layers=2, **OVERRIDES["qwen2_moe"]
    )
    path = write_gguf(ckpt, tmp_path / "q4" / "qwen2_moe-q4_0.gguf", "Q4_0")
    ref = round_trip_reference(ckpt, tmp_path / "ref", "Q4_0")
    eng = engine_factory(path, quantization="gguf", chunked_prefill_size=16)
    prompts = prompts_of([6, 33, 14], seed=3)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [
        hf_greedy(ref, ids, GREEDY["max_new_tokens"]) for ids in prompts
    ]


def n_experts(config: dict[str, object]) -> object:
    """The expert count under either name (transformers 5 spells Qwen3-MoE's ``num_local_experts``)."""
    return config.get("num_experts") or config.get("num_local_experts")


def test_config_reads_what_transformers_mapping_drops(files: dict[str, tuple[Path, Path]]) -> None:
    """Expert sizes, Mixtral from a llama file with experts, Phi-3's LongRoPE factors."""
    keys = {
        "mixtral": ("num_experts_per_tok", "intermediate_size"),
        "qwen2_moe": (
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
        ),
        "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
        "phi3": ("original_max_position_embeddings", "intermediate_size"),
    }
    for arch, (path, ref) in files.items():
        ours = gguf.hf_config(path)
        theirs = json.loads((ref / "config.json").read_text())
        assert ours["model_type"] == theirs["model_type"], arch
        assert n_experts(ours) == n_experts(theirs), arch
        for key in keys[arch]:
            assert ours[key] == theirs[key], (arch, key)
    ours_rope = gguf.hf_config(files["phi3"][0])["rope_parameters"]
    theirs_rope = json.loads((files["phi3"][1] / "config.json").read_text())["rope_parameters"]
    for key in ("rope_type", "long_factor", "short_factor", "original_max_position_embeddings"):
        assert ours_rope[key] == theirs_rope[key], key


def test_stacked_experts_read_as_the_checkpoints_matrices(files: dict[str, tuple[Path, Path]]) -> None:
    """``blk.N.ffn_*_exps`` ``[E, out, in]``: expert j's slice is the reference checkpoint's expert j."""
    path, ref = files["qwen2_moe"]
    weights = gguf.read_weights(path, gguf.hf_config(path))
    tensors = load_file(str(ref / "model.safetensors"))
    for piece in ("gate_proj", "up_proj", "down_proj"):
        w = weights[f"model.layers.1.mlp.experts.{piece}.weight"]
        assert w.ggml_type == "Q8_0" and len(w.shape) == 3
        stacked = w.dequantize()
        for j in range(stacked.shape[0]):
            expect = torch.from_numpy(tensors[f"model.layers.1.mlp.experts.{j}.{piece}.weight"])
            assert torch.equal(stacked[j], expect), (piece, j)
    assert weights["model.layers.0.mlp.gate.weight"].ggml_type == "F32"
    assert weights["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 256)
