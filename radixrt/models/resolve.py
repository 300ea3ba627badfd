"""Resolve ``--model-path`` to the HF checkpoint directory the runtime loads.

In order: an existing local path (an HF directory as is; a GGUF file, or a directory holding exactly one,
converted once into a cached HF directory, see `radixrt.models.gguf`); the short name of an embedded model
(`radixrt.models.embedded`: ``smollm2``, ``gemma3-270m``); a Hugging Face Hub id (`radixrt.models.hub`:
``org/name``, ``org/name:Q4_K_M``, ``org/name/file.gguf``; ``revision`` picks a branch, tag or commit). No path
means the embedded default model (SmolLM2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from radixrt.models import gguf
from radixrt.models.embedded import EMBEDDED_MODELS, embedded_gguf_path
from radixrt.models.hub import parse_hub_id, resolve_hub


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``path``: the HF directory to load; ``name``: the served model name; ``gguf_file``: its source, if any."""

    path: str
    name: str
    gguf_file: str | None


def resolve_model(
    model_path: str | None, progress: bool = True, revision: str | None = None
) -> ResolvedModel:
    """Where the checkpoint of ``model_path`` lives in HF form (converting a GGUF file on first use)."""
    if model_path is None:
        return _from_gguf(embedded_gguf_path(), None, progress)
    local = Path(model_path).expanduser()
    if local.exists():
        if revision is not None:
            raise ValueError(f"revision: {revision!r} applies to Hub ids, but {model_path!r} is a local path")
        source = gguf.find_gguf_file(local)
        if source is not None:
            return _from_gguf(source, None, progress)
        if not local.is_dir():
            raise FileNotFoundError(f"model_path: {model_path!r} is neither a directory nor a .gguf file")
        return ResolvedModel(str(local), local.resolve().name, None)
    if model_path in EMBEDDED_MODELS:
        return _from_gguf(EMBEDDED_MODELS[model_path](), model_path, progress)
    hub = parse_hub_id(model_path)
    if hub is None:
        raise FileNotFoundError(
            f"model_path: {model_path!r} is not a local directory or .gguf file, not an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}), and not a Hugging Face id (org/name, org/name:QUANT, "
            "org/name/file.gguf)"
        )
    path = resolve_hub(hub, revision)
    if path.suffix == ".gguf":
        return _from_gguf(path, model_path, progress)
    return ResolvedModel(str(path), model_path, None)


def _from_gguf(source: Path, name: str | None, progress: bool) -> ResolvedModel:
    converted = gguf.converted_dir(source, progress=progress)
    return ResolvedModel(str(converted), name or source.stem, str(source))
