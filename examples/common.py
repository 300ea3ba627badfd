"""Shared by the examples: choose the backend from the command line and print cache statistics.

Every example runs in one command on the embedded default model (SmolLM2-135M-Instruct, a real but small
chat model: expect plausible, often wrong answers). ``--model-path`` loads another local checkpoint (an HF
directory or a .gguf file) instead; ``--url http://host:port`` uses a running radixrt (or SGLang) server.
"""

from __future__ import annotations

import argparse
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


def make_backend(ns: argparse.Namespace) -> sgl.BaseBackend:
    """An in-process Engine backend, or a RuntimeEndpoint with ``--url``; also the default backend."""
    if ns.url:
        backend: sgl.BaseBackend = sgl.RuntimeEndpoint(ns.url, api_key=ns.api_key)
    else:
        backend = sgl.EngineBackend(model_path=ns.model_path, max_total_tokens=32768)
    sgl.set_default_backend(backend)
    return backend


def print_cache_stats(backend: sgl.BaseBackend, started: float) -> None:
    """What the RadixCache saved over the whole run: prompt tokens the worker did not have to compute."""
    info = backend.get_server_info()
    prompt, computed = int(info["prompt_tokens"]), int(info["computed_prefill_tokens"])
    print(
        f"\ncache: {int(info['num_requests'])} requests with {prompt} prompt tokens; the worker computed "
        f"{computed} of them, {prompt - computed} ({(prompt - computed) / max(prompt, 1):.0%}) came from the "
        f"RadixCache; generated {int(info['generation_tokens'])} tokens in {time.perf_counter() - started:.1f}s"
    )
