"""The examples: their programs on the session's Engine backend, and one example run end to end."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import frontend_lang as sgl

pytest_plugins = ["frontend_fixtures"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def test_react_agent(fl_backend: sgl.EngineBackend) -> None:
    mod = example("react_agent")
    assert "Paris" in mod.search("Search[eiffel tower]") and "Could not find" in mod.search("zzz")
    states = mod.react.run_batch([{"question": q} for q in mod.QUESTIONS[:2]], backend=fl_backend,
                                 progress_bar=False, temperature=0.7)  # fmt: skip
    for st in states:
        assert st.error() is None, st.error()
        trace = st.text()[len(mod.FEW_SHOT) :]
        assert trace.startswith("Question: ") and "\nThought 1:" in trace and "\nAction 1: " in trace
        steps = trace.count("\nAction ")
        assert steps == trace.count("\nObservation ") + (st["tool" + str(steps)] == "Finish")
        assert "\nThought" not in st["thought1"]  # the stop strings cut every thought


def test_rag_pipeline(fl_backend: sgl.EngineBackend) -> None:
    mod = example("rag_pipeline")
    assert mod.retrieve(mod.QUESTIONS[0], k=1) == [0]  # BM25 finds the Eiffel Tower passage
    assert mod.retrieve("Paris capital France river", k=1, exclude=(0,)) == [1]
    st = mod.rag.run(question=mod.QUESTIONS[0], backend=fl_backend)
    assert st.error() is None, st.error()
    hops = st.ret_value
    assert not set(hops["hop1"]) & set(hops["hop2"]) and len(hops["hop2"]) == 2
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert st.get_meta_info("answer")["cached_tokens"] > st.get_meta_info("query")["prompt_tokens"] // 2


def test_tree_of_thought(fl_backend: sgl.EngineBackend) -> None:
    mod = example("tree_of_thought")
    st = mod.tree_of_thought.run(question=mod.QUESTION, width=2, depth=2, backend=fl_backend)
    assert st.error() is None, st.error()
    assert [len(level["steps"]) for level in st.ret_value] == [2, 2]
    for level in st.ret_value:
        assert level["margins"][level["best"]] == max(level["margins"])
        assert level["steps"][level["best"]] in st.text()


def test_chat_select_runs_end_to_end(fl_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "chat_select.py"), "--model-path", str(fl_model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("intent: ") == 7 and "came from the RadixCache" in out.stdout
    saved = int(out.stdout.split("(")[-1].split("%")[0])
    assert saved > 50, out.stdout[-300:]


def test_classify(fl_backend: sgl.EngineBackend) -> None:
    mod = example("classify")
    states = mod.classify.run_batch(
        [{"review": r} for r in mod.REVIEWS[:2]], backend=fl_backend, temperature=0
    )
    for st in states:
        assert st.error() is None, st.error()
        r = st.ret_value
        assert r["sentiment"] in mod.SENTIMENTS and r["topic"] in mod.TOPICS and r["rating"] in "12345"
        assert st.text().endswith(f"Rating: {r['rating']}<|im_end|>\n")


@pytest.mark.parametrize(
    "name", ["react_agent", "rag_pipeline", "tree_of_thought", "chat_select", "classify"]
)
def test_examples_have_a_main(name: str) -> None:
    assert callable(example(name).main)
