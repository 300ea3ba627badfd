"""A ReAct agent: few-shot Thought / Action / Observation loop with a toy search tool.

``python examples/react_agent.py`` — every question shares the few-shot prompt (cached once by
run_batch), and each step extends the same growing scratchpad, so each request only computes its new
tokens. Thoughts stop at the next "Action"; the tool name is a ``select``; its argument stops at "]".
"""

from __future__ import annotations

import time
from typing import Any

from common import make_backend, parse_args, print_cache_stats

import frontend_lang as sgl

KNOWLEDGE = {
    "eiffel tower": "The Eiffel Tower is a wrought-iron tower in Paris, France, completed in 1889.",
    "paris": "Paris is the capital and largest city of France, on the river Seine.",
    "blade runner": "Blade Runner (1982) is based on the novel by Philip K. Dick.",
    "philip k. dick": "Philip K. Dick was an American writer of science fiction, born in Chicago.",
    "kenya": "Kenya is a country in East Africa; its highest mountain is Mount Kenya.",
    "kilimanjaro": "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa.",
    "apollo 11": "Apollo 11 landed the first humans on the Moon on 20 July 1969.",
}

FEW_SHOT = """Solve a question with interleaving Thought, Action, Observation steps. Actions are
Search[entity] (returns a sentence about the entity), Lookup[keyword] (finds the keyword in the last
result) and Finish[answer].

Question: In which city is the tower completed in 1889?
Thought 1: I need to search for the tower completed in 1889.
Action 1: Search[Eiffel Tower]
Observation 1: The Eiffel Tower is a wrought-iron tower in Paris, France, completed in 1889.
Thought 2: The tower is in Paris.
Action 2: Finish[Paris]

Question: Who wrote the novel that Blade Runner is based on?
Thought 1: I should search for Blade Runner.
Action 1: Search[Blade Runner]
Observation 1: Blade Runner (1982) is based on the novel by Philip K. Dick.
Thought 2: The novel is by Philip K. Dick.
Action 2: Finish[Philip K. Dick]

"""
QUESTIONS = [
    "What is the highest mountain in Africa?",
    "In which year did people first land on the Moon?",
    "Where was the author of the Blade Runner novel born?",
    "What river flows through the capital of France?",
]


def _words(text: str) -> set[str]:
    return {w.strip(".,;:!?()[]{}'\"") for w in text.lower().split()} - {"the", "a", "of", "in", "is", ""}


def search(query: str) -> str:
    """The toy tool: the entry whose name (counted twice) and sentence share most words with the query."""
    words = _words(query)

    def score(key: str) -> int:
        return 2 * len(words & _words(key)) + len(words & _words(KNOWLEDGE[key]))

    best = max(KNOWLEDGE, key=score)
    if score(best) == 0:
        return f"Could not find {query.strip()!r}. Similar: {', '.join(sorted(KNOWLEDGE)[:3])}."
    return KNOWLEDGE[best]


def lookup(keyword: str, last: str) -> str:
    sentences = [
        x for x in last.split(". ") if keyword.lower().strip() and keyword.lower().strip() in x.lower()
    ]
    return sentences[0] if sentences else "No more results."


@sgl.function
def react(s: Any, question: str, max_steps: int = 3) -> str | None:
    s += FEW_SHOT + f"Question: {question}\n"
    last = ""
    for step in range(1, max_steps + 1):
        s += f"Thought {step}:" + sgl.gen(
            f"thought{step}", max_tokens=32, stop=[f"\nAction {step}:", "\nObservation", "\nQuestion:"]
        )
        s += f"\nAction {step}: " + sgl.select(f"tool{step}", choices=["Search", "Lookup", "Finish"])
        s += "[" + sgl.gen(f"arg{step}", max_tokens=12, stop=["]", "\n"]) + "]"
        tool, arg = s[f"tool{step}"], s[f"arg{step}"]
        if tool == "Finish":
            return str(arg)
        last = search(arg) if tool == "Search" else lookup(arg, last)
        s += f"\nObservation {step}: {last}\n"
    return None


def main() -> None:
    ns = parse_args(__doc__)
    started = time.perf_counter()
    backend = make_backend(ns)
    states = react.run_batch([{"question": q} for q in QUESTIONS], temperature=0.7, progress_bar=True)
    for q, st in zip(QUESTIONS, states, strict=True):
        if st.error() is not None:
            print(f"\n{q}\n  error: {st.error()!r}")
            continue
        trace = st.text()[len(FEW_SHOT) :]
        steps = trace.count("\nAction ")
        print(f"\n{q}\n  steps: {steps}, answer: {st.ret_value!r}")
        print("  " + trace.replace("\n", "\n  ")[:600])
    print_cache_stats(backend, started)
    backend.shutdown()


if __name__ == "__main__":
    main()
