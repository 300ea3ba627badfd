"""Tool-call parsers (radixrt/server/tool_parsers): each family on well-formed, malformed and partial output,
and the streaming split against the whole-output split (the oracle: ``ToolParser.parse``)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from radixrt.config.server_args import TOOL_CALL_PARSERS
from radixrt.server.tool_parsers.base import ToolCall
from radixrt.server.tool_parsers.registry import PARSERS, get_parser, parser_for_template, template_has_tools
from radixrt.server.tool_parsers.streaming import ToolStream

NAMES = ["get_weather", "search"]
ARGS = '{"city": "Paris", "nested": {"list": [1, {"brace": "}]{["}], "quote": "a\\"b"}, "unit": null}'


def stream(parser_name: str, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """The stream's deltas for ``text`` arriving cut at ``cuts``, reassembled as a client does."""
    s = ToolStream(get_parser(parser_name), NAMES)
    content = ""
    calls: dict[int, list[str]] = {}
    pieces = [text[:c] for c in sorted(set(cuts)) if 0 < c < len(text)]
    for i, prefix in enumerate([*pieces, text]):
        delta = s.update(prefix, final=i == len(pieces))
        content += delta.content
        for piece in delta.calls:
            if piece.name is not None:
                assert piece.index not in calls and piece.arguments == ""  # the first delta: name only
                assert piece.index == len(calls)  # one new index per call, in order
                calls[piece.index] = [piece.name, ""]
            else:
                calls[piece.index][1] += piece.arguments
    return content or None, [(n, a) for n, a in calls.values()]


def whole(parser_name: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = get_parser(parser_name).parse(text, NAMES)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


def assert_streams_like_whole(parser_name: str, text: str, seed: int = 0) -> None:
    """Every way of cutting the text (one character at a time, random chunks) reassembles to ``parse``."""
    expected = whole(parser_name, text)
    assert stream(parser_name, text, list(range(len(text)))) == expected
    rng = random.Random(seed)
    for _ in range(20):
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6)))
        assert stream(parser_name, text, cuts) == expected


# (parser, output, expected content, expected calls)
WELL_FORMED: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    ("qwen25", f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>', None,
     [("get_weather", ARGS)]),
    ("qwen25", 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {}, "name": "get_weather"}\n</tool_call>', "Let me look.",
     [("search", '{"q": "x"}'), ("get_weather", "{}")]),
    ("qwen25", '<tool_call>{"name":"search","arguments":{"q":"compact"}}</tool_call>', None,
     [("search", '{"q":"compact"}')]),
    ("llama3", f'{{"name": "get_weather", "parameters": {ARGS}}}', None, [("get_weather", ARGS)]),
    ("llama3", '<|python_tag|>{"name": "search", "parameters": {"q": "a"}}; {"name": "search", "parameters": {}}',
     None, [("search", '{"q": "a"}'), ("search", "{}")]),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
                '{"name": "search", "arguments": {"q": "]"}}]', None,
     [("get_weather", ARGS), ("search", '{"q": "]"}')]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "search", "arguments": {}}] done', "Sure.  done", [("search", "{}")]),
    ("mistral", '[{"name": "search", "arguments": {"q": 1}}]', None, [("search", '{"q": 1}')]),
    ("pythonic", '[get_weather(city="Paris", days=3, exact=true, note=None), search(q=\'x\')]', None,
     [("get_weather", '{"city": "Paris", "days": 3, "exact": true, "note": null}'), ("search", '{"q": "x"}')]),
    ("pythonic", 'See [1]. [search(q="a]b", tags=["x", {"k": [1]}])]', "See [1].",
     [("search", '{"q": "a]b", "tags": ["x", {"k": [1]}]}')]),
    ("pythonic", "[search()]", None, [("search", "{}")]),
]  # fmt: skip

# Malformed after a name-first header: the stream has sent the call by then (the documented limit).
MALFORMED_AFTER_HEADER: list[tuple[str, str, str]] = [
    ("qwen25", '<tool_call>\n{"name": "search", "arguments": {"q": "x"}\n</tool_call>', '{"q": "x"}'),
    ("qwen25", '<tool_call>\n{"name": "search", "arguments": {}, "extra": 1}\n</tool_call>', "{}"),
    ("qwen25", '<tool_call>\n{"name": "search", "arguments": {}} trailing\n</tool_call>', "{}"),
    ("llama3", '{"name": "search", "parameters": {}} and then prose', "{}"),
]
MALFORMED: list[tuple[str, str]] = [
    ("qwen25", '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>'),  # not offered
    (
        "qwen25",
        '<tool_call>\n{"name": "search", "arguments": "q=x"}\n</tool_call>',
    ),  # arguments not an object
    ("qwen25", '<tool_call>\n{"arguments": {}, "name": "search"} x\n</tool_call>'),
    ("qwen25", "I would write <tool_call> here, and </tool_call> there"),
    ("llama3", '{"answer": 42}'),
    ("llama3", 'Text first {"name": "search", "parameters": {}}'),  # JSON calls only from the start
    ("llama3", '{"parameters": {}, "name": "search"} and then prose'),
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", '[TOOL_CALLS] [{"name": "search"}, 3]'),
    ("mistral", "[1, 2, 3] is a list"),
    ("pythonic", "[search(q=some_variable)]"),  # not a literal
    ("pythonic", '[search("positional")]'),
    ("pythonic", "[search(q={1, 2})]"),  # a set has no JSON
    ("pythonic", "[search(q=1), 5]"),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), WELL_FORMED)
def test_well_formed(parser: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert whole(parser, text) == (content, calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)  # arguments are always the JSON text of an object
    assert_streams_like_whole(parser, text)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_stays_content(parser: str, text: str) -> None:
    assert whole(parser, text) == (text.strip(), [])
    assert_streams_like_whole(parser, text)


@pytest.mark.parametrize(("parser", "text", "streamed_args"), MALFORMED_AFTER_HEADER)
def test_malformed_after_the_header(parser: str, text: str, streamed_args: str) -> None:
    """Content when parsed whole; a call with the arguments written before it broke when streamed."""
    assert whole(parser, text) == (text.strip(), [])
    assert stream(parser, text, list(range(len(text)))) == (None, [("search", streamed_args)])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("qwen25", 'Thinking <tool_call>\n{"name": "search", "argu'),
        ("qwen25", "Almost a tag <tool_ca"),
        ("llama3", '{"name": "search", "parameters": {"q": "unfinished'),
        ("mistral", '[TOOL_CALLS] [{"name": "search", "arguments": {"q": 1}}, {"na'),
        ("pythonic", '[search(q="open'),
    ],
)
def test_cut_off_output_is_content(parser: str, text: str) -> None:
    """An output that ends inside a call (max_tokens) has no call: its text is the content."""
    assert whole(parser, text) == (text.strip(), [])


def test_stream_holds_back_a_possible_opening() -> None:
    s = ToolStream(get_parser("qwen25"), NAMES)
    assert s.update("Hello <tool").content == "Hello"  # " <tool" may open a call
    assert s.update("Hello <tool_c").content == ""
    assert s.update("Hello <tool_cx").content == " <tool_cx"  # it did not
    assert s.update("Hello <tool_cx  ", final=True).content == ""  # trailing whitespace is dropped


def test_stream_sends_arguments_while_they_are_written() -> None:
    """JSON formats: the name as soon as the header is written, then the arguments piece by piece."""
    s = ToolStream(get_parser("qwen25"), NAMES)
    head = '<tool_call>\n{"name": "search", "arguments": '
    assert s.update(head).calls == []  # the arguments object has not started
    first = s.update(head + '{"q": "ab').calls
    assert [(c.index, c.name, c.arguments) for c in first] == [(0, "search", ""), (0, None, '{"q": "ab')]
    more = s.update(head + '{"q": "abcd"}').calls
    assert [(c.name, c.arguments) for c in more] == [(None, 'cd"}')]
    assert s.update(head + '{"q": "abcd"}}\n</tool_call>', final=True).calls == []
    assert s.has_calls


def test_stream_of_a_call_cut_off_after_its_header() -> None:
    """Documented limit: a call streamed ahead stays a (partial) call when the output then stops."""
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "ab'
    assert stream("qwen25", text, list(range(len(text)))) == (None, [("search", '{"q": "ab')])
    assert whole("qwen25", text) == (text, [])


def test_stream_without_the_fast_path_reports_whole_calls() -> None:
    """Arguments before the name, or a function not offered: judged when the region is complete."""
    text = '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>'
    assert stream("qwen25", text, list(range(len(text)))) == (None, [("search", '{"q": "x"}')])
    bad = '<tool_call>\n{"name": "other", "arguments": {"q": "x"}}\n</tool_call>'
    assert stream("qwen25", bad, list(range(len(bad)))) == (bad, [])


def random_output(rng: random.Random, parser: str) -> str:
    """Prose and well-formed calls in the parser's own format, mixed."""
    p = get_parser(parser)
    words = ["Sure", "the", "[1]", "{x}", "<b>", "a,b", "call", "\n", " ", "tool"]
    calls = [
        ToolCall(
            rng.choice(NAMES), json.dumps({"k": rng.randint(0, 99), "s": rng.choice(["a]", "}{", "q\"'"])})
        )
        for _ in range(rng.randint(1, 3))
    ]
    if parser in ("qwen25", "mistral"):  # calls may follow prose
        prose = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        return prose + " " + p.render_calls(calls) + rng.choice(["", "\n", " done"])
    return p.render_calls(calls)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_rendered_calls_parse_back_and_stream_alike(parser: str) -> None:
    """``render_calls`` (how the constraint and the generic prompt write calls) round-trips through
    ``parse``; random outputs stream to what ``parse`` returns."""
    rng = random.Random(parser)
    for _ in range(25):
        calls = [
            ToolCall(rng.choice(NAMES), json.dumps({"a": [rng.random()], "b": "x\\y"})) for _ in range(2)
        ]
        parsed = get_parser(parser).parse(get_parser(parser).render_calls(calls), NAMES)
        assert parsed.content is None
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
            (c.name, json.loads(c.arguments)) for c in calls
        ]
        text = random_output(rng, parser)
        assert_streams_like_whole(parser, text, seed=rng.randint(0, 1000))


def test_registry_names_match_the_flag_choices() -> None:
    assert tuple(PARSERS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="qwen25"):
        get_parser("nope")


QWEN_LIKE = "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>"
TEMPLATES: list[tuple[Any, bool, str | None]] = [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False, None),  # ChatML-like: no tools
    (QWEN_LIKE, True, "qwen25"),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", True, "mistral"),
    ("{% if tools %}{{ '<|python_tag|>' }}{% endif %}", True, "llama3"),
    ("{% if tools %}[func_name1(params_name1=params_value1)]{% endif %}", True, "pythonic"),
    ({"default": "plain", "tool_use": QWEN_LIKE}, True, "qwen25"),
]


@pytest.mark.parametrize(("template", "has_tools", "parser"), TEMPLATES)
def test_default_parser_from_the_template(template: Any, has_tools: bool, parser: str | None) -> None:
    assert template_has_tools(template) is has_tools
    assert parser_for_template(template) == parser
