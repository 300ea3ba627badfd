"""Shared fixtures: small random-weight checkpoints (built once per session, in seconds).

Every checkpoint comes from `make_checkpoint`, so HF transformers can load it as the oracle. Load their
tokenizers only through `tokenizer_for` (i.e. `radixrt.models.tokenizer.load_tokenizer`) so ids agree with the
runtime's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from radixrt.kernels.torch_native import EXTEND_KERNEL_ENV
from radixrt.models.tokenizer import load_tokenizer
from radixrt.testing.random_checkpoint import make_checkpoint

# The engine tests exercise the C extend kernel on every CPU (by default only AVX-512 CPUs run it; the
# reference path it would otherwise take has tests of its own): servers the tests start inherit this.
os.environ.setdefault(EXTEND_KERNEL_ENV, "c")

# Engine fixtures (engine_factory, ...) live in their own module; registering them here makes them global.
pytest_plugins = ["tests.engine_fixtures"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the natively compiled kernels before any test starts a server. A cold build of all of them takes
    ~1 minute on a 2-core AVX2 machine, which would otherwise fall inside the first server's start timeout;
    servers and engines then load them from the cache. A kernel that cannot build here is skipped (its users
    fall back and log why, and the kernels' own tests report it)."""
    from radixrt.kernels import cpu_decode, decode_op, int4_gemm

    t0 = time.perf_counter()
    print("radixrt's native kernels: loading, or building on first use (~1 min)", file=sys.stderr, flush=True)
    cpu_decode.available()
    decode_op.available()
    for dtype in (torch.bfloat16, torch.float32):
        int4_gemm.available(dtype)
    print(f"radixrt's native kernels: ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run under 1, 2 and 3 torch threads (3 > cores here: the C kernels share their work unevenly, and a long
    request is cut into three pieces)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@cache
def _load_tokenizer_cached(path: str) -> PreTrainedTokenizerFast:
    return load_tokenizer(path)


def tokenizer_for(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of a checkpoint directory, loaded once per session (the runtime's way)."""
    return _load_tokenizer_cached(str(Path(path).resolve()))


@pytest.fixture(name="tokenizer_for", scope="session")
def tokenizer_for_fixture() -> Callable[[str | Path], PreTrainedTokenizerFast]:
    """`tokenizer_for(path)` as a fixture, for tests that prefer not to import from conftest."""
    return tokenizer_for


@pytest.fixture(scope="session")
def checkpoints_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoints_dir: Path) -> Path:
    """Llama, untied lm_head, Llama-3 rope scaling (original context 64, so it matters at test lengths)."""
    return make_checkpoint(checkpoints_dir / "tiny_llama", arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_mistral(checkpoints_dir: Path) -> Path:
    """Mistral without sliding window."""
    return make_checkpoint(checkpoints_dir / "tiny_mistral", arch="mistral", size="tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(checkpoints_dir: Path) -> Path:
    """Qwen2: q/k/v biases, tied embeddings."""
    return make_checkpoint(checkpoints_dir / "tiny_qwen2", arch="qwen2", size="tiny", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3(checkpoints_dir: Path) -> Path:
    """Qwen3: q/k RMSNorm, head_dim 48 != hidden / heads (32)."""
    return make_checkpoint(checkpoints_dir / "tiny_qwen3", arch="qwen3", size="tiny", seed=3)
