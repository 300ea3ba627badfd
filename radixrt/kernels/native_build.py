"""What the natively compiled kernels share: the CPU signature their cache keys hold (``-march=native`` builds
differ by CPU), and the atomic build into the on-disk cache (compile into a private temporary file beside
the target, then rename it into place, so concurrent processes never load a half-written library)."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["compile_atomically", "cpu_signature"]


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and flags lines of /proc/cpuinfo (the cache dir may
    be shared between machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = {ln for ln in f if ln.startswith(("model name", "flags"))}
        return "".join(sorted(lines))
    except OSError:
        return platform.processor() or platform.machine()


def compile_atomically(command: Callable[[str], list[str]], target: Path) -> subprocess.CompletedProcess[str]:
    """Run ``command(tmp)`` (a compiler invocation writing the library to ``tmp``) and, when it succeeds,
    rename ``tmp`` to ``target``; returns the finished process (the caller reports a non-zero exit)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(command(tmp), capture_output=True, text=True)
        if proc.returncode == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)  # a concurrent builder's identical file may be replaced; either is fine
        return proc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
