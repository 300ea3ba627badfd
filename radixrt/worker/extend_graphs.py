"""Extend (prefill) forwards through compiled decoder layers with a dynamic token count.

Eager prefill spends a third of its time outside the GEMMs and attention: RMSNorm, rotary, SiLU-mul and the
residual adds as separate ops over ``[T, hidden]`` tensors, each reading and writing memory in bf16 with casts
around it (a 512-token prefill of the embedded model: 33 ms of elementwise ops and 8 ms of copies beside 77 ms
of GEMMs). Here each decoder layer runs one graph compiled with a symbolic number of tokens, in which
inductor fuses those ops around the linears; attention stays the opaque op of the decode graphs
(``radixrt::decode_attention``: the backend's extend kernels, reading the batch's metadata), so any mix of
prefix and extend lengths runs the same graph.

Unlike the decode buckets these functions keep dynamo's guards: a symbolic size meets data-dependent choices
inside the layer (the quantized linears switch to their dense weight from ``--dense-gemm-min-tokens`` rows), and
a guard recompiles the other branch where the decode graphs, which see one shape each, need none. The guards
cost ~1 ms a forward of 30 layers, against the ~100 ms forwards this path serves. Forwards of fewer than
`MIN_TOKENS` new tokens stay eager (a guard-checked graph saves little there, and a second specialization
would compile for nothing). The first extend of each graph compiles it (cached on disk by inductor, as the
decode graphs are); `ExtendGraphRunner.warmup` does that at startup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from tqdm import tqdm

from radixrt.config.env import env_switch
from radixrt.kernels.base import AttentionBackend, AttentionMetadata
from radixrt.layers.routed_experts import compiled_experts
from radixrt.models.llama import LlamaForCausalLM
from radixrt.models.moe import SparseMoE
from radixrt.worker.graph_runner import (
    _CURRENT,
    _layer_step,
    _raise_recompile_limit,
    fresh_function,
    layer_kind,
)

logger = logging.getLogger(__name__)

MIN_TOKENS = 64  # forwards of fewer new tokens run eagerly (module doc)


def _dynamic(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` compiled with a symbolic token count, guards kept, under a fresh code object (its own cache)."""
    return torch.compile(fresh_function(fn, name), dynamic=True, fullgraph=True)


class ExtendGraphRunner:
    """Runs extend forwards of at least `MIN_TOKENS` new tokens through one compiled graph per layer kind
    (`radixrt.worker.graph_runner.layer_kind`); the embedding and the final norm stay eager."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend
        self._experts = [m.run_experts for m in model.modules() if isinstance(m, SparseMoE)]
        kinds: dict[Hashable, int] = {}
        self._kind_of = [kinds.setdefault(layer_kind(layer), len(kinds)) for layer in model.layers]
        self._layer = {k: _dynamic(_layer_step, f"_extend_layer_kind{k}") for k in kinds.values()}

    def serves(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` new tokens runs here."""
        return tokens >= MIN_TOKENS

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of an extend batch (metadata already planned)."""
        _raise_recompile_limit()
        fw = _CURRENT.forward
        fw.backend, fw.md, fw.layer, fw.attention_s = self.backend, md, 0, 0.0
        try:
            with compiled_experts(self._experts):
                x = self.model.embed_tokens(ids)
                for layer, kind in zip(self.model.layers, self._kind_of, strict=True):
                    x = self._layer[kind](layer, x, positions, self.model.rope)
            ran = fw.layer
        finally:
            fw.backend, fw.md = None, None
        if ran != len(self.model.layers):
            raise RuntimeError(
                f"compiled extend ran attention {ran} times for {len(self.model.layers)} layers"
            )
        return self.model.norm(x)

    def warmup(self, run_extend: Callable[[int], None]) -> float:
        """Compile the graphs by running an extend of `MIN_TOKENS` padding tokens; returns the seconds spent."""
        t0 = time.perf_counter()
        for tokens in tqdm([MIN_TOKENS], desc="compiling extend graphs", unit="graph"):
            run_extend(tokens)
        elapsed = time.perf_counter() - t0
        logger.info("compiled extend graphs (any number of tokens >= %d) in %.1f s", MIN_TOKENS, elapsed)
        return elapsed


ENV = "RADIXRT_COMPILED_EXTEND"


def compiled_extend_enabled() -> bool:
    """``RADIXRT_COMPILED_EXTEND``: 1 (default) compiles extend forwards where decode is compiled, 0 runs them
    eagerly; ValueError for anything else."""
    return env_switch(ENV)
