"""The systems the suite compares, each behind one small interface (`Side`): a frontend_lang backend, the
tokenizer the optimum is counted with, cumulative prompt/cached token counters, and a way to start every
run from an empty cache.

- ``radixrt``: a launched radixrt server over HTTP (``RuntimeEndpoint``), default flags;
- ``radixrt-engine``: the in-process ``Engine`` (``EngineBackend``);
- ``radix-off``: the server with ``--disable-radix-cache``; ``radixrt-fcfs``: with ``--schedule-policy fcfs``;
  ``radixrt-mixed``: with ``--enable-mixed-chunk``; ``radixrt-ngram`` / ``radixrt-suffix``: with
  ``--speculative-algorithm NGRAM`` / ``SUFFIX`` (speculation on vs the plain ``radixrt``); ``radixrt-kv8``:
  with ``--kv-cache-dtype fp8_e4m3`` (8-bit KV, as OpenVINO's CPU plugin keeps its KV cache by default);
  ``radixrt-q8``: with ``--int4-kernel q8`` (int8 activations in float32 decode, as llama.cpp and OpenVINO);
- ``llama.cpp``: ``python -m llama_cpp.server`` on the same GGUF file, OpenAI completions, its RAM prompt
  cache on (cached tokens are read from its verbose log: "N prefix-match hit"); restarted per run. NOTE:
  ``--interrupt_requests false``: by default it cuts a streaming completion short (sends ``[DONE]``)
  whenever another request is waiting, which truncates outputs at parallel > 1 and skips its cache save;
- ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the same GGUF file, prefix caching on,
  in-process (`openvino_backend.OpenVINOBackend`); no cached-token count, no ``select``;
- ``hf``: HF transformers ``generate``, one call at a time (`hf_backend.HFBackend`);
- ``url``: any OpenAI-compatible server (``--base-url``), cached tokens from its ``usage``.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.agents.completions import CompletionsBackend
from benchmarks.agents.servers import ServerProcess, free_port, tree_cpu_seconds
from frontend_lang import BaseBackend, EngineBackend, RuntimeEndpoint
from frontend_lang.chat_template import template_for_tokenizer
from radixrt.models.tokenizer import load_tokenizer

ALL_BACKENDS = (
    "radixrt", "radixrt-engine", "radix-off", "radixrt-fcfs", "radixrt-mixed", "radixrt-ngram", "radixrt-suffix",
    "radixrt-kv8", "radixrt-q8", "openvino", "llama.cpp", "hf",
)  # fmt: skip
SERVER_FLAGS = {
    "radixrt": [],
    "radix-off": ["--disable-radix-cache"],
    "radixrt-fcfs": ["--schedule-policy", "fcfs"],
    "radixrt-mixed": ["--enable-mixed-chunk"],
    "radixrt-ngram": ["--speculative-algorithm", "NGRAM"],
    "radixrt-suffix": ["--speculative-algorithm", "SUFFIX"],
    "radixrt-kv8": ["--kv-cache-dtype", "fp8_e4m3"],
    "radixrt-q8": ["--int4-kernel", "q8"],
}
COUNTERS = ("prompt_tokens", "cached_tokens", "computed_prefill_tokens", "generation_tokens", "retractions",
            "evicted_tokens")  # fmt: skip


class _OutputIds:
    """Mixin for the native backends: streamed snapshots carry the generated ids into ``meta_info``
    (the optimum counts the prompt prefixes a call's own decoding already put in the cache)."""

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for snap in super()._call_stream(payload):  # type: ignore[misc]
            snap["meta_info"]["output_ids"] = snap.get("output_ids")
            yield snap


class EngineWithIds(_OutputIds, EngineBackend):
    """``EngineBackend`` whose generations report their output ids."""


class EndpointWithIds(_OutputIds, RuntimeEndpoint):
    """``RuntimeEndpoint`` whose generations report their output ids."""


class Side:
    """A started system. ``counters()`` are cumulative since start (None where unknown)."""

    name: str
    backend: BaseBackend
    tokenizer: Any
    supports_select = True
    sequential = False  # one request at a time, whatever the parallelism (runs at parallel 1 only)

    def counters(self) -> dict[str, float | None]:
        return {}

    def reset(self) -> None:
        """Empty every cache before the next run."""

    def cpu_seconds(self) -> float | None:
        """CPU seconds the system has used so far (its server processes; for an in-process system this
        whole process, the client's threads included); a load-independent cost on a shared machine."""
        return None

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        self.backend.shutdown()


class RadixSide(Side):
    """radixrt behind a native backend: the in-process Engine (`engine`), a launched server (`launch`), or
    a backend someone else owns (the constructor with ``owns=False``: tests)."""

    def __init__(self, name: str, backend: BaseBackend, flags: str, server: ServerProcess | None = None,
                 owns: bool = True) -> None:  # fmt: skip
        self.name, self.backend, self.flags, self.server, self.owns = name, backend, flags, server, owns
        self.tokenizer = backend.tokenizer  # type: ignore[attr-defined]

    @classmethod
    def engine(cls, name: str, model_path: str | None, kv_tokens: int) -> RadixSide:
        kw: dict[str, Any] = {"max_total_tokens": kv_tokens}
        if model_path:
            kw["model_path"] = model_path
        return cls(name, EngineWithIds(**kw), f"Engine(max_total_tokens={kv_tokens})")

    @classmethod
    def launch(
        cls, name: str, model_path: str | None, kv_tokens: int, flags: list[str], log_dir: Path
    ) -> RadixSide:
        port = free_port()
        cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--port", str(port), "--max-total-tokens",
               str(kv_tokens), "--log-level", "warning", *flags]  # fmt: skip
        if model_path:
            cmd += ["--model-path", model_path]
        server = ServerProcess(cmd, log_dir / f"{name}.log", f"http://127.0.0.1:{port}/health")
        try:
            backend = EndpointWithIds(f"http://127.0.0.1:{port}")
        except BaseException:
            server.stop()
            raise
        return cls(
            name, backend, " ".join(["radixrt serve --max-total-tokens", str(kv_tokens), *flags]), server
        )

    def counters(self) -> dict[str, float | None]:
        info = self.backend.get_server_info()
        return {k: float(info[k]) for k in COUNTERS if k in info}

    def cpu_seconds(self) -> float | None:
        return tree_cpu_seconds(self.server.proc.pid) if self.server is not None else time.process_time()

    def reset(self) -> None:
        if not self.backend.flush_cache():
            raise RuntimeError(f"{self.name}: flush_cache refused (requests still running?)")

    def describe(self) -> str:
        return self.flags

    def close(self) -> None:
        if self.owns:
            self.backend.shutdown()
        if self.server is not None:
            self.server.stop()


_PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens")


class LlamaCppSide(Side):
    """llama-cpp-python's OpenAI server on ``gguf``; restarted by ``reset`` (it has no cache flush)."""

    supports_select = False  # prompt logprobs need --logits_all (a full LM head on every prompt token)

    def __init__(self, gguf: Path, model_dir: str, threads: int, n_ctx: int, log_dir: Path) -> None:
        self.name = "llama.cpp"
        self.gguf, self.threads, self.n_ctx, self.log_dir = gguf, threads, n_ctx, log_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.template = template_for_tokenizer(self.tokenizer, model_dir)
        self.runs = 0
        self.server: ServerProcess | None = None
        self._start()

    def _cmd(self, port: int) -> list[str]:
        t = str(self.threads)
        return [sys.executable, "-m", "benchmarks.llama_cpp_compat", "--model", str(self.gguf), "--model_alias", "default",
                "--port", str(port), "--n_ctx", str(self.n_ctx), "--n_threads", t, "--n_threads_batch", t,
                "--cache", "true", "--cache_type", "ram", "--verbose", "true", "--interrupt_requests", "false"]  # fmt: skip

    def _start(self) -> None:
        port = free_port()
        log = self.log_dir / f"llama_cpp_{self.runs}.log"
        self.server = ServerProcess(self._cmd(port), log, f"http://127.0.0.1:{port}/v1/models")
        self.backend = CompletionsBackend(f"http://127.0.0.1:{port}", "default", self.template,
                                          select_supported=False, stream_usage=False)  # fmt: skip

    def counters(self) -> dict[str, float | None]:
        assert self.server is not None
        hits = [int(m.group(1)) for m in _PREFIX_HIT.finditer(self.server.log.read_text(errors="replace"))]
        return {"cached_tokens": float(sum(hits))}

    def cpu_seconds(self) -> float | None:
        return None if self.server is None else tree_cpu_seconds(self.server.proc.pid)

    def reset(self) -> None:
        self.close()
        self.runs += 1
        self._start()

    def describe(self) -> str:
        cmd = " ".join(["python -m llama_cpp.server", *self._cmd(0)[3:]])
        return cmd.replace(str(self.gguf), "<gguf>").replace("--port 0", "--port PORT")

    def close(self) -> None:
        self.backend.shutdown()
        if self.server is not None:
            self.server.stop()
            self.server = None


class OpenVINOSide(Side):
    """OpenVINO GenAI in-process; ``reset`` builds a new pipeline (it has no cache flush)."""

    supports_select = False  # echo's prompt logprobs skip the prefix-cached tokens

    def __init__(
        self, gguf: Path, model_dir: str, threads: int, properties: dict[str, Any] | None = None
    ) -> None:
        from importlib.metadata import version

        from benchmarks.agents.openvino_backend import OpenVINOBackend

        self.name = "openvino"
        self.threads = threads
        self.version = version("openvino-genai")
        self.backend = OpenVINOBackend(gguf, model_dir, threads, properties=properties)
        self.tokenizer = self.backend.tokenizer

    def counters(self) -> dict[str, float | None]:
        return {"prompt_tokens": float(self.backend.counters["prompt_tokens"])}  # type: ignore[attr-defined]

    def cpu_seconds(self) -> float | None:
        return time.process_time()

    def reset(self) -> None:
        if not self.backend.flush_cache():
            raise RuntimeError("openvino: cannot rebuild the pipeline (requests still running?)")

    def describe(self) -> str:
        b: Any = self.backend
        return (f"OpenVINO GenAI {self.version} ContinuousBatchingPipeline on <gguf>, in-process, prefix caching, "
                f"cache {b.cache_gb} GB, max_num_batched_tokens {b.max_batched_tokens}, "
                f"INFERENCE_NUM_THREADS {self.threads}")  # fmt: skip


class HFSide(Side):
    """HF transformers ``generate``, sequential."""

    sequential = True

    def __init__(self, model_dir: str, dtype: str) -> None:
        import torch

        from benchmarks.agents.hf_backend import HFBackend

        self.name = "hf"
        self.dtype = dtype
        self.backend = HFBackend(model_dir, getattr(torch, dtype))
        self.tokenizer = self.backend.tokenizer

    def counters(self) -> dict[str, float | None]:
        return {k: float(v) for k, v in self.backend.counters.items()}  # type: ignore[attr-defined]

    def cpu_seconds(self) -> float | None:
        return time.process_time()

    def describe(self) -> str:
        return f"transformers generate, {self.dtype}, one call at a time"


class UrlSide(Side):
    """Any OpenAI-compatible server; ``select`` if it returns prompt logprobs (``--base-url-select``)."""

    def __init__(self, base_url: str, model: str, model_dir: str, select: bool, api_key: str | None) -> None:
        self.name = "url"
        self.url = base_url
        self.tokenizer = load_tokenizer(model_dir)
        self.supports_select = select
        template = template_for_tokenizer(self.tokenizer, model_dir)
        self.backend = CompletionsBackend(base_url, model, template, api_key=api_key, select_supported=select)

    def counters(self) -> dict[str, float | None]:
        c = self.backend.counters  # type: ignore[attr-defined]
        return {"prompt_tokens": float(c["prompt_tokens"]),
                "cached_tokens": float(c["cached_tokens"]) if c["usage_reports"] else None}  # fmt: skip

    def reset(self) -> None:
        try:  # SGLang and radixrt have it; elsewhere runs start from whatever the server kept
            self.backend.client.post("/flush_cache")  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            pass

    def describe(self) -> str:
        return f"OpenAI completions at {self.url}"
