"""frontend_lang against a launched server: RuntimeEndpoint (native /generate), OpenAI (/v1), Runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from frontend_util import (
    CHOICES,
    QUESTION,
    check_fork_cache,
    check_run_batch_cache,
    check_select_cache,
    check_stop_strings,
    cont,
    pick,
)
from server_harness import ServerProcess

import frontend_lang as sgl

pytest_plugins = ["server_fixtures"]


@pytest.fixture(scope="module")
def endpoint(server: ServerProcess) -> Iterator[sgl.RuntimeEndpoint]:
    ep = sgl.RuntimeEndpoint(server.url, api_key=server.api_key)
    assert ep.tokenizer is not None  # a local server: its tokenizer directory is readable here
    yield ep
    ep.shutdown()


def _direct_means(server: ServerProcess, ep: sgl.RuntimeEndpoint) -> list[float]:
    """Oracle: each choice's mean token logprob from its own /generate request."""
    prefix = ep.tokenizer.encode(QUESTION)
    means = []
    with server.client() as c:
        for choice in CHOICES:
            ids = ep.tokenizer.encode(QUESTION + choice)
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                    "logprob_start_len": len(prefix)}  # fmt: skip
            row = [e[0] for e in c.post("/generate", json=body).json()["meta_info"]["input_token_logprobs"]]
            means.append(sum(row) / len(row))
    return means


def test_select_matches_direct_logprobs_over_http(
    server: ServerProcess, endpoint: sgl.RuntimeEndpoint
) -> None:
    means = _direct_means(server, endpoint)
    s = pick.run(method="token_length_normalized", backend=endpoint)
    assert s.error() is None
    assert s["c"] == CHOICES[max(range(len(CHOICES)), key=lambda i: means[i])]
    assert s.get_meta_info("c")["scores"] == pytest.approx(means, abs=1e-4)
    # without a local tokenizer the prefix is committed first and its token count is the boundary
    remote = sgl.RuntimeEndpoint(server.url, api_key=server.api_key, load_tokenizer=False)
    for method in (
        "token_length_normalized",
        "greedy_token_selection",
        "unconditional_likelihood_normalized",
    ):
        a, b = pick.run(method=method, backend=remote), pick.run(method=method, backend=endpoint)
        assert a.error() is None and a["c"] == b["c"]
        assert a.get_meta_info("c")["scores"] == pytest.approx(b.get_meta_info("c")["scores"], abs=1e-4)
    remote.shutdown()


def test_gen_stop_stream_and_errors_over_http(endpoint: sgl.RuntimeEndpoint) -> None:
    check_stop_strings(endpoint)
    s = cont.run(stops=None, stream=True, backend=endpoint)
    chunks = list(s.text_iter("x"))
    assert len(chunks) > 1 and "".join(chunks) == s["x"] == cont.run(stops=None, backend=endpoint)["x"]

    @sgl.function
    def bad(s: Any) -> None:
        s += "Hi" + sgl.gen("x", top_p=7.0)

    err = bad.run(backend=endpoint).error()
    assert isinstance(err, sgl.BackendError) and "400" in str(err) and "top_p" in str(err)


def test_cache_counts_over_http(endpoint: sgl.RuntimeEndpoint) -> None:
    check_select_cache(endpoint)
    check_fork_cache(endpoint)
    check_run_batch_cache(endpoint)


@sgl.function
def chat_turn(s: Any, question: str) -> None:
    s += sgl.system("You answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


def test_openai_backend(server: ServerProcess, endpoint: sgl.RuntimeEndpoint) -> None:
    model = endpoint.model_info["served_model_name"]
    base = server.url + "/v1"
    chat = sgl.OpenAI(model, base_url=base, api_key=server.api_key or "none")
    # the server renders the same ChatML messages, so greedy text equals the native path's
    s = chat_turn.run(question="What is a trie?", backend=chat)
    ref = chat_turn.run(question="What is a trie?", backend=endpoint)
    assert s.error() is None and s["answer"] == ref["answer"] and s.messages() == ref.messages()
    assert s.get_meta_info("answer")["completion_tokens"] == ref.get_meta_info("answer")["completion_tokens"]
    streamed = chat_turn.run(question="What is a trie?", backend=chat, stream=True)
    assert "".join(streamed.text_iter("answer")) == ref["answer"]
    # chat completions give no prompt logprobs: a clear error
    err = pick.run(method="token_length_normalized", backend=chat).error()
    assert isinstance(err, NotImplementedError) and "logprobs" in str(err)
    # a completion model scores choices with echo + logprobs
    completion = sgl.OpenAI(model, base_url=base, api_key=server.api_key or "none", is_chat_model=False)
    for method in ("token_length_normalized", "unconditional_likelihood_normalized"):
        a, b = pick.run(method=method, backend=completion), pick.run(method=method, backend=endpoint)
        assert a.error() is None and a["c"] == b["c"]
        assert a.get_meta_info("c")["scores"] == pytest.approx(b.get_meta_info("c")["scores"], abs=1e-4)
    assert cont.run(stops=None, backend=completion)["x"] == cont.run(stops=None, backend=endpoint)["x"]


def test_runtime_launches_and_stops_a_server(server_model: Path, tmp_path: Path) -> None:
    runtime = sgl.Runtime(
        model_path=str(server_model), max_total_tokens=2048, dtype="float32", log_file=tmp_path / "rt.log"
    )
    try:
        sgl.set_default_backend(runtime)
        s = cont.run(stops=["\n"])
        assert s.error() is None and s.text().startswith(QUESTION)
        assert sgl.get_server_info()["num_requests"] >= 1 and sgl.flush_cache()
    finally:
        sgl.set_default_backend(None)
        runtime.shutdown()
    assert runtime.process.returncode is not None
