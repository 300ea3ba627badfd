"""The experts of one mixture-of-experts layer as per-expert weight-only linears (``--quantization``).

Unquantized, a MoE layer keeps its experts stacked in two float parameters (``w_gate_up [E, 2I, H]``,
``w_down [E, H, I]``) and multiplies each expert's rows with ``F.linear``. Quantized, each expert's gate/up
and down matrices become the same modules a dense layer's linears become (`Int8Linear`, `Int4Linear`, a
GGUF layout from `radixrt.layers.gguf_linear`), so every method, the dense twin for large batches
(``--dense-gemm-min-tokens``) and radixrt's int4 kernel apply to experts unchanged: the MoE block only
calls ``experts(e, rows)`` for each expert that received tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.layers.quantization import quantize_linear


class QuantizedExperts(nn.Module):
    """Expert ``e``'s SwiGLU MLP as two linears: ``gate_up[e]`` (``[gate; up]`` rows) and ``down[e]``."""

    def __init__(self, gate_up: Sequence[nn.Module], down: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up linears for {len(down)} down linears")
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
        return self.down[expert](F.silu(gate) * up)


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` sharing ``weight`` (``[out, in]``), for the quantization registry's converters."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


def quantize_experts(
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    method: str,
    *,
    group_size: int = 32,
    ggml_type: str | int = "Q8_0",
    compute_dtype: torch.dtype | None = None,
) -> QuantizedExperts:
    """Every expert of the stacked ``w_gate_up [E, 2I, H]`` / ``w_down [E, H, I]`` through ``method``
    (`radixrt.layers.quantization.quantize_linear`, the options as there)."""

    def one(w: torch.Tensor) -> nn.Module:
        return quantize_linear(
            _linear_of(w), method, group_size=group_size, ggml_type=ggml_type, compute_dtype=compute_dtype
        )

    return QuantizedExperts([one(w) for w in w_gate_up], [one(w) for w in w_down])
