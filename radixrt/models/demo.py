"""The embedded demo model, used when no `--model-path` is given.

A small random-weight Qwen2-architecture checkpoint with the real Qwen2 tokenizer (so chat templates and
tokenization are realistic; the text it generates is not). It is built deterministically on first use
under the cache directory and reused afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from radixrt.models import random_checkpoint

# Bump when the recipe below or random_checkpoint.CHECKPOINT_VERSION changes: it names the cached directory.
DEMO_VERSION = "demo-qwen2-tiny-v1"
DEMO_SEED = 20240611


def default_model_path() -> Path:
    """Path of the demo checkpoint, building it (~2 s, ~170 MB fp32) if it is not cached yet.

    Hidden 256, 4 layers, 8 heads, 2 KV heads, tied embeddings: ~42M parameters, of which the 151,680 x
    256 embedding is ~39M. Safe under concurrency: each builder writes a private temporary directory and
    renames it into place; a process that loses the race discards its copy and uses the winner's.
    """
    final = random_checkpoint.cache_dir() / DEMO_VERSION
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{DEMO_VERSION}."))
    try:
        random_checkpoint.make_checkpoint(tmp, arch="qwen2", size="tiny", seed=DEMO_SEED, tokenizer="qwen")
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700 (and safetensors files come out 0600)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.rename(tmp, final)  # atomic; fails if another process already put a directory there
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
