"""The decode step compiled per batch-size bucket: torch.compile (inductor) on CPU, the analog of
SGLang's CUDA-graph runner (a GPU build captures the same buckets as CUDA graphs).

A decode batch of ``bs`` requests is padded to the smallest bucket >= bs (buckets 1, 2, 4, 8, ... up to
``--compile-max-bs``); padding rows compute token 0 at position 0 and read and write only the reserved
padding slot 0. Each decoder layer runs one compiled graph (*regional* compilation: all layers share the
code, so a bucket compiles once, not once per layer), in which inductor fuses what eager runs as separate
ops (RMSNorm, rotary, SiLU-mul, residual adds) around the linears. Attention is one opaque custom op
(``radixrt::decode_attention``): it calls the attention backend with the forward's metadata, so the
graph's shapes depend on the bucket only, never on the context lengths. A mixture-of-experts layer's routed
experts are opaque the same way (``radixrt::routed_experts``: which expert gets which rows is data-dependent),
so its graph holds attention, norms, router and shared expert. Compiled artifacts are cached on
disk by inductor's FX-graph cache (torch's default place, ``/tmp/torchinductor_$USER``; the environment
variable ``TORCHINDUCTOR_CACHE_DIR`` moves it), so a restart does not pay again.

No guards on the hot path: dynamo checks ~30 us of guards before every call of a compiled function (the
layer's parameters, its attributes, global state), 30 times a step, ~1 ms of a 9 ms batch-1 step. Here
every (bucket, layer kind) pair gets a compiled function of its own (a fresh code object, so its own
dynamo cache with exactly one entry) compiled with ``torch.compiler.skip_all_guards_unsafe``. What the
guards would have checked is fixed by construction: a function only ever sees its bucket's shapes (and
inductor's generated code still asserts every input's size and stride), and layers share a function only
when :func:`layer_kind` finds them alike (same module classes, parameter and buffer shapes and dtypes,
scalar attributes: Gemma 3's local and global layers, or a GGUF file mixing Q4_K and Q6_K layers, are
different kinds). ``--compile-scope model`` compiles the embedding and all layers as one graph per bucket
instead: one call a step instead of one per layer (batch-1 decode of the embedded model 8.2 -> 7.0 ms, 16 rows
20.4 -> 19.0 ms), for ~4x the compile time (dynamo traces every layer; ~110 s cold, ~20 s warm for 5
buckets, against ~25 s / ~3 s), and inductor may fuse across layer boundaries, so bf16 rounds differently
from the per-layer graphs (float32 stays exact).

Each graph's wrapper -- the code that allocates its buffers and calls its kernels and opaque ops -- is C++
(inductor's ``cpp_wrapper``), not Python: on a 2-core AVX2 machine in float32, four alternated processes,
batch-1 decode of the embedded model ran a median 55 tok/s against 43, 16 streams 191 against 172, for
10-45% more cold compile time (docs/cpu.md). ``RADIXRT_COMPILE_CPP_WRAPPER=0`` keeps the Python wrapper.
Inductor's per-call size asserts are off (``RADIXRT_COMPILE_SIZE_ASSERTS=1`` restores them): the shapes are
fixed by construction, and each assert builds a ``std::stringstream``. After its first call through dynamo,
each graph is called directly (:mod:`radixrt.worker.direct_call`; ``RADIXRT_COMPILE_DIRECT_CALL=0`` keeps
dynamo): ~40 us a call of Python less, 31 calls a step.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from radixrt.config.env import env_switch
from radixrt.kernels import decode_op
from radixrt.kernels.base import AttentionBackend, AttentionMetadata
from radixrt.kernels.decode_op import NativeDecode
from radixrt.layers.routed_experts import compiled_experts
from radixrt.models.llama import LlamaForCausalLM
from radixrt.models.moe import SparseMoE
from radixrt.models.rope import RotaryEmbedding
from radixrt.worker.direct_call import BoundCall, CapturingInductor, DirectCalls, direct_call_enabled
from radixrt.worker.step_cost import StepCost

logger = logging.getLogger(__name__)


def compile_buckets(max_bs: int) -> list[int]:
    """Powers of two below ``max_bs``, then ``max_bs`` itself: ``8 -> [1, 2, 4, 8]``, ``12 -> [1, 2, 4, 8, 12]``."""
    if max_bs < 1:
        raise ValueError(f"compile_max_bs: must be >= 1, got {max_bs}")
    buckets, b = [], 1
    while b < max_bs:
        buckets.append(b)
        b *= 2
    return [*buckets, max_bs]


def verify_buckets(max_requests: int, draft_tokens: int) -> list[int]:
    """Buckets of full speculative verifies besides the decode ones: ``b x (1 + k)`` tokens for ``b`` in 1, 2,
    4, ... up to ``max_requests`` (k = 4, 8 requests: 5, 10, 20, 40), so that the largest verify fits.
    NOTE: on a CPU a padding row costs about what a real one does: a batch-1 verify of 5 tokens padded to 8
    would cost 60% more."""
    if max_requests < 1:
        return []
    return [b * (1 + draft_tokens) for b in compile_buckets(max_requests)]


@dataclass
class _Forward:
    """The forward in flight: its backend and metadata, and the next layer's index."""

    backend: AttentionBackend | None = None
    md: AttentionMetadata | None = None
    layer: int = 0
    attention_s: float = 0.0  # seconds in the attention op so far (the step cost model reads it)
    layers: list[int] = field(default_factory=list)


class _PerThread(threading.local):
    """The forward in flight on this thread: engines in one process run their steps on their own scheduler
    threads, each with its own state (the native op's state is thread-local too)."""

    forward: _Forward

    def __init__(self) -> None:
        self.forward = _Forward()


_CURRENT = _PerThread()


@torch.library.custom_op("radixrt::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the current forward's next layer (stores k/v in the KV pool, then attends)."""
    # NOTE: the layer index is a counter, not an argument: an int argument would be a constant of the
    # traced graph and force one graph per layer. Layers run in order (each op consumes the previous
    # layer's output), and `DecodeGraphRunner.forward` checks that every layer ran exactly once.
    fw = _CURRENT.forward
    assert fw.backend is not None and fw.md is not None, "decode_attention outside a compiled forward"
    layer = fw.layer
    fw.layer += 1
    t0 = time.perf_counter()
    # An extend kernel may return a transposed view; the graph expects the fake's contiguous layout.
    out = fw.backend.forward(q, k, v, layer, fw.md).contiguous()
    fw.attention_s += time.perf_counter() - t0
    return out


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


class _OpaqueAttention:
    """Stands in for the attention backend inside the compiled layer."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: object
    ) -> torch.Tensor:
        return decode_attention(q, k, v)


_OPAQUE = _OpaqueAttention()


class _NativeAttention:
    """Stands in for the attention backend inside the compiled layer when the native op serves the step
    (`radixrt.kernels.decode_op`: no Python between the graph and the C kernel)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: object
    ) -> torch.Tensor:
        return torch.ops.radixrt_attn.decode(q, k, v)  # type: ignore[no-any-return]


_NATIVE = _NativeAttention()


_Attention = _OpaqueAttention | _NativeAttention


def _layer_step(
    layer: torch.nn.Module,
    x: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    attn: _Attention = _OPAQUE,
) -> torch.Tensor:
    """One decoder layer. ``attn`` (`_OPAQUE` or `_NATIVE`) is never passed: `_unguarded` sets it as the
    compiled copy's default, a constant of its graphs (an argument would cost the frame entry every call)."""
    return layer(x, positions, rope, attn, None)  # type: ignore[no-any-return]


def _stack_step(
    layers: torch.nn.ModuleList,
    embed: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    attn: _Attention = _OPAQUE,
) -> torch.Tensor:
    """The embedding and every decoder layer in one graph (``--compile-scope model``); ``attn`` as for
    `_layer_step`."""
    x = embed(ids)
    for layer in layers:
        x = layer(x, positions, rope, attn, None)
    return x


def _greedy_head(norm: torch.nn.Module, lm_head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Final norm, LM head and argmax in one graph: the next token of every row of a greedy batch."""
    return torch.argmax(lm_head(norm(x)), dim=-1)


# Attributes the compiled layer never reads: the attention backend (which reads layer_id) is the opaque op.
_IGNORED_ATTRIBUTES = frozenset({"layer_id"})


def layer_kind(layer: torch.nn.Module) -> Hashable:
    """What a compiled decoder layer's graph depends on besides its input shapes: every submodule's name and
    class, its parameters' and buffers' shapes, strides and dtypes (None buffers included), and its scalar
    attributes (bool, int, float, str, None, dtype; ``layer_id`` excepted). Layers of one kind run one graph."""
    parts: list[Hashable] = []
    for name, mod in layer.named_modules():
        parts.append((name, type(mod).__qualname__, type(mod).__module__))
        for key, value in sorted(vars(mod).items()):
            if key.startswith("_") or key in _IGNORED_ATTRIBUTES:
                continue
            if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
                parts.append((name, key, value))
            elif isinstance(value, torch.Tensor):
                parts.append((name, key, tuple(value.shape), value.stride(), value.dtype))
        for key, t in (*mod._parameters.items(), *mod._buffers.items()):
            parts.append((name, key, None if t is None else (tuple(t.shape), t.stride(), t.dtype)))
    return tuple(parts)


def fresh_function(
    fn: Callable[..., Any], name: str, defaults: tuple[Any, ...] | None = None
) -> Callable[..., Any]:
    """A copy of ``fn`` under a fresh code object named ``name`` (dynamo keeps one cache per code object), with
    ``defaults`` in place of its default argument values when given."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, defaults or fn.__defaults__, fn.__closure__)


def _unguarded(
    fn: Callable[..., Any], name: str, defaults: tuple[Any, ...] | None = None
) -> tuple[Callable[..., Any], CapturingInductor]:
    """``fn`` compiled without dynamo guards, under a fresh code object (its own dynamo cache), with
    ``defaults`` in place of its default argument values when given; and the backend that captures its graph
    for direct calls (`radixrt.worker.direct_call`)."""
    patches: dict[str, Any] = {}
    if cpp_wrapper_enabled():
        patches["cpp_wrapper"] = True
    if not env_switch(SIZE_ASSERTS_ENV, default=False):
        patches["size_asserts"] = False
    capture = CapturingInductor(patches)
    options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    compiled = torch.compile(
        fresh_function(fn, name, defaults), backend=capture, dynamic=False, fullgraph=True, options=options
    )
    return compiled, capture


CPP_WRAPPER_ENV = "RADIXRT_COMPILE_CPP_WRAPPER"
SIZE_ASSERTS_ENV = "RADIXRT_COMPILE_SIZE_ASSERTS"


def cpp_wrapper_enabled() -> bool:
    """``RADIXRT_COMPILE_CPP_WRAPPER``: 1 (default) has inductor write each decode graph's wrapper in C++
    (module doc), 0 in Python; ValueError for anything else."""
    return env_switch(CPP_WRAPPER_ENV)


def _raise_recompile_limit() -> None:
    """One graph per (bucket, model shape) lives on the shared layer code: leave room for several models
    in one process (tests, benchmarks) instead of dynamo's default of 8. NOTE: dynamo's config is per
    thread, so this runs on the thread that calls the compiled code (the scheduler's)."""
    if torch._dynamo.config.recompile_limit < 64:
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 512
        )


def _native_decode(backend: AttentionBackend) -> NativeDecode | None:
    """The native attention op for ``backend``'s decode steps, or None (logged) where it cannot serve them."""
    if backend.native_decode_buffers() is None:
        return None
    reason = decode_op.unavailable_reason()
    if reason is not None:
        logger.info("compiled decode: attention through the Python op (native op unavailable: %s)", reason)
        return None
    return NativeDecode(backend)


class DecodeGraphRunner:
    """Runs decode forwards of up to ``max_bs`` requests through per-bucket compiled layers (and speculative
    verifies, whose tokens fill the buckets as rows do: ``extra_buckets`` adds their sizes). With
    ``native_attention`` (only decode steps run here) and a backend that allows it, attention is the native op
    (`radixrt.kernels.decode_op`) instead of the Python one."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        max_bs: int,
        scope: str = "layer",
        extra_buckets: Sequence[int] = (),
        native_attention: bool = False,
    ) -> None:
        if scope not in ("layer", "model"):
            raise ValueError(f"compile_scope: layer or model, got {scope!r}")
        self.native = _native_decode(backend) if native_attention else None
        attn: _Attention = _NATIVE if self.native else _OPAQUE
        tag = "_native" if self.native else ""
        self.model = model
        self.backend = backend
        self.buckets = sorted({*compile_buckets(max_bs), *(b for b in extra_buckets if b > 0)})
        self.cost = StepCost(self.buckets)
        self.last_attention_s = 0.0  # seconds the last forward spent in attention
        self.scope = scope
        # Mixture of experts: each MoE block's routed experts, in layer order, for the opaque op that runs
        # them (radixrt.layers.routed_experts); the router and shared expert stay in the graphs.
        self._experts = [m.run_experts for m in model.modules() if isinstance(m, SparseMoE)]
        kinds: dict[Hashable, int] = {}
        self._kind_of = [kinds.setdefault(layer_kind(layer), len(kinds)) for layer in model.layers]
        # One compiled function per (bucket, layer kind) -- or per bucket for the whole stack -- and per
        # bucket for the greedy head (module doc).
        self._layer = {
            (b, k): _unguarded(_layer_step, f"_layer_step{tag}_bs{b}_kind{k}", (attn,))
            for b in self.buckets
            for k in (kinds.values() if scope == "layer" else ())
        }
        self._stack = {
            b: _unguarded(_stack_step, f"_stack_step{tag}_bs{b}", (attn,))
            for b in self.buckets
            if scope == "model"
        }
        self._greedy = {b: _unguarded(_greedy_head, f"_greedy_head_bs{b}") for b in self.buckets}
        # After a graph's first call, the same graph called without dynamo (radixrt.worker.direct_call):
        # per bucket, the greedy head, the whole stack, or each layer's call.
        self._direct = DirectCalls(direct_call_enabled())
        self._head_calls: dict[int, BoundCall] = {}
        self._stack_calls: dict[int, BoundCall] = {}
        self._layer_calls: dict[int, list[BoundCall]] = {}

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int | None:
        """The padded batch size for ``bs`` requests, or None when the batch is too large to compile."""
        return next((b for b in self.buckets if b >= bs), None)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[bucket, hidden]`` of a padded decode batch (metadata already planned)."""
        return self.model.norm(self._layers(ids, positions, md))

    def forward_greedy(
        self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Argmax token ids ``[bucket]`` of a padded decode batch: norm, LM head and argmax compiled too."""
        bs = ids.shape[0]
        x = self._layers(ids, positions, md)
        call = self._head_calls.get(bs)
        if call is not None:
            return call(x=x)
        head, capture = self._greedy[bs]
        out = head(self.model.norm, self.model.lm_head, x)
        modules = {"norm": self.model.norm, "lm_head": self.model.lm_head}
        direct = self._direct.learn(("head", bs), capture, {"x": x}, modules)
        if direct is not None:
            self._head_calls[bs] = BoundCall(direct, modules)
        return out

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        _raise_recompile_limit()
        fw = _CURRENT.forward
        fw.backend, fw.md, fw.layer, fw.attention_s = self.backend, md, 0, 0.0
        native = self.native
        if native is not None:
            native.begin(md.out_cache_loc)
        ran = 0
        try:
            bs = ids.shape[0]
            with compiled_experts(self._experts):
                x = self._run_graphs(bs, ids, positions)
            ran = fw.layer
        finally:
            if native is not None:
                ran, fw.attention_s = native.finish()
            self.last_attention_s = fw.attention_s
            fw.backend, fw.md = None, None
        if ran != len(self.model.layers):
            raise RuntimeError(
                f"compiled decode ran attention {ran} times for {len(self.model.layers)} layers"
            )
        return x

    def _run_graphs(self, bs: int, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embedding and the layers of bucket ``bs``: directly where bound, else through dynamo (and
        bound after)."""
        model, rope = self.model, self.model.rope
        if self.scope == "model":
            stack = self._stack_calls.get(bs)
            if stack is not None:
                return stack(ids=ids, positions=positions)
            fn, capture = self._stack[bs]
            x = fn(model.layers, model.embed_tokens, ids, positions, rope)
            modules = {"layers": model.layers, "embed": model.embed_tokens, "rope": rope}
            direct = self._direct.learn(("stack", bs), capture, {"ids": ids, "positions": positions}, modules)
            if direct is not None:
                self._stack_calls[bs] = BoundCall(direct, modules)
            return x
        x = model.embed_tokens(ids)
        calls = self._layer_calls.get(bs)
        if calls is not None:
            for call in calls:
                x = call(x=x, positions=positions)
            return x
        for layer, kind in zip(model.layers, self._kind_of, strict=True):
            fn, capture = self._layer[bs, kind]
            x_in, x = x, fn(layer, x, positions, rope)
            inputs = {"x": x_in, "positions": positions}
            self._direct.learn(("layer", bs, kind), capture, inputs, {"layer": layer, "rope": rope})
        directs = [self._direct.get(("layer", bs, kind)) for kind in self._kind_of]
        if all(d is not None for d in directs):
            self._layer_calls[bs] = [
                BoundCall(d, {"layer": layer, "rope": rope})
                for d, layer in zip(directs, model.layers, strict=True)
                if d is not None
            ]
        return x

    def warmup(self, run_padding_batch: Callable[[int], None]) -> float:
        """Compile every bucket (the layers and the greedy head) by running a batch of padding rows through
        it; returns the seconds spent."""
        t0 = time.perf_counter()
        for bs in tqdm(self.buckets, desc="compiling decode buckets", unit="bucket"):
            run_padding_batch(bs)
        elapsed = time.perf_counter() - t0
        logger.info("compiled decode for batch sizes %s in %.1f s", self.buckets, elapsed)
        return elapsed
