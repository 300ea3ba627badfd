"""The systems `cpu_speed` compares, behind one small interface: radixrt (a mode), llama.cpp, HF transformers.

Each system answers three questions about one model on this CPU: decode tok/s of a batch after a prompt of
some length, prefill tok/s of one prompt, and (radixrt) the bare compiled forward loop for the same batch.
Decode rates exclude prefill: radixrt computes the prompts once, then times ``1 + n`` against ``1`` new
tokens on the same, now cached prompts (the RadixCache leaves one token to compute); llama.cpp evaluates
single tokens after its prompt; HF times ``1 + n`` against ``1`` new tokens on fresh prompts.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from benchmarks.llama_cpp_compat import amx_buffers_off


class System(Protocol):
    name: str

    def decode_tok_s(self, batch: int, context: int, new_tokens: int) -> float: ...

    def prefill_tok_s(self, length: int) -> float: ...

    def close(self) -> None: ...


def random_prompts(batch: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


class RadixSystem:
    """radixrt's Engine in one mode (``quantization``, ``disable_compile``, ``dtype``, ...)."""

    def __init__(self, name: str, model_path: str | None, **kw: Any) -> None:
        from radixrt import Engine

        self.name = name
        t0 = time.perf_counter()
        self.engine = Engine(model_path=model_path, max_total_tokens=80_000, **kw)
        self.startup_s = time.perf_counter() - t0
        self.vocab = self.engine.worker.scheduler.runner.config.vocab_size
        self.rng = random.Random(0)

    def _run(self, prompts: list[list[int]], n: int) -> float:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        t0 = time.perf_counter()
        self.engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t0

    def decode_tok_s(self, batch: int, context: int, new_tokens: int) -> float:
        prompts = random_prompts(batch, context, self.vocab, self.rng)  # each request its own context
        self._run(prompts, 1)  # prefill once: the prompts are cached from here on
        t1 = min(self._run(prompts, 1) for _ in range(2))
        t2 = self._run(prompts, 1 + new_tokens)
        self.engine.flush_cache()
        return batch * new_tokens / (t2 - t1)

    def prefill_tok_s(self, length: int) -> float:
        self._run(random_prompts(1, 16, self.vocab, self.rng), 1)
        t = self._run(random_prompts(1, length, self.vocab, self.rng), 1)
        self.engine.flush_cache()
        return length / t

    def bare_loop_tok_s(self, batch: int, context: int, steps: int) -> float:
        """The model alone: ``steps`` decode forwards + logits + argmax on fixed metadata, on the scheduler
        thread (where the Engine runs it), no scheduling, sampling or output."""
        from radixrt.kernels.base import ForwardMode
        from radixrt.worker.model_runner import ForwardInput

        def loop(sched: Any) -> float:
            runner = sched.runner
            table = runner.req_to_token_pool.req_to_token
            for i in range(batch):
                table[i, : context + 1] = torch.arange(1 + i * (context + 1), 1 + (i + 1) * (context + 1))
            fi = ForwardInput(ForwardMode.DECODE, list(range(batch)), [context] * batch, [1] * batch,
                              [5] * batch, torch.full((batch,), context))  # fmt: skip
            for _ in range(3):
                runner.logits(runner.forward(fi)).argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.logits(runner.forward(fi)).argmax(-1)
            dt = time.perf_counter() - t0
            table[:batch].zero_()
            return batch * steps / dt

        return float(self.engine.worker.call(loop, timeout=600))

    def close(self) -> None:
        self.engine.shutdown()


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on the GGUF file itself: one sequence at a time."""

    def __init__(self, gguf_file: Path, threads: int, n_ctx: int = 8448) -> None:
        from llama_cpp import Llama

        amx_buffers_off()
        self.name = "llama.cpp"
        t0 = time.perf_counter()
        self.llm = Llama(model_path=str(gguf_file), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)  # fmt: skip
        self.startup_s = time.perf_counter() - t0
        self.vocab = self.llm.n_vocab()
        self.rng = random.Random(0)

    def decode_tok_s(self, batch: int, context: int, new_tokens: int) -> float:
        if batch != 1:
            return float("nan")  # llama-cpp-python's Llama runs one sequence
        prompt = random_prompts(1, context, self.vocab, self.rng)[0]
        self.llm.reset()
        self.llm.eval(prompt)
        tok = prompt[-1]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            self.llm.eval([tok])
        return new_tokens / (time.perf_counter() - t0)

    def prefill_tok_s(self, length: int) -> float:
        prompt = random_prompts(1, length, self.vocab, self.rng)[0]
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return length / (time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.close()


class HFSystem:
    """HF transformers ``generate`` (greedy, its own KV cache) on its own load of the checkpoint."""

    def __init__(
        self, name: str, path: Path, gguf_file: Path | None, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        self.device = torch.device(device)
        kw: dict[str, Any] = {"gguf_file": gguf_file.name} if gguf_file is not None else {}
        src = gguf_file.parent if gguf_file is not None else path
        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).eval().to(self.device)
        self.vocab = int(self.model.config.vocab_size)
        self.rng = random.Random(0)

    @torch.inference_mode()
    def _run(self, prompts: list[list[int]], n: int) -> float:
        x = torch.tensor(prompts, device=self.device)
        t0 = time.perf_counter()
        self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)  # fmt: skip
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def decode_tok_s(self, batch: int, context: int, new_tokens: int) -> float:
        self._run(random_prompts(batch, 8, self.vocab, self.rng), 2)
        t1 = self._run(random_prompts(batch, context, self.vocab, self.rng), 1)
        t2 = self._run(random_prompts(batch, context, self.vocab, self.rng), 1 + new_tokens)
        return batch * new_tokens / max(t2 - t1, 1e-9)

    @torch.inference_mode()
    def prefill_tok_s(self, length: int) -> float:
        x = torch.tensor(random_prompts(1, length, self.vocab, self.rng), device=self.device)
        self._sync()
        t0 = time.perf_counter()
        self.model(x)
        self._sync()
        return length / (time.perf_counter() - t0)

    def close(self) -> None:
        del self.model
