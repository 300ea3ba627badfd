"""Natively built torch operator libraries (C++ against torch's headers, registered with ``TORCH_LIBRARY``):
the int4 GEMMs (`radixrt.kernels.int4_gemm`) and the compiled decode step's attention op
(`radixrt.kernels.decode_op`). Registered operators, not ctypes calls, so compiled graphs call them without
Python.

Each library is compiled on first use with g++ (~10-20 s, with a log line) into
``radixrt.config.cache_dir.cache_dir() / "kernels"``, keyed by its source and headers, the compiler, the flags,
torch's version and the CPU, and reused by later starts.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from radixrt.config.cache_dir import cache_dir
from radixrt.kernels.native_build import compile_atomically, cpu_signature

logger = logging.getLogger(__name__)

__all__ = ["COMPILER", "FLAGS", "TorchOpLibrary"]

COMPILER = "g++"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20")


class TorchOpLibrary:
    """One natively built operator library: its source (and the headers it includes), the CPU flags it needs,
    what to run once it is loaded (register fake kernels, configure), and its load state."""

    def __init__(
        self,
        source: Path,
        cpu_flags: tuple[str, ...],
        what: str,
        on_load: Callable[[], None],
        headers: tuple[Path, ...] = (),
    ) -> None:
        self.source = source
        self.headers = headers
        self.cpu_flags = cpu_flags
        self.what = what
        self.on_load = on_load
        self.lock = threading.Lock()
        self.state: dict[str, str | bool] = {}

    def path(self, cc: str) -> Path:
        """Where the library for this source, compiler, flags, torch and CPU lives in the cache."""
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256()
        for part in (
            self.source.read_text(),
            *(h.read_text() for h in self.headers),
            version,
            " ".join(FLAGS),
            torch.__version__,
            platform.machine(),
            cpu_signature(),
        ):
            key.update(part.encode())
            key.update(b"\0")
        return cache_dir() / "kernels" / f"{self.source.stem}-{key.hexdigest()[:20]}.so"

    def build(self, cc: str, target: Path) -> None:
        """Compile the library into ``target``; RuntimeError with the compiler's output when it fails."""
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        src = str(self.source)
        proc = compile_atomically(lambda tmp: [cc, *FLAGS, abi, *includes, src, "-o", tmp, *libs], target)
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling {self.source.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )

    def load(self) -> None:
        """Build (if not cached) and load the library once; records the reason when it cannot run."""
        if "loaded" in self.state or "error" in self.state:
            return
        with self.lock:
            if "loaded" in self.state or "error" in self.state:
                return
            flags = cpu_signature().split()
            missing = [f for f in self.cpu_flags if f not in flags]
            if missing:
                self.state["error"] = f"the CPU has no {' / '.join(missing)}"
                return
            cc = shutil.which(COMPILER)
            if cc is None:
                self.state["error"] = f"{COMPILER} is not on PATH"
                return
            try:
                path = self.path(cc)
                if not path.is_file():
                    logger.info("compiling radixrt's %s (first use here, ~20 s) into %s", self.what, path)
                    t0 = time.perf_counter()
                    self.build(cc, path)
                    logger.info("compiled the %s in %.1f s", self.what, time.perf_counter() - t0)
                torch.ops.load_library(str(path))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                self.state["error"] = f"building or loading {self.source.name} failed: {exc}"
                return
            self.state["loaded"] = True
            self.on_load()

    def reason(self) -> str | None:
        """Why the library cannot run here (building it on the first call), or None when it can."""
        self.load()
        err = self.state.get("error")
        return None if err is None else str(err)
