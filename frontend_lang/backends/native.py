"""NativeBackend: everything shared by the backends that speak SGLang's native ``/generate`` request
(the in-process Engine and a server over HTTP); subclasses only move the request.

``select`` first commits the text before the choices (one prefill-only request, as SGLang's select and
``fork`` do), then scores all choices in ONE batched prefill-only request: the prompt+choice token ids with
``logprob_start_len`` at the prefix boundary, so every choice reuses the committed prefix (the radix cache
matches up to that boundary) and the runtime returns the logprobs of exactly the choice tokens. Without the
commit, the choices of one batch would each compute the uncached part of the text they share.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from frontend_lang.backends.base import BackendError, BaseBackend, PromptContext, validate_choices
from frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams
from frontend_lang.retention import DEFAULT_PIN_TTL

PREFILL_ONLY = {"max_new_tokens": 0}


def check_result(out: dict[str, Any]) -> dict[str, Any]:
    """Raise BackendError for a request the runtime aborted (the message is the runtime's)."""
    reason = out.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"the runtime aborted the request: {reason.get('message', 'aborted')}")
    return out


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class NativeBackend(BaseBackend):
    """Request building, select scoring and streaming over SGLang's native request format."""

    tokenizer: Any = None  # the model's tokenizer when it can be loaded here (exact select boundaries)
    _tok_lock = threading.Lock()
    _constraints: bool | None = None
    retention = False  # send program-aware retention hints (frontend_lang.retention)
    pin_ttl = DEFAULT_PIN_TTL

    # -- transport (subclasses) -----------------------------------------------------------------
    def _call(self, payload: dict[str, Any]) -> Any:
        """Send one native request; return the result dict (or the list of a batch)."""
        raise NotImplementedError

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Send one native streaming request; yield its cumulative snapshots."""
        raise NotImplementedError

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Pin a cached prefix (``{"text", "ttl"}``); the runtime's ``{"pin_id", "pinned_tokens"}``."""
        raise NotImplementedError

    def _unpin(self, pin_id: str) -> None:
        """Release the pin ``pin_id``."""
        raise NotImplementedError

    # -- retention hints ------------------------------------------------------------------------
    def hints(self, priority: int | None) -> dict[str, Any]:
        """The retention fields of a request of a program with ``priority`` (none when retention is
        off or the request belongs to no program)."""
        return {"priority": priority} if self.retention and priority is not None else {}

    def pin_prefix(self, text: str) -> str | None:
        if not self.retention or not text:
            return None
        pin_id = self._pin({"text": text, "ttl": self.pin_ttl}).get("pin_id")
        return None if pin_id is None else str(pin_id)

    def release_pin(self, pin_id: str) -> None:
        self._unpin(pin_id)

    # -- generation -----------------------------------------------------------------------------
    @staticmethod
    def payload(text: str, params: GenParams) -> dict[str, Any]:
        """The native request of one ``gen``."""
        out: dict[str, Any] = {"text": text, "sampling_params": params.to_native()}
        if params.return_logprob:
            out["return_logprob"] = True
            if params.logprob_start_len is not None:
                out["logprob_start_len"] = params.logprob_start_len
            if params.top_logprobs_num:
                out["top_logprobs_num"] = params.top_logprobs_num
        return out

    def _checked_call(self, payload: dict[str, Any], params: GenParams) -> Any:
        try:
            return self._call(payload)
        except (ValueError, BackendError) as exc:
            if params.constraint is not None:  # name the constraint: the runtime's message may not
                raise BackendError(f"the runtime refused {params.constraint}=: {exc}") from exc
            raise

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        out = self._checked_call({**self.payload(ctx.text, params), **self.hints(ctx.priority)}, params)
        if isinstance(out, list):  # n > 1
            outs = [check_result(o) for o in out]
            return [o["text"] for o in outs], {"outputs": [o["meta_info"] for o in outs]}
        check_result(out)
        return out["text"], out["meta_info"]

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        payload = {**self.payload(ctx.text, params), **self.hints(ctx.priority), "stream": True}
        seen = ""
        for snap in self._call_stream(payload):
            check_result(snap)
            text = snap["text"]
            delta, seen = text[len(seen) :], text
            yield delta, snap["meta_info"]

    def cache_prefix(self, text: str) -> None:
        if text:
            check_result(self._call({"text": text, "sampling_params": dict(PREFILL_ONLY)}))

    # -- select ---------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        # NOTE: one Rust tokenizer used from several threads at once can raise "Already borrowed".
        with self._tok_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=True))

    def _score(
        self, input_ids: list[list[int]], starts: list[int], priority: int | None
    ) -> list[dict[str, Any]]:
        """One batched prefill-only request returning prompt logprobs from ``starts``."""
        batch = len(input_ids) > 1
        out = self._call(
            {
                "input_ids": input_ids if batch else input_ids[0],
                "sampling_params": dict(PREFILL_ONLY),
                "return_logprob": True,
                "logprob_start_len": starts if batch else starts[0],
                **self.hints(priority),
            }
        )
        return [check_result(o) for o in (out if batch else [out])]

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        choices = validate_choices(choices)
        if self.tokenizer is not None:
            scores = self._scores_by_ids(ctx.text, choices, method.requires_unconditional, ctx.priority)
        else:
            scores = self._scores_by_text(ctx.text, choices, method.requires_unconditional, ctx.priority)
        return method.decide(scores, temperature)

    def _scores_by_ids(
        self, text: str, choices: list[str], unconditional: bool, priority: int | None
    ) -> ChoiceScores:
        prefix = self._encode(text)
        full = [self._encode(text + c) for c in choices]
        # NOTE: BPE may merge the end of the prefix with a choice; then the boundary moves left and
        # those re-tokenized prefix tokens are scored too (the same text for every choice).
        boundary = min(min(shared_prefix_len(prefix, f) for f in full), min(len(f) for f in full) - 1)
        if boundary < 1:
            raise ValueError("select: needs at least one token of text before the choices")
        commit = self._commit({"input_ids": prefix}, priority) if len(choices) > 1 else None
        ids, starts = list(full), [boundary] * len(full)
        if unconditional:
            ids += [f[boundary:] for f in full]
            starts += [0] * len(full)
        outs = self._score(ids, starts, priority)
        return self._to_scores(choices, outs, boundary, commit)

    def _commit(self, source: dict[str, Any], priority: int | None) -> dict[str, Any]:
        """Cache the text the choices share (``source``: its ``text`` or ``input_ids``) with one
        prefill-only request; its token counts (``prompt_tokens``, ``cached_tokens``)."""
        out = check_result(
            self._call({**source, "sampling_params": dict(PREFILL_ONLY), **self.hints(priority)})
        )
        meta = out["meta_info"]
        return {
            "prompt_tokens": int(meta["prompt_tokens"]),
            "cached_tokens": int(meta.get("cached_tokens") or 0),
        }

    def _scores_by_text(
        self, text: str, choices: list[str], unconditional: bool, priority: int | None
    ) -> ChoiceScores:
        """Without a local tokenizer: commit the prefix (its token count sets the boundary), then
        score the prompt+choice texts; the unconditional pass reuses the returned token ids."""
        if not text:
            raise ValueError("select: needs text before the choices")
        hints = self.hints(priority)
        commit = self._commit({"text": text}, priority)
        boundary = commit["prompt_tokens"]
        payload = {
            "text": [text + c for c in choices],
            "sampling_params": dict(PREFILL_ONLY),
            "return_logprob": True,
            "logprob_start_len": boundary,
            **hints,
        }
        outs = [check_result(o) for o in self._call(payload)]
        if unconditional:
            ids = [[e[1] for e in o["meta_info"]["input_token_logprobs"]] for o in outs]
            outs += self._score(ids, [0] * len(ids), priority)
        return self._to_scores(choices, outs, boundary, commit)

    @staticmethod
    def _to_scores(
        choices: list[str], outs: list[dict[str, Any]], boundary: int, commit: dict[str, Any] | None
    ) -> ChoiceScores:
        k = len(choices)
        entries = [o["meta_info"]["input_token_logprobs"] for o in outs]
        cond = [[float(e[0]) for e in row if e[0] is not None] for row in entries[:k]]
        uncond = [[None if e[0] is None else float(e[0]) for e in row] for row in entries[k:]] or None
        extra = {
            "logprob_start_len": boundary,
            "token_ids": [[e[1] for e in row] for row in entries[:k]],
            "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in outs[:k]],
            "cached_tokens": [o["meta_info"]["cached_tokens"] for o in outs[:k]],
        }
        if commit is not None:  # the prefill-only request that cached the text before the choices
            extra["prefix_commit"] = commit
        return ChoiceScores(choices, cond, uncond, extra)

    # -- capabilities ---------------------------------------------------------------------------
    tool_call_parser: str | None = None  # overrides the format derived from the chat template

    def tool_parser_name(self) -> str | None:
        """``tool_call_parser`` if set, else the format the tokenizer's chat template writes, else the
        Hermes format (as the server's default with the generic tool prompt)."""
        from radixrt.server.tool_parsers.registry import DEFAULT_PARSER, parser_for_template

        if self.tool_call_parser is not None:
            return self.tool_call_parser
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        return parser_for_template(template) or DEFAULT_PARSER

    def supports_constraints(self) -> bool:
        """False only when the server says it has no grammar backend (SGLang's ``grammar_backend:
        "none"``); otherwise constraints are sent and a runtime without them answers with an error."""
        if self._constraints is None:
            self._constraints = self.get_server_info().get("grammar_backend", "xgrammar") != "none"
        return self._constraints
