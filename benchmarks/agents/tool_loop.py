"""A native tool-calling agent's loop, replayed from the ReAct traces (the shape agent frameworks produce).

``tool_loop``: the ReAct traces as an OpenAI-style tool conversation, in the chat template's role blocks
and the generic tool prompt's Hermes format (what radixrt's server renders for a model whose template has
no tools, e.g. the embedded SmolLM2): a system message listing three tools (``search``, ``lookup``,
``finish``), the question as the user turn, then per recorded step the assistant's turn (its thought, then
``<tool_call>{"name", "arguments"}</tool_call>`` for the step's ``Search[x]`` / ``Lookup[x]`` /
``Finish[x]``) and the tool result as a ``<tool_response>`` user turn (the step's observation). Before each
recorded assistant turn the model writes its own turn in a ``fork(1)`` (``tool_max_tokens`` tokens,
``ignore_eos``, kept aside as in ``react``), so every backend does the same work on the same prompts and
the conversation grows turn by turn as a framework's tool loop does; each prompt extends the previous
one, which a prefix cache serves. No grammar is involved, so backends without constrained decoding
(OpenVINO GenAI, llama.cpp) run it too; call validity is measured by ``benchmarks.tool_loop``.
"""

from __future__ import annotations

import json

import frontend_lang as sgl
from benchmarks.agents.data import Trace, parse_action
from benchmarks.agents.workload import Args, Scale, Workload
from frontend_lang import ProgramState
from frontend_lang.tool_exec import prompt_text, response_turn
from frontend_lang.tools import normalize_tools
from radixrt.server.tool_parsers.registry import get_parser

ARGUMENT = {"search": "query", "lookup": "keyword", "finish": "answer"}
TOOLS = normalize_tools(
    [
        {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": {ARGUMENT[name]: {"type": "string"}}, "required": [ARGUMENT[name]]}}}
        for name, desc in (
            ("search", "Search Wikipedia for an entity; returns the first paragraph of its page."),
            ("lookup", "Find the next sentence containing a keyword in the current page."),
            ("finish", "Give the final answer and end the task."),
        )
    ]
)  # fmt: skip
SYSTEM = "You answer questions by calling tools, one call per turn, until you can finish.\n\n"


def call_text(action: str) -> str | None:
    """A trace's ``Search[x]`` / ``Lookup[x]`` / ``Finish[x]`` as a Hermes tool call (None: not one)."""
    act = parse_action(action)
    if act is None or act[0].lower() not in ARGUMENT:
        return None
    name = act[0].lower()
    call = {"name": name, "arguments": {ARGUMENT[name]: act[1]}}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def workload(traces: list[Trace], scale: Scale) -> Workload:
    system = SYSTEM + prompt_text(get_parser("qwen25"), TOOLS)
    cap = scale.react_replay_steps or max(len(t.steps) for t in traces)
    max_tokens = scale.tool_max_tokens
    arguments = []
    for trace in traces:
        turns = []
        for step in trace.steps[:cap]:
            call = call_text(step["action"])
            if call is None:
                break
            turns.append({"assistant": f"{step['thought']}\n{call}", "result": step["observation"].strip()})
        if turns:
            arguments.append({"question": trace.question, "turns": turns})

    @sgl.function
    def tool_loop(s: ProgramState, question: str, turns: list[dict[str, str]]) -> None:
        s += sgl.system(system)
        s += sgl.user(question)
        for i, turn in enumerate(turns):
            ss = s.fork(1)
            ss[0] += sgl.assistant(sgl.gen(f"turn_{i}", max_tokens=max_tokens, ignore_eos=True))
            ss.join()
            s += sgl.assistant(turn["assistant"])
            s += sgl.user(response_turn(turn["result"]))
        s += sgl.assistant(sgl.gen("final", max_tokens=max_tokens, ignore_eos=True))

    def outputs(state: ProgramState, args: Args) -> list[str]:
        return [state[f"turn_{i}"][0] for i in range(len(args["turns"]))] + [str(state["final"])]

    return Workload(
        "tool_loop",
        tool_loop,
        arguments,
        outputs=outputs,
        description=f"ReAct traces as native tool calls (generic Hermes tool prompt), up to {cap} calls, "
        f"{max_tokens}-token turns written aside",
    )
