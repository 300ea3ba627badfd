"""TokenizerManager results -> OpenAI response objects and stream chunks.

A formatter serves one request: ``response`` builds the whole answer from the final results (one per
choice, in choice order), ``chunks`` turns one cumulative stream snapshot into the delta chunks the
client has not seen yet, ``usage_chunk`` is the closing usage-only chunk. Logprob entries arrive as
``[logprob, token_id, token_text]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from radixrt.server.reasoning_parser import ReasoningPlan, ReasoningStream
from radixrt.server.tool_parsers.base import ToolParser
from radixrt.server.tool_parsers.streaming import ToolStream

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_fields(meta: dict[str, Any]) -> tuple[str | None, Any]:
    """OpenAI ``finish_reason`` and SGLang's ``matched_stop`` of a result."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return _FINISH.get(reason.get("type", ""), reason.get("type")), reason.get("matched")


def _entry(e: list[Any]) -> dict[str, Any]:
    text = e[2] if e[2] is not None else ""
    return {"token": text, "logprob": e[0], "bytes": list(text.encode("utf-8"))}


class _Formatter:
    prefix = ""

    def __init__(self, model: str, n: int, include_usage: bool, rid: str | None = None) -> None:
        self.id = f"{self.prefix}-{rid or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.sent_text: dict[int, int] = {}
        self.sent_lp: dict[int, int] = {}
        self.last: dict[int, dict[str, Any]] = {}

    def usage(self, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Token counts: each prompt once (its n choices share it), every choice's completion."""
        prompt = cached = completion = 0
        groups: dict[int, list[dict[str, Any]]] = {}
        for index, res in results.items():
            groups.setdefault(index // self.n, []).append(res["meta_info"])
            completion += res["meta_info"]["completion_tokens"]
        for metas in groups.values():
            prompt += metas[0]["prompt_tokens"]
            cached += min(m["cached_tokens"] for m in metas)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, index: int, out: dict[str, Any], first: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    chunk_object = ""

    def chunks(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks for one cumulative snapshot of choice ``out.get("index", 0)``."""
        index = out.get("index", 0)
        first = index not in self.last
        self.last[index] = out
        choice = self.delta_choice(index, out, first)
        chunks = [] if choice is None else [self._envelope(self.chunk_object, [choice])]
        if self.include_usage:
            for c in chunks:
                c["usage"] = None
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = self.usage(self.last)
        return chunk

    def _new_text(self, index: int, text: str) -> str:
        sent = self.sent_text.get(index, 0)
        self.sent_text[index] = max(sent, len(text))
        return text[sent:]

    def _new_logprobs(self, index: int, meta: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        sent = self.sent_lp.get(index, 0)
        self.sent_lp[index] = len(entries)
        return entries[sent:], tops[sent:]


def call_id() -> str:
    """A tool call's ``id``, as OpenAI spells them."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatFormatter(_Formatter):
    """/v1/chat/completions answers; with ``reasoning`` the reasoning is split off first
    (``reasoning_content``), then with ``tools`` (the parser and the offered function names) the rest
    is split into content and ``tool_calls``."""

    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        n: int,
        include_usage: bool,
        logprobs: bool,
        rid: str | None = None,
        tools: tuple[ToolParser, list[str]] | None = None,
        reasoning: ReasoningPlan | None = None,
    ) -> None:
        super().__init__(model, n, include_usage, rid)
        self.logprobs = logprobs
        self.tools = tools
        self.reasoning = reasoning
        self.streams: dict[int, ToolStream] = {}
        self.thinking: dict[int, ReasoningStream] = {}

    def _message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The reply message (reasoning, content and calls) and the finish reason (``tool_calls`` when
        it called)."""
        if self.reasoning is None:
            return self._answer(text, reason)
        split = self.reasoning.split(text)
        message, reason = self._answer(split.content, reason)
        message["reasoning_content"] = split.reasoning
        return message, reason

    def _answer(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": text}, reason
        parsed = self.tools[0].parse(text, self.tools[1])
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if not parsed.calls:
            return message, reason
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
        return message, "tool_calls" if reason == "stop" else reason

    def chunks(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        """With reasoning: the new reasoning as ``delta.reasoning_content`` on the snapshot's first chunk,
        the answer's chunks as below from the answer's text so far."""
        if self.reasoning is None:
            return self._answer_chunks(out)
        index = out.get("index", 0)
        reason, _ = finish_fields(out["meta_info"])
        thinking = self.thinking.setdefault(index, self.reasoning.stream())
        new, content = thinking.update(out["text"], final=reason is not None)
        chunks = self._answer_chunks({**out, "text": content})
        if new:
            if not chunks:
                empty = {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": None,
                    "matched_stop": None,
                }
                chunks = [self._envelope(self.chunk_object, [empty])]
                if self.include_usage:
                    chunks[0]["usage"] = None
            choice = chunks[0]["choices"][0]
            choice["delta"] = {**choice["delta"], "reasoning_content": new}
        return chunks

    def _answer_chunks(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        """With tools: the content delta, then one chunk per call piece (a call's first chunk carries
        its index, id, type, name and empty arguments; later ones pieces of the arguments)."""
        if self.tools is None:
            return super().chunks(out)
        index = out.get("index", 0)
        first = index not in self.last
        self.last[index] = out
        meta = out["meta_info"]
        reason, matched = finish_fields(meta)
        stream = self.streams.setdefault(index, ToolStream(*self.tools))
        delta = stream.update(out["text"], final=reason is not None)
        entries, tops = self._new_logprobs(index, meta)
        deltas: list[dict[str, Any]] = []
        if first or delta.content or entries:
            deltas.append(
                {"role": "assistant", "content": delta.content} if first else {"content": delta.content}
            )
        for piece in delta.calls:
            if piece.name is not None:
                fn = {"name": piece.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": piece.index, "id": call_id(), "type": "function", "function": fn}
                        ]
                    }
                )
            if piece.arguments:
                deltas.append(
                    {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}
                )
        if reason is not None:
            deltas = deltas or [{}]
            reason = "tool_calls" if reason == "stop" and stream.has_calls else reason
        chunks = []
        for k, d in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {
                "index": index,
                "delta": d,
                "logprobs": self._logprobs(entries, tops) if k == 0 and entries else None,
                "finish_reason": reason if last else None,
                "matched_stop": matched if last else None,
            }
            chunk = self._envelope(self.chunk_object, [choice])
            if self.include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def _logprobs(self, entries: list[Any], tops: list[Any]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for i, e in enumerate(entries):
            item = _entry(e)
            item["top_logprobs"] = [_entry(t) for t in (tops[i] or [])] if i < len(tops) else []
            content.append(item)
        return {"content": content}

    def response(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for i, res in enumerate(results):
            meta = res["meta_info"]
            reason, matched = finish_fields(meta)
            lp = self._logprobs(
                meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
            )
            message, reason = self._message(res["text"], reason)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        body = self._envelope("chat.completion", choices)
        body["usage"] = self.usage(dict(enumerate(results)))
        return body

    def delta_choice(self, index: int, out: dict[str, Any], first: bool) -> dict[str, Any] | None:
        meta = out["meta_info"]
        text = self._new_text(index, out["text"])
        entries, tops = self._new_logprobs(index, meta)
        reason, matched = finish_fields(meta)
        if not (first or text or entries or reason):
            return None
        delta: dict[str, Any] = (
            {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        )
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(entries, tops) if entries else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }


class CompletionFormatter(_Formatter):
    """/v1/completions answers (legacy logprobs format; ``echo`` prepends the prompt)."""

    prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(
        self,
        model: str,
        n: int,
        include_usage: bool,
        logprobs: int | None,
        echo_texts: list[str] | None,
        rid: str | None = None,
    ) -> None:
        super().__init__(model, n, include_usage, rid)
        self.logprobs = logprobs
        self.echo_texts = echo_texts
        self.offsets: dict[int, int] = {}

    def _legacy(self, index: int, entries: list[Any], tops: list[Any]) -> dict[str, Any]:
        offset = self.offsets.get(index, 0)
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            token = e[2] or ""
            out["tokens"].append(token)
            out["token_logprobs"].append(e[0])
            top = tops[i] if i < len(tops) else None
            out["top_logprobs"].append(None if top is None else {t[2] or "": t[0] for t in top})
            out["text_offset"].append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return out

    def _echo(self, index: int, meta: dict[str, Any]) -> tuple[str, list[Any], list[Any]]:
        if self.echo_texts is None:
            return "", [], []
        text = self.echo_texts[index // self.n]
        return text, meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []

    def response(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for i, res in enumerate(results):
            meta = res["meta_info"]
            reason, matched = finish_fields(meta)
            echo, in_lp, in_top = self._echo(i, meta)
            lp = None
            if self.logprobs is not None:
                entries = in_lp + (meta.get("output_token_logprobs") or [])
                tops = in_top + (meta.get("output_top_logprobs") or [])
                lp = self._legacy(i, entries, tops)
            choices.append(
                {
                    "index": i,
                    "text": echo + res["text"],
                    "logprobs": lp,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        body = self._envelope("text_completion", choices)
        body["usage"] = self.usage(dict(enumerate(results)))
        return body

    def delta_choice(self, index: int, out: dict[str, Any], first: bool) -> dict[str, Any] | None:
        meta = out["meta_info"]
        text = self._new_text(index, out["text"])
        entries, tops = self._new_logprobs(index, meta)
        if first:
            echo, in_lp, in_top = self._echo(index, meta)
            text, entries, tops = echo + text, in_lp + entries, in_top + tops
        reason, matched = finish_fields(meta)
        if not (text or entries or reason):
            return None
        lp = self._legacy(index, entries, tops) if self.logprobs is not None else None
        return {
            "index": index,
            "text": text,
            "logprobs": lp,
            "finish_reason": reason,
            "matched_stop": matched,
        }
