"""GenerateReqInput: the user-facing request (native /generate and Engine.generate), normalized."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """SGLang's native request: one prompt (``text`` or ``input_ids``) or a batch of them.

    A msgspec Struct so the HTTP layer decodes JSON straight into it (``input_ids`` is a list of ids
    or a list of such lists; msgspec allows one list type per union, so the items are ``Any``).
    """

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    # Cache retention: the priority of the prefix it uses; a TTL pin of it when it finishes
    # ({"type": "ephemeral", "ttl": 600 | "600" | "5m" | "1h"}).
    priority: int | list[int] | None = None
    cache_control: dict[str, Any] | list[dict[str, Any]] | None = None
    # Set by /v1/chat/completions with --strip-thinking-cache: the output's reasoning opens with these token
    # ids ([]: it reasons from its first token); a finished request whose output does is cached up to its
    # prompt only (chat templates drop the reasoning, so the output's KV would never be matched again).
    strip_thinking: list[int] | None = None
    # Set by /v1/embeddings: pool the prompt's final hidden states ("last" / "mean"; prefill only).
    embed: str | None = None
    # Prefill/decode disaggregation (set from sglang-router's fields by the HTTP layer, which validates them).
    bootstrap_host: str | list[Any] | None = None
    bootstrap_port: int | list[Any] | None = None
    bootstrap_room: int | list[Any] | None = None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids
        return ids is not None and len(ids) > 0 and isinstance(ids[0], list)

    def batch_size(self) -> int:
        if self.text is not None:
            return len(self.text) if isinstance(self.text, list) else 1
        if self.input_ids is None:
            return 1
        return len(self.input_ids) if self.is_batch else 1

    def item(self, i: int) -> SingleReq:
        """The i-th prompt of a batch (or the only one) with its own settings."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of `text` and `input_ids`")
        batch = self.is_batch

        def pick(value: Any, name: str) -> Any:
            if batch and isinstance(value, list):
                if len(value) != self.batch_size():
                    raise ValueError(f"{name}: list length {len(value)} != batch size {self.batch_size()}")
                return value[i]
            return value

        text = self.text[i] if batch and isinstance(self.text, list) else self.text
        ids = self.input_ids[i] if batch and self.input_ids is not None else self.input_ids
        rid = (
            self.rid[i]
            if isinstance(self.rid, list)
            else (f"{self.rid}-{i}" if batch and self.rid else self.rid)
        )
        return SingleReq(
            text=text if isinstance(text, str) or text is None else _bad("text", "must be a string"),
            input_ids=ids,  # type: ignore[arg-type]
            sampling_params=dict(pick(self.sampling_params, "sampling_params") or {}),
            return_logprob=bool(pick(self.return_logprob, "return_logprob")),
            logprob_start_len=pick(self.logprob_start_len, "logprob_start_len"),
            top_logprobs_num=pick(self.top_logprobs_num, "top_logprobs_num"),
            return_text_in_logprobs=self.return_text_in_logprobs,
            rid=rid,
            cache_salt=pick(self.cache_salt, "cache_salt"),
            priority=pick(self.priority, "priority"),
            cache_control=pick(self.cache_control, "cache_control"),
            strip_thinking=self.strip_thinking,
            embed=self.embed,
            bootstrap_host=pick(self.bootstrap_host, "bootstrap_host"),
            bootstrap_port=pick(self.bootstrap_port, "bootstrap_port"),
            bootstrap_room=pick(self.bootstrap_room, "bootstrap_room"),
        )


@dataclass(slots=True)
class SingleReq:
    """One prompt's request after batch splitting (before tokenization)."""

    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    rid: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    cache_control: dict[str, Any] | None = None
    strip_thinking: list[int] | None = None
    embed: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


def _bad(name: str, why: str) -> Any:
    raise ValueError(f"{name}: {why}")
