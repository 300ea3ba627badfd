"""A ReAct agent with native tool calls: the model calls ``search`` and ``finish`` as functions.

``python examples/react_tools.py`` — the same toy knowledge base as ``react_agent.py``, but instead of a
few-shot text format the model is shown its tools (``sgl.tools_prompt``) and every step is a tool call
(``gen(..., tools=TOOLS, tool_choice="required")``): the call grammar makes each call well-formed and its
arguments valid against the tool's schema, so the loop runs on the 135M model too. Each result goes back as
a tool turn (``sgl.tool(call.id, ...)``); after ``MAX_STEPS`` searches the agent is made to ``finish``
(``tool_choice="finish"``). Every step extends the same conversation, so each request computes only its
new tokens (the cache line at the end). Greedy, one question at a time: the same text every run.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from common import cache_counters, make_backend, parse_args, print_cache_stats
from react_agent import QUESTIONS, search
from tqdm import tqdm

import frontend_lang as sgl

MAX_STEPS = 3
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Look an entity up in the encyclopedia; returns one sentence about it.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "minLength": 2, "maxLength": 40}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Give the final answer to the question.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 60}},
                "required": ["answer"],
            },
        },
    },
]
SYSTEM = (
    "You answer questions by calling tools. Call search to look facts up, one entity at a time, then call "
    "finish with a short answer."
)


def run_search(query: str) -> str:
    """The toy search of ``react_agent.py``; a small model writes entities as identifiers
    (``highest_mountain_in_africa``), so underscores count as spaces."""
    return search(query.replace("_", " "))


@sgl.function
def agent(s: Any, question: str, on_step: Any = None) -> str:
    """One episode: up to ``MAX_STEPS`` tool calls, then a forced ``finish``; returns the answer."""
    s += sgl.system(SYSTEM + "\n\n" + sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    for step in range(MAX_STEPS + 1):
        choice = "required" if step < MAX_STEPS else "finish"
        s += sgl.assistant(sgl.gen(f"step{step}", tools=TOOLS, tool_choice=choice, max_tokens=64))
        call = s.tool_calls(f"step{step}")[0]  # required: exactly one call (parallel_tool_calls=False)
        if on_step is not None:
            on_step()
        if call.name == "finish":
            return str(call.args["answer"])
        s += sgl.tool(call.id, run_search(call.args["query"]))
    raise AssertionError("unreachable: the last step is a forced finish")


def trace(state: Any) -> list[str]:
    """The episode's calls as lines: ``search("...") -> result`` / ``finish("...")``."""
    lines = []
    step = 0
    while f"step{step}" in state:
        for call in state.tool_calls(f"step{step}"):
            arg = next(iter(call.args.values()))
            result = f" -> {run_search(arg)}" if call.name == "search" else ""
            lines.append(f"  {call.name}({arg!r}){result}")
        step += 1
    return lines


def run(backend: sgl.BaseBackend) -> None:
    """Answer every question (greedy) on ``backend`` and print each episode's calls."""
    with tqdm(desc=f"tool calls ({len(QUESTIONS)} questions)", unit="call", file=sys.stderr) as bar:
        for question in QUESTIONS:
            state = agent.run(question=question, on_step=bar.update, backend=backend, temperature=0)
            if state.error() is not None:
                raise state.error()
            print(f"\nQ: {question}")
            print("\n".join(trace(state)))
            print(f"A: {state.ret_value}", flush=True)


def main() -> None:
    ns = parse_args(__doc__.splitlines()[0] if __doc__ else None)
    backend = make_backend(ns)
    started, before = time.perf_counter(), cache_counters(backend)
    run(backend)
    print_cache_stats(backend, started, before)
    backend.shutdown()


if __name__ == "__main__":
    main()
