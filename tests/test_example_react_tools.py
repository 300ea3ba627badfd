"""examples/react_tools.py (the ReAct agent with native tool calls) on the session's Engine backend: every
step is a call that validates against its tool's schema, results go back as tool turns, the episode ends
with ``finish``, and each step's prompt is the previous one extended (the RadixCache has it)."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from types import ModuleType

import jsonschema

import frontend_lang as sgl

pytest_plugins = ["frontend_fixtures"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def test_react_tools_agent(fl_backend: sgl.EngineBackend) -> None:
    mod = example("react_tools")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in mod.TOOLS}
    for question in mod.QUESTIONS[:2]:
        steps: list[int] = []
        state = mod.agent.run(
            question=question, on_step=functools.partial(steps.append, 1), backend=fl_backend, temperature=0
        )
        assert state.error() is None, state.error()
        calls = [state.tool_calls(f"step{k}") for k in range(len(steps))]
        assert all(len(c) == 1 for c in calls) and 1 <= len(steps) <= mod.MAX_STEPS + 1
        for (call,) in calls:
            jsonschema.validate(call.args, schemas[call.name])
        names = [c.name for (c,) in calls]
        assert names[-1] == "finish" and "finish" not in names[:-1]
        assert state.ret_value == calls[-1][0].args["answer"]
        for (call,) in calls[:-1]:  # each search result went back as a tool turn
            assert f"<tool_response>\n{mod.run_search(call.args['query'])}\n</tool_response>" in state.text()
        for k in range(1, len(steps)):  # each step's prompt extends the last one's: a cache hit
            before, now = state.get_meta_info(f"step{k - 1}"), state.get_meta_info(f"step{k}")
            assert now["cached_tokens"] >= before["prompt_tokens"]
        assert mod.trace(state)[-1].startswith("  finish(")
    assert "highest mountain" in mod.run_search("highest_mountain_in_africa")
