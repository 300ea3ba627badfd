"""Resolve ``--model-path`` to the HF checkpoint directory the runtime loads.

An HF directory is used as is; a GGUF file (or a directory holding exactly one) is converted once into a
cached HF directory (see `radixrt.models.gguf`); no path means the embedded default model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from radixrt.models import gguf
from radixrt.models.embedded import embedded_gguf_path


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``path``: the HF directory to load; ``name``: the served model name; ``gguf_file``: its source, if any."""

    path: str
    name: str
    gguf_file: str | None


def resolve_model(model_path: str | None, progress: bool = True) -> ResolvedModel:
    """Where the checkpoint of ``model_path`` lives in HF form (converting a GGUF file on first use)."""
    source = embedded_gguf_path() if model_path is None else gguf.find_gguf_file(model_path)
    if source is None:
        assert model_path is not None
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path: {model_path!r} is neither a directory nor a .gguf file")
        return ResolvedModel(model_path, Path(model_path).resolve().name, None)
    converted = gguf.converted_dir(source, progress=progress)
    return ResolvedModel(str(converted), source.stem, str(source))
