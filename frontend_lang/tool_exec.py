"""What the interpreter does for tools (`frontend_lang.tools`): the prompt text, the call grammar, the
parsed calls and the result turn, with radixrt's own tool-call parsers and constraint builder (imported
when a program first uses tools), so a program's calls read and are constrained exactly as the server's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from frontend_lang.ir import GenParams
from frontend_lang.tools import ToolCall, ToolSpec, new_call_id

if TYPE_CHECKING:
    from frontend_lang.backends.base import BaseBackend
    from radixrt.server.tool_parsers.base import ToolParser

# The server's generic tool prompt (radixrt.server.http.tool_calls.GENERIC_TOOL_PROMPT), spelled here so
# that the DSL does not import the HTTP layer; tests/test_frontend_tools.py checks that they are equal.
GENERIC_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "{instructions}"
)


def parser_of(backend: BaseBackend) -> ToolParser:
    """The tool-call parser of ``backend`` (ValueError when the backend cannot do tools)."""
    from radixrt.server.tool_parsers.registry import get_parser

    name = backend.tool_parser_name()
    if name is None:
        raise ValueError(
            f"tools: {type(backend).__name__} does not support tools= (use a radixrt backend, or an OpenAI "
            "chat model: is_chat_model=True)"
        )
    return get_parser(name)


def prompt_text(parser: ToolParser, tools: tuple[dict[str, Any], ...]) -> str:
    """The generic tool prompt listing ``tools`` in ``parser``'s format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return GENERIC_TOOL_PROMPT.format(tools=lines, instructions=parser.instructions)


def constrained(params: GenParams, spec: ToolSpec, parser: ToolParser) -> GenParams:
    """``params`` with the call grammar of ``spec`` (none for ``auto`` in a format without a trigger)."""
    from radixrt.server.tool_parsers.constraint import ToolSchemaError, tool_grammar

    if params.constraint is not None:
        raise ValueError(f"tools: cannot be combined with {params.constraint}= in one gen")
    if (params.n or 1) > 1:
        raise ValueError("n: a gen with tools generates one answer")
    try:
        grammar = tool_grammar(parser, spec.schemas(), spec.required, spec.parallel, False)
    except ToolSchemaError as exc:
        name = spec.schemas()[exc.index][0]
        raise ValueError(f"tools: the parameters of {name!r} cannot be constrained: {exc}") from None
    return params if grammar is None else replace(params, ebnf=grammar)


def calls_of(parser: ToolParser, text: str, spec: ToolSpec) -> list[ToolCall]:
    """The well-formed calls of offered functions in ``text``, each with a new id."""
    parsed = parser.parse(text, spec.names)
    return [ToolCall(new_call_id(), c.name, c.arguments) for c in parsed.calls]


def response_turn(content: str) -> str:
    """A tool result as the generic prompt's user turn shows it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def known_call(meta_info: dict[str, Any], call_id: str) -> bool:
    """Whether some gen of the state (its ``meta_info``) made the call ``call_id``."""
    for meta in meta_info.values():
        calls = meta.get("tool_calls") if isinstance(meta, dict) else None
        if calls and any(c.id == call_id for c in calls):
            return True
    return False


def calls_text(calls: list[ToolCall]) -> str:
    """Calls a native-tools backend returned, written into the program's text as the generic tool
    prompt's format shows them (``<tool_call>{"name", "arguments"}</tool_call>``)."""
    return "".join(
        f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
        for c in calls
    )


@dataclass(slots=True)
class NativeTurn:
    """The tool calls an open assistant turn made through a native-tools backend, and where their
    written-out text (`calls_text`) lies in the program's text, so the turn's chat message carries the
    calls as ``tool_calls`` and only the rest of the text as ``content``."""

    calls: list[ToolCall] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)

    def copy(self) -> NativeTurn:
        return NativeTurn(list(self.calls), list(self.spans))

    def add(self, calls: list[ToolCall], start: int, end: int) -> None:
        self.calls += calls
        self.spans.append((start, end))

    def message(self, role: str, text: str, role_start: int, content: str) -> dict[str, Any]:
        """The chat message of a turn whose text is ``content`` (``text[role_start:]`` before the
        role's suffix)."""
        if not self.calls:
            return {"role": role, "content": content}
        kept, at = [], role_start
        for start, end in self.spans:
            kept.append(text[at:start])
            at = end
        kept.append(text[at : role_start + len(content)])
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
        ]
        return {"role": role, "content": "".join(kept), "tool_calls": calls}
