"""What every tool-call format shares: the parsed call, and the parser interface.

A model writes its tool calls inside *regions* of its output (``<tool_call>...</tool_call>``,
``[TOOL_CALLS] [...]``, ``[f(a=1)]``). A parser knows where a region starts and ends and turns one region
into calls; everything outside regions, and every region that is not a well-formed call, is content.
``ToolParser.parse`` does that for a whole output; `radixrt.server.tool_parsers.streaming` does the same
incrementally and, for the JSON formats, streams the arguments while the model writes them.

A parser also knows how to *write* its format: the constraint builder (`.constraint`) uses ``call_begin``
/ ``call_end`` / ``separator`` / ``list_open`` / ``list_close`` to make the grammar, and the generic tool
prompt (`.prompt`) uses ``instructions`` and ``render_calls`` for models whose chat template has no tools.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: ``arguments`` is the JSON text of an object (as the model wrote it)."""

    name: str
    arguments: str


@dataclass(slots=True)
class ParsedOutput:
    """A whole output split into content (None when only whitespace) and calls."""

    content: str | None
    calls: list[ToolCall]


def start_of_output(text: str, pos: int, opener: str) -> int | None:
    """The index of ``opener`` when the output (after leading whitespace) begins with it and that index
    is at or after ``pos``; formats whose marker is a special token (skipped in the detokenized text)
    also open a region this way."""
    i = len(text) - len(text.lstrip())
    return i if i >= pos and text.startswith(opener, i) else None


def first_of(*found: int | None) -> int | None:
    """The smallest of the indices that are not None."""
    present = [i for i in found if i is not None]
    return min(present) if present else None


def partial_suffix(text: str, pos: int, marker: str) -> int:
    """The smallest index ``i >= pos`` such that ``text[i:]`` is a proper prefix of ``marker`` (text that
    may still become ``marker``), or ``len(text)`` when there is none."""
    for i in range(max(pos, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


class ToolParser(ABC):
    """One model family's tool-call format (registered by ``name`` in `.registry`)."""

    name: ClassVar[str]
    # How calls are written (the constraint and the generic prompt's history use these).
    separator: ClassVar[str] = "\n"
    list_open: ClassVar[str] = ""
    list_close: ClassVar[str] = ""
    # How a call's arguments are written: "json" (an object) or "kwargs" (Python keyword arguments).
    args_style: ClassVar[str] = "json"
    # Text that opens a call in free output: `auto` is constrained from there on (None: `auto` stays free).
    auto_trigger: ClassVar[str | None] = None
    # The generic tool prompt's description of the format.
    instructions: ClassVar[str]
    # Streaming fast path (JSON formats): a region's opening text, one call's name-first header ending
    # right before its arguments object, and what lies between one call's arguments and the next header.
    stream_open: ClassVar[re.Pattern[str] | None] = None
    stream_header: ClassVar[re.Pattern[str] | None] = None
    stream_between: ClassVar[re.Pattern[str] | None] = None

    @abstractmethod
    def find_region(self, text: str, pos: int) -> int | None:
        """Index of the first region start at or after ``pos``, or None."""

    @abstractmethod
    def holdback(self, text: str, pos: int) -> int:
        """The smallest index ``>= pos`` from which ``text`` may still turn into a region start once more
        text arrives (``len(text)`` when none): a stream holds that text back."""

    @abstractmethod
    def region_end(self, text: str, start: int) -> int | None:
        """End of the region that starts at ``start``, or None while it is still open."""

    @abstractmethod
    def parse_region(self, region: str) -> list[ToolCall] | None:
        """The calls in one region, or None when it is not well-formed."""

    @abstractmethod
    def call_begin(self, name: str) -> str:
        """The text before a call's arguments object."""

    @abstractmethod
    def call_end(self) -> str:
        """The text after a call's arguments object."""

    def render_calls(self, calls: list[ToolCall]) -> str:
        """Calls written the way this format (and its constraint) writes them."""
        body = self.separator.join(self.call_begin(c.name) + c.arguments + self.call_end() for c in calls)
        return self.list_open + body + self.list_close

    def parse(self, text: str, names: Collection[str]) -> ParsedOutput:
        """Split a whole output. A region is calls only if it parses and names functions in ``names``."""
        parts: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := self.find_region(text, pos)) is not None:
            parts.append(text[pos:start])
            end = self.region_end(text, start) or len(text)
            found = self.region_calls(text[start:end], names)
            if found is None:
                parts.append(text[start:end])
            else:
                calls += found
            pos = end
        parts.append(text[pos:])
        return ParsedOutput("".join(parts).strip() or None, calls)

    def region_calls(self, region: str, names: Collection[str]) -> list[ToolCall] | None:
        """``parse_region`` that also refuses calls to functions not offered."""
        found = self.parse_region(region)
        if not found or any(c.name not in names for c in found):
            return None
        return found
