"""Speculative decoding without a draft model: n-gram or suffix-trie drafts, verified in one forward.

- ``ngram``: the NGRAM drafter, an incremental index over a request's prompt + output ids.
- ``suffix``, ``suffix_cache``, ``suffix_worker``: the SUFFIX drafter (suffix decoding): bounded suffix
  tries over the request's tokens and over finished requests per cache namespace, adaptive draft length.
- ``policy``: when drafts are verified at all (acceptance history, batch size, verify cost).
- ``verify``: sampling the verify rows and the acceptance rule (exact for greedy, distribution-
  preserving rejection sampling for sampled requests).
- ``worker``: the scheduler step that drafts, runs the verify forward and fixes up KV and outputs.

Enabled with ``--speculative-algorithm NGRAM`` (``--speculative-num-draft-tokens``,
``--speculative-ngram-max-match-window-size``) or ``SUFFIX``; the scheduler calls ``Speculator.step`` in
place of a plain decode step. Requests with a grammar or with logprobs are never drafted (they decode
one token per step, inside the same verify forwards); see ``worker`` for the rest of the contract.
"""

from __future__ import annotations

from radixrt.config.server_args import ServerArgs
from radixrt.speculative.ngram import NgramIndex
from radixrt.speculative.suffix_worker import SuffixSpeculator
from radixrt.speculative.worker import NgramSpeculator, Speculator


def build_speculator(args: ServerArgs) -> Speculator:
    """The speculator named by ``args.speculative_algorithm`` (ServerArgs validated the name)."""
    if args.speculative_algorithm == "NGRAM":
        return NgramSpeculator(args)
    if args.speculative_algorithm == "SUFFIX":
        return SuffixSpeculator(args)
    raise ValueError(f"speculative_algorithm: no speculator for {args.speculative_algorithm!r}")


__all__ = ["NgramIndex", "NgramSpeculator", "Speculator", "SuffixSpeculator", "build_speculator"]
