"""Helpers of SGLang's benchmark scripts (``sglang.utils``): read a JSONL data file, dump states' text."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_jsonl(filename: str | Path) -> list[Any]:
    """Every JSON line of ``filename``, as a list (lines starting with ``#`` and blank lines skipped)."""
    with open(filename, encoding="utf-8") as fin:
        return [json.loads(line) for line in fin if line.strip() and not line.startswith("#")]


def dump_state_text(filename: str | Path, states: Iterable[Any], mode: str = "w") -> None:
    """Write each state's text (a ``ProgramState``'s ``text()``, a string as is, else ``str()``) to
    ``filename``, framed by numbered ``=`` rules as SGLang writes them."""
    from frontend_lang.state import ProgramState

    with open(filename, mode, encoding="utf-8") as fout:
        for i, state in enumerate(states):
            if isinstance(state, ProgramState):
                text = state.text()
            else:
                text = state if isinstance(state, str) else str(state)
            rule = "=" * 40
            fout.write(f"{rule} {i} {rule}\n{text}\n{'=' * 80}\n\n")
