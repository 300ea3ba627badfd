"""The output half of a scheduler step: sample, advance grammars, detect finishes, report tokens.

`OutputProcessor` is owned by the ``Scheduler`` (kept apart so each file stays one concern): it changes
requests and reports them, and never schedules anything itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixrt.config.server_args import ServerArgs
from radixrt.sampling.logprobs import compute_logprobs
from radixrt.sampling.sampler import sample
from radixrt.sampling.sampling_batch import SamplingBatchInfo
from radixrt.transport.protocol import BatchTokenOut, ReqOut, WorkerOutput
from radixrt.worker.kv_manager import KVManager
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats

if TYPE_CHECKING:
    from radixrt.worker.grammar_queue import GrammarQueue
    from radixrt.worker.model_runner import ModelRunner


class OutputProcessor:
    """Sampling, logprobs, finishing and emitting for the scheduler.

    ``by_rid`` is the scheduler's own table (a finished request leaves it when it is emitted);
    ``grammars`` holds the scheduler's grammar backend (built on first use).
    """

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        kv: KVManager,
        stats: SchedulerStats,
        eos_ids: set[int],
        by_rid: dict[str, Req],
        send: Callable[[WorkerOutput], None],
        grammars: GrammarQueue,
    ) -> None:
        self.args = args
        self.runner = runner
        self.kv = kv
        self.stats = stats
        self.eos_ids = eos_ids
        self.vocab_size = runner.config.vocab_size
        self.by_rid = by_rid
        self.send = send
        self.grammars = grammars

    def input_logprobs(self, req: Req, hidden: torch.Tensor, start: int) -> None:
        """Prompt logprobs: logits at position p score token p+1 (position 0 gets None)."""
        first = req.logprob_start_len
        prompt_len = len(req.origin_input_ids)
        if first == 0 and start == 0:
            req.input_logprobs.append((None, req.origin_input_ids[0]))
            req.input_top_logprobs.append(None)
        lo = max(start, first - 1, 0)
        hi = min(start + req.extend_len, prompt_len - 1)
        if hi > lo:
            logits = self.runner.logits(hidden[lo - start : hi - start])
            targets = torch.tensor(
                req.origin_input_ids[lo + 1 : hi + 1], dtype=torch.int64, device=logits.device
            )
            res = compute_logprobs(logits, targets, req.top_logprobs_num)
            tok = res.token_logprobs.tolist()
            req.input_logprobs.extend(zip(tok, req.origin_input_ids[lo + 1 : hi + 1], strict=True))
            if req.top_logprobs_num:
                for vals, ids in zip(res.top_logprobs.tolist(), res.top_ids.tolist(), strict=True):
                    req.input_top_logprobs.append(list(zip(vals, ids, strict=True)))
            else:
                req.input_top_logprobs.extend([None] * len(tok))
        if start + req.extend_len >= prompt_len:
            req.input_logprobs_done = True

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request from its ``logits`` row (grammar masks, min_new_tokens bans,
        logprobs when asked for) and append it (`append_tokens`)."""
        banned = [
            sorted(self.eos_ids | set(r.params.stop_token_ids))
            if len(r.output_ids) < r.params.min_new_tokens
            else []
            for r in reqs
        ]
        info = SamplingBatchInfo.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [len(r.output_ids) for r in reqs],
            [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs],
            banned,
            self.vocab_size,
            logits.device,
        )
        grammars = [r.grammar for r in reqs]
        constrained = sum(g is not None for g in grammars)
        if constrained:
            t0 = time.perf_counter()
            masked = self.grammars.backend.apply_masks(logits, grammars)
            self.stats.grammar_mask_seconds += time.perf_counter() - t0
            self.stats.grammar_masked_rows += constrained
            next_ids = sample(masked, info)
        else:
            next_ids = sample(logits, info)
        want = [i for i, r in enumerate(reqs) if r.return_logprob]
        if want:
            top_k = max(reqs[i].top_logprobs_num for i in want)
            res = compute_logprobs(logits[want], next_ids[want], top_k)
            for j, i in enumerate(want):
                req = reqs[i]
                req.pending_logprobs.append((float(res.token_logprobs[j]), int(next_ids[i])))
                if req.top_logprobs_num:
                    k = req.top_logprobs_num
                    vals, ids = res.top_logprobs[j, :k].tolist(), res.top_ids[j, :k].tolist()
                    req.pending_top_logprobs.append(list(zip(vals, ids, strict=True)))
        self.append_tokens(reqs, next_ids)

    def append_tokens(self, reqs: list[Req], next_ids: torch.Tensor) -> None:
        """Append each request's next token, then advance its grammar or check whether it finished."""
        for req, tok in zip(reqs, next_ids.tolist(), strict=True):
            req.output_ids.append(tok)
            req.pending_out.append(tok)
            req.jumped = False
            if req.grammar is not None:
                self._advance_grammar(req, tok)
            else:
                self.check_finished(req, tok)

    def _advance_grammar(self, req: Req, tok: int) -> None:
        """Feed the sampled token to the matcher; finish, or append the tokens the grammar forces."""
        grammar = req.grammar
        if not grammar.accept(tok):
            req.finish_reason = {"type": "abort", "message": f"token {tok} violates the grammar"}
            return
        if grammar.terminated:
            req.finish_reason = {"type": "stop", "matched": tok}
            return
        self.check_finished(req, tok)
        if req.finish_reason is not None or self.args.disable_jump_forward:
            return
        room = min(req.params.max_new_tokens - len(req.output_ids), self.runner.context_len - req.seq_len - 1)
        forced = grammar.jump_forward_tokens()[: max(room, 0)]
        for t in forced:
            if not grammar.accept(t):
                break
            req.output_ids.append(t)
            req.pending_out.append(t)
            req.jumped = True
            self.stats.jump_forward_tokens += 1
        if req.jumped:
            req.reset_fill()
            if len(req.output_ids) >= req.params.max_new_tokens:
                req.finish_reason = {"type": "length", "length": req.params.max_new_tokens}
            elif grammar.terminated:
                req.finish_reason = {"type": "stop", "matched": req.output_ids[-1]}

    def check_finished(self, req: Req, tok: int) -> None:
        """Set ``req.finish_reason`` if ``tok`` (just appended) ends it: stop token, EOS, length, context."""
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                req.finish_reason = {"type": "stop", "matched": tok}
                return
        if len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": p.max_new_tokens}
        elif req.seq_len >= self.runner.context_len:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}

    def finish(self, reqs: list[Req]) -> None:
        """Release the KV of requests that ended and count them."""
        for req in reqs:
            self.kv.release(req)
            self.stats.on_finish(req)

    def end_with_abort(self, req: Req, message: str, status_code: int | None = None) -> None:
        """End ``req`` now with an abort carrying ``message`` (and an HTTP status), release it, report it."""
        req.finish_reason = {"type": "abort", "message": message}
        if status_code is not None:
            req.finish_reason["status_code"] = status_code
        self.finish([req])
        self.emit([req])

    def emit(self, reqs: list[Req]) -> None:
        """Send every request's new tokens (and logprobs, cache and pin facts) as one BatchTokenOut."""
        outs = []
        for req in reqs:
            out = ReqOut(
                req.rid, req.pending_out, len(req.origin_input_ids), req.cached_tokens, req.finish_reason
            )
            if req.return_logprob:
                out.output_logprobs = req.pending_logprobs
                out.output_top_logprobs = req.pending_top_logprobs if req.top_logprobs_num else None
                if req.input_logprobs:
                    out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
                    req.input_logprobs, req.input_top_logprobs = [], []
                req.pending_logprobs, req.pending_top_logprobs = [], []
            if self.kv.tiered:
                out.cached_tokens_host = req.cached_host_tokens
                out.cached_tokens_disk = req.cached_disk_tokens
            if req.pin_ttl is not None and req.finish_reason is not None:
                out.pinned_tokens, out.pin_id = req.pinned_tokens, req.pin_id
            if req.embedding is not None and req.finish_reason is not None:
                out.embedding = req.embedding
            if self.args.speculative_algorithm is not None:
                out.spec_verify_ct, out.spec_accepted_tokens = req.spec_verify_ct, req.spec_accepted
            req.pending_out = []
            if req.finish_reason is not None:
                self.by_rid.pop(req.rid, None)
            outs.append(out)
        if outs:
            self.send(BatchTokenOut(outs))
