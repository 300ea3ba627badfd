"""Speculative decoding without a draft model: n-gram (prompt lookup) drafts, verified in one forward.

- ``ngram``: the drafter, an incremental index over a request's prompt + output ids.
- ``verify``: sampling the verify rows and the acceptance rule (exact for greedy, distribution-
  preserving rejection sampling for sampled requests).
- ``worker``: the scheduler step that drafts, runs the verify forward and fixes up KV and outputs.

Enabled with ``--speculative-algorithm NGRAM`` (``--speculative-num-draft-tokens``,
``--speculative-ngram-max-match-window-size``); the scheduler calls ``NgramSpeculator.step`` in
place of a plain decode step. Requests with a grammar or with logprobs are never drafted (they decode
one token per step, inside the same verify forwards); see ``worker`` for the rest of the contract.
"""

from __future__ import annotations

from radixrt.config.server_args import ServerArgs
from radixrt.speculative.ngram import NgramIndex
from radixrt.speculative.worker import NgramSpeculator


def build_speculator(args: ServerArgs) -> NgramSpeculator:
    """The speculator named by ``args.speculative_algorithm`` (ServerArgs validated the name)."""
    if args.speculative_algorithm != "NGRAM":
        raise ValueError(f"speculative_algorithm: no speculator for {args.speculative_algorithm!r}")
    return NgramSpeculator(args)


__all__ = ["NgramIndex", "NgramSpeculator", "build_speculator"]
