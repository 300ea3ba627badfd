"""Fuzz the live server from its own OpenAPI document with schemathesis (bounded and deterministic):
no 5xx, responses (errors included) match their declared schemas and content types, 405s name the
allowed methods; afterwards the server is healthy and its KV accounting is intact at idle."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]

MAX_EXAMPLES = 12  # per operation
STATUSES: defaultdict[str, Counter[int]] = defaultdict(Counter)  # operation -> status -> responses
CHECKS = [
    checks.not_a_server_error,
    checks.response_schema_conformance,
    checks.content_type_conformance,
    checks.allow_header_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_server(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("schemathesis") / "server.log"
    # a small context keeps the generations the fuzzer asks for short
    flags = ["--max-total-tokens", "8192", "--context-length", "64", "--grammar-compile-timeout", "2",
             "--disable-compile"]  # fmt: skip
    srv = ServerProcess(server_model, log, flags, None, cli=False)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: ServerProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_api(case: schemathesis.Case) -> None:
    response = case.call(timeout=60)
    STATUSES[f"{case.method} {case.path}"][response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


def test_server_is_healthy_after_the_fuzz(fuzzed_server: ServerProcess) -> None:
    """Runs after test_api (file order): whatever the fuzzer sent, nothing leaked or broke."""
    assert httpx.get(fuzzed_server.url + "/health", timeout=10).status_code == 200
    with fuzzed_server.client() as c:
        info = wait_idle(c, timeout=30)
        assert info["kv_invariant_ok"] == 1.0
        ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    for op in ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        codes = STATUSES[op]  # the generated bodies reached the handlers: some served, some refused
        assert codes[200] > 0 and codes[400] > 0, (op, dict(codes))
    log = fuzzed_server.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
