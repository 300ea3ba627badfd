"""The agent suite's OpenVINO GenAI backend (benchmarks/agents/openvino_backend.py) on a tiny model.

OpenVINO GenAI is a benchmark-only dependency (``pip install openvino-genai==2026.4.1``); without it this
module is skipped. The tiny random Llama is written as an F16 GGUF file (OpenVINO reads no F32 GGUF) and
run by both sides in fp32 (OpenVINO: f32 inference precision and KV cache), so greedy programs must
produce the same outputs as radixrt's Engine on the same file, two programs in flight on each side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.agents.backends import EngineWithIds, RadixSide, Side
from benchmarks.agents.runner import run_workload
from benchmarks.agents.suite import build_workloads
from benchmarks.agents.workload import Scale, Workload
from frontend_lang.backends.base import PromptContext
from frontend_lang.ir import GenParams
from radixrt.testing.gguf_writer import write_gguf

pytest.importorskip(
    "openvino_genai", reason="OpenVINO GenAI is benchmark-only: pip install openvino-genai==2026.4.1"
)

pytest_plugins = ["frontend_fixtures"]

SCALE = Scale(react_shots=1, react_max_tokens=6, chat_turns=2, chat_user_words=12, chat_short_answer=3,
              tot_breadth=2, tot_depth=2, tot_max_tokens=4)  # fmt: skip
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


@pytest.fixture(scope="module")
def gguf_file(fl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(fl_model, tmp_path_factory.mktemp("ov") / "tiny-f16.gguf", "F16")


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    rows = []
    for q in range(4):  # HotpotQA-shaped traces: Search, Lookup, Finish
        steps = [
            {"thought": f"I need to search topic {q}.", "action": f"Search[Topic {q}]",
             "observation": f"Topic {q} is a town in county {q}. It was founded in {1800 + q}."},
            {"thought": "I should look up the founding.", "action": "Lookup[founded]",
             "observation": f"(Result 1 / 1) It was founded in {1800 + q}."},
            {"thought": "So the answer is the year.", "action": f"Finish[{1800 + q}]",
             "observation": "Episode finished, reward = 1"},
        ]  # fmt: skip
        rows.append(json.dumps({f"Question: When was topic {q} founded?": steps}))
    data = tmp_path_factory.mktemp("ov-traces") / "traces.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return {w.name: w for w in build_workloads(data, SCALE, ["react", "multi_turn", "tot"])}


@pytest.fixture(scope="module")
def sides(gguf_file: Path, fl_model: Path) -> Iterator[tuple[Side, Side]]:
    from benchmarks.agents.backends import OpenVINOSide

    engine = EngineWithIds(model_path=str(gguf_file), dtype="float32", quantization="none",
                           max_total_tokens=8192, disable_compile=True)  # fmt: skip
    ref = RadixSide("radixrt-engine", engine, "test engine")
    ov = OpenVINOSide(gguf_file, str(fl_model), threads=2, properties=F32)
    yield ref, ov
    ov.close()
    ref.close()


@pytest.mark.parametrize("name", ["react", "multi_turn"])
def test_openvino_backend_matches_engine(
    name: str, workloads: dict[str, Workload], sides: tuple[Side, Side]
) -> None:
    """Same greedy outputs as the Engine with two programs in flight (the driver thread batches their
    requests; react's gens end at a stop string, multi_turn's at a fixed length); prompt tokens counted
    as the runner counts them; no cached-token count is claimed."""
    ref, ov = sides
    want = run_workload(ref, workloads[name], parallel=2, programs=2)
    got = run_workload(ov, workloads[name], parallel=2, programs=2)
    assert want["status"] == got["status"] == "ok", (want.get("errors"), got.get("errors"))
    assert got["output_digests"] == want["output_digests"]
    assert got["requests"] == want["requests"] and got["requests"]["gen"] >= 2
    assert got["prompt_tokens_reported"] == got["prompt_tokens"]
    assert got["cached_tokens"] is None and got["hit_rate"] is None


def test_openvino_select_programs_are_na(workloads: dict[str, Workload], sides: tuple[Side, Side]) -> None:
    run = run_workload(sides[1], workloads["tot"], parallel=2, programs=2)
    assert run["status"] == "n/a"


def test_openvino_stop_string_cuts_like_radixrt(sides: tuple[Side, Side]) -> None:
    """A stop string taken from the middle of the greedy continuation ends both generations at the same
    text (the stop itself cut off), and earlier than without it."""
    ref, ov = sides
    ctx = PromptContext("Question: what is the river of the town?\nThought 1:", [], None, "")
    full, _ = ref.backend.generate(ctx, GenParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert ov.backend.generate(ctx, GenParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0] == full
    words = full.split()
    stop = next(w for w in words[2:] if len(w) >= 3 and full.find(w) > 0)
    params = GenParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    want, _ = ref.backend.generate(ctx, params)
    got, meta = ov.backend.generate(ctx, params)
    assert got == want == full[: full.find(stop)]
    assert meta["completion_tokens"] < 12
