"""Tree of thought (SGLang's ``benchmark/tree_of_thought`` shape) with ``fork`` and a ``select`` judge.

A full tree of breadth ``tot_breadth`` and depth ``tot_depth`` over a HotpotQA question: every node
forks ``b`` branches; a branch at depth < d writes one reasoning step (``gen``, up to a blank line), a branch at
depth d (a leaf, ``b ** d`` of them) writes an answer. Branch i is steered by its own hint, so greedy
branches differ (SGLang's samples at temperature > 0 instead). The root then lists the candidate
answers, and a ``select`` over their numbers picks one (scored against the trace's Finish answer).
"""

from __future__ import annotations

import frontend_lang as sgl
from benchmarks.agents.data import Trace, split_shots
from benchmarks.agents.workload import Args, Scale, Workload
from frontend_lang import ProgramState

INSTRUCTION = (
    "Solve the question by exploring several lines of reasoning, one short step per line, then give a "
    "short factoid answer.\n"
)
HINTS = (
    "start from the first entity the question names",
    "start from the second entity the question names",
    "think about dates, numbers and places",
    "think about what the two parts have in common",
    "think about what the answer must look like",
)


def workload(traces: list[Trace], scale: Scale) -> Workload:
    b, d, max_tokens = scale.tot_breadth, scale.tot_depth, scale.tot_max_tokens
    _, questions = split_shots(traces, scale.react_shots)

    def expand(state: ProgramState, level: int) -> list[ProgramState]:
        """Fork ``state`` into ``b`` branches that write step ``level``; recurse; return the leaves."""
        branches = state.fork(b)
        branches += lambda i: f"Step {level} ({HINTS[(level + i) % len(HINTS)]}):"
        if level == d:
            branches += " Answer:" + sgl.gen("answer", max_tokens=max_tokens, stop="\n")
            return list(branches)
        # NOTE: this model often starts a step on a new line; stopping at the first "\n" left it empty
        branches += sgl.gen("thought", max_tokens=max_tokens, stop=["\n\n", "\nStep"]) + "\n"
        return [leaf for branch in branches for leaf in expand(branch, level + 1)]

    @sgl.function
    def tot(s: ProgramState, question: str) -> None:
        s += INSTRUCTION + f"Question: {question}\n"
        leaves = expand(s, 1)
        answers = [str(leaf["answer"]).strip() for leaf in leaves]
        s.set_var("candidates", answers)
        s += "Candidate answers:\n" + "".join(f"({i + 1}) {a}\n" for i, a in enumerate(answers))
        s += "The best candidate is (" + sgl.select("best", choices=[str(i + 1) for i in range(len(leaves))])

    def outputs(state: ProgramState, args: Args) -> tuple[list[str], str]:
        return list(state["candidates"]), str(state["best"])

    def answer(state: ProgramState, args: Args) -> str:
        return str(state["candidates"][int(state["best"]) - 1])

    return Workload(
        "tot",
        tot,
        [{"question": t.question} for t in questions],
        needs_select=True,
        outputs=outputs,
        answer=answer,
        references=[t.answer for t in questions],
        description=f"tree of thought, breadth {b}, depth {d} ({b**d} leaves), select judge",
    )
