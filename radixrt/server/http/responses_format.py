"""TokenizerManager results -> Responses API objects: the response, its output items, its usage, and the
typed stream events.

The output of one generation is a list of items: with ``--reasoning-parser``, a ``reasoning`` item for the
model's ``<think>`` text (split off first, as /v1/chat/completions splits ``reasoning_content``), then a
``message`` item for the text (when there is any) and one ``function_call`` item per tool call, split by
the same parser as /v1/chat/completions. A stream
(`ResponseStream`) emits OpenAI's event sequence: ``response.created`` / ``response.in_progress``, then per
item ``response.output_item.added``, its content (``response.reasoning_text.delta``...
``response.reasoning_text.done``; or ``response.content_part.added``,
``response.output_text.delta``... ``response.output_text.done``, ``response.content_part.done``; or
``response.function_call_arguments.delta``... ``.done``), ``response.output_item.done``, and a terminal
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed`` when
aborted) carrying the whole response. Every event has a ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixrt.server.http.openai_format import call_id
from radixrt.server.reasoning_parser import ReasoningPlan, ReasoningStream
from radixrt.server.tool_parsers.base import ToolCall, ToolParser
from radixrt.server.tool_parsers.streaming import ToolStream

Tools = tuple[ToolParser, list[str]]
TokenCounter = Callable[[str], int]


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_event(event: dict[str, Any]) -> bytes:
    """One SSE event: ``event: <type>`` and its JSON ``data``."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def usage_of(meta: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses ``usage`` of one result's ``meta_info`` (``reasoning_tokens``: of its output, the
    reasoning's)."""
    prompt, completion = int(meta["prompt_tokens"]), int(meta["completion_tokens"])
    cached = int(meta.get("cached_tokens", 0))
    return {
        "input_tokens": prompt,
        # written to the cache: the prompt tokens this request computed (the RadixCache keeps them)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
        "total_tokens": prompt + completion,
    }


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """A ``reasoning`` output item holding the model's reasoning text (no summary: none is written)."""
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def reasoning_text(items: list[dict[str, Any]]) -> str:
    """The reasoning text of a response's output items ("" when it has none)."""
    return "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i.get("content") or [])


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id(),
        "name": call.name,
        "arguments": call.arguments,
    }


def output_items(
    text: str, tools: Tools | None, reasoning: ReasoningPlan | None = None
) -> list[dict[str, Any]]:
    """One whole output as items: its reasoning split off first (with ``reasoning``), then with ``tools``
    its calls parsed as the chat route parses them."""
    head: list[dict[str, Any]] = []
    if reasoning is not None:
        split = reasoning.split(text)
        head = [reasoning_item(split.reasoning)] if split.reasoning is not None else []
        text = split.content
    if tools is None:
        return head + [message_item(text)] if text or not head else head
    parsed = tools[0].parse(text, tools[1])
    items = [message_item(parsed.content)] if parsed.content is not None else []
    return head + items + [call_item(c) for c in parsed.calls]


def status_of(meta: dict[str, Any]) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) of a finished result."""
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "abort":
        message = (meta.get("finish_reason") or {}).get("message") or "the request was aborted"
        return "failed", None, {"code": "server_error", "message": str(message)}
    return "completed", None, None


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as one chat assistant message (what a continuation renders again; its reasoning
    as ``reasoning_content``, which templates such as Qwen3's show within the current turn)."""
    content = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    thought = reasoning_text(items)
    return {
        "role": "assistant",
        "content": content,
        **({"reasoning_content": thought} if thought else {}),
        **({"tool_calls": calls} if calls else {}),
    }


@dataclass(slots=True)
class ResponseShell:
    """What a response object says besides its output, fixed when the request arrives: its id, the
    echoed settings, how its output is split (tool calls, reasoning) and how reasoning tokens are counted."""

    id: str
    fields: dict[str, Any]  # the request's settings as the response echoes them
    tools: Tools | None = None
    reasoning: ReasoningPlan | None = None
    count_tokens: TokenCounter = field(default=lambda text: 0)

    def usage(self, meta: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
        """``usage``, its reasoning tokens counted by tokenizing the reasoning text of ``items``."""
        thought = reasoning_text(items)
        return usage_of(meta, self.count_tokens(thought) if thought else 0)

    def build(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.fields["created_at"],
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            "usage": usage,
            **{k: v for k, v in self.fields.items() if k != "created_at"},
        }

    def final(self, out: dict[str, Any]) -> dict[str, Any]:
        """The finished response of one (non-streamed) result."""
        meta = out["meta_info"]
        status, incomplete, error = status_of(meta)
        items = output_items(out["text"], self.tools, self.reasoning)
        return self.build(status, items, self.usage(meta, items), incomplete, error)


def shell_fields(model: str, req: Any, tools: list[dict[str, Any]], previous: str | None) -> dict[str, Any]:
    """The echoed settings of a `ResponsesRequest` ``req``."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "created_at": int(time.time()),
        "model": model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": previous,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": fmt},
        "tool_choice": choice,
        "tools": tools,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }


class ResponseStream:
    """One streamed response: cumulative TokenizerManager snapshots in, typed events out."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.parser = ToolStream(*shell.tools) if shell.tools is not None else None
        self.thinking: ReasoningStream | None = shell.reasoning.stream() if shell.reasoning else None
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open_reasoning: int | None = None  # output index of the reasoning item being written
        self.open_text: int | None = None  # output index of the message item being written
        self.open_call: int | None = None  # output index of the function call being written
        self.sent = 0  # characters of text streamed (no tools)
        self.final: dict[str, Any] | None = None  # the terminal response, once finished

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        shell = self.shell.build("in_progress", [], None)
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def update(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one snapshot (the terminal one when its ``finish_reason`` is set)."""
        meta = out["meta_info"]
        done = bool(meta.get("finish_reason"))
        events: list[dict[str, Any]] = []
        text = out["text"]
        if self.thinking is not None:
            thought, text = self.thinking.update(text, final=done)
            if thought:
                events += self._reasoning(thought)
        if self.parser is None:
            piece = text[self.sent :]
            self.sent = len(text)
            if piece or (done and not self.items):
                events += self._text(piece)
        else:
            delta = self.parser.update(text, final=done)
            if delta.content:
                events += self._text(delta.content)
            for call in delta.calls:
                events += self._call(call.name, call.arguments)
        if done:
            events += self._close_reasoning() + self._close_text() + self._close_call()
            status, incomplete, error = status_of(meta)
            usage = self.shell.usage(meta, self.items)
            self.final = self.shell.build(status, self.items, usage, incomplete, error)
            events.append(self._event(f"response.{status}", response=self.final))
        return events

    def _reasoning(self, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open_reasoning is None:
            self.open_reasoning = len(self.items)
            item = reasoning_item("", "in_progress")
            self.items.append(item)
            added = {**item, "content": []}
            events.append(
                self._event("response.output_item.added", output_index=self.open_reasoning, item=added)
            )
        item = self.items[self.open_reasoning]
        item["content"][0]["text"] += piece
        events.append(self._event("response.reasoning_text.delta", **self._where(item), delta=piece))
        return events

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if self.open_reasoning is None:
            return []
        item = self.items[self.open_reasoning]
        item["status"] = "completed"
        text = item["content"][0]["text"]
        events = [
            self._event("response.reasoning_text.done", **self._where(item), text=text),
            self._event("response.output_item.done", output_index=self.open_reasoning, item=item),
        ]
        self.open_reasoning = None
        return events

    def _text(self, piece: str) -> list[dict[str, Any]]:
        events = self._close_reasoning() + self._close_call()
        if self.open_text is None:
            self.open_text = len(self.items)
            item = message_item("", "in_progress")
            self.items.append(item)
            added = {**item, "content": []}
            events.append(self._event("response.output_item.added", output_index=self.open_text, item=added))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._part("response.content_part.added", part))
        item = self.items[self.open_text]
        item["content"][0]["text"] += piece
        if piece:
            events.append(
                self._event("response.output_text.delta", **self._where(item), delta=piece, logprobs=[])
            )
        return events

    def _part(self, type_: str, part: dict[str, Any]) -> dict[str, Any]:
        assert self.open_text is not None
        return self._event(type_, **self._where(self.items[self.open_text]), part=part)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _close_text(self) -> list[dict[str, Any]]:
        if self.open_text is None:
            return []
        item = self.items[self.open_text]
        item["status"] = "completed"
        part = item["content"][0]
        events = [
            self._event("response.output_text.done", **self._where(item), text=part["text"], logprobs=[]),
            self._part("response.content_part.done", dict(part)),
            self._event("response.output_item.done", output_index=self.open_text, item=item),
        ]
        self.open_text = None
        return events

    def _call(self, name: str | None, arguments: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if name is not None:  # a new call
            events += self._close_reasoning() + self._close_text() + self._close_call()
            self.open_call = len(self.items)
            item = call_item(ToolCall(name, ""), "in_progress")
            self.items.append(item)
            events.append(
                self._event("response.output_item.added", output_index=self.open_call, item=dict(item))
            )
        if arguments and self.open_call is not None:
            item = self.items[self.open_call]
            item["arguments"] += arguments
            where = {"item_id": item["id"], "output_index": self.open_call}
            events.append(self._event("response.function_call_arguments.delta", **where, delta=arguments))
        return events

    def _close_call(self) -> list[dict[str, Any]]:
        if self.open_call is None:
            return []
        item = self.items[self.open_call]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.open_call}
        events = [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=self.open_call, item=item),
        ]
        self.open_call = None
        return events
