"""Hugging Face Hub model ids for ``--model-path``: ``org/name``, ``org/name:QUANT`` and ``org/name/file.gguf``.

`huggingface_hub` does the fetching and caching (``snapshot_download``): online it downloads what is missing
into its cache (``$HF_HOME/hub``, ``$HF_HUB_CACHE``); with ``HF_HUB_OFFLINE=1``, or when the Hub cannot be
reached, it serves the cached snapshot of the revision. A GGUF file inside a repository is chosen the way vLLM
names it, ``org/name:Q4_K_M`` (the repository's one ``.gguf`` whose name carries that quantization type), or
by its file name, ``org/name/model-Q4_K_M.gguf``. Only the files the runtime reads are fetched: config,
tokenizer and safetensors of an HF repository; the one chosen file of a GGUF repository.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?::(?P<quant>[A-Za-z0-9_.-]+)|/(?P<file>[^:]+\.gguf))?$")
# What an HF checkpoint directory needs (radixrt.models.loader, radixrt.models.tokenizer).
HF_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")


@dataclass(frozen=True, slots=True)
class HubModel:
    """A parsed model id: ``repo`` (``org/name``), and a GGUF ``quant`` type or ``file`` name inside it."""

    repo: str
    quant: str | None = None
    file: str | None = None


def parse_hub_id(model_path: str) -> HubModel | None:
    """The hub id ``model_path`` spells, or None when it is not one (``./x``, ``/abs``, ``a/b/c``...)."""
    m = _HUB_ID.match(model_path)
    if m is None or model_path.startswith((".", "/", "~")):
        return None
    return HubModel(m["repo"], m["quant"], m["file"])


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """The local snapshot directory of ``repo`` at ``revision`` holding ``patterns`` (downloaded when online)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"model_path: {repo!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        mode = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {mode}: download it "
            f"once online (`hf download {repo}`), or pass a local directory ({exc.__class__.__name__})"
        ) from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"{where}: the Hub has no such revision") from exc
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(f"{where}: no such repository on the Hub (or it is gated/private)") from exc


def _quant_matches(name: str, quant: str) -> bool:
    """Whether GGUF file ``name`` carries quantization type ``quant`` as a whole word (Q4_K does not match
    Q4_K_M), case-insensitively."""
    stem = name.removesuffix(".gguf").lower()
    return re.search(rf"(^|[-.]){re.escape(quant.lower())}($|[-.])", stem) is not None


def resolve_hub(model: HubModel, revision: str | None) -> Path:
    """The local path of ``model``: an HF checkpoint directory, or the GGUF file it names.

    Raises FileNotFoundError naming what is missing (repository, revision, cached snapshot, the GGUF file
    of a quantization type) and ValueError when the choice is ambiguous.
    """
    if model.file is not None:
        path = _snapshot(model.repo, revision, [model.file]) / model.file
        if not path.is_file():
            raise FileNotFoundError(f"model_path: repository {model.repo!r} has no file {model.file!r}")
        return path
    if model.quant is not None:
        quant = model.quant
        patterns = [f"*{q}*.gguf" for q in {quant, quant.upper(), quant.lower()}]
        snap = _snapshot(model.repo, revision, patterns)
        files = sorted(p for p in snap.rglob("*.gguf") if _quant_matches(p.name, quant))
        if not files:
            present = ", ".join(sorted(p.name for p in snap.rglob("*.gguf"))) or "none"
            raise FileNotFoundError(
                f"model_path: repository {model.repo!r} has no GGUF file of quantization type {quant!r} "
                f"(GGUF files here: {present})"
            )
        if len(files) > 1:
            names = ", ".join(p.name for p in files)
            raise ValueError(
                f"model_path: {quant!r} matches several GGUF files in {model.repo!r} ({names}); "
                f"name one as {model.repo}/<file>.gguf (split GGUF files are not supported)"
            )
        return files[0]
    snap = _snapshot(model.repo, revision, list(HF_PATTERNS))
    if (snap / "config.json").is_file():
        return snap
    raise FileNotFoundError(
        f"model_path: repository {model.repo!r} has no config.json (not an HF checkpoint); for a GGUF "
        f"repository name the file's quantization type, e.g. {model.repo}:Q4_K_M"
    )
