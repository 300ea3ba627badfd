"""Constrained requests whose grammar is compiling, and the worker's grammar backend (built on first use).

A constrained request submits its grammar on arrival (`GrammarQueue.submit`, which may refuse it) and
waits here, outside the scheduler's admission queue, until its grammar compiled (it then gets its own
matcher and joins the waiting queue) or failed (it ends with a 400).
"""

from __future__ import annotations

import time

from radixrt.config.server_args import ServerArgs
from radixrt.constrained.grammar import DEFAULT_CLIENT, GrammarBackend, GrammarError, GrammarLimits
from radixrt.worker.req import Req


class GrammarQueue:
    """The requests waiting for their grammar (``compiling``, in arrival order) and the backend."""

    def __init__(
        self, args: ServerArgs, model_path: str, vocab_size: int, eos_ids: set[int], tenants: bool
    ) -> None:
        self.args = args
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.tenants = tenants
        self.compiling: list[Req] = []
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend, built on the first constrained request (loads the tokenizer)."""
        if self._backend is None:
            from radixrt.models.tokenizer import load_tokenizer

            args = self.args
            tokenizer = load_tokenizer(args.tokenizer_path or self.model_path)
            limits = GrammarLimits(
                compile_timeout_s=args.grammar_compile_timeout,
                compile_threads=args.grammar_compile_threads,
                compiles_per_client=args.max_grammar_compiles_per_client,
                cache_bytes=int(args.grammar_cache_size_mb * 2**20),
                max_grammar_bytes=args.max_grammar_bytes,
                reserve_thread=self.tenants,  # tenants: one never holds every compile thread
            )
            self._backend = GrammarBackend(
                tokenizer, self.vocab_size, sorted(self.eos_ids), args.json_whitespace, limits
            )
        return self._backend

    def submit(self, req: Req) -> None:
        """Start compiling ``req``'s grammar (or find it cached); GrammarError (400) when it cannot be
        compiled, GrammarBusy (429) when its client has its share of compilations in flight."""
        assert req.grammar_key is not None
        self.backend.submit(req.grammar_key, req.tenant or DEFAULT_CLIENT)

    def add(self, req: Req) -> None:
        """``req`` (submitted) waits here for its grammar."""
        req.grammar_since = time.monotonic()
        self.compiling.append(req)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(compiled, failed): the requests whose grammar compiled (``req.grammar`` set) and those whose
        did not (``req.finish_reason`` set, status 400), in arrival order; the rest keep waiting."""
        still: list[Req] = []
        compiled: list[Req] = []
        failed: list[Req] = []
        backend = self.backend
        backend.collect()
        for req in self.compiling:
            assert req.grammar_key is not None
            res = backend.poll(req.grammar_key, req.tenant or DEFAULT_CLIENT)
            if res is None:
                still.append(req)
            elif isinstance(res, GrammarError):
                req.finish_reason = {"type": "abort", "message": str(res), "status_code": 400}
                failed.append(req)
            else:
                req.grammar = res
                compiled.append(req)
        self.compiling = still
        return compiled, failed
