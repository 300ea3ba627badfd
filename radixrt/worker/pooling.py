"""Embedding requests in the worker: a prompt's final hidden states pooled into one vector.

An embedding request (``TokenizedGenerateReq.embed``: ``"last"`` or ``"mean"``) is a prefill with no
decode (``max_new_tokens`` 0). ``"last"`` keeps the last prompt token's hidden state (decoder embedding
models: e5-mistral, gte-Qwen, Qwen3-Embedding), so a cached prefix still serves it; ``"mean"`` averages every
prompt token's, so the request computes all of them (`Req.max_prefix_len` is 0 for it). The vector goes
out raw in float32; the HTTP layer normalizes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixrt.worker.req import Req

POOLING_MODES = ("last", "mean")


def pool_chunk(req: Req, hidden: torch.Tensor) -> None:
    """Fold one computed chunk ``[extend_len, hidden]`` of ``req``'s prompt into its pooled vector; once
    the prefill is done, ``req.embedding`` holds the result."""
    rows = hidden.float()
    if req.embed == "mean":
        total = rows.sum(dim=0)
        req.embed_acc = total if req.embed_acc is None else req.embed_acc + total
        if req.prefill_done:
            req.embedding = (req.embed_acc / len(req.origin_input_ids)).tolist()
    elif req.prefill_done:
        req.embedding = rows[-1].tolist()
