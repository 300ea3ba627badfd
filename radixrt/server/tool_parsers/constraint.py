"""The grammar that makes a model write well-formed calls: xgrammar structural tags, printed as EBNF.

``tool_choice`` "required" (or a named function) gets a grammar of calls only: the format's opening, one
call per offered function (its name, then its ``parameters`` schema as a JSON grammar), the format's
separator between calls when ``parallel_tool_calls``, the closing. `auto` in a format with a plain-text
trigger (``<tool_call>``) gets xgrammar's triggered tags: free text until the model writes the trigger,
then a well-formed call, then free text again. The result goes to the worker as an ``ebnf`` constraint
(the same path as ``response_format``), so it is compiled, cached and masked like any other grammar.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    ConstStringFormat,
    Format,
    GrammarFormat,
    OptionalFormat,
    OrFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from radixrt.constrained.json_strings import json_schema_grammar, repair_bounded_strings
from radixrt.server.tool_parsers.base import ToolParser


class ToolSchemaError(ValueError):
    """A tool's ``parameters`` cannot be turned into a grammar; ``index`` is the tool's position."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def _json_value(schema: dict[str, Any], whitespace: bool) -> Format:
    return GrammarFormat(grammar=str(json_schema_grammar(json.dumps(schema), whitespace)))


def _seq(*parts: Format | None) -> Format | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else SequenceFormat(elements=present)


def kwargs_format(schema: dict[str, Any], whitespace: bool) -> Format | None:
    """Python keyword arguments for an object schema: its ``properties`` in order, each value a JSON
    value of its schema, the ``required`` ones always present (None: no arguments at all)."""
    props = list((schema.get("properties") or {}).items())
    required = set(schema.get("required") or [])
    defs: dict[str, Any] = {
        k: schema[k] for k in ("$defs", "definitions") if k in schema
    }  # "$ref"s in values
    values = [_json_value({**sub, **defs}, whitespace) for _, sub in props]

    def rest(i: int, first: bool) -> Format | None:
        if i == len(props):
            return None
        name = props[i][0]
        item = SequenceFormat(
            elements=[ConstStringFormat(value=("" if first else ", ") + f"{name}="), values[i]]
        )
        tail = rest(i + 1, False)
        if name in required:
            return _seq(item, tail)
        if not first:
            return _seq(OptionalFormat(content=item), tail)
        with_item = _seq(item, tail)
        assert with_item is not None
        without = rest(i + 1, True)
        return (
            OptionalFormat(content=with_item) if without is None else OrFormat(elements=[with_item, without])
        )

    return rest(0, True)


def _call_tag(
    parser: ToolParser, index: int, name: str, schema: dict[str, Any], whitespace: bool
) -> TagFormat:
    try:
        if parser.args_style == "kwargs":
            args = kwargs_format(schema, whitespace)
            content: Format = args if args is not None else ConstStringFormat(value="")
        else:
            content = _json_value(schema, whitespace)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses for schemas it cannot use
        raise ToolSchemaError(index, f"cannot be used as a grammar: {exc}") from None
    return TagFormat(begin=parser.call_begin(name), content=content, end=parser.call_end())


def tool_grammar(
    parser: ToolParser,
    tools: list[tuple[str, dict[str, Any]]],
    required: bool,
    parallel: bool,
    whitespace: bool,
) -> str | None:
    """EBNF for calls to ``tools`` ((name, parameters) pairs): calls only when ``required``, else free
    text with calls after the parser's ``auto_trigger`` (None when the format has no such trigger).
    ToolSchemaError names the tool whose schema is unusable."""
    if not required and parser.auto_trigger is None:
        return None
    tags = [_call_tag(parser, i, name, schema, whitespace) for i, (name, schema) in enumerate(tools)]
    fmt: Format
    if required:
        calls = TagsWithSeparatorFormat(
            tags=tags, separator=parser.separator, at_least_one=True, stop_after_first=not parallel
        )
        opening = ConstStringFormat(value=parser.list_open) if parser.list_open else None
        closing = ConstStringFormat(value=parser.list_close) if parser.list_close else None
        fmt = _seq(opening, calls, closing) or calls
    else:
        assert parser.auto_trigger is not None
        fmt = TriggeredTagsFormat(triggers=[parser.auto_trigger], tags=tags, stop_after_first=not parallel)
    grammar = xgr.Grammar.from_structural_tag(StructuralTag(format=fmt))
    return repair_bounded_strings(str(grammar))
