"""The agent benchmark suite (benchmarks/agents) at tiny size on the tiny random model.

Every workload runs on the in-process Engine and on a server over HTTP and must yield the same outputs
(greedy, fp32, one program at a time); the cache may never beat the optimum the runner computes, and that
optimum is checked against a brute-force count. The suite's own backends (OpenAI completions for
llama.cpp / ``--base-url``, HF transformers) run the same programs to the same outputs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import ServerProcess

from benchmarks.agents.backends import EndpointWithIds, EngineWithIds, HFSide, RadixSide, Side, UrlSide
from benchmarks.agents.data import Wikipedia, load_traces, parse_action
from benchmarks.agents.recorder import Request
from benchmarks.agents.report import detail_table, headline_table, targets
from benchmarks.agents.runner import run_optimum, run_workload
from benchmarks.agents.suite import WORKLOADS, build_workloads
from benchmarks.agents.workload import Scale, Workload
from benchmarks.react_traces import synthetic_traces, traces_file, write_traces
from frontend_lang import EngineBackend

pytest_plugins = ["frontend_fixtures", "server_fixtures"]

TINY = Scale(react_shots=1, react_max_tokens=6, react_live_steps=2, rag_k=2, rag_hops=2, rag_max_tokens=5,
             chat_turns=2, chat_user_words=12, chat_short_answer=3, chat_long_answer=6, tot_breadth=2,
             tot_depth=2, tot_max_tokens=4, tool_max_tokens=4)  # fmt: skip


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    # the suite's own stand-in for the HotpotQA file: four traces (Search, a failed Search, Lookup, Finish;
    # the fourth stops before Finish)
    data = write_traces(tmp_path_factory.mktemp("agents") / "traces.jsonl", synthetic_traces(4))
    return {w.name: w for w in build_workloads(data, TINY, list(WORKLOADS))}


@pytest.fixture(scope="module")
def engine_side(fl_backend: EngineBackend) -> Iterator[Side]:
    side = RadixSide("radixrt-engine", EngineWithIds(fl_backend.engine), "test engine", owns=False)
    yield side
    side.close()
    fl_backend.engine.check_invariant()


@pytest.fixture(scope="module")
def http_side(server: ServerProcess) -> Iterator[Side]:
    side = RadixSide("radixrt", EndpointWithIds(server.url), "test server")
    yield side
    side.close()


def _ok(run: dict[str, Any]) -> dict[str, Any]:
    assert run["status"] == "ok", run.get("errors")
    return run


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_same_outputs_engine_and_http(
    name: str, workloads: dict[str, Workload], engine_side: Side, http_side: Side
) -> None:
    wl = workloads[name]
    eng = _ok(run_workload(engine_side, wl, parallel=1, programs=2))
    http = _ok(run_workload(http_side, wl, parallel=1, programs=2))
    assert eng["output_digests"] == http["output_digests"]
    for run in (eng, http):
        assert run["requests"]["gen"] >= 2
        opt = run["optimum"]
        assert run["prompt_tokens"] == run["prompt_tokens_reported"]  # the runner tokenizes as the server
        # the cache never beats the optimum; with ample KV it reaches it (select commits the text its
        # choices share before scoring them, so a short shared tail is not computed once per choice)
        assert run["cached_tokens"] <= opt["optimal_hit"]
        assert run["hit_over_optimal"] >= 0.99, run
        assert run["computed_prefill_tokens"] >= opt["optimal_computed"]
    # the same program ran: same number of requests of each kind
    assert eng["requests"] == http["requests"]


def test_parallel_runs_keep_the_optimum(workloads: dict[str, Workload], http_side: Side) -> None:
    """Four programs in flight: each finishes, hit rate still at the optimum (no eviction)."""
    run = _ok(run_workload(http_side, workloads["multi_turn"], parallel=4, programs=4))
    assert len(run["output_digests"]) == 4 and run["hit_over_optimal"] >= 0.99
    assert run["ttft_p50_s"] is not None and run["latency_p99_s"] >= run["latency_p50_s"]


def test_completions_backend_matches_native(
    workloads: dict[str, Workload], server: ServerProcess, http_side: Side, fl_model: Path
) -> None:
    """The OpenAI-completions backend (llama.cpp / --base-url) on radixrt's own /v1: same outputs as the
    native backend, cached tokens from ``usage``, select through echo + logprobs."""
    url = UrlSide(server.url + "/v1", "default", str(fl_model), select=True, api_key=None)
    try:
        for name in ("multi_turn", "rag_verify"):
            native = _ok(run_workload(http_side, workloads[name], parallel=1, programs=1))
            compat = _ok(run_workload(url, workloads[name], parallel=1, programs=1))
            assert compat["output_digests"] == native["output_digests"], name
            assert compat["cached_tokens"] is not None and compat["cached_tokens"] > 0
    finally:
        url.close()


def test_hf_backend_matches_engine(workloads: dict[str, Workload], engine_side: Side, fl_model: Path) -> None:
    """HF transformers' generate (fp32) runs the same programs to the same greedy outputs, select included."""
    hf = HFSide(str(fl_model), "float32")
    for name in ("multi_turn", "tot"):
        ref = _ok(run_workload(engine_side, workloads[name], parallel=1, programs=1))
        got = _ok(run_workload(hf, workloads[name], parallel=1, programs=1))
        assert got["output_digests"] == ref["output_digests"], name
        assert got["cached_tokens"] == 0 and got["hit_over_optimal"] == 0


def test_select_programs_are_na_without_logprobs(workloads: dict[str, Workload], http_side: Side) -> None:
    class NoSelect(Side):
        name = "llama.cpp"
        supports_select = False

    side = NoSelect()
    side.backend, side.tokenizer = http_side.backend, http_side.tokenizer
    run = run_workload(side, workloads["tot"], parallel=8, programs=8)
    assert run["status"] == "n/a"
    ok = _ok(run_workload(http_side, workloads["tot"], parallel=1, programs=1)) | {"parallel": 8}
    table = headline_table([ok, run], 8)
    assert "n/a" in table and "tot" in table and "tot" in detail_table([ok, run])
    assert any(name.startswith("hit/optimal radixrt tot") for name, _, _ in targets([ok, run], 8))


class _Chars:
    """A tokenizer whose tokens are characters (for the brute-force check)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def _brute_force(records: list[tuple[str, str]]) -> tuple[int, int]:
    """(distinct prompt prefixes, those also produced by some call's own decoding), by enumeration."""
    prefixes = {p[:k] for p, _ in records for k in range(1, len(p) + 1)}
    decoded = {(p + o[:j]) for p, o in records for j in range(1, len(o))}
    return len(prefixes), len(prefixes & decoded)


def test_optimum_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(20):
        system = "".join(rng.choice("ab") for _ in range(rng.randint(0, 6)))
        records: list[tuple[str, str]] = []
        for _ in range(rng.randint(1, 6)):
            prompt = system + "".join(rng.choice("abc") for _ in range(rng.randint(1, 8)))
            if records and rng.random() < 0.5:  # a chat turn: the previous prompt + its answer + more
                prev_p, prev_o = records[-1]
                prompt = prev_p + prev_o[: rng.randint(0, len(prev_o))] + rng.choice("abc")
            records.append((prompt, "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))))
        reqs = [Request("gen", p, 0.0, output=o) for p, o in records]
        opt = run_optimum(reqs, _Chars())
        union, supplied = _brute_force(records)
        assert (opt.union_prompt_tokens, opt.decode_supplied) == (union, supplied), records
        assert opt.prompt_tokens == sum(len(p) for p, _ in records)
        assert opt.optimal_hit == opt.prompt_tokens - union + supplied


def test_synthetic_traces_have_the_real_files_shape(tmp_path: Path) -> None:
    """Without --data the benchmarks replay ``synthetic_traces``: deterministic, the file's JSON shape, and
    episodes whose Finish answers follow from their own observations (a founded-first question's answer
    is the town with the earlier year)."""
    assert synthetic_traces(12, seed=3) == synthetic_traces(12, seed=3) != synthetic_traces(12, seed=4)
    path = traces_file(None, 40, seed=5)
    assert (
        path.read_text(encoding="utf-8")
        == write_traces(tmp_path / "t.jsonl", synthetic_traces(40, 5)).read_text()
    )
    traces = load_traces(path)
    assert len(traces) == 40 and 0.6 <= sum(t.answer is not None for t in traces) / 40 <= 0.9
    checked = 0
    for t in traces:
        assert 2 <= len(t.steps) <= 5 and all(set(s) == {"thought", "action", "observation"} for s in t.steps)
        assert all(parse_action(s["action"]) is not None for s in t.steps)
        m = re.fullmatch(r"Which town was founded first, (\w+) or (\w+)\?", t.question)
        if m and t.answer is not None:
            years = {}
            for s in t.steps:
                page = re.match(r"(\w+) is a .*? It was founded in (\d+)", s["observation"])
                if page:
                    years[page.group(1)] = int(page.group(2))
            assert t.answer == min(m.groups(), key=lambda town: years[town]), t
            checked += 1
    assert checked >= 5
    wiki = Wikipedia(traces)
    title = parse_action(traces[0].steps[0]["action"])
    assert title is not None and wiki.search(title[1])[1] == traces[0].steps[0]["observation"]
    with pytest.raises(FileNotFoundError, match="sgl-project/sglang"):
        traces_file(tmp_path / "missing.jsonl")
