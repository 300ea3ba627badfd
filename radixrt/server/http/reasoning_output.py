"""Which /v1/chat/completions requests get their reasoning split off (``--reasoning-parser``).

A request gets a `ReasoningPlan` when the server has a reasoning parser, the request did not turn it
off (``separate_reasoning: false``, SGLang's field) and its output is free to reason: an output a grammar
constrains from its first token (``tool_choice`` required or named, ``response_format``, ``regex``,
``json_schema``, ``ebnf``) has no room for a ``<think>`` block, so its text is all answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixrt.server.reasoning_parser import ReasoningPlan, get_reasoning_format, prompt_opens_reasoning

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixrt.server.http.openai_protocol import ChatCompletionRequest
    from radixrt.server.http.tool_calls import ToolPlan

PROMPT_TAIL_TOKENS = 8  # enough to see whether the prompt ends with an opening <think>


def reasoning_plan(
    parser: str | None,
    tokenizer: PreTrainedTokenizerBase,
    req: ChatCompletionRequest,
    tools: ToolPlan | None,
    prompt_ids: list[int],
) -> ReasoningPlan | None:
    """The request's reasoning split, or None when its text is all answer."""
    if parser is None or not req.separate_reasoning:
        return None
    if (tools is not None and tools.required) or req.regex or req.json_schema or req.ebnf:
        return None
    fmt = get_reasoning_format(parser)
    tail = str(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
    return ReasoningPlan(fmt, prompt_opens_reasoning(fmt, tail), req.stream_reasoning)


def thinking_opening(plan: ReasoningPlan, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids a reasoning output opens with (``[]``: it reasons from its first token), for
    ``--strip-thinking-cache`` (`GenerateReqInput.strip_thinking`)."""
    if plan.fmt.forced or plan.opened:
        return []
    return [int(t) for t in tokenizer.encode(plan.fmt.start, add_special_tokens=False)]
