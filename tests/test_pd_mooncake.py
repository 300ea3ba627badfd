"""Prefill/decode disaggregation over the real Mooncake transfer engine (its TCP transport) behind the real
sglang-router in PD mode: greedy outputs equal one server's, the KV bytes arrive through the engine (the
control messages carry none), both KV invariants hold at idle. Skips without ``radixrt[pd]``."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pd_harness import PDPair, PDRouter, stats
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="mooncake-transfer-engine is not installed (radixrt[pd])",
    ),
]

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    "Mooncake moves the pages",
    "over its TCP transport " * 10,
    "and the decode server",
    "generates the rest",
]


@pytest.fixture(scope="module")
def pair(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    p = PDPair(server_model, tmp_path_factory.mktemp("pd_mooncake"), "mooncake")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def router(pair: PDPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDRouter]:
    r = PDRouter(pair, tmp_path_factory.mktemp("pd_mooncake_router") / "router.log")
    yield r
    r.stop()


def test_mooncake_outputs_equal_one_server(router: PDRouter, pair: PDPair, server: ServerProcess) -> None:
    before_d, before_p = stats(pair.decode), stats(pair.prefill)

    def run(url: str, text: str, stream: bool = False) -> list[int]:
        r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["output_ids"]
        return ids

    with ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda t: run(router.url, t), PROMPTS))
    assert routed == [run(server.url, t) for t in PROMPTS]
    for side in (pair.prefill, pair.decode):
        with side.client() as c:
            wait_idle(c)
    after_d, after_p = stats(pair.decode), stats(pair.prefill)
    assert after_d["computed_prefill_tokens"] == before_d["computed_prefill_tokens"]
    sent = after_p["pd_sent_bytes"] - before_p["pd_sent_bytes"]
    received = after_d["pd_received_bytes"] - before_d["pd_received_bytes"]
    assert sent == received > 0
    assert after_d["pd_received_transfers"] - before_d["pd_received_transfers"] == len(PROMPTS)
