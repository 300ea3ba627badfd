"""One plain decode forward over the running batch: one token per request, argmax inside the compiled step
when every request is plain greedy (no logits leave it, no sampling metadata is built), else sampled."""

from __future__ import annotations

import torch

from radixrt.kernels.base import ForwardMode
from radixrt.worker.model_runner import ForwardInput, ModelRunner
from radixrt.worker.output import OutputProcessor
from radixrt.worker.req import Req


def decode_forward(runner: ModelRunner, out: OutputProcessor, reqs: list[Req]) -> None:
    """Run one decode step for ``reqs`` (their slots already allocated) and append each next token."""
    kv_lens = [r.kv_len for r in reqs]
    fi = ForwardInput(
        ForwardMode.DECODE,
        [r.req_pool_idx for r in reqs if r.req_pool_idx is not None],
        kv_lens,
        [1] * len(reqs),
        [r.output_ids[-1] for r in reqs],
        torch.tensor(kv_lens, dtype=torch.int64),
    )
    if all(r.plain_greedy for r in reqs):
        next_ids = runner.forward_greedy(fi)
        for req in reqs:
            req.kv_len += 1
        out.append_tokens(reqs, next_ids)
        return
    hidden = runner.forward(fi)
    for req in reqs:
        req.kv_len += 1
    out.sample_and_append(reqs, runner.logits(hidden))
