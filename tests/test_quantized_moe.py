"""--quantization int8 / int4 on mixture-of-experts models (Qwen2-MoE, Mixtral, OLMoE): every expert's gate/up and down (and Qwen2-MoE's
shared expert, attention, LM head) through the dense layers' weight-only linears, the routers float.

Each mode against its own dequantized reference, token for token: transformers' fp32 model of the same
checkpoint with every quantized matrix replaced by the radixrt module's reference weight (the stacked
experts rebuilt from the per-expert modules), as tests/test_quantized_engine.py does for dense models; and
compiled decode against the same mode's eager decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixrt.layers import Int4Linear, Int8Linear, QuantLinearBase
from radixrt.models.moe import SparseMoE
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.test_compile import count_compiled
from tests.test_quantized_engine import greedy

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
# Every in_features a multiple of int4's group of 32 (the tiny size's 688 is not).
OVERRIDES: dict[str, dict[str, object]] = {
    "qwen2_moe": {
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "intermediate_size": 704,
    },
    "mixtral": {"intermediate_size": 128},
    "olmoe": {"intermediate_size": 128},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qmoe")
    return {
        arch: make_checkpoint(root / arch, arch=arch, seed=60 + i, num_hidden_layers=3, **kw)
        for i, (arch, kw) in enumerate(OVERRIDES.items())
    }


def reference_model(path: Path, model: torch.nn.Module) -> torch.nn.Module:
    """HF's model of ``path`` with every quantized matrix replaced by the radixrt module's reference weight."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sd = hf.state_dict()
    cfg = model.config  # type: ignore[attr-defined]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    new: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, SparseMoE):
            assert mod.experts is not None and mod.w_gate_up is None
            for ours, theirs in ((mod.experts.gate_up, "gate_up_proj"), (mod.experts.down, "down_proj")):
                weights = [m.reference_weight(torch.float32) for m in ours]  # type: ignore[operator]
                new[f"model.{name}.experts.{theirs}"] = torch.stack(weights)
        if not isinstance(mod, QuantLinearBase) or ".experts." in name:
            continue
        w = mod.reference_weight(torch.float32)
        if name.endswith("qkv_proj"):
            base = "model." + name.removesuffix("qkv_proj")
            for part, rows in zip("qkv", w.split([q, kv, kv]), strict=True):
                new[f"{base}{part}_proj.weight"] = rows
        else:
            new[("" if name == "lm_head" else "model.") + name + ".weight"] = w
    assert new and set(new) <= set(sd), sorted(set(new) - set(sd))
    head = new.pop("lm_head.weight")
    sd.update(new)
    hf.load_state_dict(sd)
    hf.lm_head.weight = torch.nn.Parameter(head)
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_quantized_experts_match_their_reference(
    checkpoints: dict[str, Path], engine_factory, arch: str, method: str
) -> None:
    path = checkpoints[arch]
    eng = engine_factory(path, quantization=method, chunked_prefill_size=16)
    model = eng.worker.scheduler.runner.model
    kind = Int8Linear if method == "int8" else Int4Linear
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.experts is not None for m in moes)
    assert all(isinstance(lin, kind) for m in moes for lin in [*m.experts.gate_up, *m.experts.down])  # type: ignore[union-attr]
    assert all(type(m.gate) is torch.nn.Linear for m in moes)  # the routers stay float
    ref = reference_model(path, model)
    prompts = prompts_of([7, 30, 12], seed=5)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == greedy(ref, ids, GREEDY["max_new_tokens"])


def test_compiled_quantized_experts_equal_eager(checkpoints: dict[str, Path], engine_factory) -> None:
    """int4 experts under compiled decode (the routed experts an opaque op, the shared expert's int4 linears
    inside the graph) equal int4 eager decode token for token (fp32): two requests decode eagerly together,
    then the longer one alone in bucket 1 (compile time: the bucket sweep is tests/test_models_moe.py's). The
    op runs whatever experts the block holds, so one method covers them; int8 compiles 2-3x slower."""
    path = checkpoints["qwen2_moe"]
    prompts = prompts_of([9, 26], seed=6)
    params = [{**GREEDY, "max_new_tokens": n} for n in (4, 10)]
    eager = engine_factory(path, quantization="int4").generate(input_ids=prompts, sampling_params=params)
    eng = engine_factory(path, quantization="int4", disable_compile=False, compile_max_bs=1)
    seen = count_compiled(eng)
    compiled = eng.generate(input_ids=prompts, sampling_params=params)
    assert seen and set(seen) == {1}
    assert [o["output_ids"] for o in compiled] == [o["output_ids"] for o in eager]
