"""OpenVINOBackend: OpenVINO GenAI's ``ContinuousBatchingPipeline`` as a frontend_lang backend, in-process,
prefix caching on (the CPU peer that does radixrt's own job: continuous batching, paged KV, prefix reuse).

One driver thread owns the pipeline: it adds the requests the program threads submitted, calls ``step()``
while any request is unfinished, reads each handle's new tokens and hands them to the waiting program
thread, so the generations of several programs (and of a program's forks) run in the same batches.
Prompts are tokenized as radixrt tokenizes them (``add_special_tokens=True``) and sent as token ids, the
generated ids are decoded with the same tokenizer; stop strings are found in the decoded text by the
driver right after each step and end the request there (``handle.stop()``), the text is cut before the
stop as radixrt cuts it; greedy with ``temperature == 0``; ``ignore_eos`` maps to OpenVINO's own.

It reports no cached-token count (``cached_tokens`` is None), and ``select`` is not offered: prompt
logprobs come from ``echo``, which with prefix caching returns them only for the prompt tokens it
computed (measured: a repeated prompt yields one logprob), and which tokens those were is not reported.
``flush_cache`` builds a new pipeline (OpenVINO has no cache flush) and warms it with one short request.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend_lang import BackendError, BaseBackend
from frontend_lang.backends.base import PromptContext
from frontend_lang.chat_template import template_for_tokenizer
from frontend_lang.choices import ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams
from radixrt.models.tokenizer import load_tokenizer

# sampling parameters that have no OpenVINO mapping here: refused when set to anything but neutral
_UNSUPPORTED = {"min_p": 0.0, "return_logprob": False, "top_logprobs_num": 0}


@dataclass(eq=False)
class _Request:
    """One generation between a program thread (``events``) and the driver (everything else)."""

    ids: list[int]
    config: Any
    stops: list[str]
    events: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    handle: Any = None
    out: list[int] = field(default_factory=list)
    decoded: str = ""  # the generated ids' text (cut before a stop string)
    text: str = ""  # what the program thread has been given of it


def _settled(text: str, stops: list[str]) -> int:
    """Length of the prefix of ``text`` that no further token can change: without a trailing U+FFFD and
    without a suffix that begins a stop string."""
    end = len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:k]):
                end -= k
                break
    return end


class OpenVINOBackend(BaseBackend):
    """``OpenVINOBackend(gguf, model_dir, threads)``: the GGUF file loaded by OpenVINO GenAI on the CPU;
    ``model_dir`` gives the tokenizer and chat template (radixrt's view of the same model)."""

    def __init__(
        self,
        gguf: Path,
        model_dir: str,
        threads: int,
        *,
        cache_gb: int = 2,
        max_batched_tokens: int = 2048,
        properties: dict[str, Any] | None = None,
    ) -> None:
        import openvino_genai as og

        self._og = og
        self.gguf, self.threads = gguf, threads
        self.cache_gb, self.max_batched_tokens = cache_gb, max_batched_tokens
        self.properties = {"INFERENCE_NUM_THREADS": threads, **(properties or {})}
        self.tokenizer = load_tokenizer(model_dir)
        self.chat_template = template_for_tokenizer(self.tokenizer, model_dir)
        self.counters: dict[str, int] = {"prompt_tokens": 0, "generation_tokens": 0}
        self._tok_lock = threading.Lock()  # one Rust tokenizer from several threads: "Already borrowed"
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._active: dict[int, _Request] = {}
        self._busy = False  # the driver is between taking requests and finishing its step
        self._closed = False
        self._ids = itertools.count()
        self._pipe = self._build()
        self._driver = threading.Thread(target=self._drive, name="openvino-driver", daemon=True)
        self._driver.start()
        self._warm()

    # -- the pipeline --------------------------------------------------------------------------------
    def _build(self) -> Any:
        sc = self._og.SchedulerConfig()
        sc.enable_prefix_caching = True
        sc.cache_size = self.cache_gb
        sc.max_num_batched_tokens = self.max_batched_tokens
        return self._og.ContinuousBatchingPipeline(str(self.gguf), sc, "CPU", self.properties)

    def _warm(self) -> None:
        """One short request: the plugin compiles its kernels on the first step (seconds), not in a run."""
        req = _Request(list(range(1000, 1064)), self._config({"max_new_tokens": 4}), [])
        for _ in self._submit(req):
            pass

    def _config(self, native: dict[str, Any]) -> Any:
        for key, neutral in _UNSUPPORTED.items():
            if native.get(key, neutral) not in (neutral, None):
                raise NotImplementedError(f"OpenVINOBackend: {key}")
        cfg = self._pipe.get_config()  # the file's EOS ids
        cfg.max_new_tokens = int(native.get("max_new_tokens", 128))
        if native.get("min_new_tokens"):
            cfg.min_new_tokens = int(native["min_new_tokens"])
        temperature = float(native.get("temperature", 1.0))
        cfg.do_sample = temperature > 0
        if cfg.do_sample:
            cfg.temperature = temperature
            cfg.top_p = float(native.get("top_p", 1.0))
            if int(native.get("top_k", -1)) > 0:
                cfg.top_k = int(native["top_k"])
            if native.get("seed") is not None:
                cfg.rng_seed = int(native["seed"])
        cfg.frequency_penalty = float(native.get("frequency_penalty", 0.0))
        cfg.presence_penalty = float(native.get("presence_penalty", 0.0))
        if native.get("ignore_eos"):
            cfg.ignore_eos = True
        if native.get("stop_token_ids"):
            cfg.stop_token_ids = set(cfg.stop_token_ids) | {int(t) for t in native["stop_token_ids"]}
        return cfg

    # -- the driver thread ---------------------------------------------------------------------------
    def _drive(self) -> None:
        import numpy as np
        import openvino as ov

        unfinished = False  # a request stopped at a stop string leaves the pipeline at its next step
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._pending and not self._active and not unfinished:
                        self._cv.wait()
                    if self._closed:
                        return
                    new, self._pending = self._pending, []
                    self._busy = True
                    pipe = self._pipe
                for req in new:
                    rid = next(self._ids)
                    tensor = ov.Tensor(np.asarray([req.ids], dtype=np.int64))
                    req.handle = pipe.add_request(rid, tensor, req.config)
                    self._active[rid] = req
                if pipe.has_non_finished_requests():
                    pipe.step()
                for rid, req in list(self._active.items()):
                    if self._collect(req):
                        del self._active[rid]
                unfinished = pipe.has_non_finished_requests()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting program, then re-raised
            with self._cv:
                self._closed = True
                for req in [*self._active.values(), *self._pending]:
                    req.events.put(("error", exc))
                self._busy = False
                self._cv.notify_all()
            raise

    def _collect(self, req: _Request) -> bool:
        """Read the request's new tokens, end it at a stop string; True when it is finished."""
        status = req.handle.get_status()
        fresh: list[int] = []
        if req.handle.can_read():
            for out in req.handle.read().values():
                fresh += list(out.generated_ids)
        done = status != self._og.GenerationStatus.RUNNING
        if fresh:
            req.out += fresh
            with self._tok_lock:
                req.decoded = str(self.tokenizer.decode(req.out, skip_special_tokens=True))
            cut = [i for i in (req.decoded.find(s) for s in req.stops) if i >= 0]
            if cut:
                req.decoded, done = req.decoded[: min(cut)], True
                req.handle.stop()
        # while running, hold back what may still change: a partial stop string, an incomplete UTF-8
        # character (decoded as U+FFFD); the program sees the text as radixrt streams it
        shown = req.decoded if done else req.decoded[: _settled(req.decoded, req.stops)]
        if not shown.startswith(req.text):
            raise RuntimeError(f"detokenized text changed: {req.text!r} -> {shown!r}")
        if fresh or shown != req.text:
            req.events.put(("tokens", (shown[len(req.text) :], list(req.out))))
            req.text = shown
        if done and status == self._og.GenerationStatus.IGNORED:
            why = "OpenVINO ignored the request (a prompt longer than its KV cache?)"
            req.events.put(("error", BackendError(why)))
        elif done:
            req.events.put(("done", None))
        return done

    # -- the frontend_lang interface -----------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=True))

    def _submit(self, req: _Request) -> Iterator[tuple[str, list[int]]]:
        with self._cv:
            if self._closed:
                raise BackendError("OpenVINOBackend: shut down (or its driver failed)")
            self._pending.append(req)
            self._cv.notify_all()
        while True:
            kind, value = req.events.get()
            if kind == "error":
                raise BackendError(f"OpenVINO: {value}") from value
            if kind == "done":
                return
            yield value

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise NotImplementedError("OpenVINOBackend: n > 1")
        ids = self._encode(ctx.text)
        req = _Request(ids, self._config(params.to_native()), params.stop_list())
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": None,
                                "output_ids": []}  # fmt: skip
        for delta, out in self._submit(req):
            meta = meta | {"completion_tokens": len(out), "output_ids": out}
            yield delta, meta
        with self._cv:
            self.counters["prompt_tokens"] += len(ids)
            self.counters["generation_tokens"] += len(req.out)

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        pieces: list[str] = []
        meta: dict[str, Any] = {}
        for delta, snapshot in self.generate_stream(ctx, params):
            pieces.append(delta)
            meta = snapshot
        return "".join(pieces), meta

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        raise NotImplementedError("OpenVINOBackend: select (no prompt logprobs with prefix caching)")

    def flush_cache(self) -> bool:
        """A new pipeline (empty prefix cache), warmed; False while requests are in flight."""
        with self._cv:
            if self._pending or self._active or self._busy or self._closed:
                return False
            old, self._pipe = self._pipe, None
            del old
            self._pipe = self._build()
        self._warm()
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "openvino_genai", "gguf": self.gguf.name, **self.counters}

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._driver:
            self._driver.join(timeout=60)
        self._pipe = None
