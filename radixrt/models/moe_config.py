"""The mixture-of-experts fields of a config.json (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(slots=True)
class MoEConfig:
    """Routing and expert shapes. ``sparse_layers``: the layers whose MLP is routed (others are dense)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    sparse_layers: list[int] = field(default_factory=list)
    # OLMoE's attention: q/k RMSNorm over the whole projection (not per head), q/k/v clamped to +-clip_qkv.
    full_qk_norm: bool = False
    clip_qkv: float | None = None


def moe_config(family: str, cfg: dict[str, Any]) -> MoEConfig:
    """Mixtral: every layer sparse, top-k weights always renormalized. OLMoE: every layer sparse,
    ``norm_topk_prob``, its own q/k norm. Qwen2/3-MoE: ``decoder_sparse_step``
    and ``mlp_only_layers`` pick the sparse layers, ``norm_topk_prob`` the renormalization, and Qwen2-MoE adds
    a shared expert."""
    layers = int(cfg["num_hidden_layers"])
    if family == "mixtral":
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            sparse_layers=list(range(layers)),
        )
    if family == "olmoe":
        clip = cfg.get("clip_qkv")
        return MoEConfig(
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=list(range(layers)),
            full_qk_norm=True,
            clip_qkv=None if clip is None else float(clip),
        )
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if family == "qwen2_moe"
        else 0,
        sparse_layers=[i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0],
    )
