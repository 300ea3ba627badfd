"""Reasoning output: a model's ``<think>...</think>`` text split from its answer (``--reasoning-parser``).

Two formats, named as SGLang names them:

- ``qwen3``: reasoning only when the output opens with ``<think>`` (leading whitespace allowed), or when
  the prompt itself ends with ``<think>`` (templates that open the block for the model); it ends at
  ``</think>``, or at a ``<tool_call>`` written before ``</think>`` (that text stays the answer's, for the
  tool parser);
- ``deepseek-r1``: the output *is* reasoning from its first token, with or without an opening ``<think>``
  (DeepSeek-R1 writes none, R1-0528 writes one), up to ``</think>``.

An output that never closes its reasoning (cut off by ``max_tokens``) is all reasoning. The reasoning is
stripped of surrounding whitespace, the answer of its leading whitespace; an empty reasoning is None.

`split` works on the whole output so far, so a stream is the finished output's split read early: what it
reports while the output grows (``final`` false) is always a prefix of what it reports at the end. It
holds back text that may still turn out to be a tag (``</thi``), whitespace that may end the reasoning,
and, with ``stream_reasoning`` off, the whole reasoning until it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one model family marks its reasoning."""

    name: str
    forced: bool  # reasoning from the first token, opening tag or not
    start: str = "<think>"
    end: str = "</think>"
    interrupts: tuple[str, ...] = ()  # texts that end the reasoning without ``end`` (and stay content)


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", forced=False, interrupts=("<tool_call>",)),
    "deepseek-r1": ReasoningFormat("deepseek-r1", forced=True),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format ``--reasoning-parser NAME`` names (ValueError listing the known ones)."""
    if name not in FORMATS:
        raise ValueError(f"reasoning_parser: unknown {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return FORMATS[name]


@dataclass(frozen=True, slots=True)
class Split:
    """An output's reasoning (None: none, or none reported yet) and its answer (``content``)."""

    reasoning: str | None
    content: str
    done: bool  # the reasoning is complete (closed, interrupted, or there is none)


def _held_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        tail = text[-n:]
        if any(len(tag) > n and tag.startswith(tail) for tag in tags):
            return n
    return 0


def split(
    fmt: ReasoningFormat,
    text: str,
    *,
    opened: bool = False,
    final: bool = True,
    stream_reasoning: bool = True,
) -> Split:
    """Split ``text`` (the whole output so far; ``final`` once it is complete). ``opened``: the prompt
    ended inside a reasoning block (its last text is ``<think>``)."""
    lead = text.lstrip()
    body_at = len(text) - len(lead)
    if not final and len(lead) < len(fmt.start) and fmt.start.startswith(lead):
        return Split(None, "", False)  # empty so far, or a partial ``<think>``
    if lead.startswith(fmt.start):
        body_at += len(fmt.start)
    elif not (fmt.forced or opened):
        return Split(None, text, True)
    body = text[body_at:]
    cut, after = len(body), len(body)
    for tag, keep in ((fmt.end, False), *((t, True) for t in fmt.interrupts)):
        at = body.find(tag)
        if 0 <= at < cut:
            cut, after = at, at if keep else at + len(tag)
    if cut < len(body):
        return Split(body[:cut].strip() or None, body[after:].lstrip(), True)
    if final:
        return Split(body.strip() or None, "", True)
    if not stream_reasoning:
        return Split(None, "", False)
    held = _held_tag(body, (fmt.end, *fmt.interrupts))
    return Split(body[: len(body) - held].strip() or None, "", False)


def prompt_opens_reasoning(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the model inside a reasoning block."""
    return fmt.forced or prompt_tail.rstrip().endswith(fmt.start)


class ReasoningStream:
    """One choice's reasoning as its output grows: the new reasoning text and the answer so far."""

    def __init__(self, fmt: ReasoningFormat, opened: bool, stream_reasoning: bool) -> None:
        self.fmt = fmt
        self.opened = opened
        self.stream_reasoning = stream_reasoning
        self.sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning text not reported yet, the answer's text so far) for the whole output ``text``."""
        s = split(self.fmt, text, opened=self.opened, final=final, stream_reasoning=self.stream_reasoning)
        reasoning = s.reasoning or ""
        new = reasoning[self.sent :]
        self.sent = max(self.sent, len(reasoning))
        return new, s.content


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One request's reasoning split: the format, whether the prompt opened the block, and whether
    reasoning streams as it arrives (``stream_reasoning``) or in one piece once complete."""

    fmt: ReasoningFormat
    opened: bool
    stream_reasoning: bool = True

    def split(self, text: str) -> Split:
        """The finished output's split."""
        return split(self.fmt, text, opened=self.opened)

    def stream(self) -> ReasoningStream:
        """A fresh stream for one choice."""
        return ReasoningStream(self.fmt, self.opened, self.stream_reasoning)
