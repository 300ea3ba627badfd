"""A ReAct agent: few-shot Thought / Action / Observation loop with a toy search tool.

``python examples/react_agent.py`` — every question shares the few-shot prompt (cached once by
run_batch), and each step extends the same growing scratchpad, so each request only computes its new
tokens. A thought is one line: it stops at the end of the line or at the next "Action", "Thought",
"Observation" or "Question" marker (SGLang's ReAct benchmark stops at "Observation"); the tool name is a
``select``; its argument stops at "]". Greedy decoding, one question at a time: the same text every run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from common import cache_counters, make_backend, parse_args, print_cache_stats
from tqdm import tqdm

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
# NOTE: without the newline and the markers, a small model writes the next step itself ("Thought 3:" before
# "Action 2:"): a thought ends where the format's next line begins.
THOUGHT_STOP = ["\n", "Action", "Thought", "Observation", "Question"]
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


def worker_stop_ids(backend: sgl.BaseBackend) -> dict[str, list[int] | None]:
    """``react``'s ``line_end_ids`` (tokens whose text holds a newline) and ``arg_end_ids`` (a newline or
    "]"), from the backend's tokenizer; None without a local tokenizer.

    NOTE: a stop string is matched outside the worker, which may decode a token or two past it before
    the abort reaches it; those tokens enter the prefix cache, the next step's prompt reuses a varying
    number of them, and the rounding that changes can flip a small model's greedy choice. A stop token
    id ends the generation inside the worker at once: the same text on every run."""
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        return {"line_end_ids": None, "arg_end_ids": None}
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return {
        "line_end_ids": [i for i, text in enumerate(texts) if "\n" in text],
        "arg_end_ids": [i for i, text in enumerate(texts) if "\n" in text or "]" in text],
    }


@sgl.function
def react(
    s: Any,
    question: str,
    max_steps: int = 3,
    on_step: Callable[[], None] | None = None,
    line_end_ids: list[int] | None = None,
    arg_end_ids: list[int] | None = None,
) -> str | None:
    """One ReAct episode; ``on_step`` is called after each action; ``line_end_ids`` / ``arg_end_ids``
    end a thought / an action's argument in the worker (see ``worker_stop_ids``)."""
    s += FEW_SHOT + f"Question: {question}\n"
    last = ""
    for step in range(1, max_steps + 1):
        s += f"Thought {step}:" + sgl.gen(
            f"thought{step}", max_tokens=32, stop=THOUGHT_STOP, stop_token_ids=line_end_ids
        )
        s += f"\nAction {step}: " + sgl.select(f"tool{step}", choices=["Search", "Lookup", "Finish"])
        s += "[" + sgl.gen(f"arg{step}", max_tokens=12, stop=["]", "\n"], stop_token_ids=arg_end_ids) + "]"
        tool, arg = s[f"tool{step}"], s[f"arg{step}"]
        if on_step is not None:
            on_step()
        if tool == "Finish":
            return str(arg)
        last = search(arg) if tool == "Search" else lookup(arg, last)
        s += f"\nObservation {step}: {last}\n"
    return None


def run(backend: sgl.BaseBackend) -> None:
    """Answer every question (greedy) on ``backend`` and print each trace; a progress bar on stderr counts
    the agents' steps as they happen."""
    with tqdm(desc=f"ReAct steps ({len(QUESTIONS)} questions)", unit="step", file=sys.stderr) as bar:
        ends = worker_stop_ids(backend)
        args = [{"question": q, "on_step": bar.update, **ends} for q in QUESTIONS]
        # NOTE: one program at a time: concurrent programs share decode batches that differ from run to
        # run, and a rounding difference flips a small model's greedy choice (the same text every run)
        states = react.run_batch(args, backend=backend, temperature=0, num_threads=1, progress_bar=False)
    for q, st in zip(QUESTIONS, states, strict=True):
        if st.error() is not None:
            print(f"\n{q}\n  error: {st.error()!r}")
            continue
        trace = st.text()[len(FEW_SHOT) :]
        steps = trace.count("\nAction ")
        print(f"\n{q}\n  steps: {steps}, answer: {st.ret_value!r}")
        print("  " + trace.rstrip("\n").replace("\n", "\n  "))


def main() -> None:
    ns = parse_args(__doc__)
    backend = make_backend(ns)
    before, started = cache_counters(backend), time.perf_counter()
    run(backend)
    print_cache_stats(backend, started, before)
    backend.shutdown()


if __name__ == "__main__":
    main()
