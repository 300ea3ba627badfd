"""JSON read with the positions of what was read, for the JSON call formats.

A call's ``arguments`` are reported as the exact text the model wrote (not re-serialized), so that the
streamed pieces and the whole answer agree byte for byte. ``json_call`` finds that text's span inside a
call object; ``ValueScanner`` follows an object that is still being written, to know which of its
characters are already settled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from radixrt.server.tool_parsers.base import ToolCall

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def object_members(text: str, start: int) -> tuple[dict[str, tuple[object, int, int]], int] | None:
    """The JSON object at ``text[start]`` (after whitespace): ``{key: (value, value_start, value_end)}``
    and the index after its ``}``; None if there is no well-formed object there."""
    i = skip_ws(text, start)
    if i >= len(text) or text[i] != "{":
        return None
    members: dict[str, tuple[object, int, int]] = {}
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return members, i + 1
    while True:
        try:
            key, i = _DECODER.raw_decode(text, i)
            i = skip_ws(text, i)
            if not isinstance(key, str) or i >= len(text) or text[i] != ":":
                return None
            vstart = skip_ws(text, i + 1)
            value, vend = _DECODER.raw_decode(text, vstart)
        except json.JSONDecodeError:
            return None
        members[key] = (value, vstart, vend)
        i = skip_ws(text, vend)
        if i >= len(text):
            return None
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            return None
        i = skip_ws(text, i + 1)


def json_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[ToolCall, int] | None:
    """The call object ``{"name": ..., "<args key>": {...}}`` at ``text[start]`` and the index after it;
    missing arguments are ``{}``. None when it is not such an object."""
    found = object_members(text, start)
    if found is None:
        return None
    members, end = found
    name = members.get("name")
    if name is None or not isinstance(name[0], str):
        return None
    keys = [k for k in args_keys if k in members]
    if set(members) - {"name", *args_keys} or len(keys) > 1:
        return None
    if not keys:
        return ToolCall(name[0], "{}"), end
    value, vstart, vend = members[keys[0]]
    if not isinstance(value, dict):
        return None
    return ToolCall(name[0], text[vstart:vend]), end


def json_call_list(text: str, start: int, sep: str, args_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """Call objects separated by ``sep`` (with whitespace around it) from ``start`` to the end of
    ``text`` (trailing whitespace allowed); None unless all of it is calls."""
    calls: list[ToolCall] = []
    i = start
    while True:
        found = json_call(text, i, args_keys)
        if found is None:
            return None
        calls.append(found[0])
        i = skip_ws(text, found[1])
        if i == len(text):
            return calls
        if not text.startswith(sep, i):
            return None
        i += len(sep)


@dataclass(slots=True)
class ValueScanner:
    """Follows a JSON object or array being written from ``start``: ``advance`` reads what arrived
    and returns the index after the closing bracket once it has been written."""

    start: int
    pos: int = -1
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None

    def advance(self, text: str) -> int | None:
        """Read ``text`` up to its end (resuming where the last call stopped)."""
        if self.end is not None:
            return self.end
        i = self.start if self.pos < 0 else self.pos
        while i < len(text):
            c = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
                    break
        self.pos = i
        return self.end
