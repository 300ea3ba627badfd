"""The examples: their programs on the session's Engine backend, and one example run end to end."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from frontend_util import FakeBackend

import frontend_lang as sgl
from frontend_lang.backends.base import PromptContext
from frontend_lang.ir import GenParams

pytest_plugins = ["frontend_fixtures"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def test_react_agent(fl_backend: sgl.EngineBackend) -> None:
    mod = example("react_agent")
    assert "Paris" in mod.search("Search[eiffel tower]") and "Could not find" in mod.search("zzz")
    ends = mod.worker_stop_ids(fl_backend)  # oracle: every token's own text
    texts = [fl_backend.tokenizer.decode([i]) for i in range(len(fl_backend.tokenizer))]
    assert ends["line_end_ids"] == [i for i, t in enumerate(texts) if "\n" in t] != []
    assert ends["arg_end_ids"] == [i for i, t in enumerate(texts) if "\n" in t or "]" in t]
    done: list[int] = []
    states = mod.react.run_batch([{"question": q, "on_step": lambda: done.append(1), **ends} for q in mod.QUESTIONS[:2]],
                                 backend=fl_backend, progress_bar=False, temperature=0.7)  # fmt: skip
    total = 0
    for st in states:
        assert st.error() is None, st.error()
        trace = st.text()[len(mod.FEW_SHOT) :]
        assert trace.startswith("Question: ") and "\nThought 1:" in trace and "\nAction 1: " in trace
        steps = trace.count("\nAction ")
        assert steps == trace.count("\nObservation ") + (st["tool" + str(steps)] == "Finish")
        # every line of the trace is the format's next one: Thought k / Action k / Observation k
        lines = [ln for ln in trace.split("\n")[1:] if ln]
        expected = [
            f"{kind} {k}" for k in range(1, steps + 1) for kind in ("Thought", "Action", "Observation")
        ]
        assert [ln.split(":")[0] for ln in lines] == expected[: len(lines)]
        total += steps
    assert len(done) == total  # on_step: once per step


class _Rambler(FakeBackend):
    """Every gen "writes" a thought that runs on into the next steps; the stop strings cut it, as the
    runtime does (its stop semantics are checked in test_frontend_engine / test_frontend_server)."""

    RAMBLE = " I should search for it. Thought 3: more Action 2: Search[x]\nObservation 2: y"

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        stops = [params.stop] if isinstance(params.stop, str) else params.stop or []
        text = self.RAMBLE
        cut = min([i for i in (text.find(x) for x in stops) if i >= 0], default=len(text))
        return text[:cut], {}


def test_react_thoughts_stop_at_the_next_marker() -> None:
    """A thought ends at its line's end or at the next Action / Thought / Observation marker, never
    carrying a later step into the trace ("Thought 3:" printed before "Action 2:")."""
    mod = example("react_agent")
    st = mod.react.run(question="Q?", backend=_Rambler())
    assert st.error() is None, st.error()
    for k in (1, 2, 3):
        assert st[f"thought{k}"] == " I should search for it. ", st[f"thought{k}"]
    lines = st.text()[len(mod.FEW_SHOT) :].split("\n")[1:]
    assert [ln.split(":")[0] for ln in lines if ln] == [
        f"{kind} {k}" for k in (1, 2, 3) for kind in ("Thought", "Action", "Observation")
    ]


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


def test_demo_runs_both_programs_on_one_engine(fl_model: Path) -> None:
    """examples/demo.py (what scripts/demo.sh runs): the model is loaded once for both programs; results
    on stdout, progress on stderr."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--model-path", str(fl_model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("-- model ready in ") == 1 and "compiling decode buckets" in out.stderr
    assert "=== 1/2 ReAct agent" in out.stdout and "=== 2/2 structured answers" in out.stdout
    assert out.stdout.count("  steps: ") == 4 and out.stdout.count("came from the RadixCache") == 2
    assert "-- " not in out.stdout and " s\n" not in out.stdout  # no progress or timing in the results


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
    "name", ["react_agent", "rag_pipeline", "tree_of_thought", "chat_select", "classify", "demo"]
)
def test_examples_have_a_main(name: str) -> None:
    assert callable(example(name).main)
