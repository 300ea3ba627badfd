"""ReAct over HotpotQA traces: SGLang's trace replay, and a live agent on a BM25 "Wikipedia".

``react`` (SGLang's ``benchmark/react`` shape): a few-shot header (the ``react_shots`` shortest
finished traces, in full), the question, then for step i = 1 .. len(steps) + 1: ``Thought i:`` and a
``gen`` in a ``fork(1)`` that stops at "Observation" (the model's own thought and action, kept aside),
followed by the recorded thought / action / observation of step i (the small suite replays the first
``react_replay_steps`` steps of each trace). The model thus sees exactly the history the recorded agent
saw; its ``Finish[...]`` at the recorded Finish step is scored against the recorded answer.

``react_live``: the same header and question, but the model's own ``Thought i: ... Action i: ...``
stays in the prompt (when the thought comes without an action, ``Action i:`` is asked for with a
second ``gen``, as ReAct's own code does) and its action is executed: ``Search[x]`` and ``Lookup[x]``
against `data.Wikipedia` (pages from the traces' Search observations), ``Finish[x]`` ends the episode.
"""

from __future__ import annotations

from typing import Any

import frontend_lang as sgl
from benchmarks.agents.data import Trace, Wikipedia, parse_action, split_shots
from benchmarks.agents.workload import Args, Scale, Workload
from benchmarks.prefix_workloads import REACT_INSTRUCTION
from frontend_lang import ProgramState


def step_text(i: int, step: dict[str, str]) -> str:
    """Step ``i`` as it follows ``Thought i:`` in the prompt."""
    return (
        f" {step['thought']}\nAction {i}: {step['action']}\nObservation {i}: {step['observation'].strip()}\n"
    )


def header(shots: list[Trace]) -> str:
    """The instruction and the few-shot episodes (every step of each)."""
    text = REACT_INSTRUCTION
    for trace in shots:
        text += f"Question: {trace.question}\n"
        text += "".join(f"Thought {i}:{step_text(i, s)}" for i, s in enumerate(trace.steps, 1))
    return text


def finish_answer(generated: str) -> str | None:
    act = parse_action(generated)
    return act[1] if act is not None and act[0] == "Finish" else None


def replay_workload(traces: list[Trace], scale: Scale) -> Workload:
    shots, questions = split_shots(traces, scale.react_shots)
    head = header(shots)
    max_tokens = scale.react_max_tokens
    cap = scale.react_replay_steps or max(len(t.steps) for t in traces)

    @sgl.function
    def react(s: ProgramState, question: str, steps: list[dict[str, str]]) -> None:
        s += head + f"Question: {question}\n"
        for i in range(1, len(steps) + 2):
            s += f"Thought {i}:"
            ss = s.fork(1)
            ss[0] += sgl.gen(f"thought_action_{i}", max_tokens=max_tokens, stop="Observation")
            ss.join()
            if i > len(steps):
                break
            s += step_text(i, steps[i - 1])

    def outputs(state: ProgramState, args: Args) -> list[str]:
        return [state[f"thought_action_{i}"][0] for i in range(1, len(args["steps"]) + 2)]

    def answer(state: ProgramState, args: Args) -> str | None:
        # the model's action at the recorded Finish step (same history as the recorded agent)
        steps = args["steps"]
        last = len(steps) if steps and steps[-1]["action"].startswith("Finish") else len(steps) + 1
        return finish_answer(state[f"thought_action_{last}"][0])

    return Workload(
        "react",
        react,
        [{"question": t.question, "steps": t.steps[:cap]} for t in questions],
        outputs=outputs,
        answer=answer,
        # a trace cut before its Finish step has no reference for the model's answer
        references=[t.answer if len(t.steps) <= cap else None for t in questions],
        description=f"ReAct trace replay, {scale.react_shots}-shot header, <= {max_tokens} tokens/step"
        + (f", first {cap} recorded steps of each trace" if scale.react_replay_steps else ""),
    )


def live_workload(traces: list[Trace], scale: Scale, wiki: Wikipedia | None = None) -> Workload:
    shots, questions = split_shots(traces, scale.react_shots)
    head = header(shots)
    wiki = wiki if wiki is not None else Wikipedia(traces)
    max_tokens, max_steps = scale.react_max_tokens, scale.react_live_steps

    @sgl.function
    def react_live(s: ProgramState, question: str) -> None:
        s += head + f"Question: {question}\n"
        page: str | None = None
        looked: dict[str, int] = {}
        for i in range(1, max_steps + 1):
            s += f"Thought {i}:"
            s += sgl.gen(f"step_{i}", max_tokens=max_tokens, stop="Observation")
            generated = s[f"step_{i}"]
            act = parse_action(generated)
            if act is None and "Action" not in generated:  # as ReAct does: ask for the action itself
                sep = "" if generated.endswith("\n") else "\n"
                s += f"{sep}Action {i}:" + sgl.gen(f"action_{i}", max_tokens=max_tokens, stop="\n")
                generated = s[f"action_{i}"] + "\n"
                act = parse_action(generated)
            if act is None:
                obs = "Invalid action: use Search[entity], Lookup[keyword] or Finish[answer]."
            elif act[0] == "Finish":
                s.set_var("answer", act[1])
                return
            elif act[0] == "Search":
                obs, page = wiki.search(act[1])
                looked = {}
            else:
                obs = wiki.lookup(page, act[1], looked.get(act[1], 0))
                looked[act[1]] = looked.get(act[1], 0) + 1
            sep = "" if generated.endswith("\n") else "\n"
            s += f"{sep}Observation {i}: {obs}\n"

    def outputs(state: ProgramState, args: Args) -> Any:
        return state.text()

    def answer(state: ProgramState, args: Args) -> str | None:
        return str(state["answer"]) if "answer" in state else None

    return Workload(
        "react_live",
        react_live,
        [{"question": t.question} for t in questions],
        outputs=outputs,
        answer=answer,
        references=[t.answer for t in questions],
        description=f"live ReAct agent on a BM25 Wikipedia of {len(wiki.titles)} pages, <= {max_steps} steps",
    )
