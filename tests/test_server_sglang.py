"""SGLang frontend compatibility: the exact HTTP requests ``sglang.RuntimeEndpoint`` (0.5.x) makes for
gen / select / fork, replayed with httpx; and, when sglang is installed, a real SGLang program."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]

# what RuntimeEndpoint.generate sends: SglSamplingParams.to_srt_kwargs() defaults plus two flags
FRONTEND_PARAMS: dict[str, Any] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
    "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "ignore_eos": False, "regex": None, "json_schema": None,
}  # fmt: skip


def post(c: httpx.Client, body: dict[str, Any]) -> Any:
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_frontend_http_requests(server: ServerProcess) -> None:
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert isinstance(info["model_path"], str)
        assert c.get("/server_info").status_code == 200
        prefix = "Question: which cache holds prefixes?\nAnswer:"
        # gen (non-stream, then stream: the frontend slices data["text"][pos:])
        out = post(c, {"text": prefix, "sampling_params": {**FRONTEND_PARAMS, "stop": ["\n"]}})
        assert isinstance(out["text"], str) and out["meta_info"]["prompt_tokens"] > 0
        pieces, pos = [], 0
        with c.stream("POST", "/generate", json={"text": prefix, "sampling_params": FRONTEND_PARAMS,
                                                 "stream": True}) as r:  # fmt: skip
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break
                if line.startswith("data:"):
                    data = json.loads(line[5:].strip("\n"))
                    pieces.append(data["text"][pos:])
                    pos += len(pieces[-1])
        full = post(c, {"text": prefix, "sampling_params": FRONTEND_PARAMS})
        assert "".join(pieces) == full["text"]
        # fork: commit the shared prefix (max_new_tokens 0), then each branch hits it
        post(c, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        branches = [
            post(c, {"text": prefix + f" branch {i}", "sampling_params": FRONTEND_PARAMS}) for i in range(2)
        ]
        assert all(
            b["meta_info"]["cached_tokens"] >= full["meta_info"]["prompt_tokens"] - 2 for b in branches
        )
        # select: cache the prefix, score every choice's prompt logprobs from prompt_len - 2
        choices = [" the radix tree", " a hash map", " nothing"]
        first = post(c, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        start = max(first["meta_info"]["prompt_tokens"] - 2, 0)
        scored = post(c, {"text": [prefix + ch for ch in choices],
                          "sampling_params": {"max_new_tokens": 0, "temperature": 0}, "return_logprob": True,
                          "return_text_in_logprobs": True, "logprob_start_len": start})  # fmt: skip
        assert len(scored) == len(choices)
        for res in scored:
            lps = res["meta_info"]["input_token_logprobs"]
            assert len(lps) == res["meta_info"]["prompt_tokens"] - start
            assert all(isinstance(e[0], float) and isinstance(e[2], str) for e in lps)
            assert res["meta_info"]["output_token_logprobs"] == []
        # unconditional logprobs (choices_method "unconditional_likelihood_normalized")
        ids = [[e[1] for e in res["meta_info"]["input_token_logprobs"]] for res in scored]
        uncond = post(c, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
        assert [len(u["meta_info"]["input_token_logprobs"]) for u in uncond] == [1] * len(ids)
        wait_idle(c)
        assert c.post("/flush_cache").status_code == 200


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_sglang_program(server: ServerProcess) -> None:
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(server.url)

    @sgl.function
    def qa(s: Any, question: str) -> None:
        s += "Question: " + question + "\n"
        s += "Answer:" + sgl.gen("answer", max_tokens=10, temperature=0, stop="\n")
        s += "\nVerdict:" + sgl.select("verdict", choices=["yes", "no", "maybe"])

    @sgl.function
    def fork(s: Any, topic: str) -> None:
        s += "Two ideas about " + topic + ".\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=6, temperature=0)
        s += "Best:" + forks[0]["idea"] + forks[1]["idea"] + sgl.gen("best", max_tokens=4, temperature=0)

    state = qa.run(question="What is a radix tree?", backend=backend)
    assert isinstance(state["answer"], str) and state["verdict"] in ("yes", "no", "maybe")
    assert state.get_meta_info("answer")["completion_tokens"] <= 10
    assert isinstance(fork.run(topic="caching", backend=backend)["best"], str)
    states = qa.run_batch([{"question": f"question {i}?"} for i in range(4)], backend=backend, num_threads=4)
    assert all(s["verdict"] in ("yes", "no", "maybe") for s in states)
    streamed = qa.run(question="What is a radix tree?", backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == state["answer"]
    streamed.sync()  # the rest of the program (the select) runs on after the streamed variable
    with server.client() as c:
        wait_idle(c)
