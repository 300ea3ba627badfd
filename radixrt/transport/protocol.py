"""Messages that cross between the TokenizerManager and the worker (msgspec Structs).

One request type in (``TokenizedGenerateReq``), one output type back (``BatchTokenOut``), plus
small control messages. The worker never sees text.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixrt.sampling.sampling_params import SamplingParams


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    """A validated, tokenized request for the scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None  # the client's salt; the worker derives the namespace with the tenant
    tenant: str | None = None  # set by the server from the API key when tenants exist
    priority: int | None = None  # cache priority of the prefix it uses (--radix-eviction-policy priority)
    pin_ttl: float | None = None  # seconds to pin its cached prefix for when it finishes (cache_control)
    # The output's reasoning opens with these ids ([]: from its first token): if it does, the finished
    # request is cached up to its prompt only (--strip-thinking-cache; `GenerateReqInput.strip_thinking`).
    strip_thinking: list[int] | None = None
    # An embedding request (``"last"`` / ``"mean"`` pooling, `radixrt.worker.pooling`): prefill only, and
    # the finished ReqOut carries the pooled final hidden state.
    embed: str | None = None
    # Prefill/decode disaggregation (sglang-router PD mode): the prefill server's bootstrap server and the
    # room both servers' copies of the request share.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class AbortReq(msgspec.Struct, tag=True):
    """Stop a request (client gone, stop string seen by the detokenizer); its KV is released."""

    rid: str
    reason: str = "abort"


class FlushCacheReq(msgspec.Struct, tag=True):
    """Empty the RadixCache; refused while requests run."""


class GetStatsReq(msgspec.Struct, tag=True):
    """Ask the worker for a StatsOut snapshot."""


class ListPinsReq(msgspec.Struct, tag=True):
    """Ask for the live TTL pins (StatsOut.pins)."""


class DropPinsReq(msgspec.Struct, tag=True):
    """Release one TTL pin (``pin_id``) or all of them (None); StatsOut.ok is False for an unknown id."""

    pin_id: str | None = None


class PinInfo(msgspec.Struct):
    """One live TTL pin of the RadixCache."""

    pin_id: str
    tokens: int
    expires_in_s: float
    tenant: str | None


class ReqOut(msgspec.Struct, array_like=True):
    """New output of one request since its previous ReqOut.

    Logprob entries are ``(logprob, token_id)``; ``top`` lists are per position lists of them.
    ``finish_reason`` is None while running, else a dict like ``{"type": "length"}``.
    """

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # With the hierarchical cache: how many of cached_tokens came from the host and disk tiers.
    cached_tokens_host: int | None = None
    cached_tokens_disk: int | None = None
    # With cache_control on a finished request: the prefix tokens pinned (0: none fit) and the pin's id.
    pinned_tokens: int | None = None
    pin_id: str | None = None
    # An embedding request's pooled final hidden state (float32, not normalized), when it finished.
    embedding: list[float] | None = None
    # With --speculative-algorithm: verify steps that carried a draft of the request, draft tokens accepted.
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int | None = None


class BatchTokenOut(msgspec.Struct, tag=True):
    """Every request that advanced in one scheduler step."""

    outs: list[ReqOut]


class StatsOut(msgspec.Struct, tag=True):
    """Worker counters, answered to GetStatsReq and FlushCacheReq."""

    ok: bool = True
    message: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    tenants: dict[str, dict[str, float]] | None = None  # per tenant (TenantLedger.snapshot)
    pins: list[PinInfo] | None = None  # answered to ListPinsReq


class WorkerReady(msgspec.Struct, tag=True):
    """Handshake: the worker process loaded the model and is polling its inbox (first message out)."""

    pid: int
    architecture: str
    dtype: str
    context_len: int
    vocab_size: int
    kv_total_tokens: int
    kv_bytes: int
    page_size: int
    max_running_requests: int


class WorkerStartupFailed(msgspec.Struct, tag=True):
    """Handshake: the worker process could not start (bad checkpoint, out of memory, ...)."""

    message: str


WorkerInput = TokenizedGenerateReq | AbortReq | FlushCacheReq | GetStatsReq | ListPinsReq | DropPinsReq
WorkerOutput = BatchTokenOut | StatsOut
WorkerHandshake = WorkerReady | WorkerStartupFailed
