"""One speculative decode step: draft per request, verify the whole batch in one compiled forward.

``Speculator.step`` replaces a plain decode step when the policy verifies at least one draft:

1. Draft: per request, the drafter's proposal (``propose``), capped so that it can never overrun
   max_new_tokens or the context length; the policy (``policy``) keeps the draft tokens that pay.
2. KV: slots for ``1 + d`` new tokens (its last sampled token plus the draft) per request. When the
   pool cannot hold them, the step falls back to plain decode (which retracts if it must).
3. Forward: one TARGET_VERIFY batch (`verify_input`): each request computes its new tokens causally over
   its cached prefix, an undrafted request one token as in a decode. Where the tokens fit a compiled
   bucket it runs through the compiled decode step (``radixrt.worker.graph_runner``: the layers' graphs
   depend on the token count only, attention is an opaque op reading the batch's metadata), else eagerly.
   A plain greedy batch gets the compiled argmax of every position; otherwise logits, sampled per row.
4. Accept (``verify``); append tokens one by one through the scheduler's finish check, so stop
   tokens, EOS, max_new_tokens and the context length end a request exactly where plain decoding
   would; then free the pages of rejected positions. Rejected tokens are never in ``output_ids``
   and lie beyond ``kv_len``, so they never reach the RadixCache.

Requests with a grammar or with logprobs requested are never drafted (draft length 0): in a
speculative step they take one token through the scheduler's own ``sample_and_append``, exactly as
in plain decoding. Penalties and min_new_tokens are applied per verify row (see ``verify``).

The step sees the scheduler only through `DecodeTarget` (the model runner, KV, counters and the output
path: the scheduler's `OutputProcessor`); the scheduler settles the step's requests after it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixrt.config.server_args import ServerArgs
from radixrt.config.speculative_args import draft_tokens
from radixrt.kernels.base import ForwardMode
from radixrt.speculative.ngram import NgramIndex
from radixrt.speculative.policy import SpecPolicy
from radixrt.speculative.verify import accept_all, verify, verify_info
from radixrt.worker.kv_manager import KVManager
from radixrt.worker.model_runner import ForwardInput, ModelRunner
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats


class DecodeTarget(Protocol):
    """What a speculative step uses of the scheduler (its `OutputProcessor` provides all of it)."""

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def kv(self) -> KVManager: ...

    @property
    def stats(self) -> SchedulerStats: ...

    @property
    def eos_ids(self) -> set[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample and append one token per request, exactly as a plain decode step does."""

    def append_tokens(self, reqs: list[Req], next_ids: torch.Tensor) -> None:
        """Append each request's next token (a greedy decode step's argmax), as a plain decode step does."""

    def check_finished(self, req: Req, tok: int) -> None:
        """Set ``req.finish_reason`` if the token just appended ends it."""


def can_draft(req: Req) -> bool:
    """Requests whose tokens need per-token handling the verifier does not do are not drafted."""
    return req.grammar is None and not req.return_logprob


def free_rejected(kv: KVManager, req: Req, computed_end: int) -> None:
    """Free the pages that only held rejected positions ``[kv_len, computed_end)`` of ``req``.

    NOTE: slots of rejected positions inside the request's last kept page stay with the request (it
    owns whole pages); the next write at those positions reuses them.
    """
    ps = kv.page_size
    keep = -(-req.kv_len // ps) * ps
    if computed_end > keep and req.req_pool_idx is not None:
        row = kv.req_pool.req_to_token[req.req_pool_idx]
        kv.allocator.free(row[keep:computed_end].clone())


class Speculator:
    """The speculative decode step for the scheduler; subclasses provide the drafter (``propose``).

    ``policy`` (`SpecPolicy`) decides per step which drafts are verified; requests are tracked while
    running and ``retire`` is called once for each that left the running batch (finished, aborted or
    retracted; a retracted one comes back as a new entry).
    """

    algorithm = ""

    def __init__(self, args: ServerArgs) -> None:
        self.num_draft_tokens = draft_tokens(args)
        self.policy = SpecPolicy(args.speculative_max_batch_size, args.speculative_verify_cost)
        self._live: dict[int, Req] = {}  # id(req) -> req, the requests of the last step

    def draft(self, req: Req, context_len: int) -> list[int]:
        """Draft tokens for ``req`` (possibly none); at most as many as it may still emit minus one."""
        room = min(
            self.num_draft_tokens,
            req.params.max_new_tokens - len(req.output_ids) - 1,
            context_len - req.seq_len - 1,
        )
        if room <= 0 or not can_draft(req):
            return []
        return self.propose(req, room)[:room]

    def propose(self, req: Req, max_len: int) -> list[int]:
        """Up to ``max_len`` draft tokens continuing ``req`` (the drafter; tests substitute oracles)."""
        raise NotImplementedError(f"{type(self).__name__} has no drafter")

    def retire(self, req: Req) -> None:
        """``req`` left the running batch (``req.finish_reason`` set when it finished)."""

    def report(self, stats: SchedulerStats) -> None:
        """Write the drafter's own gauges (index size) into the scheduler's stats."""

    def _track(self, reqs: list[Req]) -> None:
        ids = {id(r) for r in reqs}
        for key, req in list(self._live.items()):
            if key not in ids:
                del self._live[key]
                self.retire(req)
        for r in reqs:
            self._live[id(r)] = r
        self.policy.prune({r.rid for r in reqs})

    def step(self, reqs: list[Req], target: DecodeTarget) -> bool:
        """Run one speculative decode step over the running requests ``reqs``; False (nothing done) when
        no request has a draft or the drafts do not fit in KV memory: the caller then decodes plainly.
        After True the caller settles ``reqs`` as after a decode step (finish, report)."""
        self._track(reqs)
        self.report(target.stats)
        if not self.policy.batch_allows(len(reqs), target.stats):
            return False
        drafts = [self.draft(r, target.runner.context_len) for r in reqs]
        gr = target.runner.graph_runner
        drafts = self.policy.choose(
            [r.rid for r in reqs], [r.kv_len for r in reqs], drafts, target.stats, gr.cost if gr else None
        )
        if not any(drafts):
            return False
        kv = target.kv
        if sum(kv.pages_needed(r, 1 + len(d)) for r, d in zip(reqs, drafts, strict=True)) > kv.available():
            return False
        for r, d in zip(reqs, drafts, strict=True):
            ok = kv.alloc(r, 1 + len(d))
            assert ok, "speculative slot allocation failed after the capacity check"
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + 1 + len(d))
        fi = verify_input(reqs, drafts)
        # Plain greedy batches take the compiled step's argmax (no logits leave it, nothing is sampled),
        # as a plain decode step does; otherwise every row is sampled (`verify`).
        greedy = all(r.plain_greedy for r in reqs)
        targets = target.runner.forward_greedy(fi) if greedy else None
        logits = None if targets is not None else target.runner.logits(target.runner.forward(fi))
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            preqs = [reqs[i] for i in plain]
            for r in preqs:
                r.kv_len += 1
            if targets is not None:
                target.append_tokens(preqs, targets[[starts[i] for i in plain]])
            else:
                assert logits is not None
                target.sample_and_append(preqs, logits[[starts[i] for i in plain]])
        drafted = [i for i, d in enumerate(drafts) if d]
        dreqs, ddrafts = [reqs[i] for i in drafted], [drafts[i] for i in drafted]
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in drafted])
        if targets is not None:
            emitted = accept_all(targets[rows].tolist(), ddrafts)
        else:
            assert logits is not None
            info = verify_info(dreqs, ddrafts, target.eos_ids, target.vocab_size)
            emitted = verify(logits[rows], info, ddrafts)
        for r, d, toks in zip(dreqs, ddrafts, emitted, strict=True):
            self._emit(r, d, toks, target)
        target.stats.spec_verify_steps += 1
        return True

    def _emit(self, r: Req, draft: list[int], toks: list[int], target: DecodeTarget) -> None:
        """Append a drafted request's accepted tokens through the finish check, then free its rejected
        positions' pages and count the verify."""
        computed_end = r.kv_len + 1 + len(draft)
        emitted = 0
        for tok in toks:
            r.output_ids.append(tok)
            r.pending_out.append(tok)
            emitted += 1
            target.check_finished(r, tok)
            if r.finish_reason is not None:
                break
        # KV is valid for the previous last token and every accepted draft token before the newest one,
        # which (as in plain decoding) has no KV yet.
        r.kv_len += emitted
        free_rejected(target.kv, r, computed_end)
        stats = target.stats
        stats.spec_verify_reqs += 1
        stats.spec_draft_tokens += len(draft)
        stats.spec_accepted_tokens += emitted - 1
        r.spec_verify_ct += 1
        r.spec_accepted += emitted - 1
        self.policy.record(r.rid, len(draft), emitted - 1)


def verify_input(reqs: list[Req], drafts: list[list[int]]) -> ForwardInput:
    """The verify forward: ``[last token] + draft`` per request after its ``kv_len`` cached tokens, as one
    TARGET_VERIFY batch (the compiled decode step where its tokens fit a bucket; an undrafted request is
    a plain decode row in it)."""
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    for r, d in zip(reqs, drafts, strict=True):
        ids.append(r.output_ids[-1])
        ids.extend(d)
        positions.append(torch.arange(r.kv_len, r.kv_len + 1 + len(d)))
    return ForwardInput(
        ForwardMode.TARGET_VERIFY,
        [r.req_pool_idx for r in reqs if r.req_pool_idx is not None],
        [r.kv_len for r in reqs],
        [1 + len(d) for d in drafts],
        ids,
        torch.cat(positions),
    )


class NgramSpeculator(Speculator):
    """Prompt-lookup speculative decoding (``--speculative-algorithm NGRAM``)."""

    algorithm = "NGRAM"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.max_n = args.speculative_ngram_max_match_window_size
        self._index: dict[int, NgramIndex] = {}  # id(req) -> its index, while it runs

    def propose(self, req: Req, max_len: int) -> list[int]:
        """The n-gram proposal of up to ``max_len`` tokens from the request's own prompt + output."""
        idx = self._index.get(id(req))
        if idx is None:
            idx = self._index[id(req)] = NgramIndex(self.max_n)
        return idx.propose(req.origin_input_ids + req.output_ids, max_len)

    def retire(self, req: Req) -> None:
        self._index.pop(id(req), None)
