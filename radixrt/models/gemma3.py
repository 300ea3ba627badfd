"""Gemma 3 (text): the Llama-family decoder with Gemma's differences, exact against transformers.

- RMSNorm scales by ``(1 + weight)`` and multiplies in float32 before casting back (`GemmaRMSNorm`);
- four norms per layer: after attention and around the MLP (pre/post feed-forward), plus q/k norms;
- GeGLU MLP with tanh-approximated GELU;
- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weights' dtype, as transformers does);
- local (sliding-window) layers and global layers use different RoPE bases (`GemmaRotary.local`); the
  window itself is applied by the attention backend per layer (`radixrt.kernels.layer_windows`);
- attention scaled by ``query_pre_attn_scalar ** -0.5`` (`ModelConfig.softmax_scale`), tied embeddings,
  optional final logit soft-capping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels.base import AttentionBackend, AttentionMetadata
from radixrt.models.config import ModelConfig
from radixrt.models.llama import Attention, LlamaForCausalLM, RMSNorm
from radixrt.models.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32, then cast (Llama casts before the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``scale`` (sqrt(hidden)) in the weights' dtype."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim, _weight=torch.empty(num, dim))
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * torch.tensor(self.scale).to(out.dtype)  # float32 first, as transformers rounds it


class GemmaRotary(RotaryEmbedding):
    """The global layers' rotary tables, with the local layers' as the child ``local``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        self.local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, cfg.local_rope_scaling)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and the MLP; local layers rotate with ``rope.local``."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_local = cfg.window_of(layer_id) is not None
        self.self_attn = Attention(cfg, layer_id)
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        table = rope.local if self.is_local and isinstance(rope, GemmaRotary) else rope
        attn = self.self_attn(self.input_layernorm(x), positions, table, backend, md)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder (HF ``Gemma3ForCausalLM``, GGUF ``gemma3``) behind LlamaForCausalLM's interface."""

    def make_embedding(self, cfg: ModelConfig) -> nn.Embedding:
        return ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size**0.5)

    def make_layer(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, layer_id)

    def make_norm(self, cfg: ModelConfig) -> RMSNorm:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_rope(self, cfg: ModelConfig) -> RotaryEmbedding:
        return GemmaRotary(cfg)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
