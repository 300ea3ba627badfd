"""Reasoning on /v1/responses, without a server: whole outputs and streams of snapshots.

Oracles: the reasoning parser's own split of the whole text (``reasoning`` item = its reasoning, message =
its answer, calls = the tool parser's calls of the answer), the ``openai`` package's own event and response
types (every event and the final response must validate against them), and the non-streamed response
(the stream's final response must equal it, item by item, for every way of cutting the output into
snapshots). Outputs that close their reasoning are written here by hand, since the tests' random model
never writes ``</think>``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixrt.server.http.responses_format import ResponseShell, ResponseStream, assistant_message
from radixrt.server.reasoning_parser import ReasoningPlan, get_reasoning_format, split
from radixrt.server.tool_parsers.registry import get_parser

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CASES = [
    ("qwen3", False, "<think>\nThe user wants Oslo.\nCheck the tool.\n</think>\n\nIt is sunny."),
    ("qwen3", False, "No reasoning here, only an answer."),
    ("qwen3", False, "<think>Call the tool.</think>\n" + CALL),
    ("qwen3", False, "<think>Interrupted by a call " + CALL),
    ("qwen3", True, "Opened by the prompt.\n</think>\n\nAnswer."),
    ("deepseek-r1", False, "Forced reasoning first.</think>The answer."),
    ("deepseek-r1", False, "<think>Never closed, cut off by the limit"),
]


def _shell(fmt: str, opened: bool, tools: bool, stream_reasoning: bool = True) -> ResponseShell:
    fields = {"created_at": 0, "model": "m", "tool_choice": "auto", "tools": [], "parallel_tool_calls": True}
    return ResponseShell(
        "resp_x",
        fields,
        tools=(get_parser("qwen25"), ["get_weather"]) if tools else None,
        reasoning=ReasoningPlan(get_reasoning_format(fmt), opened, stream_reasoning),
        count_tokens=lambda text: len(text.split()),
    )


def _out(text: str, done: bool, reason: str = "stop") -> dict[str, Any]:
    meta: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": 40, "cached_tokens": 0}
    meta["finish_reason"] = {"type": reason} if done else None
    return {"text": text, "meta_info": meta}


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


@pytest.mark.parametrize(("fmt", "opened", "text"), CASES)
@pytest.mark.parametrize("tools", [False, True])
def test_whole_output_items_follow_the_parsers(fmt: str, opened: bool, text: str, tools: bool) -> None:
    shell = _shell(fmt, opened, tools)
    response = shell.final(_out(text, True))
    Response.model_validate(response)
    want = split(get_reasoning_format(fmt), text, opened=opened)
    kinds = [i["type"] for i in response["output"]]
    if want.reasoning is None:
        assert "reasoning" not in kinds
    else:
        assert kinds[0] == "reasoning"
        assert response["output"][0]["content"][0]["text"] == want.reasoning
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == len(want.reasoning.split())
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    if tools and CALL in text:
        assert [c["name"] for c in calls] == ["get_weather"]
        assert calls[0]["arguments"].replace(" ", "") == '{"city":"Oslo"}'
    else:
        assert not calls
        message = "".join(
            p["text"] for i in response["output"] if i["type"] == "message" for p in i["content"]
        )
        assert message == want.content
    # what a continuation renders again: the reasoning as reasoning_content
    again = assistant_message(response["output"])
    assert again.get("reasoning_content") == want.reasoning


@pytest.mark.parametrize(("fmt", "opened", "text"), CASES)
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_stream_reassembles_to_the_whole_response(
    fmt: str, opened: bool, text: str, tools: bool, stream_reasoning: bool
) -> None:
    whole = _shell(fmt, opened, tools, stream_reasoning).final(_out(text, True))
    rng = random.Random(hash((fmt, text, tools)) & 0xFFFF)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        stream = ResponseStream(_shell(fmt, opened, tools, stream_reasoning))
        events = stream.start()
        for cut in cuts:
            events += stream.update(_out(text[:cut], False))
        events += stream.update(_out(text, True))
        for event in events:
            EVENTS.validate_python(event)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        assert _strip_ids(final["output"]) == _strip_ids(whole["output"])
        assert final["usage"] == whole["usage"]
        # every item added is done once, in output order, and its deltas add up to it
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
        assert added == done == list(range(len(final["output"])))
        thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        texts = [i["content"][0]["text"] for i in final["output"] if i["type"] == "reasoning"]
        assert thought == "".join(texts)
        if not stream_reasoning:
            assert sum(e["type"] == "response.reasoning_text.delta" for e in events) <= 1
