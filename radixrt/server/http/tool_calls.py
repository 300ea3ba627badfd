"""Tool calling on /v1/chat/completions: the request's ``tools`` / ``tool_choice`` checked, the
conversation rendered with them, and the grammar that guarantees ``required`` / named calls.

``ToolSupport`` is decided once per server from the chat template: which parser reads the model's calls
(``--tool-call-parser``, else the format the template writes, else the Hermes ``<tool_call>`` format) and
whether the template renders tools itself. A template without tools (SmolLM2's, ChatML) gets the
*generic tool prompt*: a system-message block listing the tools' JSON schemas and the format's
instructions (``GENERIC_TOOL_PROMPT``); earlier calls are written into the assistant turns in that format
and tool results become user turns ``<tool_response>...</tool_response>``, as Qwen2.5's template does.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema

from radixrt.server.http.chat_prompt import special_texts
from radixrt.server.http.errors import APIError
from radixrt.server.tool_parsers.base import ToolCall, ToolParser
from radixrt.server.tool_parsers.constraint import ToolSchemaError, tool_grammar
from radixrt.server.tool_parsers.registry import (
    DEFAULT_PARSER,
    get_parser,
    parser_for_template,
    template_has_tools,
    template_source,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixrt.server.http.openai_protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)

GENERIC_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "{instructions}"
)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")
# Request fields that constrain the output themselves: they cannot be combined with a tool grammar.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tools: what the template sees, what the parser accepts, what the grammar forces."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, parameters filled in
    names: list[str]  # the functions the model may call now (a named tool_choice: that one)
    required: bool  # "required" or a named function
    parallel: bool

    @property
    def schemas(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, parameters) of the functions the model may call now."""
        fns = [t["function"] for t in self.tools]
        return [(fn["name"], fn["parameters"]) for fn in fns if fn["name"] in self.names]


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """How this server's model does tools (decided once from its chat template)."""

    parser: ToolParser
    native: bool  # the chat template renders ``tools`` and ``tool_calls`` itself
    args_as_text: bool  # the template writes a call's ``arguments`` string as is (else it wants a dict)
    # Special-token texts: refused inside tools and calls a native template renders (they would become
    # control tokens; text a template does not render goes through `chat_prompt.encode_chat`'s guard).
    specials: tuple[str, ...] = ()

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, parser_name: str | None) -> ToolSupport:
        """The parser named by ``--tool-call-parser``, else the one the chat template's format names."""
        template = getattr(tokenizer, "chat_template", None)
        native = template_has_tools(template)
        found = parser_for_template(template)
        name = parser_name or found or DEFAULT_PARSER
        if native and parser_name is None and found is None:
            logger.warning(
                "the chat template renders tools in a format radixrt does not recognise; reading calls as "
                "%s (set --tool-call-parser to choose)",
                name,
            )
        args_as_text = "arguments is string" in template_source(template)
        specials = tuple(special_texts(tokenizer)) if native else ()
        return cls(get_parser(name), native, args_as_text, specials)

    def messages(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it: tool calls and results in the template's
        own form, or (no tool support in the template) folded into text with the generic prompt."""
        if self.native:
            for i, m in enumerate(messages):
                if m.get("tool_calls") and not self.args_as_text:
                    m["tool_calls"] = [_with_dict_args(c) for c in m["tool_calls"]]
                _refuse_special(m.get("tool_calls"), f"messages[{i}].tool_calls", self.specials)
            return messages
        folded = _fold_history(messages, self.parser)
        if plan is None:
            return folded
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        block = GENERIC_TOOL_PROMPT.format(tools=lines, instructions=self.parser.instructions)
        if folded and folded[0]["role"] in ("system", "developer"):
            folded[0] = {**folded[0], "content": f"{folded[0]['content']}\n\n{block}"}
        else:
            folded.insert(0, {"role": "system", "content": block})
        return folded

    def template_kwargs(self, plan: ToolPlan | None) -> dict[str, Any]:
        """``tools=`` for a template that renders them."""
        return {"tools": plan.tools} if plan is not None and self.native else {}

    def grammar(self, plan: ToolPlan, whitespace: bool) -> str | None:
        """The EBNF constraint for ``plan`` (None when ``auto`` stays free in this format)."""
        schemas = plan.schemas
        try:
            return _cached_grammar(
                self.parser.name, json.dumps(schemas), plan.required, plan.parallel, whitespace
            )
        except ToolSchemaError as exc:
            index = [t["function"]["name"] for t in plan.tools].index(schemas[exc.index][0])
            field = f"tools[{index}].function.parameters"
            raise APIError(400, f"{field}: {exc}", param=field) from None


@functools.lru_cache(maxsize=256)
def _cached_grammar(
    parser: str, schemas: str, required: bool, parallel: bool, whitespace: bool
) -> str | None:
    pairs = [(name, schema) for name, schema in json.loads(schemas)]
    return tool_grammar(get_parser(parser), pairs, required, parallel, whitespace)


def _with_dict_args(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}


def _refuse_special(value: object, field: str, specials: Sequence[str]) -> None:
    if value is None or not specials:
        return
    text = json.dumps(value, ensure_ascii=False)
    for special in specials:
        if special in text:
            raise APIError(400, f"{field}: special-token text {special!r} is refused here", param=field)


def _fold_history(messages: list[dict[str, Any]], parser: ToolParser) -> list[dict[str, Any]]:
    """Tool calls written into the assistant's text, tool results as user turns (consecutive ones
    joined), for templates that know neither."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            after_tool = True
            continue
        after_tool = False
        content = m["content"]
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            written = parser.render_calls(calls)
            content = f"{content.strip()}\n{written}" if content.strip() else written
        out.append({"role": m["role"], "content": content})
    return out


def plan_tools(req: ChatCompletionRequest, support: ToolSupport) -> ToolPlan | None:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (400 naming the field); None when the
    request offers no tools or ``tool_choice`` is "none" (then the tools are not shown to the model)."""
    choice = req.tool_choice
    tools = [_check_tool(i, t, support.specials) for i, t in enumerate(req.tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function name {dup!r} appears twice", param="tools")
    named = None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise APIError(
                400, f"tool_choice: must be one of {', '.join(CHOICES)} or a function", "tool_choice"
            )
    elif choice is not None:
        if choice.type != "function":
            raise APIError(400, 'tool_choice.type: only "function" is supported', param="tool_choice")
        named = choice.function.name
        if named not in names:
            raise APIError(400, f"tool_choice: no tool named {named!r} in tools", param="tool_choice")
    required = choice == "required" or named is not None
    if required and not tools:
        raise APIError(400, "tool_choice: requires tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        raise APIError(
            400,
            "response_format: cannot be combined with tools (unless tool_choice is none)",
            "response_format",
        )
    for field in CONSTRAINT_FIELDS:
        if getattr(req, field) is not None:
            raise APIError(400, f"{field}: cannot be combined with tools (unless tool_choice is none)", field)
    # NOTE: the prompt lists every tool whatever tool_choice says, so that turns of a conversation that
    # differ in tool_choice still share their prefix in the cache.
    callable_names = [named] if named is not None else names
    return ToolPlan(tools, callable_names, required, req.parallel_tool_calls is not False)


def _check_tool(i: int, tool: Any, specials: Sequence[str]) -> dict[str, Any]:
    where = f"tools[{i}]"
    if tool.type != "function":
        raise APIError(400, f'{where}.type: only "function" tools are supported', param=f"{where}.type")
    fn = tool.function
    if not TOOL_NAME.fullmatch(fn.name):
        field = f"{where}.function.name"
        raise APIError(400, f"{field}: must be 1-64 letters, digits, '_' or '-'", param=field)
    params = EMPTY_PARAMETERS if fn.parameters is None else fn.parameters
    field = f"{where}.function.parameters"
    if params.get("type", "object") != "object":
        raise APIError(400, f'{field}: must be a JSON schema of type "object"', param=field)
    try:
        # NOTE: one draft for every schema: validator_for() would trust a client's "$schema" value
        jsonschema.Draft202012Validator.check_schema(params)
    except jsonschema.SchemaError as exc:
        raise APIError(400, f"{field}: not a valid JSON schema: {exc.message}", param=field) from None
    function: dict[str, Any] = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    function["parameters"] = params
    _refuse_special(function, f"{where}.function", specials)
    return {"type": "function", "function": function}


def check_call_args(arguments: str, field: str) -> None:
    """An assistant message's call arguments must be the JSON text of an object (400 naming it)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"{field}: must be the JSON text of an object", param=field)
