"""Shared by the examples: choose the backend from the command line and print cache statistics.

Every example runs in one command on the embedded default model (SmolLM2-135M-Instruct, a real but small
chat model: expect plausible, often wrong answers). ``--model-path`` loads another local checkpoint (an HF
directory or a .gguf file) instead; ``--url http://host:port`` uses a running radixrt (or SGLang) server.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import frontend_lang as sgl


def parse_args(
    description: str | None, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model-path", default=None, help="an HF directory or .gguf file (default: the embedded model)"
    )
    parser.add_argument("--url", default=None, help="use a running server instead of an in-process engine")
    parser.add_argument("--api-key", default=None)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def progress(message: str) -> None:
    """A progress line on stderr (with the progress bars), so that stdout holds only the results."""
    print(f"-- {message}", file=sys.stderr, flush=True)


def make_backend(ns: argparse.Namespace) -> sgl.BaseBackend:
    """An in-process Engine backend, or a RuntimeEndpoint with ``--url``; also the default backend."""
    if ns.url:
        backend: sgl.BaseBackend = sgl.RuntimeEndpoint(ns.url, api_key=ns.api_key)
    else:
        started = time.perf_counter()
        name = ns.model_path or "the embedded SmolLM2-135M-Instruct"
        progress(f"loading {name} (the first run converts the GGUF file, then compiles the decode step)")
        # float32 with dense weights: greedy ids equal HF transformers' whether a request runs alone or in a
        # batch, with or without a cache hit, so the demo prints the same text every run. bf16 (the server's
        # default here) rounds by batch shape and can flip near-ties (docs/server.md).
        backend = sgl.EngineBackend(
            model_path=ns.model_path, max_total_tokens=32768, dtype="float32", quantization="none"
        )
        progress(f"model ready in {time.perf_counter() - started:.1f} s")
    sgl.set_default_backend(backend)
    return backend


COUNTERS = ("num_requests", "prompt_tokens", "computed_prefill_tokens", "generation_tokens")


def cache_counters(backend: sgl.BaseBackend) -> dict[str, int]:
    """The worker's request and token counters now (``print_cache_stats`` reports the change since)."""
    info = backend.get_server_info()
    return {k: int(info[k]) for k in COUNTERS}


def print_cache_stats(backend: sgl.BaseBackend, started: float, before: dict[str, int] | None = None) -> None:
    """What the RadixCache saved since ``before`` (default: since the worker started): prompt tokens the
    worker did not have to compute. The counts go to stdout, the time to stderr (it differs every run)."""
    now = cache_counters(backend)
    n = {k: now[k] - (before or {}).get(k, 0) for k in COUNTERS}
    prompt, computed = n["prompt_tokens"], n["computed_prefill_tokens"]
    print(
        f"\ncache: {n['num_requests']} requests with {prompt} prompt tokens; the worker computed "
        f"{computed} of them, {prompt - computed} ({(prompt - computed) / max(prompt, 1):.0%}) came from the "
        f"RadixCache; generated {n['generation_tokens']} tokens",
        flush=True,
    )
    progress(f"done in {time.perf_counter() - started:.1f} s")
