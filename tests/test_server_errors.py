"""Bad requests: every one is a 4xx with an OpenAI-shaped error naming the problem; the server stays healthy."""

from __future__ import annotations

from typing import Any

import pytest
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "m", "prompt": "hi", "max_tokens": 4}
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
LONG_TEXT = "word " * 3000  # well over the 2048-token context

# (route, body (bytes = raw), expected status, a fragment of the message, expected param or None)
CASES: list[tuple[str, Any, int, str, str | None]] = [
    ("/generate", b"{not json", 400, "malformed JSON", None),
    ("/generate", b"", 400, "empty body", None),
    ("/generate", b"[1, 2]", 400, "JSON object", None),
    ("/generate", {**GEN, "sampling_params": {"max_new_tokens": 4, "bogus": 1}}, 400, "unknown", "bogus"),
    ("/generate", {**GEN, "sampling_params": {"temperature": "hot"}}, 400, "temperature", "temperature"),
    ("/generate", {**GEN, "sampling_params": {"top_p": 1.5}}, 400, "top_p", "top_p"),
    ("/generate", {**GEN, "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens", "max_new_tokens"),
    ("/generate", {**GEN, "sampling_params": {"n": True}}, 400, "n", "n"),
    ("/generate", {"sampling_params": {}}, 400, "text", "text"),
    ("/generate", {**GEN, "input_ids": [1, 2]}, 400, "exactly one", "text"),
    ("/generate", {"input_ids": [1, 99999999]}, 400, "vocabulary", "input_ids"),
    ("/generate", {"input_ids": ["a"]}, 400, "input_ids", "input_ids"),
    ("/generate", {"text": LONG_TEXT}, 400, "context length", "text"),
    ("/generate", {**GEN, "sampling_params": {"max_new_tokens": 5000}}, 400, "context length", "max_new_tokens"),
    ("/generate", {**GEN, "unknown_field": 1}, 400, "unrecognized", "unknown_field"),
    ("/generate", {**GEN, "top_logprobs_num": 1000}, 400, "top_logprobs_num", "top_logprobs_num"),
    ("/generate", {**GEN, "text": []}, 400, "empty", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"model": "m"}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role", "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "4"}, 400, "Expected `int | null`", "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 100000}, 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "logprobs", "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "context length", "messages"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": True}, 400, "unrecognized", "frobnicate"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1.0}}, 400, "logit_bias", "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "required field", "tools[0].function"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n", "n"),
    ("/v1/completions", {**COMP, "prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {**COMP, "prompt": [1.5]}, 400, "prompt", "prompt"),
    ("/v1/completions", {**COMP, "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {**COMP, "stop": 7}, 400, "stop", "stop"),
    ("/v1/completions", {**COMP, "min_tokens": 9}, 400, "min_tokens", "min_tokens"),
    ("/v1/completions", {**COMP, "prompt": LONG_TEXT}, 400, "context length", "prompt"),
    ("/v1/models/unknown-model", None, 404, "not found", "model"),
    ("/no/such/route", None, 404, "Not Found", None),
]  # fmt: skip


def _id(case: tuple[str, Any, int, str, str | None]) -> str:
    return f"{case[0]}:{case[3]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_request_is_a_4xx_with_a_message(
    server: ServerProcess, case: tuple[str, Any, int, str, str | None]
) -> None:
    route, body, status, fragment, param = case
    with server.client() as c:
        if body is None:
            r = c.get(route)
        elif isinstance(body, bytes):
            r = c.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(route, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert fragment.lower() in error["message"].lower(), error
        if param is not None:
            assert error["param"] == param, error
        assert error["type"] in ("invalid_request_error", "not_found_error")


def test_server_healthy_after_bad_requests(server: ServerProcess) -> None:
    with server.client() as c:
        for route, body, *_ in CASES:
            if isinstance(body, dict):
                c.post(route, json=body)
        assert c.get("/health").status_code == 200
        ok = c.post("/generate", json=GEN)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
        wait_idle(c)
