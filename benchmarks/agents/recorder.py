"""Recorder: a backend that forwards every request of a program to another backend and writes down what was
sent (prompt text), what came back (text, token ids when the backend gives them, token counts) and when
(start, time to first token, end). The runner computes the metrics and the optimum from these records.

Generations are always streamed from the inner backend, so the time to the first token is measured on
the client for every backend alike; the text returned to the program is the same as without streaming.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from frontend_lang import BaseBackend
from frontend_lang.backends.base import PromptContext
from frontend_lang.choices import ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams


@dataclass(slots=True)
class Request:
    """One request as sent: a ``gen``, one choice of a ``select`` (prompt = text + choice), or the prefix
    a ``fork`` or a ``select`` commits to the cache."""

    kind: str  # "gen" | "select" | "prefix"
    prompt: str
    start: float
    end: float = 0.0
    ttft: float | None = None  # seconds from start to the first generated token (gen only)
    output: str = ""
    output_ids: list[int] | None = None  # the generated ids, where the backend returns them
    prompt_tokens: int | None = None  # as the backend counted them
    cached_tokens: int | None = None  # as the backend reported them
    completion_tokens: int | None = None


def _sends_prefix(backend: BaseBackend) -> bool:
    return type(backend).cache_prefix is not BaseBackend.cache_prefix


class Recorder(BaseBackend):
    """Wraps ``inner``; thread-safe (a program's forks call it from several threads)."""

    def __init__(self, inner: BaseBackend) -> None:
        self.inner = inner
        self.chat_template = inner.get_chat_template()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._prefix = _sends_prefix(inner)

    def _add(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def cache_prefix(self, text: str) -> None:
        if not self._prefix or not text:
            return  # the inner backend sends nothing: nothing to record
        req = Request("prefix", text, time.perf_counter())
        self.inner.cache_prefix(text)
        req.end = time.perf_counter()
        self._add(req)

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        if (params.n or 1) > 1:
            raise NotImplementedError("the recorder times one generation per request (n == 1)")
        req = Request("gen", ctx.text, time.perf_counter())
        pieces: list[str] = []
        meta: dict[str, Any] = {}
        for delta, snapshot in self.inner.generate_stream(ctx, params):
            meta = snapshot
            if req.ttft is None and (delta or (snapshot.get("completion_tokens") or 0) > 0):
                req.ttft = time.perf_counter() - req.start
            pieces.append(delta)
        req.end = time.perf_counter()
        if meta.get("first_token_at") is not None:  # a backend that does not stream timestamps it
            req.ttft = float(meta["first_token_at"]) - req.start
        req.output = "".join(pieces)
        req.output_ids = meta.get("output_ids")
        req.prompt_tokens = meta.get("prompt_tokens")
        req.cached_tokens = meta.get("cached_tokens")
        req.completion_tokens = meta.get("completion_tokens")
        self._add(req)
        return req.output, meta

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        text, meta = self.generate(ctx, params)
        yield text, meta

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        start = time.perf_counter()
        decision = self.inner.select(ctx, choices, temperature, method)
        end = time.perf_counter()
        info = decision.meta_info
        commit = info.get("prefix_commit")
        if commit is not None:  # the backend first cached the text before the choices (prefill only)
            req = Request("prefix", ctx.text, start, end)
            req.prompt_tokens, req.cached_tokens = commit["prompt_tokens"], commit["cached_tokens"]
            self._add(req)
        for i, choice in enumerate(choices):
            req = Request("select", ctx.text + choice, start, end)
            req.prompt_tokens = _item(info.get("prompt_tokens"), i)
            req.cached_tokens = _item(info.get("cached_tokens"), i)
            self._add(req)
        return decision

    def supports_constraints(self) -> bool:
        return self.inner.supports_constraints()

    def check_constraints(self, params: GenParams) -> None:
        self.inner.check_constraints(params)

    def flush_cache(self) -> bool:
        return self.inner.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.inner.get_server_info()


def _item(values: Any, i: int) -> int | None:
    if isinstance(values, list | tuple) and i < len(values) and values[i] is not None:
        return int(values[i])
    return None
