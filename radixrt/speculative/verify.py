"""Verification of deterministic drafts: which draft tokens the target model accepts.

A request with draft ``x_1..x_d`` contributes ``d + 1`` logit rows: row ``j`` is the target's
next-token distribution after its output plus ``x_1..x_j``. Each row is sampled by the one batched
sampler (``radixrt.sampling``) *as if* the draft prefix before it were already output: step
``len(output) + j`` (so the counter-based uniform is the one plain decoding would use for that output
index), output ids ``output + x_1..x_j`` (penalties) and the min_new_tokens bans of that step. Then
the longest prefix of the draft equal to the sampled targets is accepted, plus the target at the first
mismatch (or after the last draft token): between 1 and ``d + 1`` tokens per request.

Why this is speculative rejection sampling: with a deterministic draft (q one-hot at ``x``), the
standard rule accepts ``x`` with probability ``min(1, p(x) / q(x)) = p(x)`` and on rejection samples
from ``norm(max(p - q, 0))``, which is ``p`` with ``x`` removed and renormalized. Drawing ``y ~ p``
and accepting iff ``y == x`` (emitting ``y`` otherwise) accepts with probability ``p(x)`` and, given
rejection, emits ``y`` distributed as ``p`` restricted to ``y != x``: the same law, token by token, so
the output distribution is the target's. For greedy rows the "draw" is the argmax, so output ids equal
plain greedy decoding; for seeded rows every output index uses the same uniform as plain decoding,
so a seeded request gives the same tokens with speculation on or off (up to float rounding of the
logits, which differ slightly between an extend and a decode forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrt.sampling.sampler import sample
from radixrt.sampling.sampling_batch import SamplingBatchInfo
from radixrt.worker.req import Req


def uses_penalties(req: Req) -> bool:
    """Whether the request's sampling reads its output ids (repetition / frequency / presence)."""
    p = req.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def verify_info(
    reqs: Sequence[Req], drafts: Sequence[Sequence[int]], eos_ids: set[int], vocab_size: int
) -> SamplingBatchInfo:
    """Sampling tensors for the verify rows, request-major, ``1 + len(draft)`` rows per request."""
    params, seeds, steps, outputs, prompts, banned = [], [], [], [], [], []
    for req, draft in zip(reqs, drafts, strict=True):
        p = req.params
        ban = sorted(eos_ids | set(p.stop_token_ids))
        pen = uses_penalties(req)
        for j in range(len(draft) + 1):
            step = len(req.output_ids) + j
            params.append(p)
            seeds.append(req.seed)
            steps.append(step)
            # NOTE: only rows with a penalty read output ids; the others skip the copy.
            outputs.append(req.output_ids + list(draft[:j]) if pen else req.output_ids)
            prompts.append(req.origin_input_ids)
            banned.append(ban if step < p.min_new_tokens else [])
    return SamplingBatchInfo.build(params, seeds, steps, outputs, prompts, banned, vocab_size)


def accept(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Tokens a request emits: the draft prefix matching ``targets`` plus the next target.

    ``targets`` holds the ``len(draft) + 1`` sampled target tokens of the request's rows.
    """
    m = 0
    while m < len(draft) and targets[m] == draft[m]:
        m += 1
    return list(targets[: m + 1])


def verify(logits: torch.Tensor, info: SamplingBatchInfo, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sample every verify row of ``logits`` (``[sum(1 + d), V]``) and accept per request.

    Returns each request's emitted tokens (at least one: the target of its first row).
    """
    return accept_all(sample(logits, info).tolist(), drafts)


def accept_all(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """`accept` per request over request-major ``targets`` (``1 + len(draft)`` per request): for plain
    greedy requests the targets are the argmax of the compiled step, without logits or sampling."""
    out: list[list[int]] = []
    offset = 0
    for draft in drafts:
        out.append(accept(targets[offset : offset + len(draft) + 1], draft))
        offset += len(draft) + 1
    if offset != len(targets):
        raise ValueError(f"{len(targets)} logit rows for drafts needing {offset}")
    return out
