"""Tool-call parsers by name (``--tool-call-parser``), and the default read from a chat template."""

from __future__ import annotations

import re

from radixrt.server.tool_parsers.base import ToolParser
from radixrt.server.tool_parsers.hermes import HermesParser
from radixrt.server.tool_parsers.llama3 import Llama3Parser
from radixrt.server.tool_parsers.mistral import MistralParser
from radixrt.server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3Parser, MistralParser, PythonicParser)
}
DEFAULT_PARSER = HermesParser.name  # also the generic tool prompt's format
_TOOLS_VAR = re.compile(r"\btools\b")
# (a marker the chat template writes when it renders tool calls, the parser for that format)
_TEMPLATE_MARKERS = (
    ("<tool_call>", HermesParser.name),
    ("[TOOL_CALLS]", MistralParser.name),
    ("func_name1(", PythonicParser.name),
    ("<|python_tag|>", Llama3Parser.name),
    ('"parameters": dictionary of argument name', Llama3Parser.name),
)


def get_parser(name: str) -> ToolParser:
    """A parser by its ``--tool-call-parser`` name (ValueError naming the choices)."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; choose one of {', '.join(PARSERS)}")
    return cls()


def template_source(template: str | dict[str, str] | None) -> str:
    """The text of a chat template (a named set: all of them)."""
    if template is None:
        return ""
    return template if isinstance(template, str) else "\n".join(template.values())


def template_has_tools(template: str | dict[str, str] | None) -> bool:
    """Whether the chat template renders ``tools`` (else the generic tool prompt is used)."""
    return bool(_TOOLS_VAR.search(template_source(template)))


def parser_for_template(template: str | dict[str, str] | None) -> str | None:
    """The parser whose format the chat template writes, or None when it names none we know."""
    source = template_source(template)
    for marker, name in _TEMPLATE_MARKERS:
        if marker in source:
            return name
    return None
