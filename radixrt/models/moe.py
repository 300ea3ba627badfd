"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE and OLMoE.

Attention is the Llama-family one (Qwen2-MoE: q/k/v bias; Qwen3-MoE: per-head q/k norm; OLMoE: q/k norm over
the whole projection and optional q/k/v clamping, `FullNormAttention`); the MLP of a sparse
layer is `SparseMoE`: a linear router, softmax in float32, the top-k experts of each token, their weights
renormalized to sum 1 where the family does (Mixtral always; Qwen ``norm_topk_prob``), and the experts' SwiGLU
MLPs. The experts' weights are stacked, ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` (the loader fills
them from the checkpoint's per-expert matrices). The CPU path groups the routed (token, expert) pairs by
expert with one sort, then runs each expert that received tokens as two matmuls over its rows: a Python loop
over experts (at most E iterations), never over tokens; the outputs return to (token, slot) order and are
summed with the routing weights. Under ``--quantization`` the stacked parameters give
way to per-expert quantized linears (`radixrt.layers.experts.QuantizedExperts`, `SparseMoE.use_experts`);
the router stays float. In compiled decode the grouping is one opaque op (`radixrt.layers.routed_experts`)
inside the traced layer: the graph holds the router, the weighted sum and the shared expert, the op runs
`run_experts`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels.base import AttentionBackend, AttentionMetadata
from radixrt.layers.experts import QuantizedExperts
from radixrt.layers.routed_experts import routed_experts
from radixrt.models.config import ModelConfig
from radixrt.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from radixrt.models.rope import RotaryEmbedding


class SparseMoE(nn.Module):
    """Top-k routed experts (plus, for Qwen2-MoE, a shared expert scaled by a sigmoid gate)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        e, i, h = moe.num_experts, moe.expert_intermediate_size, cfg.hidden_size
        self.top_k, self.normalize, self.num_experts = moe.top_k, moe.norm_topk_prob, e
        self.gate = nn.Linear(h, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.experts: QuantizedExperts | None = None  # set by use_experts (quantized experts)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def use_experts(self, experts: QuantizedExperts) -> None:
        """Run ``experts`` instead of the stacked float parameters, which are dropped."""
        if len(experts.down) != self.num_experts:
            raise ValueError(f"{len(experts.down)} quantized experts for a layer of {self.num_experts}")
        self.experts = experts
        self.register_parameter("w_gate_up", None)
        self.register_parameter("w_down", None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) of each token."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if torch.compiler.is_compiling():  # compiled decode: the grouping runs as an opaque op
            pairs = routed_experts(x, experts)
        else:
            pairs = self.run_experts(x, experts)
        out = (pairs.view(*experts.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every routed (token, slot) pair's expert output, ``[T * k, H]``: row ``t * k + j`` is token t's j-th
        expert (``experts [T, k]``) applied to ``x[t]``, unweighted."""
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, order // self.top_k)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = grouped[start : start + n]
            if self.experts is not None:
                ys.append(self.experts(e, rows))
            else:
                gate, up = F.linear(rows, self.w_gate_up[e]).chunk(2, dim=-1)
                ys.append(F.linear(F.silu(gate) * up, self.w_down[e]))
            start += n
        # NOTE: back to pair order by a copy, not an index_add_ per expert: on CPU index_add_ opens an
        # OpenMP region even for one row (~5 us alone, ~300 us while other processes share the cores).
        return torch.empty_like(grouped).index_copy_(0, order, torch.cat(ys))


class FullNormAttention(Attention):
    """OLMoE's attention: RMSNorm over all query / key channels before the split into heads, then
    q, k, v clamped to ``[-clip_qkv, clip_qkv]`` when the config sets it."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        assert cfg.moe is not None
        self.clip = cfg.moe.clip_qkv
        self.q_full_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_full_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_full_norm(q), self.k_full_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q, k = rope(
            positions, q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        )
        out = backend.forward(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), self.layer_id, md)
        return self.o_proj(out.reshape(t, self.q_size))


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers (``ModelConfig.moe.sparse_layers``) use `SparseMoE`."""

    def make_layer(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        layer = DecoderLayer(cfg, layer_id)
        assert cfg.moe is not None
        if layer_id in cfg.moe.sparse_layers:
            layer.mlp = SparseMoE(cfg)  # type: ignore[assignment]
        if cfg.moe.full_qk_norm:
            layer.self_attn = FullNormAttention(cfg, layer_id)
        return layer


_PIECES = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_piece(name: str) -> tuple[str, int, str] | None:
    """Where a checkpoint's per-expert matrix goes: (stacked parameter, expert, "gate" | "up" | "down") for
    ``layers.N.mlp.experts.J.gate_proj.weight`` (Qwen) / ``layers.N.block_sparse_moe.experts.J.w1.weight``
    (Mixtral: w1 gate, w3 up, w2 down); None for any other name."""
    parts = name.split(".")
    if len(parts) != 7 or parts[0] != "layers" or parts[3] != "experts" or parts[5] not in _PIECES:
        return None
    piece = _PIECES[parts[5]]
    param = "w_down" if piece == "down" else "w_gate_up"
    return f"layers.{parts[1]}.mlp.{param}", int(parts[4]), piece


def canonical_name(name: str, full_qk_norm: bool = False) -> str:
    """Mixtral's ``block_sparse_moe`` module is this model's ``mlp``; v5-style stacked experts
    (``mlp.experts.gate_up_proj`` / ``down_proj``) are ``mlp.w_gate_up`` / ``mlp.w_down``; OLMoE's
    whole-projection q/k norms are ``self_attn.q_full_norm`` / ``k_full_norm``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if full_qk_norm:
        name = name.replace(".self_attn.q_norm.", ".self_attn.q_full_norm.").replace(
            ".self_attn.k_norm.", ".self_attn.k_full_norm."
        )
    return name.replace(".mlp.experts.gate_up_proj", ".mlp.w_gate_up").replace(
        ".mlp.experts.down_proj", ".mlp.w_down"
    )


def copy_expert_piece(param: torch.Tensor, expert: int, piece: str, tensor: torch.Tensor) -> None:
    """Copy one expert's gate / up / down matrix into its rows of the stacked parameter."""
    half = param.shape[1] // 2
    target = {"gate": param[expert, :half], "up": param[expert, half:], "down": param[expert]}[piece]
    if target.shape != tensor.shape:
        raise ValueError(
            f"expert {expert} {piece}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor.to(param.dtype))
