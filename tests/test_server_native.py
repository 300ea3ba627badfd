"""The SGLang-native HTTP API of a real server process: /generate, admin routes, /metrics, disconnects."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_idle

from radixrt import Engine

pytest_plugins = ["server_fixtures"]

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def sse_payloads(lines: list[str]) -> list[Any]:
    """The JSON payloads of ``data:`` lines, checking the stream ends with ``data: [DONE]``."""
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_generate_matches_in_process_engine(server: ServerProcess, server_model: Path) -> None:
    """Oracle: the HTTP + ZMQ path gives exactly the tokens of the in-process Engine (greedy, fp32)."""
    prompts = [random_ids(n, seed) for seed, n in enumerate([5, 17, 40])]
    with server.client() as c:
        single = [
            c.post("/generate", json={"input_ids": p, "sampling_params": GREEDY}).json() for p in prompts
        ]
        batch = c.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY}).json()
    with Engine(model_path=str(server_model), max_total_tokens=4096, dtype="float32") as eng:
        ref = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in single] == [r["output_ids"] for r in ref]
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in ref]
    assert [r["text"] for r in batch] == [r["text"] for r in ref]
    for r, p in zip(batch, prompts, strict=True):
        meta = r["meta_info"]
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == 12
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["cached_tokens"] >= len(p) - 1  # the single requests cached these prompts


def test_generate_stream_is_cumulative_and_ends_with_done(server: ServerProcess) -> None:
    body = {"text": "Streaming is cumulative", "sampling_params": {**GREEDY, "max_new_tokens": 16}}
    with server.client() as c:
        final = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_payloads(list(r.iter_lines()))
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == final["text"] and events[-1]["output_ids"] == final["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 16}


def test_batch_stream_carries_index(server: ServerProcess) -> None:
    body = {"text": ["first prompt", "second one"], "sampling_params": GREEDY, "stream": True}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        events = sse_payloads(list(r.iter_lines()))
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1] and all(len(e["output_ids"]) == 12 for e in finals.values())


def test_logprobs_and_prefill_only(server: ServerProcess) -> None:
    ids = random_ids(9, 100)
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3, "return_text_in_logprobs": True}  # fmt: skip
    with server.client() as c:
        out = c.post("/generate", json=body).json()
        prefill = c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}).json()
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert isinstance(text, str) and len(top) == 3
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy picks the argmax
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert prefill["output_ids"] == [] and prefill["meta_info"]["completion_tokens"] == 0
    assert prefill["meta_info"]["finish_reason"]["type"] == "length"
    got = [e[0] for e in prefill["meta_info"]["input_token_logprobs"][1:]]
    want = [e[0] for e in meta["input_token_logprobs"][1:]]
    assert got == pytest.approx(want, abs=1e-4)


def test_concurrent_clients_match_sequential(server: ServerProcess) -> None:
    prompts = [random_ids(4 + i % 13, 200 + i) for i in range(32)]
    params = {"max_new_tokens": 8, "temperature": 0}

    async def run_all() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:

            async def one(p: list[int]) -> dict[str, Any]:
                r = await ac.post("/generate", json={"input_ids": p, "sampling_params": params})
                assert r.status_code == 200, r.text
                return dict(r.json())

            return await asyncio.gather(*[one(p) for p in prompts])

    concurrent = asyncio.run(run_all())
    with server.client() as c:
        c.post("/flush_cache")
        sequential = [
            c.post("/generate", json={"input_ids": p, "sampling_params": params}).json() for p in prompts
        ]
        wait_idle(c)
    assert [r["output_ids"] for r in concurrent] == [r["output_ids"] for r in sequential]


def metric_values(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, via prometheus-client's own parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le")
            )
            if "le" in s.labels:
                continue
            out[f"{s.name}{{{labels}}}"] = s.value
            assert s.labels.get("model_name"), f"{s.name} has no model_name label"
    return out


def test_metrics_count_a_request(server: ServerProcess) -> None:
    with server.client() as c:
        before = metric_values(c.get("/metrics").text)
        out = c.post("/generate", json={"input_ids": random_ids(20, 300), "sampling_params": GREEDY}).json()
        after = metric_values(c.get("/metrics").text)
    meta = out["meta_info"]

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("radixrt:prompt_tokens_total{}") == meta["prompt_tokens"]
    assert delta("radixrt:generation_tokens_total{}") == meta["completion_tokens"]
    assert delta("radixrt:num_requests_total{finish_reason=length}") == 1
    assert delta("radixrt:e2e_request_latency_seconds_count{}") == 1
    assert delta("radixrt:time_to_first_token_seconds_count{}") == 1
    assert delta("radixrt:inter_token_latency_seconds_count{}") == meta["completion_tokens"] - 1
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "worker_up"):
        assert f"radixrt:{gauge}{{}}" in after
    for counter in ("evicted_tokens_total", "num_retractions_total", "cached_tokens_total"):
        assert f"radixrt:{counter}{{}}" in after
    assert after["radixrt:worker_up{}"] == 1.0


def test_admin_routes(server: ServerProcess) -> None:
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["model_path"] and info["is_generation"] and info["context_length"] == 2048
        assert info["kv_total_tokens"] >= 16384 and info["kv_bytes"] > 0 and info["dtype"] == "float32"
        assert c.get("/health_generate").status_code == 200
        long = {"text": "keep running", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        with c.stream("POST", "/generate", json={**long, "stream": True}) as r:
            lines = r.iter_lines()  # NOTE: keep a reference: a collected iterator closes the stream
            next(ln for ln in lines if ln.startswith("data:"))
            busy = c.post("/flush_cache")
        assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
        wait_idle(c)
        assert c.post("/flush_cache").status_code == 200
        assert wait_idle(c)["kv_cached_tokens"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server: ServerProcess, stream: bool) -> None:
    body = {"text": "a long answer", "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
    series = "radixrt:num_requests_total{finish_reason=abort}"  # reported once per request, abort included
    with server.client() as c:
        metrics = metric_values(c.get("/metrics").text)
        aborted, finished_aborted = metrics["radixrt:num_aborted_requests_total{}"], metrics.get(series, 0.0)
        before = c.get("/get_server_info").json()["generation_tokens"]
        if stream:
            with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(ln for ln in lines if ln.startswith("data:"))
        else:
            with pytest.raises(httpx.TimeoutException):
                c.post("/generate", json=body, timeout=0.5)
        info = wait_idle(c)  # long before 1800 tokens could have been generated
        metrics = metric_values(c.get("/metrics").text)
    assert metrics["radixrt:num_aborted_requests_total{}"] == aborted + 1
    assert metrics.get(series, 0.0) == finished_aborted + 1
    assert info["generation_tokens"] - before < 1800  # stopped long before max_new_tokens


def test_stream_never_shows_text_past_a_stop_string_spanning_tokens(server: ServerProcess) -> None:
    """A stop string that starts in one token and ends in the next: the streamed text only ever grows
    and never contains the stop's first half before the match is known."""
    with server.client() as c:
        for seed in range(400, 420):
            ids = random_ids(12, seed)
            body: dict[str, Any] = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0},
            }
            base = c.post(
                "/generate", json={**body, "return_logprob": True, "return_text_in_logprobs": True}
            ).json()
            toks = [e[2] for e in base["meta_info"]["output_token_logprobs"]]
            ks = [k for k in range(2, len(toks) - 1) if toks[k].isascii() and toks[k + 1].isascii()
                  and len(toks[k].strip()) >= 2 and len(toks[k + 1]) >= 2]  # fmt: skip
            if ks:
                break
        else:
            pytest.skip("no pair of plain ASCII tokens in the outputs")
        k = ks[0]
        stop = toks[k][-2:] + toks[k + 1][:2]
        want = base["text"][: base["text"].find(stop)]
        body["sampling_params"]["stop"] = [stop]
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            events = sse_payloads(list(r.iter_lines()))
    texts = [e["text"] for e in events]
    assert texts[-1] == want and events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert all(want.startswith(t) for t in texts)
