"""Pythonic calls (SGLang's ``pythonic``; Llama 3.2 / 4 and others): ``[get_weather(city="Paris"), f(n=1)]``.

A region is a Python list of calls with keyword arguments whose values are literals. Values are read as
JSON first (so ``true`` / ``null`` and JSON escapes mean what JSON says) and as Python literals
otherwise; ``arguments`` is the JSON of the keyword arguments. The arguments are not streamed piece by
piece: each call is reported once its region is complete.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from radixrt.server.tool_parsers.base import ToolCall, ToolParser

_START = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*\s*\(")
_MAYBE_START = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*)?$")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr, source: str) -> Any:
    """A keyword argument's value: JSON when its text is JSON, else a Python literal (ValueError)."""
    segment = ast.get_source_segment(source, node)
    if segment is not None:
        try:
            return json.loads(segment)
        except json.JSONDecodeError:
            pass
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    return ast.literal_eval(node)


def _bracket_end(text: str, start: int) -> int | None:
    """The index after the ``]`` that closes the ``[`` at ``start`` (Python strings skipped)."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class PythonicParser(ToolParser):
    """``[f(a=1), g(b="x")]`` regions."""

    name = "pythonic"
    args_style = "kwargs"
    separator = ", "
    list_open = "["
    list_close = "]"
    instructions = (
        "To call functions, respond with only a Python list of calls with keyword arguments, in the "
        'format [func_name1(param_name1="value1", param_name2=2), func_name2(param=...)].'
    )

    def find_region(self, text: str, pos: int) -> int | None:
        m = _START.search(text, pos)
        return None if m is None else m.start()

    def holdback(self, text: str, pos: int) -> int:
        m = _MAYBE_START.search(text, pos)
        return len(text) if m is None else m.start()

    def region_end(self, text: str, start: int) -> int | None:
        return _bracket_end(text, start)

    def parse_region(self, region: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(region.strip(), mode="eval")
        except SyntaxError:
            return None
        source = region.strip()
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            kwargs: dict[str, Any] = {}
            for kw in node.keywords:
                if kw.arg is None or kw.arg in kwargs:
                    return None
                try:
                    kwargs[kw.arg] = _literal(kw.value, source)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    return None
            try:
                arguments = json.dumps(kwargs, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, nan)
                return None
            calls.append(ToolCall(node.func.id, arguments))
        return calls

    def call_begin(self, name: str) -> str:
        return f"{name}("

    def call_end(self) -> str:
        return ")"

    def render_calls(self, calls: list[ToolCall]) -> str:
        """``[f(a=1, b="x")]``: keyword arguments with JSON values (which this parser reads back)."""
        rendered = []
        for call in calls:
            args = json.loads(call.arguments)
            inner = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
            rendered.append(f"{call.name}({inner})")
        return self.list_open + self.separator.join(rendered) + self.list_close
