"""Tensor parallelism on torch.distributed: shard a loaded model's heads, MLP columns/rows and vocabulary.

Megatron's layout, applied in place to a model whose full weights are loaded:

- attention: the fused q/k/v projection is column-parallel by heads (rank r keeps query heads
  ``[r*H/N, (r+1)*H/N)`` and the matching KV heads), ``o_proj`` row-parallel, then one all-reduce;
- MLP: ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel, then one all-reduce;
- mixture of experts: sharded within experts, not by expert: every rank keeps every expert's slice
  ``[r*I/N, (r+1)*I/N)`` of the intermediate width (gate/up rows, down columns) and the router whole, so it
  routes exactly as one rank would, runs the same experts on thinner matrices, and the layer's partial sums
  (Qwen2-MoE's shared expert sharded the same way inside them) meet in one all-reduce
  (`AllReducedOutput`). By expert would leave a rank idle whenever the batch's tokens miss its experts,
  needs E divisible by N and a gather of the tokens each rank's experts take; within experts costs nothing
  more than a dense MLP's one all-reduce and balances itself at any routing;
- embedding and LM head vocab-parallel: each rank holds a contiguous slice of the vocabulary (padded to
  equal slices); the embedding masks ids outside its slice and all-reduces, the LM head all-gathers its
  logits slices;
- norms, rotary tables and biases of row-parallel layers stay replicated (a row-parallel bias is added on
  rank 0 only, so the all-reduce counts it once); a scaled embedding (Gemma 3's ``sqrt(hidden)``) scales
  after the all-reduce, so its values are those of one rank; a norm over every head's channels (OLMoE's q/k
  norms) sums its squares across the ranks (`ShardedRMSNorm`).

The KV pool of each rank then holds its KV heads only (sharded by KV heads). ``gloo`` on CPU, NCCL on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from radixrt.models.config import ModelConfig
from radixrt.models.llama import LlamaForCausalLM, RMSNorm
from radixrt.models.moe import FullNormAttention, SparseMoE


class RowParallelLinear(nn.Module):
    """``x[:, shard] @ W[:, shard].T`` on every rank, summed by an all-reduce."""

    def __init__(self, inner: nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        cols = inner.in_features // size
        self.linear = nn.Linear(cols, inner.out_features, bias=inner.bias is not None and rank == 0)
        self.linear.to(device=inner.weight.device, dtype=inner.weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(inner.weight[:, rank * cols : (rank + 1) * cols])
            if self.linear.bias is not None and inner.bias is not None:
                self.linear.bias.copy_(inner.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding; ids outside look up zeros, then an all-reduce."""

    def __init__(self, inner: nn.Embedding, rank: int, size: int) -> None:
        super().__init__()
        vocab = inner.num_embeddings
        self.per_rank = -(-vocab // size)
        self.start = rank * self.per_rank
        end = min(self.start + self.per_rank, vocab)
        self.weight = nn.Parameter(inner.weight[self.start : end].detach().clone(), requires_grad=False)
        self.scale: float | None = getattr(inner, "scale", None)  # Gemma 3's ScaledEmbedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out)
        if self.scale is not None:  # as ScaledEmbedding rounds it: float32 first, then the weights' dtype
            out = out * torch.tensor(self.scale).to(out.dtype)
        return out


class ShardedRMSNorm(RMSNorm):
    """`RMSNorm` over a vector whose channels are split across the ranks: this rank's slice of the weight,
    the mean of squares over the full width from an all-reduced sum."""

    def __init__(self, inner: RMSNorm, start: int, n: int) -> None:
        super().__init__(n, inner.eps)
        self.full = inner.weight.shape[0]
        self.weight = nn.Parameter(_rows(inner.weight, start, n), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        h = h * torch.rsqrt(squares / self.full + self.eps)
        return self.weight * h.to(dtype)


class AllReducedOutput(nn.Module):
    """``inner(x)`` summed over the ranks: a block (a MoE layer) whose every rank computes a partial sum."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """The LM head's rows for this rank's vocabulary slice; ``forward`` all-gathers the full logits."""

    def __init__(self, weight: torch.Tensor, vocab: int, per_rank: int, size: int) -> None:
        super().__init__()
        self.weight = weight  # shared with the embedding when tied
        self.vocab, self.per_rank, self.size = vocab, per_rank, size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight)
        if local.shape[-1] < self.per_rank:  # the last slice is shorter: pad to the common width
            pad = self.per_rank - local.shape[-1]
            local = nn.functional.pad(local, (0, pad))
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[start : start + n].detach().clone()


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError naming what ``--tp-size`` does not divide (heads, MLP and expert widths) or cannot shard."""
    widths = [
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP width", cfg.intermediate_size),
    ]
    if cfg.moe is not None:
        widths.append(("expert width", cfg.moe.expert_intermediate_size))
        if cfg.moe.shared_expert_intermediate_size:
            widths.append(("shared expert width", cfg.moe.shared_expert_intermediate_size))
    for name, value in widths:
        if value % size:
            raise ValueError(f"tp_size: {size} does not divide the model's {value} {name}")


def _shard_mlp(mlp: Any, rank: int, size: int, reduce: bool = True) -> None:
    """``gate_proj`` / ``up_proj`` column-parallel, ``down_proj`` row-parallel (all-reduced if ``reduce``)."""
    inter = mlp.gate_proj.out_features // size
    for name in ("gate_proj", "up_proj"):
        full: nn.Linear = getattr(mlp, name)
        part = nn.Linear(full.in_features, inter, bias=False).to(
            device=full.weight.device, dtype=full.weight.dtype
        )
        part.weight.copy_(_rows(full.weight, rank * inter, inter))
        setattr(mlp, name, part)
    down = RowParallelLinear(mlp.down_proj, rank, size)
    mlp.down_proj = down if reduce else down.linear


def _shard_experts(moe: SparseMoE, rank: int, size: int) -> None:
    """Every expert's slice of the intermediate width: gate and up rows, down columns (no all-reduce)."""
    width = moe.w_down.shape[2]
    part = width // size
    lo, hi = rank * part, (rank + 1) * part
    gate_up = torch.cat([moe.w_gate_up[:, lo:hi], moe.w_gate_up[:, width + lo : width + hi]], dim=1)
    moe.w_gate_up = nn.Parameter(gate_up.clone(), requires_grad=False)
    moe.w_down = nn.Parameter(moe.w_down[:, :, lo:hi].clone(), requires_grad=False)
    if moe.shared_expert is not None:
        _shard_mlp(moe.shared_expert, rank, size, reduce=False)


def shard_model(model: LlamaForCausalLM, rank: int, size: int) -> None:
    """Keep rank ``rank``'s shard of every layer (see the module docstring); in place."""
    cfg = model.config
    check_divisible(cfg, size)
    h, kvh, d = cfg.num_heads // size, cfg.num_kv_heads // size, cfg.head_dim
    with torch.no_grad():
        for layer in model.layers:
            attn: Any = layer.self_attn  # Attention (ModuleList items type as Module)
            qkv: nn.Linear = attn.qkv_proj
            q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
            pieces = [
                (rank * h * d, h * d),
                (q_all + rank * kvh * d, kvh * d),
                (q_all + kv_all + rank * kvh * d, kvh * d),
            ]
            new = nn.Linear(qkv.in_features, (h + 2 * kvh) * d, bias=qkv.bias is not None)
            new.to(device=qkv.weight.device, dtype=qkv.weight.dtype)
            new.weight.copy_(torch.cat([_rows(qkv.weight, s, n) for s, n in pieces]))
            if qkv.bias is not None and new.bias is not None:
                new.bias.copy_(torch.cat([_rows(qkv.bias, s, n) for s, n in pieces]))
            attn.qkv_proj = new
            attn.num_heads, attn.num_kv_heads = h, kvh
            attn.q_size, attn.kv_size = h * d, kvh * d
            attn.o_proj = RowParallelLinear(attn.o_proj, rank, size)
            if isinstance(attn, FullNormAttention):  # OLMoE: q/k norms over every head's channels
                attn.q_full_norm = ShardedRMSNorm(attn.q_full_norm, rank * h * d, h * d)
                attn.k_full_norm = ShardedRMSNorm(attn.k_full_norm, rank * kvh * d, kvh * d)
            mlp: Any = layer.mlp
            if isinstance(mlp, SparseMoE):
                _shard_experts(mlp, rank, size)
                layer.mlp = AllReducedOutput(mlp)
            else:
                _shard_mlp(mlp, rank, size)
        tied = model.lm_head.weight is model.embed_tokens.weight
        embed = VocabParallelEmbedding(model.embed_tokens, rank, size)
        head_weight = (
            embed.weight
            if tied
            else nn.Parameter(
                _rows(model.lm_head.weight, embed.start, embed.weight.shape[0]), requires_grad=False
            )
        )
        model.embed_tokens = embed  # type: ignore[assignment]
        model.lm_head = VocabParallelHead(head_weight, cfg.vocab_size, embed.per_rank, size)  # type: ignore[assignment]
