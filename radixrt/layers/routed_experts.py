"""The routed experts of a mixture-of-experts layer as one opaque op (``radixrt::routed_experts``) for
compiled decode.

Which expert runs which rows is data-dependent (a sort, a bincount read back to Python, a loop over the
experts that received tokens), so a compiled graph cannot contain it. Inside a compiled forward the MoE block
calls this op instead: the graph keeps the router (softmax, top-k, renormalization), the weighted sum of
each token's expert outputs and the shared expert around it, and the op runs the expert-grouped computation
eagerly, as the uncompiled model does, with float or quantized experts alike. Its tracing twin only gives
the output's shape, one row per (token, slot) pair.

Like the compiled attention op, the op takes no layer argument (an int would be a constant of the traced
graph, forcing one graph per layer): the caller of the compiled code lists the model's MoE blocks in layer
order (:func:`compiled_experts`), and each call runs the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# (hidden ``[T, H]``, expert ids ``[T, k]``) -> each (token, slot) pair's expert output ``[T * k, H]``
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Pass:
    """The compiled forward in flight: its MoE blocks in layer order and the next one's index."""

    blocks: Sequence[ExpertsFn] = ()
    next: int = 0


_PASS = _Pass()


@torch.library.custom_op("radixrt::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The next MoE block's experts ``ids [T, k]`` over the rows of ``x [T, H]``: ``[T * k, H]``, row
    ``t * k + j`` for token t's j-th expert (unweighted)."""
    p = _PASS
    if p.next >= len(p.blocks):
        raise RuntimeError(f"routed_experts: call {p.next + 1} with {len(p.blocks)} MoE blocks listed "
                           "(outside compiled_experts?)")  # fmt: skip
    run = p.blocks[p.next]
    p.next += 1
    return run(x, ids)


@routed_experts.register_fake
def _(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.new_empty((ids.numel(), x.shape[1]))


@contextmanager
def compiled_experts(blocks: Sequence[ExpertsFn]) -> Iterator[None]:
    """Inside: the i-th call of the op runs ``blocks[i]``. On a normal exit, RuntimeError unless every
    block ran exactly once."""
    saved = (_PASS.blocks, _PASS.next)
    _PASS.blocks, _PASS.next = blocks, 0
    try:
        yield
        if _PASS.next != len(blocks):
            raise RuntimeError(f"compiled forward ran {_PASS.next} of {len(blocks)} MoE blocks")
    finally:
        _PASS.blocks, _PASS.next = saved
