"""OpenAI request bodies (msgspec Structs: strict types, unknown fields refused) and their translation
into radixrt's sampling parameters and prompts.

OpenAI names map to SGLang's: ``max_tokens`` -> ``max_new_tokens``, ``min_tokens`` -> ``min_new_tokens``;
SGLang's extra sampling fields (``top_k``, ``min_p``, ``ignore_eos``, ``regex``, ...) ride along as
extra body fields, as with SGLang's OpenAI server.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec
from transformers import PreTrainedTokenizerBase

from radixrt.server.http.chat_prompt import encode_chat, special_texts
from radixrt.server.http.errors import APIError
from radixrt.server.http.limits import tokenize_texts
from radixrt.server.http.tool_calls import ToolPlan, ToolSupport, check_call_args

if TYPE_CHECKING:
    from radixrt.server.tokenizer_manager import TokenizerManager

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20

# OpenAI field -> sampling-parameter name, for the fields passed through unchanged when set
_PASSTHROUGH = {
    "temperature": "temperature", "top_p": "top_p", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop", "top_k": "top_k",
    "min_p": "min_p", "min_tokens": "min_new_tokens", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "no_stop_trim": "no_stop_trim",
    "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
}  # fmt: skip
# sampling-parameter / TokenizerManager field names -> the OpenAI names, for error messages
RENAME_CHAT = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "text": "messages",
    "input_ids": "messages",
    "top_logprobs_num": "top_logprobs",
}
RENAME_COMPLETION = {**RENAME_CHAT, "text": "prompt", "input_ids": "prompt", "top_logprobs_num": "logprobs"}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    cache_salt: str | None = None
    priority: int | None = None  # cache priority (--radix-eviction-policy priority)
    cache_control: dict[str, Any] | None = None  # {"type": "ephemeral", "ttl": "5m"}: pin the prefix
    rid: str | None = None
    response_format: ResponseFormat | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The SGLang-named sampling parameters (validated later by the TokenizerManager)."""
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": self.n}
        for name, ours in _PASSTHROUGH.items():
            value = getattr(self, name, None)
            if value is not None:
                params[ours] = value
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def apply_response_format(self) -> None:
        """``response_format`` -> ``json_schema`` (SGLang accepts it on both routes)."""
        fmt = self.response_format
        if fmt is None:
            return
        if fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(
                    400, "response_format: json_schema.schema must be an object", param="response_format"
                )
            self.json_schema = json.dumps(schema)
        elif fmt.type == "json_object":
            self.json_schema = json.dumps({"type": "object"})
        elif fmt.type != "text":
            raise APIError(400, f"response_format: unknown type {fmt.type!r}", param="response_format")


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions (``max_tokens`` defaults to 16, as OpenAI's)."""

    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix: not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        self.apply_response_format()


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A call in an earlier assistant message (OpenAI's shape)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message; fields we do not use (name, ...) are ignored."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning (vLLM's and SGLang's field), for templates that show it (Qwen3's shows
    # the current turn's), so a tool loop's prompt repeats what the model wrote and hits the cache
    reasoning_content: str | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One entry of ``tools``."""

    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: str
    function: NamedFunction


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's reasoning switches (with --reasoning-parser): split the reasoning off at all, and stream
    # it as it arrives (else in one delta once complete)
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def content_chars(self) -> int:
        """Characters of text in all messages."""
        return sum(
            len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
            for m in self.messages
        )

    def check(self) -> None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        self.apply_response_format()


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    req: ChatCompletionRequest,
    tools: ToolSupport | None = None,
    plan: ToolPlan | None = None,
) -> list[int]:
    """Apply the model's chat template (with the generation prompt) and tokenize the result; with
    ``tools``, earlier tool calls / results and the ``plan``'s tools are rendered as the model takes them."""
    if not req.messages:
        raise APIError(400, "messages: must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise APIError(
                400, f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}", param="messages"
            )
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400, f"messages[{i}].content: only text parts are supported", param="messages"
                    )
                parts.append(part.text)
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or "", **_tool_fields(i, m)})
        if m.reasoning_content:
            messages[-1]["reasoning_content"] = _reasoning_field(tokenizer, i, m)
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, "messages: this model has no chat template; use /v1/completions", param="messages"
        )
    kwargs = req.chat_template_kwargs or {}
    if tools is not None:
        messages = tools.messages(messages, plan)
        kwargs = {**kwargs, **tools.template_kwargs(plan)}
    return encode_chat(tokenizer, messages, kwargs)  # content cannot forge roles


def _reasoning_field(tokenizer: PreTrainedTokenizerBase, i: int, m: ChatMessage) -> str:
    """An assistant message's ``reasoning_content``: refused elsewhere, and when it spells a special
    token (the template renders it unescaped, so it could forge a role)."""
    field = f"messages[{i}].reasoning_content"
    if m.role != "assistant":
        raise APIError(400, f"{field}: only assistant messages carry reasoning", param=field)
    text = m.reasoning_content or ""
    if any(t in text for t in special_texts(tokenizer)):
        raise APIError(400, f"{field}: must not contain special-token text", param=field)
    return text


def _tool_fields(i: int, m: ChatMessage) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` / a tool message's ``tool_call_id`` (checked)."""
    if m.role == "tool":
        if m.tool_call_id is None:
            field = f"messages[{i}].tool_call_id"
            raise APIError(400, f'{field}: required for role "tool"', param=field)
        return {"tool_call_id": m.tool_call_id}
    if not m.tool_calls:
        return {}
    if m.role != "assistant":
        field = f"messages[{i}].tool_calls"
        raise APIError(400, f"{field}: only assistant messages carry tool calls", param=field)
    calls = []
    for j, call in enumerate(m.tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if call.type != "function":
            raise APIError(400, f'{where}.type: only "function" calls are supported', param=f"{where}.type")
        check_call_args(call.function.arguments, f"{where}.function.arguments")
        fn = {"name": call.function.name, "arguments": call.function.arguments}
        calls.append({"id": call.id or f"call_{i}_{j}", "type": "function", "function": fn})
    return {"tool_calls": calls}


async def completion_prompts(tm: TokenizerManager, prompt: str | list[Any]) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, a list of ids or a list of id lists
    (strings through ``TokenizerManager.tokenize``, off the event loop when long)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    for item in items:
        ids = isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        if not (isinstance(item, str) or ids):
            raise APIError(400, "prompt: must be a string, a list of strings, or token ids", param="prompt")
        if not item:
            raise APIError(400, "prompt: must not be empty", param="prompt")
    texts = iter(await tokenize_texts(tm, [item for item in items if isinstance(item, str)]))
    return [next(texts) if isinstance(item, str) else list(item) for item in items]
