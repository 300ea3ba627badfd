"""Grammar-constrained decoding with xgrammar: regex, JSON schema, EBNF; masks and jump-forward.

``GrammarBackend`` lives in the worker: it builds xgrammar's ``TokenizerInfo`` once, compiles
grammars on a bounded, per-client-fair thread pool (off the scheduler's critical path), keeps the
compiled ones in a byte-bounded LRU cache keyed by (kind, text), and hands each request its own
``GrammarState`` (a matcher) once the compiled grammar is ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from radixrt.constrained.cache import GrammarCache, GrammarKey
from radixrt.constrained.compile_pool import CompileJob, CompilePool, GrammarBusy
from radixrt.constrained.json_strings import json_schema_grammar
from radixrt.sampling.sampling_params import SamplingParams

__all__ = ["ANY_JSON", "GrammarBackend", "GrammarBusy", "GrammarError", "GrammarKey", "GrammarState"]

# json_schema value meaning "any JSON value" (OpenAI response_format {"type": "json_object"}).
ANY_JSON = "$$ANY$$"
# The request field each constraint kind comes from (error messages name it).
FIELDS = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf"}
DEFAULT_CLIENT = "default"


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
    """The constraint cannot be compiled (bad regex / schema / grammar, too large, or too slow)."""

    status_code = 400


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


@dataclass(slots=True)
class GrammarLimits:
    """How much grammar work the backend accepts (ServerArgs' ``--grammar-*`` flags)."""

    compile_timeout_s: float = 30.0  # from the moment a thread starts compiling
    compile_threads: int = 2
    compiles_per_client: int = 4  # unfinished compilations per client (queued or running)
    cache_bytes: int = 256 << 20
    max_grammar_bytes: int = 256 << 10  # of the constraint text
    reserve_thread: bool = False  # several clients: one client never holds every compile thread


class GrammarBackend:
    """Compiles constraints asynchronously and applies token bitmasks to batched logits.

    Used from the scheduler thread: ``submit`` when a request arrives, then once per step ``collect``
    followed by ``poll`` for each request still waiting.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int],
        json_whitespace: bool = False,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # xgrammar's own cache is unbounded by default; ours (bounded by bytes) replaces it.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.json_whitespace = json_whitespace
        self.cache = GrammarCache(self.limits.cache_bytes)
        self.pool = CompilePool(
            self._compile,
            self.limits.compile_threads,
            self.limits.compiles_per_client,
            self.limits.reserve_thread,
        )
        self.in_flight: dict[GrammarKey, CompileJob] = {}
        # Outcomes of the compilations that ended at this step's ``collect``, for its ``poll`` calls.
        self.outcomes: dict[GrammarKey, xgr.CompiledGrammar | GrammarError] = {}

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text = key
        try:
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "json":
                if text == ANY_JSON:
                    return self.compiler.compile_builtin_json_grammar()
                grammar = json_schema_grammar(text, self.json_whitespace)
                return self.compiler.compile_grammar(grammar)
            return self.compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            raise GrammarError(f"{FIELDS[kind]}: invalid constraint: {exc}") from exc

    def submit(self, key: GrammarKey, client: str = DEFAULT_CLIENT) -> None:
        """Make ``key``'s compiled grammar available to a later ``poll``: cached, joining a compilation
        in flight, or starting one. GrammarError when the constraint text is too large; GrammarBusy
        when ``client`` already has its share of compilations in flight."""
        size = len(key[1].encode())
        if size > self.limits.max_grammar_bytes:
            raise GrammarError(
                f"{FIELDS[key[0]]}: the constraint is {size} bytes, above this server's limit of "
                f"{self.limits.max_grammar_bytes} (--max-grammar-bytes)"
            )
        if key in self.cache or key in self.in_flight:
            return
        self.in_flight[key] = self.pool.submit(key, client)

    def collect(self) -> None:
        """Settle compilations that finished, failed or ran past the timeout since the last step."""
        self.outcomes = {}
        now = time.monotonic()
        for key, job in list(self.in_flight.items()):
            fut = job.future
            if fut.done():
                del self.in_flight[key]
                exc = fut.exception()
                if exc is None:
                    compiled = fut.result()
                    self.cache.put(key, compiled)
                    self.outcomes[key] = compiled
                else:
                    self.outcomes[key] = exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
            elif job.started_at is not None and now - job.started_at > self.limits.compile_timeout_s:
                del self.in_flight[key]  # its thread finishes in the background; the result is dropped
                self.outcomes[key] = GrammarError(
                    f"{FIELDS[key[0]]}: grammar compilation took longer than "
                    f"{self.limits.compile_timeout_s:g}s"
                )

    def poll(self, key: GrammarKey, client: str = DEFAULT_CLIENT) -> GrammarState | GrammarError | None:
        """A fresh matcher when compiled, an error when it failed or timed out, None while compiling."""
        outcome = self.outcomes.get(key)
        if outcome is None:
            outcome = self.cache.get(key)
        if isinstance(outcome, GrammarError):
            return outcome
        if outcome is not None:
            return GrammarState(xgr.GrammarMatcher(outcome))
        if key not in self.in_flight:  # evicted before this request took it: compile it again
            self.in_flight[key] = self.pool.submit(key, client, exempt=True)
        return None

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
        self.pool.shutdown()
