"""Multi-turn chat (SGLang's ``benchmark/multi_turn_chat`` shape) with a shared system prompt.

Each program is one conversation of ``chat_turns`` turns: a user message, then an assistant answer of a
fixed length (``gen(..., ignore_eos=True)``, as SGLang's benchmark does, so every backend does the same
work). Turn k+1's prompt is turn k's prompt + its answer + the next user message; all conversations
share one system prompt. ``multi_turn``: short answers (prefill-bound, SGLang's default);
``multi_turn_long``: long answers (SGLang's ``--long``). User messages are cut from the traces'
observations, so every conversation has its own text.
"""

from __future__ import annotations

import frontend_lang as sgl
from benchmarks.agents.data import Trace
from benchmarks.agents.workload import Args, Scale, Workload
from frontend_lang import ProgramState

SYSTEM = (
    "You are a careful research assistant. The user shares passages from encyclopedia articles, one per "
    "message. For each one, answer briefly: say what the passage is about, name the people, places, "
    "works and dates it mentions, and point out anything that contradicts an earlier passage of the "
    "conversation. Do not invent facts; if a passage is unclear, say so. Keep a neutral tone, avoid "
    "lists unless asked, and never repeat the passage back. "
)


def _word_pool(traces: list[Trace]) -> list[str]:
    return [w for t in traces for s in t.steps for w in s["observation"].split()]


def workloads(traces: list[Trace], scale: Scale, instances: int = 64) -> list[Workload]:
    pool = _word_pool(traces)
    turns, words = scale.chat_turns, scale.chat_user_words
    convs = []
    for c in range(instances):
        msgs = []
        for t in range(turns):
            start = ((c * turns + t) * words * 7) % max(1, len(pool) - words)
            msgs.append(f"Passage {t + 1}: " + " ".join(pool[start : start + words]))
        convs.append({"messages": msgs})

    def make(name: str, answer_tokens: int) -> sgl.Program:
        def chat(s: ProgramState, messages: list[str]) -> None:
            s += sgl.system(SYSTEM)
            for t, msg in enumerate(messages):
                s += sgl.user(msg)
                s += sgl.assistant(sgl.gen(f"answer_{t}", max_tokens=answer_tokens, ignore_eos=True))

        chat.__name__ = name
        return sgl.function(chat)

    def outputs(state: ProgramState, args: Args) -> list[str]:
        return [str(state[f"answer_{t}"]) for t in range(len(args["messages"]))]

    return [
        Workload(name, make(name, n), convs, outputs=outputs,
                 description=f"{turns} turns, {words}-word user messages, {n}-token answers, shared system prompt")
        for name, n in (("multi_turn", scale.chat_short_answer), ("multi_turn_long", scale.chat_long_answer))
    ]  # fmt: skip
