"""Mistral (SGLang's ``mistral``): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

A region is ``[TOOL_CALLS]`` and the JSON array after it, or a JSON array of calls at the start of the
output (``[TOOL_CALLS]`` is a special token, gone from the text unless special tokens are kept).
"""

from __future__ import annotations

import re

from radixrt.server.tool_parsers.base import ToolCall, ToolParser, first_of, partial_suffix, start_of_output
from radixrt.server.tool_parsers.json_scan import ValueScanner, json_call_list, skip_ws

MARKER = "[TOOL_CALLS]"
ARGS_KEYS = ("arguments", "parameters")


class MistralParser(ToolParser):
    """A JSON array of calls after ``[TOOL_CALLS]``."""

    name = "mistral"
    separator = ", "
    list_open = f"{MARKER} ["
    list_close = "]"
    instructions = (
        f"To call functions, respond with {MARKER} followed by a JSON array of calls, each in the format "
        '{"name": <function-name>, "arguments": <args-json-object>}.'
    )
    stream_open = re.compile(r"(?:" + re.escape(MARKER) + r")?\s*\[\s*")
    stream_header = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')
    stream_between = re.compile(r"\s*\}\s*,\s*")

    def find_region(self, text: str, pos: int) -> int | None:
        marker = text.find(MARKER, pos)
        return first_of(marker if marker >= 0 else None, start_of_output(text, pos, "["))

    def holdback(self, text: str, pos: int) -> int:
        if not text.strip():  # the output may still begin with "["
            return pos
        return partial_suffix(text, pos, MARKER)

    def region_end(self, text: str, start: int) -> int | None:
        i = start + len(MARKER) if text.startswith(MARKER, start) else start
        i = skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] != "[":  # not an array: the marker alone is the region (content)
            return i
        return ValueScanner(i).advance(text)

    def parse_region(self, region: str) -> list[ToolCall] | None:
        i = skip_ws(region, len(MARKER) if region.startswith(MARKER) else 0)
        if not region.startswith("[", i) or not region.rstrip().endswith("]"):
            return None
        return json_call_list(region[: len(region.rstrip()) - 1], i + 1, ",", ARGS_KEYS)

    def call_begin(self, name: str) -> str:
        return f'{{"name": "{name}", "arguments": '

    def call_end(self) -> str:
        return "}"
