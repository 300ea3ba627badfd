"""Prefill/decode disaggregation behind the real sglang-router (0.3.2) in PD mode: greedy outputs equal one
server's (concurrent, streamed, constrained, multi-turn), the decode server computes no prompt token the
prefill server sent, faults end in 503/504 without a hang, and both KV invariants hold at idle.

The ``fake`` transfer backend carries the KV bytes in the control messages (test_pd_mooncake.py runs the
same flow over Mooncake's TCP transport)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_harness import PD_TIMEOUT_S, PDPair, PDRouter, stats
from server_harness import ServerProcess, free_port, wait_idle

pytest_plugins = ["server_fixtures"]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    "The radix tree keeps every prefix it has computed",
    "Prefill and decode run on different servers",
    "A long prompt " * 12,
    "Eviction frees the least recently used leaves first",
]


@pytest.fixture(scope="module")
def pair(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    p = PDPair(server_model, tmp_path_factory.mktemp("pd"), "fake")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def router(pair: PDPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDRouter]:
    r = PDRouter(pair, tmp_path_factory.mktemp("pd_router") / "router.log")
    yield r
    r.stop()


def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def check_idle(pair: PDPair) -> None:
    for side in (pair.prefill, pair.decode):
        with side.client() as c:
            wait_idle(c)


def test_generate_equals_one_server(router: PDRouter, pair: PDPair, server: ServerProcess) -> None:
    """Concurrent requests through the router answer what one server answers; the decode server computes
    no prompt token: every prompt token it holds came from the prefill server or its own cache."""
    before = stats(pair.decode)
    with ThreadPoolExecutor(4) as pool:
        routed = list(
            pool.map(lambda t: generate(router.url, {"text": t, "sampling_params": GREEDY}), PROMPTS)
        )
    for text, out in zip(PROMPTS, routed, strict=True):
        ref = generate(server.url, {"text": text, "sampling_params": GREEDY})
        assert out["output_ids"] == ref["output_ids"], text
        assert out["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
    check_idle(pair)
    after = stats(pair.decode)
    assert after["computed_prefill_tokens"] == before["computed_prefill_tokens"]
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in routed)
    received = after["pd_received_tokens"] - before["pd_received_tokens"]
    local = after["pd_local_prefix_tokens"] - before["pd_local_prefix_tokens"]
    assert received + local == prompt_tokens and received > 0
    assert after["pd_received_transfers"] - before["pd_received_transfers"] == len(PROMPTS)


def test_logprobs_equal_one_server(router: PDRouter, pair: PDPair, server: ServerProcess) -> None:
    """The first token's logprob comes from the prefill server, the rest from the decode server."""
    body = {"text": PROMPTS[0] + " twice", "sampling_params": GREEDY, "return_logprob": True}
    out, ref = generate(router.url, body), generate(server.url, body)
    got, want = out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == [t[1] for t in want] == out["output_ids"]
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(got, want, strict=True))
    check_idle(pair)


def test_stream_equals_one_server(router: PDRouter, pair: PDPair, server: ServerProcess) -> None:
    body = {"text": PROMPTS[1] + " again", "sampling_params": GREEDY, "stream": True}
    chunks = []
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 2  # the first token, then the rest as the decode server makes them
    ref = generate(server.url, {**body, "stream": False})
    assert chunks[-1]["output_ids"] == ref["output_ids"]
    check_idle(pair)


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_multi_turn_chat_reuses_the_decode_cache(
    router: PDRouter, pair: PDPair, server: ServerProcess
) -> None:
    """Turn 2 repeats turn 1's conversation: equal outputs, and the decode server's own RadixCache holds
    that prefix, so only the new tokens are transferred."""
    messages = [
        {"role": "system", "content": "You explain radix trees. " * 4},
        {"role": "user", "content": "Hi"},
    ]
    for turn in range(2):
        before = stats(pair.decode)
        routed = chat(router.url, messages)
        ref = chat(server.url, messages)
        answer = routed["choices"][0]["message"]["content"]
        assert answer == ref["choices"][0]["message"]["content"]
        check_idle(pair)
        after = stats(pair.decode)
        received = after["pd_received_tokens"] - before["pd_received_tokens"]
        local = after["pd_local_prefix_tokens"] - before["pd_local_prefix_tokens"]
        assert received + local == routed["usage"]["prompt_tokens"]
        if turn == 1:
            assert local > received, (local, received)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


def test_constrained_equals_one_server(router: PDRouter, pair: PDPair, server: ServerProcess) -> None:
    """The prefill server samples the first token under the grammar, the decode server's grammar accepts it."""
    params = {"max_new_tokens": 12, "temperature": 0, "regex": "(yes|no), [0-9]{2,4}"}
    body = {"text": "Answer:", "sampling_params": params}
    out = generate(router.url, body)
    assert out["text"] == generate(server.url, body)["text"]
    assert out["text"].startswith(("yes, ", "no, "))
    check_idle(pair)


def test_decode_times_out_without_its_prefill(pair: PDPair) -> None:
    """A room the prefill server never gets: the decode side answers 503/504 within the timeout, slots freed."""
    body = {"text": PROMPTS[0], "sampling_params": GREEDY, **pair.boot(room=7)}
    r = httpx.post(pair.decode.url + "/generate", json=body, timeout=PD_TIMEOUT_S * 5)
    assert r.status_code in (503, 504), r.text
    assert "bootstrap_room 7" in r.text or "did not arrive" in r.text
    check_idle(pair)


def test_prefill_times_out_without_its_decode(pair: PDPair) -> None:
    """No decode server asks for the KV: the prefill side ends the request with 504, its KV cached, not leaked."""
    body = {"text": PROMPTS[2], "sampling_params": GREEDY, **pair.boot(room=8)}
    r = httpx.post(pair.prefill.url + "/generate", json=body, timeout=PD_TIMEOUT_S * 5)
    assert r.status_code == 504, r.text
    assert "decode server did not ask" in r.text
    check_idle(pair)


def test_unreachable_bootstrap_is_503(pair: PDPair) -> None:
    body = {"text": PROMPTS[0], "sampling_params": GREEDY, **pair.boot(room=9)}
    body["bootstrap_port"] = free_port()
    r = httpx.post(pair.decode.url + "/generate", json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert "bootstrap server" in r.text
    check_idle(pair)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("bootstrap_room", -1, "bootstrap_room"),
        ("bootstrap_port", "x", "bootstrap_port"),
        ("bootstrap_host", 3, "bootstrap_host"),
    ],
)
def test_bad_bootstrap_fields_are_400(pair: PDPair, field: str, value: Any, needle: str) -> None:
    body = {"text": "x", "sampling_params": GREEDY, **pair.boot(room=10), field: value}
    r = httpx.post(pair.decode.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_normal_server_refuses_a_room(server: ServerProcess) -> None:
    body = {
        "text": "x",
        "sampling_params": GREEDY,
        "bootstrap_host": "h",
        "bootstrap_port": 1,
        "bootstrap_room": 3,
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "--disaggregation-mode null" in r.text, r.text
    neutral = {"text": "x", "sampling_params": GREEDY, "bootstrap_room": None, "bootstrap_host": None}
    assert httpx.post(server.url + "/generate", json=neutral, timeout=30).status_code == 200
