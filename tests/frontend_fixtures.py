"""Fixtures of the frontend_lang tests (``pytest_plugins = ["frontend_fixtures"]``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend_lang as sgl
from radixrt.testing.random_checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def fl_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the offline BPE tokenizer (ChatML template); conftest's if present."""
    try:
        return Path(request.getfixturevalue("tiny_llama"))
    except pytest.FixtureLookupError:
        out = tmp_path_factory.getbasetemp() / "frontend_tiny_llama"
        if not (out / "config.json").exists():
            make_checkpoint(out, arch="llama", size="tiny", seed=0)
        return out


@pytest.fixture(scope="session")
def fl_backend(fl_model: Path) -> Iterator[sgl.EngineBackend]:
    """One in-process Engine backend for the session (tests that count tokens flush it first)."""
    backend = sgl.EngineBackend(
        model_path=str(fl_model), max_total_tokens=8192, dtype="float32", compile_max_bs=2
    )
    backend.engine.worker.scheduler.check_invariant_each_step = True
    yield backend
    backend.engine.check_invariant()
    backend.shutdown()
