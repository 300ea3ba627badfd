"""What a workload is: an ``@function`` program, the arguments of each of its instances, and how to read
a finished run (the outputs every backend must agree on, the answer scored against a reference)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from frontend_lang import Program, ProgramState

Args = dict[str, Any]


@dataclass(slots=True)
class Scale:
    """Sizes of the workloads. The defaults are the small suite (~10 min on 2 cores); ``full()`` is
    SGLang's benchmark sizes where it has them."""

    react_shots: int = 1  # few-shot traces in the ReAct header
    react_max_tokens: int = 32  # per Thought/Action step (SGLang: 200)
    react_replay_steps: int | None = 3  # recorded steps replayed per trace (None: all, as SGLang)
    react_live_steps: int = 3  # the live agent's step limit
    rag_k: int = 2  # passages per hop
    rag_hops: int = 2
    rag_max_tokens: int = 16
    chat_turns: int = 3
    chat_user_words: int = 50  # words per user message
    chat_short_answer: int = 8  # tokens per answer (SGLang's short: 4-8)
    chat_long_answer: int = 32  # (SGLang's --long: 256-512)
    tot_breadth: int = 2
    tot_depth: int = 2
    tot_max_tokens: int = 16
    tool_max_tokens: int = 24  # per assistant turn of the tool loop, written aside

    @classmethod
    def full(cls) -> Scale:
        return cls(react_shots=3, react_max_tokens=200, react_replay_steps=None, react_live_steps=6, rag_k=4, rag_hops=2,
                   rag_max_tokens=32, chat_turns=4, chat_user_words=120, chat_short_answer=8,
                   chat_long_answer=256, tot_breadth=3, tot_depth=3, tot_max_tokens=48, tool_max_tokens=64)  # fmt: skip


def _text(state: ProgramState, args: Args) -> Any:
    return state.text()


@dataclass(slots=True)
class Workload:
    """One program and its instances. ``outputs(state, args)`` is what must be identical on every backend
    that runs the program greedily on the same weights; ``answer(state, args)`` is scored against
    ``references[i]`` (exact match and F1) where a reference exists."""

    name: str
    program: Program
    arguments: list[Args]
    needs_select: bool = False
    outputs: Callable[[ProgramState, Args], Any] = _text
    answer: Callable[[ProgramState, Args], str | None] | None = None
    references: list[str | None] | None = None
    description: str = ""

    def take(self, n: int) -> list[Args]:
        """The first ``n`` instances (cycled if the data has fewer)."""
        if not self.arguments:
            raise ValueError(f"{self.name}: no instances")
        return [self.arguments[i % len(self.arguments)] for i in range(n)]

    def reference(self, i: int) -> str | None:
        return None if self.references is None else self.references[i % len(self.references)]
