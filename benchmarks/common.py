"""Helpers shared by the benchmarks: cached random-weight checkpoints, machine facts, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixrt.testing.random_checkpoint import cache_dir, make_checkpoint

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def bench_checkpoint(
    size: str, arch: str = "llama", seed: int = 0, context: int = 2048, dtype: str = "float32"
) -> Path:
    """A random-weight checkpoint for benchmarks, built once and cached under the radixrt cache dir.

    ``context`` sets ``max_position_embeddings`` (the ReAct prompts of the prefix benchmark need > 2048).

    Built in a temporary directory and renamed into place, so concurrent benchmark runs never see a
    half-written checkpoint.
    """
    suffix = "" if dtype == "float32" else f"-{dtype}"
    path = cache_dir() / "bench" / f"{arch}-{size}-seed{seed}-ctx{context}{suffix}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        make_checkpoint(tmp, arch=arch, size=size, seed=seed, dtype=dtype, max_position_embeddings=context)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def machine_info(threads: int) -> dict[str, Any]:
    """Facts that make a number interpretable later: when, where, with how many threads."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def scrub_paths(text: str) -> str:
    """Replace this machine's absolute paths (repo, home, site-packages) with neutral ones."""
    site = str(Path(torch.__file__).resolve().parent.parent)
    for old, new in (
        (str(REPO_ROOT) + "/", ""),
        (site + "/", "site-packages/"),
        (str(Path.home()), "~"),
    ):
        text = text.replace(old, new)
    return text


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (creating parent folders, no machine paths) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scrub_paths(json.dumps(data, indent=2)) + "\n", encoding="utf-8")
    return path


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table (also readable as plain text)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


# The results page (the method and the commands stay in benchmarks/README.md).
README = REPO_ROOT / "docs" / "benchmarks.md"


def update_readme_section(name: str, markdown: str, readme: Path = README) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` (appended if absent).

    Benchmarks write image links relative to ``benchmarks/`` (``results/x.png``); the results page lives in
    ``docs/``, so those links are rebased onto it.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    markdown = markdown.replace("](results/", "](../benchmarks/results/")
    block = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    readme.write_text(text, encoding="utf-8")
