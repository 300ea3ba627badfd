"""One prefill (extend) forward: each batch request's next chunk of prompt tokens, plus, with
``--enable-mixed-chunk``, one decode token for each running request (SGLang's mixed chunk: the weights are
read once for both, and running requests do not pause while a prompt is prefilled)."""

from __future__ import annotations

import torch

from radixrt.kernels.base import ForwardMode
from radixrt.worker.model_runner import ForwardInput, ModelRunner
from radixrt.worker.output import OutputProcessor
from radixrt.worker.req import Req


def extend_forward(
    runner: ModelRunner, out: OutputProcessor, batch: list[Req], decoding: list[Req]
) -> torch.Tensor:
    """Run ``batch``'s extends with ``decoding``'s decode rows after them (their slots already allocated);
    append each decoding request's next token and return the hidden states of ``batch``'s rows only."""
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    for req in batch:
        ids.extend(req.fill_ids[req.kv_len : req.kv_len + req.extend_len])
        positions.append(torch.arange(req.kv_len, req.kv_len + req.extend_len))
    extend_rows = len(ids)
    ids.extend(r.output_ids[-1] for r in decoding)
    positions.append(torch.tensor([r.kv_len for r in decoding], dtype=torch.int64))
    both = batch + decoding
    fi = ForwardInput(
        ForwardMode.EXTEND,
        [r.req_pool_idx for r in both if r.req_pool_idx is not None],
        [r.kv_len for r in both],
        [r.extend_len for r in batch] + [1] * len(decoding),
        ids,
        torch.cat(positions),
    )
    hidden = runner.forward(fi)
    if decoding:
        for req in decoding:
            req.kv_len += 1
        out.sample_and_append(decoding, runner.logits(hidden[extend_rows:]))
    return hidden[:extend_rows]
