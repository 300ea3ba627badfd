"""Grammar-constrained decoding with xgrammar: regex, JSON schema, EBNF; masks and jump-forward.

``GrammarBackend`` lives in the worker: it builds xgrammar's ``TokenizerInfo`` once, compiles
grammars on a thread pool (off the scheduler's critical path) with a cache keyed by (kind, text),
and hands each request its own ``GrammarState`` (a matcher) once the compiled grammar is ready.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from radixrt.sampling.sampling_params import SamplingParams

GrammarKey = tuple[str, str]
# json_schema value meaning "any JSON value" (OpenAI response_format {"type": "json_object"}).
ANY_JSON = "$$ANY$$"


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """(kind, text) of a request's constraint, or None when unconstrained."""
    if params.regex is not None:
        return ("regex", params.regex)
    if params.json_schema is not None:
        return ("json", params.json_schema)
    if params.ebnf is not None:
        return ("ebnf", params.ebnf)
    return None


class GrammarError(ValueError):
    """The constraint cannot be compiled (bad regex / schema / grammar, or compilation too slow)."""


@dataclass
class GrammarState:
    """One request's matcher over a compiled grammar."""

    matcher: xgr.GrammarMatcher

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (empty when the next token is a real choice)."""
        return list(self.matcher.find_jump_forward_tokens())

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class GrammarBackend:
    """Compiles constraints asynchronously and applies token bitmasks to batched logits."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int],
        json_whitespace: bool = False,
        compile_timeout_s: float = 30.0,
        max_threads: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixrt-grammar")
        self.cache: dict[GrammarKey, Future[xgr.CompiledGrammar]] = {}
        self.json_whitespace = json_whitespace
        self.compile_timeout_s = compile_timeout_s

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text = key
        try:
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "json":
                if text == ANY_JSON:
                    return self.compiler.compile_builtin_json_grammar()
                schema = json.loads(text)
                if self.json_whitespace:
                    return self.compiler.compile_json_schema(
                        schema, any_whitespace=True, max_whitespace_cnt=2
                    )
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            return self.compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            field = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf"}[kind]
            raise GrammarError(f"{field}: invalid constraint: {exc}") from exc

    def submit(self, key: GrammarKey) -> Future[xgr.CompiledGrammar]:
        """Start (or reuse) the compilation of ``key``."""
        fut = self.cache.get(key)
        if fut is None:
            fut = self.pool.submit(self._compile, key)
            self.cache[key] = fut
        return fut

    def poll(self, key: GrammarKey, submitted_at: float) -> GrammarState | GrammarError | None:
        """A fresh matcher when compiled, an error when it failed or timed out, None while compiling."""
        fut = self.submit(key)
        if not fut.done():
            if time.monotonic() - submitted_at > self.compile_timeout_s:
                self.cache.pop(key, None)
                field = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf"}[key[0]]
                return GrammarError(
                    f"{field}: grammar compilation took longer than {self.compile_timeout_s:g}s"
                )
            return None
        exc = fut.exception()
        if exc is not None:
            self.cache.pop(key, None)
            return exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
        return GrammarState(xgr.GrammarMatcher(fut.result()))

    def apply_masks(self, logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
        """Return ``logits`` with every constrained row's disallowed tokens set to -inf (a copy)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return logits
        bitmask = xgr.allocate_token_bitmask(len(states), self.info.vocab_size)
        for i in rows:
            state = states[i]
            assert state is not None
            state.matcher.fill_next_token_bitmask(bitmask, i)
        masked = logits.clone()
        if bitmask.device != logits.device:  # filled on the host; applied where the logits are (GPU)
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=self.vocab_size, indices=rows)
        return masked

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
