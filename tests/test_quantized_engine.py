"""--quantization on the engine: each mode against its own dequantized reference (the same int8 / int4 /
GGUF weights in HF transformers' plain fp32 matmuls), token for token, and against fp32 on logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixrt.layers import QuantLinearBase
from radixrt.testing.gguf_writer import write_gguf
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def q_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama whose every in_features is a multiple of 32 (int4 groups; the shared tiny size has 688)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("q") / "llama", arch="llama", seed=13, intermediate_size=704
    )


@pytest.fixture(scope="module")
def q_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (q/k/v biases, tied head) with int4-friendly sizes."""
    return make_checkpoint(
        tmp_path_factory.mktemp("q") / "qwen2", arch="qwen2", seed=14, intermediate_size=704
    )


def reference_model(path: Path, runner_model: torch.nn.Module) -> torch.nn.Module:
    """HF's model of ``path`` with every linear replaced by the radixrt module's reference weight."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sd = hf.state_dict()
    cfg = runner_model.config  # type: ignore[attr-defined]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    new: dict[str, torch.Tensor] = {}
    for name, mod in runner_model.named_modules():
        if not isinstance(mod, QuantLinearBase):
            continue
        w = mod.reference_weight(torch.float32)
        if name.endswith("qkv_proj"):
            base = "model." + name.removesuffix("qkv_proj")
            for part, rows in zip("qkv", w.split([q, kv, kv]), strict=True):
                new[f"{base}{part}_proj.weight"] = rows
        else:
            new[("" if name == "lm_head" else "model.") + name + ".weight"] = w
    assert new and set(new) <= set(sd)
    head = new.pop("lm_head.weight")
    sd.update(new)
    hf.load_state_dict(sd)
    hf.lm_head.weight = torch.nn.Parameter(head)  # unties a tied head: the embedding stays float
    return hf


@torch.inference_mode()
def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return list(out[0, len(ids) :].tolist())


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["q_llama", "q_qwen2"])
def test_weight_only_modes_match_their_reference(method: str, arch: str, request, engine_factory) -> None:
    path = request.getfixturevalue(arch)
    eng = engine_factory(path, quantization=method)
    model = eng.worker.scheduler.runner.model
    assert isinstance(model.lm_head, QuantLinearBase) and isinstance(
        model.layers[0].mlp.down_proj, QuantLinearBase
    )
    ref = reference_model(path, model)
    prompts = prompts_of([7, 30, 12], seed=5)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == greedy(ref, ids, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_only_modes_close_to_fp32_logprobs(method: str, q_llama: Path, engine_factory) -> None:
    ids = prompts_of([40], seed=6)[0]
    kw = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    full = engine_factory(q_llama).generate(input_ids=ids, **kw)["meta_info"]["input_token_logprobs"]
    quant = engine_factory(q_llama, quantization=method).generate(input_ids=ids, **kw)
    a = torch.tensor([e[0] for e in full[1:]])
    b = torch.tensor([e[0] for e in quant["meta_info"]["input_token_logprobs"][1:]])
    rel = float((a - b).abs().mean() / a.abs().mean())  # these random models' logprobs are ~ -12
    assert 0 < rel < (0.03 if method == "int8" else 0.15), rel


@pytest.mark.parametrize("dense", [0, 1])
def test_gguf_mode_runs_the_files_blocks_exactly(dense: int, tmp_path: Path, engine_factory) -> None:
    """In fp32 the GGUF layouts reproduce the dequantized weights exactly: same ids as transformers, through
    the weight-only kernels (``dense`` 0) or the dense twin of every linear (1: every forward)."""
    ckpt = make_checkpoint(tmp_path / "ck", arch="llama", size="tiny", seed=12, intermediate_size=704,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    for qtype in ("Q8_0", "Q4_0"):
        gguf_file = write_gguf(ckpt, tmp_path / qtype / f"m-{qtype}.gguf", qtype)
        # the file's own blocks, in fp32 (unset, fp32 would run them dequantized: quantization none)
        eng = engine_factory(gguf_file, quantization="gguf", dense_gemm_min_tokens=dense)
        runner = eng.worker.scheduler.runner
        down = runner.model.layers[0].mlp.down_proj
        assert runner.quantization == "gguf" and isinstance(down, QuantLinearBase)
        assert (down.dense_weight is not None) == (dense > 0)
        prompts = prompts_of([9, 25], seed=7)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        for ids, out in zip(prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(gguf_file, ids, GREEDY["max_new_tokens"]), qtype


def test_quantization_errors_name_the_field(tiny_llama: Path, engine_factory) -> None:
    with pytest.raises(ValueError, match="quantization: 'gguf' needs a GGUF checkpoint"):
        engine_factory(tiny_llama, quantization="gguf")
    with pytest.raises(ValueError, match="quantization: 'fp3'"):
        engine_factory(tiny_llama, quantization="fp3")
