"""ModelConfig: the subset of a Hugging Face config.json the Llama-family decoder needs.

Reads both spellings transformers has used: 4.x (``torch_dtype``, ``rope_theta`` + ``rope_scaling``)
and 5.x (``dtype``, ``rope_parameters``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixrt.models import gemma3_config
from radixrt.models.moe_config import MOE_FAMILIES, MoEConfig, moe_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bf16``, ...) to a torch dtype."""
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype: unsupported {name!r}; choose one of {sorted(set(_DTYPES))}") from None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX), as torch reports it."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def auto_dtype() -> torch.dtype:
    """``--dtype auto`` on CPU: bf16 where the CPU has native bf16 (half the bytes per weight read, and
    decode is bandwidth-bound), else float32 (emulated bf16 is slower than fp32)."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family checkpoint."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Per-layer sliding windows when they differ by layer (Gemma 3: None for its global layers); empty:
    # every layer uses ``sliding_window``.
    layer_windows: list[int | None] = field(default_factory=list)
    # Softmax scale of attention; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    # RoPE of the local (sliding-window) layers when it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Mixture-of-experts routing and shapes (Mixtral, Qwen2-MoE, Qwen3-MoE); None for dense models.
    moe: MoEConfig | None = None

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None: full attention)."""
        return self.layer_windows[layer_id] if self.layer_windows else self.sliding_window

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_dir(
        cls, path: str | Path, dtype: str = "auto", context_length: int | None = None
    ) -> ModelConfig:
        """Read ``config.json`` of a checkpoint directory; ``dtype`` "auto": see `auto_dtype`;
        ``context_length``: the server's ``--context-length`` (see `from_dict`)."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model_path: no config.json in {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()), dtype=dtype, context_length=context_length)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], dtype: str = "auto", context_length: int | None = None
    ) -> ModelConfig:
        """Build from a parsed config.json dict. ``context_length`` matters only for LongRoPE (Phi-3):
        past the original context the model uses its long factors (see `longrope_settings`)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        torch_dtype = auto_dtype() if dtype == "auto" else parse_dtype(dtype)
        sliding = cfg.get("sliding_window")
        extra: dict[str, Any] = {}
        if family in MOE_FAMILIES:
            extra["moe"] = moe_config(family, cfg)
        if family in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None
        if family == "gemma3":
            local, global_ = gemma3_config.rope_dicts(cfg)
            rope_theta, rope_scaling = _rope_settings({"rope_parameters": global_})
            extra = gemma3_config.gemma3_fields(cfg, int(sliding) if sliding else None)
            extra["local_rope_theta"], extra["local_rope_scaling"] = _rope_settings(
                {"rope_parameters": local}
            )
        else:
            rope_theta, rope_scaling = _rope_settings(cfg)
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            rope_scaling = longrope_settings(rope_scaling, cfg, max_positions, context_length)
            if not rope_scaling["use_long_factors"]:
                max_positions = int(rope_scaling["original_max_position_embeddings"])
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get(
            "partial_rotary_factor"
        )
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor: {partial} is not supported (rotary over the whole head only)"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        fields: dict[str, Any] = dict(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2"
            or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=int(sliding) if sliding else None,
            dtype=torch_dtype,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )
        return cls(**(fields | extra))


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, scaling dict or None) from either config spelling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
        elif kind == "su":  # the name Phi-3 checkpoints first shipped with
            scaling["rope_type"] = "longrope"
        elif kind not in ("llama3", "linear", "longrope"):
            raise ValueError(
                f"rope_scaling: rope_type {kind!r} is not supported (supported: default, linear, llama3, longrope)"
            )
    return theta, scaling


def longrope_settings(
    scaling: dict[str, Any], cfg: dict[str, Any], max_positions: int, context_length: int | None = None
) -> dict[str, Any]:
    """LongRoPE (Phi-3): ``original_max_position_embeddings`` and ``attention_factor`` filled in as
    transformers derives them (factor = max / original context; sqrt(1 + ln factor / ln original)).

    Which factors: transformers switches a whole sequence to the long factors once it passes the original
    context, which would re-rotate every cached key of a prefix shared with shorter sequences. radixrt
    decides once, at startup, as vLLM does: a ``context_length`` beyond the original context selects the
    long factors for every position (``use_long_factors``; sequences over the original context then equal
    transformers, shorter ones are rotated as a long sequence would be); otherwise the short factors, and
    the context stops at the original length."""
    out = dict(scaling)
    original = int(
        out.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or 0
    )
    if not original or "short_factor" not in out:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings and short_factor")
    out["original_max_position_embeddings"] = original
    long = context_length is not None and context_length > original
    if long and not out.get("long_factor"):
        raise ValueError(
            f"context_length: {context_length} passes the original context ({original}) and the "
            "model's rope_scaling has no long_factor"
        )
    if long:
        logger.warning(
            "LongRoPE: context_length %d > original context %d, so every position uses the long factors "
            "(shorter sequences lose some quality; set --context-length <= %d to keep the short ones)",
            context_length, original, original,
        )  # fmt: skip
    out["use_long_factors"] = long
    factor = float(out.get("factor") or max_positions / original)
    if out.get("attention_factor") is None:
        out["attention_factor"] = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return out
