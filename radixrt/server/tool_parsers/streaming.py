"""Tool calls from a growing output: content deltas and OpenAI's incremental call deltas.

``ToolStream.update`` takes the whole output so far and returns what is new. The split is the one
``ToolParser.parse`` makes of the finished output, so the deltas reassemble into the non-streamed
answer: content outside regions (leading and trailing whitespace dropped, as ``parse`` strips it), text
that may still become a region start held back, a region reported when it is complete.

JSON formats stream a call before its region is complete: once the region's opening and a name-first
header (``{"name": "f", "arguments": ``) naming an offered function have been written, the call's first
delta (its name) goes out, then the arguments object's characters as they arrive. A region that turns out
malformed after that (cut off by ``max_tokens``, broken JSON) stays a partial call in the stream, where
the non-streamed answer would return its text as content; a finish_reason of ``length`` tells the client.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from radixrt.server.tool_parsers.base import ToolCall, ToolParser
from radixrt.server.tool_parsers.json_scan import ValueScanner, skip_ws


@dataclass(slots=True)
class CallDelta:
    """One piece of call ``index``: its first piece has the ``name`` (and empty ``arguments``)."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class StreamDelta:
    """What one update adds: content text and call pieces (in order)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(slots=True)
class _Live:
    """A call streamed ahead of its region's end."""

    index: int
    name: str
    scanner: ValueScanner
    sent_to: int  # text index up to which its arguments went out


class _Stripped:
    """Content with leading and trailing whitespace dropped, without seeing the end first: trailing
    whitespace is held until more content follows it."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ToolStream:
    """One choice's output, parsed as it grows."""

    def __init__(self, parser: ToolParser, names: Collection[str]) -> None:
        self.parser = parser
        self.names = names
        self.pos = 0  # the text before it is accounted for
        self.region: int | None = None  # start of the open region
        self.live: list[_Live] = []  # the open region's calls streamed so far
        self.next_header: int | None = None  # where the open region's next call header may start
        self.fast = True  # whether the open region may still be streamed ahead
        self.count = 0  # calls reported so far
        self.stripped = _Stripped()

    def update(self, text: str, final: bool = False) -> StreamDelta:
        """The delta of ``text`` (the whole output so far); ``final`` once the output is complete."""
        out = StreamDelta()
        while True:
            if self.region is None:
                start = self.parser.find_region(text, self.pos)
                if start is None:
                    safe = len(text) if final else max(self.pos, self.parser.holdback(text, self.pos))
                    out.content += self.stripped.push(text[self.pos : safe])
                    self.pos = safe
                    return out
                out.content += self.stripped.push(text[self.pos : start])
                self._open(start)
            assert self.region is not None
            end = self.parser.region_end(text, self.region)
            if end is None and not final:
                self._ahead(text, out)
                return out
            end = end or len(text)
            self._ahead(text[:end], out)
            region = text[self.region : end]
            self._settle(self.parser.region_calls(region, self.names), region, out)
            self.region, self.pos = None, end

    @property
    def has_calls(self) -> bool:
        return self.count > 0

    def _open(self, start: int) -> None:
        self.region, self.pos = start, start
        self.live, self.next_header, self.fast = [], None, self.parser.stream_header is not None

    def _ahead(self, text: str, out: StreamDelta) -> None:
        """Stream the open region's calls as far as the fast path can see them."""
        parser, region = self.parser, self.region
        if not self.fast or parser.stream_open is None or parser.stream_header is None or region is None:
            return
        while True:
            if self.live:
                live = self.live[-1]
                end = live.scanner.advance(text)
                upto = len(text) if end is None else end
                if upto > live.sent_to:
                    out.calls.append(CallDelta(live.index, None, text[live.sent_to : upto]))
                    live.sent_to = upto
                if end is None or parser.stream_between is None:
                    return
                between = parser.stream_between.match(text, end)
                if between is None:
                    return
                at = between.end()
            elif self.next_header is None:
                opening = parser.stream_open.match(text, region)
                if opening is None:
                    return
                at = opening.end()
            else:
                at = self.next_header
            self.next_header = at
            header = parser.stream_header.match(text, skip_ws(text, at))
            if header is None:
                return
            if header.group(1) not in self.names:
                self.fast = False  # the region is judged whole when it ends
                return
            index = self.count + len(self.live)
            self.live.append(_Live(index, header.group(1), ValueScanner(header.end()), header.end()))
            self.next_header = None
            out.calls.append(CallDelta(index, header.group(1), ""))

    def _settle(self, calls: list[ToolCall] | None, region: str, out: StreamDelta) -> None:
        """The closed region: the rest of its calls, or its text as content."""
        if calls is None:
            if not self.live:
                out.content += self.stripped.push(region)
            self.count += len(self.live)
            return
        offset = self.region or 0
        for i, call in enumerate(calls):
            if i < len(self.live):
                live = self.live[i]
                sent = region[live.scanner.start - offset : live.sent_to - offset]
                if call.name == live.name and call.arguments.startswith(sent) and call.arguments != sent:
                    out.calls.append(CallDelta(live.index, None, call.arguments[len(sent) :]))
            else:
                index = self.count + i
                out.calls.append(CallDelta(index, call.name, ""))
                out.calls.append(CallDelta(index, None, call.arguments))
        self.count += max(len(calls), len(self.live))
