"""Load a Hugging Face checkpoint directory (single or sharded safetensors) into its model class."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixrt.models import moe
from radixrt.models.config import ModelConfig
from radixrt.models.gemma3 import Gemma3ForCausalLM
from radixrt.models.llama import LlamaForCausalLM

# Families whose decoder differs from Llama's; every other family is a LlamaForCausalLM.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "gemma3": Gemma3ForCausalLM,
    "mixtral": moe.MoEForCausalLM,
    "qwen2_moe": moe.MoEForCausalLM,
    "qwen3_moe": moe.MoEForCausalLM,
    "olmoe": moe.MoEForCausalLM,
}
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"model_path: no safetensors weights in {model_dir}")
    return found


def load_model(
    model_dir: str | Path, cfg: ModelConfig, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Build the model for ``cfg`` and fill it from the checkpoint's safetensors."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = MODEL_CLASSES.get(cfg.family, LlamaForCausalLM)(cfg)
    model = model.to_empty(device=device).to(cfg.dtype)
    model.init_rope(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    parts: dict[str, list[torch.Tensor | None]] = {}
    loaded: set[str] = set()
    filled: dict[str, int] = {}  # stacked expert parameters: how many per-expert matrices arrived
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in tqdm(list(f.keys()), desc=f"loading {path.name}", unit="tensor"):
                tensor = f.get_tensor(name)
                target = name.removeprefix("model.")
                if target.endswith("rotary_emb.inv_freq"):
                    continue
                target = moe.canonical_name(target, cfg.moe is not None and cfg.moe.full_qk_norm)
                expert = moe.expert_piece(target)
                if expert is not None:
                    param_name, index, piece = expert
                    if param_name not in params:
                        raise ValueError(
                            f"checkpoint weight {name!r} does not belong to a {cfg.architecture}"
                        )
                    moe.copy_expert_piece(params[param_name], index, piece, tensor)
                    filled[param_name] = filled.get(param_name, 0) + 1
                    if filled[param_name] == params[param_name].shape[0] * (2 if piece != "down" else 1):
                        loaded.add(param_name)
                    continue
                pieces = target.split(".")
                if len(pieces) >= 2 and pieces[-2] == "gate_up_proj":  # Phi-3: [gate; up] in one matrix
                    for half, part in zip(tensor.chunk(2, dim=0), ("gate_proj", "up_proj"), strict=True):
                        split_name = ".".join([*pieces[:-2], part, pieces[-1]])
                        _copy(params, split_name, half)
                        loaded.add(split_name)
                    continue
                fused = _FUSED.get(pieces[-2]) if len(pieces) >= 2 else None
                if fused is not None:
                    fused_name = ".".join([*pieces[:-2], fused[0], pieces[-1]])
                    slot = parts.setdefault(fused_name, [None, None, None])
                    slot[fused[1]] = tensor
                    if all(p is not None for p in slot):
                        _copy(params, fused_name, torch.cat([p for p in slot if p is not None]))
                        loaded.add(fused_name)
                    continue
                if target not in params:
                    raise ValueError(f"checkpoint weight {name!r} does not belong to a {cfg.architecture}")
                _copy(params, target, tensor)
                loaded.add(target)
    if cfg.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {missing[:8]}")
    return model.eval()


def _copy(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
