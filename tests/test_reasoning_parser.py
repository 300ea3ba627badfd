"""The reasoning parsers (qwen3, deepseek-r1) on whole and growing outputs, and the chat formatter's
reasoning_content: streamed deltas reassemble to exactly the non-streamed message, tool calls included,
read back through the openai client's own types."""

from __future__ import annotations

import json
import random
from typing import Any

import openai.types.chat as oai
import pytest

from radixrt.config.server_args import REASONING_PARSERS
from radixrt.server.http.openai_format import ChatFormatter
from radixrt.server.reasoning_parser import (
    FORMATS,
    ReasoningPlan,
    get_reasoning_format,
    prompt_opens_reasoning,
    split,
)
from radixrt.server.tool_parsers.registry import get_parser

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# (format, opened, output) -> (reasoning, content)
CASES: list[tuple[Any, bool, str, str | None, str]] = [
    (QWEN3, False, "<think>\nLet me add.\n</think>\n\nIt is 4.", "Let me add.", "It is 4."),
    (QWEN3, False, "  <think>a</think>b", "a", "b"),
    (QWEN3, False, "It is 4.", None, "It is 4."),
    (QWEN3, False, "It is <think>4</think>.", None, "It is <think>4</think>."),  # not at the start
    (QWEN3, False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (QWEN3, False, "<think></think>\n\nNo thoughts.", None, "No thoughts."),
    (QWEN3, False, f"<think>I call it.\n{CALL}", "I call it.", CALL),  # <tool_call> ends the reasoning
    (QWEN3, False, f"<think>Call.</think>\n{CALL}", "Call.", CALL),
    (QWEN3, True, "\nopened by the prompt\n</think>\n\nyes", "opened by the prompt", "yes"),
    (QWEN3, True, "never closed", "never closed", ""),
    (R1, False, "No opening tag here.</think>The answer.", "No opening tag here.", "The answer."),
    (R1, False, "<think>\nWith one.\n</think>\n\nThe answer.", "With one.", "The answer."),
    (R1, False, "all reasoning, cut off", "all reasoning, cut off", ""),
    (R1, False, f"r1 does not stop at {CALL}", f"r1 does not stop at {CALL}", ""),
    (R1, False, "a</think>b</think>c", "a", "b</think>c"),
    (R1, False, "</think>", None, ""),
]


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "content"), CASES)
def test_split_whole_output(fmt: Any, opened: bool, text: str, reasoning: str | None, content: str) -> None:
    s = split(fmt, text, opened=opened)
    assert (s.reasoning, s.content, s.done) == (reasoning, content, True)


def _grow(fmt: Any, opened: bool, text: str, cuts: list[int], stream: bool) -> list[tuple[str, str]]:
    """(reasoning, content) reported after each cut, the last one final."""
    plan = ReasoningPlan(fmt, opened, stream)
    rs, out, answer = plan.stream(), [], ""
    for k, cut in enumerate(cuts):
        new, answer_so_far = rs.update(text[:cut], final=k == len(cuts) - 1)
        assert answer_so_far.startswith(answer), "the answer so far only grows"
        answer = answer_so_far
        out.append((new, answer))
    return out


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("stream", [True, False])
def test_every_prefix_reassembles_to_the_whole(
    fmt: Any, opened: bool, text: str, reasoning: str | None, content: str, stream: bool
) -> None:
    """One character at a time and in random chunks: the reasoning deltas join to the whole output's
    reasoning, the last answer is its content, no partial tag ever leaks into the reasoning."""
    rng = random.Random(0)
    cutsets = [list(range(len(text) + 1))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(1, 6))))
        cutsets.append(cuts if cuts[-1] == len(text) else [*cuts, len(text)])
    for cuts in cutsets:
        steps = _grow(fmt, opened, text, cuts, stream)
        assert "".join(r for r, _ in steps) == (reasoning or "")
        assert steps[-1][1] == content
        for r, _ in steps:
            assert not r.endswith(("<", "</", "</think"))
        if not stream and reasoning:
            assert [r for r, _ in steps if r] == [reasoning], "stream_reasoning off: one piece"


def test_partial_tags_are_held() -> None:
    assert split(QWEN3, "<thi", final=False).content == ""
    assert split(QWEN3, "<thi", final=True).content == "<thi"
    assert split(QWEN3, "<b>bold", final=False).content == "<b>bold"
    assert split(R1, "thinking</thi", final=False).reasoning == "thinking"
    assert split(R1, "thinking  \n", final=False).reasoning == "thinking"
    assert split(QWEN3, "<think>x <tool_ca", final=False).reasoning == "x"
    assert split(R1, "x <tool_ca", final=False).reasoning == "x <tool_ca"  # not an r1 interrupt


def test_formats_and_flag_choices_agree() -> None:
    assert tuple(FORMATS) == REASONING_PARSERS
    with pytest.raises(ValueError, match="reasoning_parser: unknown 'o1'"):
        get_reasoning_format("o1")
    assert prompt_opens_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_opens_reasoning(R1, "<|im_start|>assistant\n")


# -- the chat formatter --------------------------------------------------------------------------------


def _out(text: str, finish: str | None, completion_tokens: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": completion_tokens, "cached_tokens": 0}
    meta["finish_reason"] = {"type": finish} if finish else None
    return {"text": text, "meta_info": meta, "index": 0}


def _reassemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client builds from the chunks, read through the openai client's chunk type."""
    reasoning, content, calls, finish = "", "", {}, None
    for raw in chunks:
        chunk = oai.ChatCompletionChunk.model_validate(raw)
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += (c.function.name if c.function else None) or ""
            entry["arguments"] += (c.function.arguments if c.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    return {
        "reasoning": reasoning or None,
        "content": content,
        "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()],
        "finish": finish,
    }


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("stream", [True, False])
def test_formatter_stream_equals_response(
    fmt: Any, opened: bool, text: str, reasoning: str | None, content: str, tools: bool, stream: bool
) -> None:
    parsing = (get_parser("qwen25"), ["get_weather"]) if tools else None

    def formatter() -> ChatFormatter:
        return ChatFormatter("m", 1, False, False, "r", parsing, ReasoningPlan(fmt, opened, stream))

    body = formatter().response([_out(text, "stop", 9)])
    message = oai.ChatCompletion.model_validate(body).choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == reasoning
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    if tools and content.startswith("<tool_call>"):
        assert calls == [("get_weather", {"city": "Paris"})] and not message.content
    else:
        assert (message.content or "") == content and not calls
    f = formatter()
    chunks = [c for k in range(1, len(text) + 1) for c in f.chunks(_out(text[:k], None, k))]
    chunks += f.chunks(_out(text, "stop", 9))
    got = _reassemble(chunks)
    assert got == {
        "reasoning": reasoning,
        "content": message.content or "",
        "calls": calls,
        "finish": body["choices"][0]["finish_reason"],
    }


def test_formatter_without_reasoning_has_no_field() -> None:
    body = ChatFormatter("m", 1, False, False, "r").response([_out("<think>x</think>y", "stop", 3)])
    assert "reasoning_content" not in body["choices"][0]["message"]
