"""A server of a prefill/decode pair dies (SIGKILL) behind the real sglang-router: requests end with an error
within bounded time (nothing hangs) and the surviving server's KV invariant holds at idle, no slot leaked.
Each test starts its own pair (it kills one of them)."""

from __future__ import annotations

import importlib.util
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pd_harness import PD_TIMEOUT_S, PDPair, PDRouter
from server_harness import wait_idle

pytest_plugins = ["server_fixtures"]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)

BOUND_S = 60.0  # a request to a broken pair ends within this (timeouts are PD_TIMEOUT_S)


@pytest.fixture
def routed_pair(server_model: Path, tmp_path: Path) -> Iterator[tuple[PDPair, PDRouter]]:
    pair = PDPair(server_model, tmp_path, "fake")
    router = PDRouter(pair, tmp_path / "router.log")
    yield pair, router
    router.stop()
    pair.stop()


def ok_request(url: str) -> None:
    body = {"text": "warm the route", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_decode_dies_mid_stream(routed_pair: tuple[PDPair, PDRouter]) -> None:
    pair, router = routed_pair
    ok_request(router.url)
    body = {"text": "a long answer", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    t0 = time.monotonic()
    got_first = False
    with pytest.raises((httpx.HTTPError, AssertionError)):  # noqa: PT012 (the failure comes mid-stream)
        with httpx.stream("POST", router.url + "/generate", json=body, timeout=BOUND_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not got_first:
                    got_first = True
                    pair.decode.stop(signal.SIGKILL)
                assert '"error"' not in line, line
            raise AssertionError("the stream ended normally although its decode server died")
    assert got_first and time.monotonic() - t0 < BOUND_S
    # A new request: the router cannot reach the decode server; the prefill side gives up on it.
    r = httpx.post(
        router.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
        timeout=BOUND_S,
    )
    assert r.status_code >= 500, r.text
    time.sleep(PD_TIMEOUT_S)
    with pair.prefill.client() as c:
        wait_idle(c, timeout=PD_TIMEOUT_S * 3)


def test_prefill_dies(routed_pair: tuple[PDPair, PDRouter]) -> None:
    pair, router = routed_pair
    ok_request(router.url)  # the decode side knows the prefill worker's address now
    pair.prefill.stop(signal.SIGKILL)
    t0 = time.monotonic()
    r = httpx.post(
        router.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
        timeout=BOUND_S,
    )
    assert r.status_code >= 500, r.text
    assert time.monotonic() - t0 < BOUND_S
    # Straight to the decode server, as the router would have sent it: 503/504, its reserved slots freed.
    body = {"text": "y", "sampling_params": {"max_new_tokens": 2}, **pair.boot(room=11)}
    r = httpx.post(pair.decode.url + "/generate", json=body, timeout=BOUND_S)
    assert r.status_code in (503, 504), r.text
    with pair.decode.client() as c:
        wait_idle(c, timeout=PD_TIMEOUT_S * 3)
