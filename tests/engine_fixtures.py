"""Engine fixtures shared by the test modules (registered in conftest via pytest_plugins)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from radixrt import Engine


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 8000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def record_token_counts(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name(ids, positions, md)`` so the test sees the token count (``ids.shape[0]``) of every call."""
    seen: list[int] = []
    inner = getattr(obj, name)

    def spy(ids: Any, positions: Any, md: Any) -> Any:
        seen.append(int(ids.shape[0]))
        return inner(ids, positions, md)

    setattr(obj, name, spy)
    return seen


def make_engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("dtype", "float32")  # the HF-parity oracles are exact in fp32 (auto picks bf16 here)
    kw.setdefault("disable_compile", True)  # eager is the reference; tests/test_compile.py covers compile
    eng = Engine(model_path=str(path), **kw)
    eng.worker.scheduler.check_invariant_each_step = True
    return eng


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """Build engines in a test; at teardown assert the accounting invariant at idle and shut down."""
    engines: list[Engine] = []

    def build(path: Path, **kw: Any) -> Engine:
        eng = make_engine(path, **kw)
        engines.append(eng)
        return eng

    yield build
    for eng in engines:
        eng.check_invariant()
        eng.shutdown()
