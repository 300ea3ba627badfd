"""Native tool calls in programs: offer tools to the model, read its calls, append the results.

::

    TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {...}}}]

    @sgl.function
    def agent(s, question):
        s += sgl.system("You answer questions." + sgl.tools_prompt(TOOLS))
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("step", tools=TOOLS, tool_choice="required"))
        for call in s.tool_calls("step"):
            s += sgl.tool(call.id, run(call.name, call.args))
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

The model sees its tools the way radixrt's server shows them to a model whose chat template has no tools
(the *generic tool prompt*, in the format of the backend's tool-call parser: Hermes ``<tool_call>{json}
</tool_call>`` unless the chat template names another), so a program's text is the conversation the server
would render. ``gen(..., tools=...)`` appends what the model wrote (``s["step"]`` is that text) and parses
its calls with the server's parser (``s.tool_calls("step")``: `ToolCall` objects). ``tool_choice``
``"required"`` or a function's name constrains decoding with the server's call grammar, so the calls always
parse and their arguments validate against the tool's schema (on a 135M model too); ``"auto"`` leaves
the model free and returns the calls it wrote well-formed (none otherwise). ``tool(call_id, content)``
appends a result as the generic prompt's user turn ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from frontend_lang.ir import Expr

CHOICES = ("auto", "required")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of an object (``args`` parses it)."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        assert isinstance(value, dict)
        return value


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What one ``gen`` offers: the tools (OpenAI's nested shape), which may be called, and how."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "auto", "required" or the name of the one function to call
    parallel: bool

    @property
    def names(self) -> list[str]:
        """The functions the model may call now."""
        if self.choice in CHOICES:
            return [t["function"]["name"] for t in self.tools]
        return [self.choice]

    @property
    def required(self) -> bool:
        return self.choice != "auto"

    def schemas(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, parameters) of the functions the model may call now."""
        allowed = set(self.names)
        fns = [t["function"] for t in self.tools]
        return [(fn["name"], fn["parameters"]) for fn in fns if fn["name"] in allowed]


def normalize_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """Tools as ``{"type": "function", "function": {"name", "description"?, "parameters"}}``; the flat
    Responses-API shape ``{"type": "function", "name", ...}`` is accepted too. ValueError names the tool."""
    if not isinstance(tools, list | tuple) or not tools:
        raise ValueError("tools: must be a non-empty list of function tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}: must be a {{"type": "function", ...}} tool')
        fn = tool.get("function", {k: v for k, v in tool.items() if k != "type"})
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: required (a non-empty string)")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f'{where}.function.parameters: must be a JSON schema of type "object"')
        entry: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            entry["description"] = fn["description"]
        entry["parameters"] = params
        out.append({"type": "function", "function": entry})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be distinct")
    return tuple(out)


def tool_spec(tools: Any, tool_choice: Any, parallel_tool_calls: bool) -> ToolSpec:
    """Check ``gen``'s tool arguments (ValueError naming the argument)."""
    normalized = normalize_tools(tools)
    choice = tool_choice
    if isinstance(choice, dict):  # OpenAI's {"type": "function", "function": {"name": ...}} or flat
        choice = (choice.get("function") or choice).get("name")
    if not isinstance(choice, str):
        raise ValueError(f"tool_choice: expected auto, required or a function name, got {tool_choice!r}")
    if choice not in CHOICES and choice not in [t["function"]["name"] for t in normalized]:
        raise ValueError(f"tool_choice: no tool named {choice!r} in tools")
    return ToolSpec(normalized, choice, parallel_tool_calls)


@dataclass(eq=False)
class ToolsPrompt(Expr):
    """The generic tool prompt listing ``tools``, in the backend's call format (see `tools_prompt`)."""

    tools: tuple[dict[str, Any], ...]


@dataclass(eq=False)
class ToolResult(Expr):
    """The result of call ``call_id``, appended as a ``<tool_response>`` user turn (see `tool`)."""

    call_id: str
    content: str


def tools_prompt(tools: Any) -> Expr:
    """The text that shows ``tools`` to the model (the server's generic tool prompt, with the backend's
    call format); put it in the system message, before any ``gen(..., tools=...)``."""
    return ToolsPrompt(normalize_tools(tools))


def tool(call_id: str, content: object) -> Expr:
    """Append the result of call ``call_id`` (one of this state's `ToolCall` ids) as a tool-result turn;
    ``content`` that is not a string is written as JSON."""
    if not isinstance(call_id, str) or not call_id:
        raise ValueError("call_id: must be the id of a tool call of this program state")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return ToolResult(call_id, text)


def new_call_id() -> str:
    """A call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"
