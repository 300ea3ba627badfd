"""Hermes / Qwen2.5 style (SGLang's ``qwen25``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

One call per ``<tool_call>`` region; parallel calls are consecutive regions. It is also the format of the
generic tool prompt for chat templates without tools, and the one `auto` is constrained in once the model
writes ``<tool_call>``.
"""

from __future__ import annotations

import re

from radixrt.server.tool_parsers.base import ToolCall, ToolParser, partial_suffix
from radixrt.server.tool_parsers.json_scan import json_call, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` regions."""

    name = "qwen25"
    separator = "\n"
    auto_trigger = OPEN
    instructions = (
        "For each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CLOSE}"
    )
    stream_open = re.compile(re.escape(OPEN) + r"\s*")
    stream_header = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')

    def find_region(self, text: str, pos: int) -> int | None:
        i = text.find(OPEN, pos)
        return None if i < 0 else i

    def holdback(self, text: str, pos: int) -> int:
        return partial_suffix(text, pos, OPEN)

    def region_end(self, text: str, start: int) -> int | None:
        i = text.find(CLOSE, start + len(OPEN))
        return None if i < 0 else i + len(CLOSE)

    def parse_region(self, region: str) -> list[ToolCall] | None:
        if not region.endswith(CLOSE):
            return None
        body = region[len(OPEN) : len(region) - len(CLOSE)]
        found = json_call(body, 0, ARGS_KEYS)
        if found is None or skip_ws(body, found[1]) != len(body):
            return None
        return [found[0]]

    def call_begin(self, name: str) -> str:
        return f'{OPEN}\n{{"name": "{name}", "arguments": '

    def call_end(self) -> str:
        return f"}}\n{CLOSE}"
