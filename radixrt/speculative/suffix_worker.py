"""Suffix decoding (``--speculative-algorithm SUFFIX``): drafts from what this request and the server saw.

Two suffix tries answer each draft (SuffixDecoding, arXiv 2411.04975): the request's own prompt (its last
``--speculative-suffix-prompt-window`` tokens) + output (grown token by token while it runs) and the global `SuffixCache` of finished requests in the request's
cache namespace. Each gives its adaptive chain (``SuffixTrie.draft``: longest matching suffix, most
frequent continuations while the probability product stays ``>= --speculative-suffix-min-prob``) and the
one with the higher score (expected accepted tokens) is verified. A request that finishes (not aborted)
adds its prompt + output to the global index of its namespace.
"""

from __future__ import annotations

from radixrt.config.server_args import ServerArgs
from radixrt.speculative.suffix import SuffixTrie
from radixrt.speculative.suffix_cache import SuffixCache
from radixrt.speculative.worker import Speculator
from radixrt.worker.req import Req
from radixrt.worker.stats import SchedulerStats


class SuffixSpeculator(Speculator):
    """Suffix-trie speculative decoding over the request's tokens and the served history."""

    algorithm = "SUFFIX"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.depth = args.speculative_suffix_max_depth
        self.min_prob = args.speculative_suffix_min_prob
        self.prompt_window = args.speculative_suffix_prompt_window
        self.cache = SuffixCache(self.depth, args.speculative_suffix_cache_tokens)
        self._own: dict[int, SuffixTrie] = {}  # id(req) -> its own trie, while it runs

    def propose(self, req: Req, max_len: int) -> list[int]:
        """The better of the request's own and its namespace's global suffix drafts."""
        seq = req.origin_input_ids + req.output_ids
        own = self._own.get(id(req))
        if own is None:  # NOTE: indexing costs O(depth) dict operations a token: ~25 ms for 1.7k tokens
            start = len(req.origin_input_ids) - self.prompt_window
            own = self._own[id(req)] = SuffixTrie(self.depth, start)
        own.grow(seq)
        max_match = max(1, self.depth - max_len)  # room below the depth for a full draft
        best, best_score = own.draft(seq, max_match, max_len, self.min_prob)
        shared = self.cache.trie(req.cache_salt)
        if shared is not None:
            d, score = shared.draft(seq, max_match, max_len, self.min_prob)
            if score > best_score:
                best = d
        return best

    def report(self, stats: SchedulerStats) -> None:
        stats.spec_index_tokens = self.cache.tokens
        stats.spec_index_nodes = self.cache.nodes

    def retire(self, req: Req) -> None:
        self._own.pop(id(req), None)
        if req.finish_reason is not None and req.finish_reason.get("type") != "abort":
            self.cache.add(req.cache_salt, req.origin_input_ids + req.output_ids)
