"""Rotary position embeddings (default, linear, Llama-3 and LongRoPE scaling), matching HF transformers."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, computed exactly the way transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "longrope":  # one set of factors for every position: see `config.longrope_settings`
        which = "long_factor" if scaling.get("use_long_factors") else "short_factor"
        return 1.0 / (torch.tensor(scaling[which], dtype=torch.float32) * theta**exponents)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half layout)."""

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # LongRoPE scales cos and sin by its attention factor (1 for every other kind).
        factor = (
            float((scaling or {}).get("attention_factor") or 1.0)
            if (scaling or {}).get("rope_type") == "longrope"
            else 1.0
        )
        self.register_buffer(
            "cos_cache", emb.cos() * factor if factor != 1.0 else emb.cos(), persistent=False
        )
        self.register_buffer(
            "sin_cache", emb.sin() * factor if factor != 1.0 else emb.sin(), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, H, D], ``k`` [T, KVH, D] rotated by their positions [T]."""
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
