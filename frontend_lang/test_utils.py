"""SGLang's benchmark command line (``sglang.test.test_utils``): a benchmark script ports by changing its
imports to ``frontend_lang`` / ``frontend_lang.test_utils`` / ``frontend_lang.utils``.

``--backend srt`` (SGLang's default) is a server at ``--host``/``--port`` (radixrt's or SGLang's),
through ``RuntimeEndpoint``; ``--backend engine`` runs an in-process ``EngineBackend`` on
``--model-path`` (default: the embedded demo model); ``--backend gpt-...`` is OpenAI's API.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_common_sglang_args_and_parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add SGLang's common benchmark flags (same names and defaults) to ``parser`` and parse."""
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--backend", type=str, default="srt")
    parser.add_argument("--device", type=str, default="auto", choices=["auto", "cuda", "rocm", "cpu"])
    parser.add_argument("--result-file", type=str, default="result.jsonl")
    parser.add_argument("--raw-result-file", type=str)
    try:  # radixrt's addition, for --backend engine (a script may define it already)
        parser.add_argument("--model-path", type=str, default=None)
    except argparse.ArgumentError:
        pass
    return parser.parse_args()


def base_url(host: str, port: int) -> str:
    """``http://host:port``; a host that already has a scheme keeps it, an IPv6 one is bracketed."""
    if "://" not in host:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        host = "http://" + host
    return f"{host.rstrip('/')}:{port}"


def select_sglang_backend(args: argparse.Namespace) -> Any:
    """The backend SGLang's ``--backend`` names: ``srt*`` -> ``RuntimeEndpoint(http://host:port)``,
    ``engine`` -> ``EngineBackend(model_path=...)``, ``gpt-*`` -> ``OpenAI(name)``."""
    from frontend_lang.backends import EngineBackend, OpenAI, RuntimeEndpoint

    name = str(args.backend)
    if name.startswith("srt"):
        return RuntimeEndpoint(base_url(args.host, args.port))
    if name == "engine":
        return EngineBackend(model_path=getattr(args, "model_path", None))
    if name.startswith("gpt-"):
        return OpenAI(name)
    raise ValueError(f"Invalid backend: {name} (expected srt, engine or gpt-*)")
