"""Req: one request's state inside the worker."""

from __future__ import annotations

from typing import Any

from radixrt.config.tenants import namespace
from radixrt.transport.protocol import TokenizedGenerateReq


class Req:
    """A request as the scheduler sees it; ``rid`` is the same id as on the wire.

    KV bookkeeping: ``kv_len`` tokens of ``fill_ids`` (prompt + outputs so far) have KV in the
    row ``req_pool_idx``; the first ``cached_len`` of those are owned by the RadixCache and locked
    through ``last_node``.
    """

    __slots__ = (
        "rid",
        "origin_input_ids",
        "output_ids",
        "params",
        "seed",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "cache_salt",
        "tenant",
        "req_pool_idx",
        "kv_len",
        "cached_len",
        "last_node",
        "cached_tokens",
        "cached_host_tokens",
        "cached_disk_tokens",
        "finish_reason",
        "extend_len",
        "fill_ids",
        "input_logprobs",
        "input_top_logprobs",
        "input_logprobs_done",
        "pending_out",
        "pending_logprobs",
        "pending_top_logprobs",
        "arrival",
        "retractions",
        "prefix_probe_len",
        "grammar",
        "grammar_key",
        "grammar_since",
        "jumped",
        "priority",
        "pin_ttl",
        "strip_thinking",
        "embed",
        "embed_acc",
        "embedding",
        "pinned_tokens",
        "pin_id",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "spec_verify_ct",
        "spec_accepted",
    )

    def __init__(self, msg: TokenizedGenerateReq, arrival: int) -> None:
        self.rid = msg.rid
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.output_ids: list[int] = []
        self.params = msg.sampling_params
        self.seed = msg.seed
        self.return_logprob = msg.return_logprob
        start = msg.logprob_start_len
        self.logprob_start_len = len(self.origin_input_ids) - 1 if start < 0 else start
        self.top_logprobs_num = msg.top_logprobs_num
        self.tenant = msg.tenant
        # The RadixCache namespace: derived from the tenant, so no salt reaches another tenant's cache.
        self.cache_salt = namespace(msg.tenant, msg.cache_salt)
        self.arrival = arrival
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node: Any = None
        self.cached_tokens = 0
        # Of cached_tokens, those loaded from the host and disk tiers (the rest were on the device).
        self.cached_host_tokens = 0
        self.cached_disk_tokens = 0
        # Speculative decoding: verify steps that carried a draft of this request, draft tokens accepted.
        self.spec_verify_ct = 0
        self.spec_accepted = 0
        self.finish_reason: dict[str, Any] | None = None
        self.extend_len = 0
        self.fill_ids: list[int] = self.origin_input_ids
        self.input_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_logprobs_done = not (
            self.return_logprob and self.logprob_start_len < len(self.origin_input_ids)
        )
        self.pending_out: list[int] = []
        self.pending_logprobs: list[tuple[float, int]] = []
        self.pending_top_logprobs: list[list[tuple[float, int]]] = []
        self.retractions = 0
        self.prefix_probe_len = 0
        self.grammar: Any = None  # GrammarState once compiled
        self.grammar_key: tuple[str, str] | None = None
        self.grammar_since = 0.0
        self.jumped = False  # jump-forward appended tokens that still need KV
        self.priority = msg.priority  # cache priority (None: the default, 0)
        self.pin_ttl = msg.pin_ttl  # pin the cached prefix for this long when it finishes (None: no pin)
        self.strip_thinking = msg.strip_thinking  # cache only the prompt if the output opens with these ids
        self.embed = msg.embed  # pooling of an embedding request (`radixrt.worker.pooling`), else None
        self.embed_acc: Any = None  # mean pooling: the sum of the hidden states computed so far
        self.embedding: list[float] | None = None
        self.pinned_tokens = 0
        self.pin_id: str | None = None
        # Prefill/decode disaggregation: the prefill server's bootstrap address and the pair's shared room.
        self.bootstrap_host, self.bootstrap_port = msg.bootstrap_host, msg.bootstrap_port
        self.bootstrap_room = msg.bootstrap_room

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= len(self.fill_ids)

    @property
    def seq_len(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def plain_greedy(self) -> bool:
        """True when the next token is exactly the argmax of the raw logits: greedy, no penalty, no ban
        (min_new_tokens reached), no grammar and no logprobs to report."""
        p = self.params
        return (
            p.is_greedy
            and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0
            and len(self.output_ids) >= p.min_new_tokens
            and self.grammar is None
            and not self.return_logprob
        )

    def reset_fill(self) -> None:
        """Tokens that need KV before the next token can be sampled (after admission or retraction)."""
        self.fill_ids = self.origin_input_ids + self.output_ids

    def max_prefix_len(self) -> int:
        """How much of fill_ids may come from the cache: at least one token is always computed, and
        prompt logprobs need their positions computed."""
        limit = len(self.fill_ids) - 1
        if self.embed == "mean":  # every prompt token's hidden state is averaged
            return 0
        if not self.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)
