"""CompletionsBackend: a frontend_lang backend for any OpenAI-compatible ``/v1/completions`` server
(llama.cpp's server, vLLM, SGLang, radixrt's own ``/v1``), for the benchmark.

frontend_lang's ``OpenAI`` backend targets chat models and reports no cached tokens or first-token
times; this one sends the program's text as a completion prompt (the program renders roles with the
model's own chat template, exactly as for radixrt), always streams (time to first token), reads
``usage.prompt_tokens_details.cached_tokens`` where the server reports it, and asks for fixed-length
answers (``ignore_eos``) with ``min_tokens`` (llama.cpp, vLLM, SGLang) plus ``ignore_eos`` (vLLM, SGLang).

``select`` scores choices with ``echo`` + ``logprobs`` (the prompt tokens' logprobs) where the server
returns them; llama.cpp's server needs ``--logits_all`` for that, which slows every request, so the
suite runs it without and reports select programs as n/a there.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from frontend_lang import BackendError, BaseBackend
from frontend_lang.backends.base import PromptContext, validate_choices
from frontend_lang.chat_template import ChatTemplate
from frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams


class CompletionsBackend(BaseBackend):
    """``CompletionsBackend("http://host:port", model, chat_template)``; ``select_supported`` False makes
    ``select`` raise NotImplementedError without a request."""

    def __init__(
        self,
        base_url: str,
        model: str,
        chat_template: ChatTemplate,
        *,
        api_key: str | None = None,
        select_supported: bool = True,
        stream_usage: bool = True,
        timeout: float = 900.0,
    ) -> None:
        url = base_url.rstrip("/")
        url = url[: -len("/v1")] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        self.model = model
        self.chat_template = chat_template
        self.select_supported = select_supported
        self.stream_usage = stream_usage
        self._lock = threading.Lock()
        # cumulative usage as reported by the server (cached tokens only where it reports them)
        self.counters: dict[str, int] = {"prompt_tokens": 0, "cached_tokens": 0, "usage_reports": 0}

    def _body(self, text: str, params: GenParams) -> dict[str, Any]:
        native = params.to_native()
        body: dict[str, Any] = {"model": self.model, "prompt": text, "stream": True,
                                "max_tokens": int(native.get("max_new_tokens", 128)),
                                "temperature": float(native.get("temperature", 1.0))}  # fmt: skip
        neutral = {"top_p": 1.0, "top_k": -1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": None}
        for key, value in neutral.items():  # only what differs from the neutral value (servers differ)
            if native.get(key, value) != value:
                body[key] = native[key]
        if params.stop_list():
            body["stop"] = params.stop_list()
        if native.get("ignore_eos"):
            body["min_tokens"] = body["max_tokens"]
            body["ignore_eos"] = True
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def _count(self, usage: dict[str, Any]) -> dict[str, Any]:
        details = usage.get("prompt_tokens_details") or {}
        meta = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": details.get("cached_tokens")}  # fmt: skip
        with self._lock:
            self.counters["prompt_tokens"] += int(meta["prompt_tokens"] or 0)
            if meta["cached_tokens"] is not None:
                self.counters["cached_tokens"] += int(meta["cached_tokens"])
                self.counters["usage_reports"] += 1
        return meta

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise NotImplementedError("CompletionsBackend: n > 1")
        chunks = 0
        try:
            with self.client.stream("POST", "/v1/completions", json=self._body(ctx.text, params)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise BackendError(f"/v1/completions: HTTP {resp.status_code}: {resp.text[:500]}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise BackendError(f"/v1/completions stream: {event['error']}")
                    meta: dict[str, Any] = {"completion_chunks": chunks}
                    if event.get("usage"):
                        meta |= self._count(event["usage"])
                    text = "".join(c.get("text") or "" for c in event.get("choices") or [])
                    if text:
                        chunks += 1
                        meta["completion_chunks"] = chunks
                    yield text, meta
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.client.base_url}: {exc}") from exc

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        pieces: list[str] = []
        last: dict[str, Any] = {}
        for delta, snapshot in self.generate_stream(ctx, params):
            pieces.append(delta)
            last = snapshot
        return "".join(pieces), last

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        choices = validate_choices(choices)
        if not self.select_supported:
            raise NotImplementedError("select: this server returns no prompt logprobs")
        if method.requires_unconditional:
            raise NotImplementedError("CompletionsBackend.select: unconditional normalization")
        body = {"model": self.model, "prompt": [ctx.text + c for c in choices], "max_tokens": 1,
                "echo": True, "logprobs": 1, "temperature": 0}  # fmt: skip
        try:
            resp = self.client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.client.base_url}: {exc}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"select via echo + logprobs: HTTP {resp.status_code}: {resp.text[:300]}")
        out = resp.json()
        rows = sorted(out["choices"], key=lambda c: c["index"])
        cond = []
        for c, row in zip(choices, rows, strict=True):
            lp = row.get("logprobs") or {}
            if not lp.get("token_logprobs"):
                raise NotImplementedError("select: the server returned no prompt logprobs")
            begin, end = len(ctx.text), len(ctx.text) + len(c)
            cond.append([float(v) for tok, v, off in zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"],
                                                         strict=True)
                         if v is not None and off < end and off + len(tok) > begin])  # fmt: skip
        if out.get("usage"):
            self._count(out["usage"])
        return method.decide(ChoiceScores(choices, cond, None), temperature)

    def shutdown(self) -> None:
        self.client.close()
