"""The Gemma 3 fields of a config.json, in both spellings transformers has written.

transformers 5.x writes ``layer_types`` (``sliding_attention`` / ``full_attention`` per layer) and
``rope_parameters`` keyed by layer type; 4.x wrote ``rope_theta`` (global layers), ``rope_local_base_freq``
(local layers), ``rope_scaling`` (global layers only) and ``sliding_window_pattern`` (every n-th layer global).
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """``sliding_attention`` or ``full_attention`` for each layer."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types: expected {n} entries of {SLIDING!r} / {FULL!r}, got {types!r}")
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def rope_dicts(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(local, global) RoPE parameter dicts, each in the ``rope_parameters`` form (with ``rope_theta``)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params and FULL in params:
        return dict(params[SLIDING]), dict(params[FULL])
    global_ = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
    global_["rope_theta"] = float(cfg.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq", 10_000.0))}
    return local, global_


def gemma3_fields(cfg: dict[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """The `ModelConfig` fields that differ for Gemma 3 (windows per layer, attention scale, activation...)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping: attention logit soft-capping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal Gemma 3 checkpoints are supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: {act!r} is not supported for Gemma 3 (gelu_pytorch_tanh)")
    cap = cfg.get("final_logit_softcapping")
    return {
        "layer_windows": [sliding_window if t == SLIDING else None for t in layer_types(cfg)],
        "attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcapping": None if cap is None else float(cap),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "qk_norm": True,
    }
