"""HFBackend: HF transformers as a frontend_lang backend: one ``model.generate`` at a time, no cache kept
between calls (the sequential baseline a user gets from a plain transformers script).

Prompts are tokenized as radixrt tokenizes them (``add_special_tokens=True``), stop strings end a
generation and are cut from its text as radixrt cuts them, ``ignore_eos`` becomes ``min_new_tokens``.
``select`` scores each choice with one forward over prompt + choice (the same token boundary rule as
radixrt's native backends).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from frontend_lang import BaseBackend
from frontend_lang.backends.base import PromptContext, validate_choices
from frontend_lang.backends.native import shared_prefix_len
from frontend_lang.chat_template import template_for_tokenizer
from frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams
from radixrt.models.tokenizer import load_tokenizer


class _FirstToken(BaseStreamer):
    """Timestamps the first generated token (``put`` is called with the prompt first)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class HFBackend(BaseBackend):
    """``HFBackend(model_dir, dtype)``: the checkpoint loaded by transformers on the CPU."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.chat_template = template_for_tokenizer(self.tokenizer, model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {"prompt_tokens": 0, "cached_tokens": 0}

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    @torch.inference_mode()
    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise NotImplementedError("HFBackend: n > 1")
        native = params.to_native()
        max_new = int(native.get("max_new_tokens", 128))
        stops = params.stop_list()
        kw: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": 0}
        if native.get("ignore_eos"):
            kw["min_new_tokens"] = max_new
        if stops:
            kw |= {"stop_strings": stops, "tokenizer": self.tokenizer}
        first = _FirstToken()
        with self._lock:
            ids = self._encode(ctx.text)
            x = torch.tensor([ids])
            out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=first, **kw)
            self.counters["prompt_tokens"] += len(ids)
        new = out[0, len(ids) :].tolist()
        text = str(self.tokenizer.decode(new, skip_special_tokens=True))
        cut = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cut:
            text = text[: min(cut)]
        yield text, {"prompt_tokens": len(ids), "completion_tokens": len(new), "cached_tokens": 0,
                     "output_ids": new, "first_token_at": first.at}  # fmt: skip

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        text, meta = next(iter(self.generate_stream(ctx, params)))
        return text, meta

    @torch.inference_mode()
    def _logprobs(self, ids: list[int], start: int) -> list[float]:
        logits = self.model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(ids[1:])
        picked = lp.gather(1, target[:, None])[:, 0]
        return [float(v) for v in picked[start - 1 :]]

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        choices = validate_choices(choices)
        with self._lock:
            prefix = self._encode(ctx.text)
            full = [self._encode(ctx.text + c) for c in choices]
            boundary = min(min(shared_prefix_len(prefix, f) for f in full), min(len(f) for f in full) - 1)
            if boundary < 1:
                raise ValueError("select: needs at least one token of text before the choices")
            cond = [self._logprobs(f, boundary) for f in full]
            uncond = None
            if method.requires_unconditional:
                uncond = [[None, *self._logprobs(f[boundary:], 1)] for f in full]
            self.counters["prompt_tokens"] += sum(len(f) for f in full)
        extra = {"prompt_tokens": [len(f) for f in full], "cached_tokens": [0] * len(full)}
        return method.decide(ChoiceScores(choices, cond, uncond, extra), temperature)
