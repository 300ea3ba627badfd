"""Server fixtures (registered with ``pytest_plugins = ["server_fixtures"]`` by the server tests).

``server`` is one server shared by the whole session (started on first use); ``launch_server`` starts
private ones for the tests that break or stop them. Both serve a tiny random-weight Llama.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_harness import ServerProcess

from radixrt.testing.random_checkpoint import make_checkpoint


def _model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny Llama (conftest's ``tiny_llama`` when it exists)."""
    try:
        return Path(request.getfixturevalue("tiny_llama"))
    except (pytest.FixtureLookupError, pytest.fail.Exception):  # absent, or not session-scoped
        out = tmp_path_factory.getbasetemp() / "server_tiny_llama"
        if not (out / "config.json").exists():
            make_checkpoint(out, arch="llama", size="tiny", seed=0)
        return out


@pytest.fixture(scope="session")
def server_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(request, tmp_path_factory)


@pytest.fixture(scope="session")
def server(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server (KV pool of 16k tokens)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(server_model, log, ["--max-total-tokens", "16384"], None, cli=False)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def launch_server(server_model: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start private servers in a test; whatever is still running at teardown is stopped."""
    started: list[ServerProcess] = []

    def start(*extra: str, api_key: str | None = None, cli: bool = False) -> ServerProcess:
        srv = ServerProcess(server_model, tmp_path / f"server{len(started)}.log", list(extra), api_key, cli)
        started.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in started:
        srv.stop()
