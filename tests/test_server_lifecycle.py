"""Server processes that are locked, broken and stopped: --api-key, a killed worker, SIGINT / SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import ServerProcess, pid_alive, wait_until

pytest_plugins = ["server_fixtures"]

KEY = "sk-test-123"


def test_api_key_then_worker_death_then_sigint(
    server: ServerProcess, launch_server: Callable[..., ServerProcess]
) -> None:
    """Also two servers at once: ``server`` keeps serving on its port while this one lives and dies."""
    srv = launch_server("--max-total-tokens", "8192", api_key=KEY)
    gen = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    # --api-key: everything but /health needs it
    for method, route in [("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/metrics"),
                          ("GET", "/get_server_info"), ("POST", "/flush_cache")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, srv.url + route, json=gen, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (route, r.text)
    assert httpx.get(srv.url + "/health").status_code == 200
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0) as oc:
        assert oc.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as oc:
        with pytest.raises(openai.AuthenticationError):
            oc.models.list()
    # kill the worker in the middle of a streamed request
    worker = srv.info["worker_pid"]
    ipc_dir = Path(srv.info["ipc_dir"])
    assert pid_alive(worker) and ipc_dir.is_dir()
    events: list[str] = []
    with srv.client() as c:
        body = {
            "text": "long",
            "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True},
            "stream": True,
        }
        with c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data:"))
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            events = [ln for ln in lines if ln.startswith("data:")]
        assert time.monotonic() - killed < 5, "the stream did not end soon after the worker died"
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "worker_unavailable" and "exited" in error["message"]
        wait_until(lambda: c.get("/health").status_code == 503, timeout=5)
        for route, payload in [("/generate", gen), ("/v1/completions", {"prompt": "x", "max_tokens": 2})]:
            r = c.post(route, json=payload)
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
        assert c.get("/get_server_info").status_code == 503
        assert c.get("/health_generate").status_code == 503
        assert "radixrt:worker_up" in c.get("/metrics").text
    # the other server is unaffected
    with server.client() as other:
        assert other.post("/generate", json=gen).status_code == 200
    # SIGINT (Ctrl-C) still shuts down cleanly and removes the ipc socket files
    assert srv.stop(signal.SIGINT) == 0, srv.log_tail()
    assert not ipc_dir.exists()


def test_cli_serve_and_sigterm_with_requests_in_flight(launch_server: Callable[..., ServerProcess]) -> None:
    srv = launch_server(
        "--max-total-tokens", "8192", "--served-model-name", "tiny-served", "--log-requests", cli=True
    )
    worker, ipc_dir = srv.info["worker_pid"], Path(srv.info["ipc_dir"])
    assert srv.info["model_info"]["served_model_name"] == "tiny-served"
    assert sorted(p.name for p in ipc_dir.iterdir()) == ["worker_in", "worker_out"]
    log = srv.log.read_text()
    for needle in (
        "LlamaForCausalLM",
        "float32",
        "KV pool 8192 tokens",
        srv.url,
        "warm-up request",
        "ready:",
    ):
        assert needle in log, needle
    # --log-requests: the warm-up request's line, its counts but not its text
    assert re.search(r"request rid=\w+ tenant=- prompt_tokens=\d+ cached_tokens=0 generated_tokens=\d+ ", log)
    assert "capital of France" not in log
    results: list[int] = []

    def busy() -> None:
        body = {"text": "busy", "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
        try:
            results.append(httpx.post(srv.url + "/generate", json=body, timeout=60).status_code)
        except httpx.HTTPError:
            results.append(-1)

    t = threading.Thread(target=busy)
    t.start()
    time.sleep(0.5)
    start = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0, srv.log_tail()
    assert time.monotonic() - start < 20
    t.join(10)
    assert results and not t.is_alive()
    wait_until(lambda: not pid_alive(worker), timeout=5)
    assert not ipc_dir.exists()
    assert "shut down" in srv.log.read_text()
