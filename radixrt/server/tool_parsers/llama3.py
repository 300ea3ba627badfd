"""Llama 3.x JSON (SGLang's ``llama3``): ``{"name": ..., "parameters": {...}}``, several joined by ``; ``.

The calls are the rest of the output: after ``<|python_tag|>``, or from the start when the output begins
with ``{`` (``<|python_tag|>`` is a special token, gone from the text unless special tokens are kept).
"""

from __future__ import annotations

import re

from radixrt.server.tool_parsers.base import ToolCall, ToolParser, first_of, partial_suffix, start_of_output
from radixrt.server.tool_parsers.json_scan import json_call_list, skip_ws

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
ARGS_KEYS = ("parameters", "arguments")


class Llama3Parser(ToolParser):
    """JSON calls that make up the end of the output."""

    name = "llama3"
    separator = "; "
    instructions = (
        "To call functions, respond with only JSON, one object per call in the format "
        '{"name": <function-name>, "parameters": <args-json-object>}; separate several calls with "; ".'
    )
    stream_open = re.compile(r"(?:" + re.escape(PYTHON_TAG) + r")?\s*")
    stream_header = re.compile(
        r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
    )
    stream_between = re.compile(r"\s*\}\s*;\s*")

    def find_region(self, text: str, pos: int) -> int | None:
        tag = text.find(PYTHON_TAG, pos)
        return first_of(tag if tag >= 0 else None, start_of_output(text, pos, "{"))

    def holdback(self, text: str, pos: int) -> int:
        if not text.strip():  # the output may still begin with "{"
            return pos
        return partial_suffix(text, pos, PYTHON_TAG)

    def region_end(self, text: str, start: int) -> int | None:
        return None  # the calls run to the end of the output

    def parse_region(self, region: str) -> list[ToolCall] | None:
        start = len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        start = skip_ws(region, start)
        return json_call_list(region, start, SEPARATOR, ARGS_KEYS)

    def call_begin(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '

    def call_end(self) -> str:
        return "}"
