"""radixrt's on-disk cache of generated artifacts (converted checkpoints, tokenizers, compiled code).

Everything under it can be deleted at any time; it is rebuilt on next use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """Where radixrt caches generated artifacts: `$RADIXRT_CACHE_DIR`, else `~/.cache/radixrt`."""
    env = os.environ.get("RADIXRT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixrt"


def build_dir_once(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """Return ``final``, building it with ``build(tmp_dir)`` first if ``final / marker`` is missing.

    Safe under concurrency: each builder writes a private temporary directory beside ``final`` and renames
    it into place (atomic); a process that loses the race discards its copy and uses the winner's. The
    files come out world-readable (mkdtemp makes 0700 directories, safetensors writes 0600 files).
    """
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.rename(tmp, final)  # fails if another process already put a directory there
        except OSError:
            if not (final / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
