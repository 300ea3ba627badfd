"""The OpenAI Responses API request (POST /v1/responses) and its translation into a chat conversation.

A Responses request is served by the chat-completions machinery: ``input`` items become chat messages
(``message`` items by role, ``function_call`` items the assistant's ``tool_calls``, ``function_call_output``
items ``tool`` messages), ``instructions`` a leading system message, the flat function tools
(``{"type": "function", "name", "parameters"}``) chat's nested ones. `to_chat_request` builds the
`ChatCompletionRequest` that `plan_tools` and `chat_prompt_ids` take, so the prompt, the tool prompt and
the call grammar are exactly those of /v1/chat/completions.

Every check names the field in the Responses request's own terms (``input[2].call_id``, ``tools[0].name``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixrt.server.http.errors import APIError
from radixrt.server.http.openai_protocol import ChatCompletionRequest
from radixrt.server.http.tool_calls import check_call_args

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Tool choices spelled as strings; a function is {"type": "function", "name": ...}.
TOOL_CHOICES = ("none", "auto", "required")


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/responses. Fields OpenAI defines that change nothing here (``metadata``, ``user``,
    ``service_tier``, ``prompt_cache_key``, ...) are accepted; fields asking for what this server does
    not do (``background``, ``conversation``, ``include`` entries, reasoning effort) are refused by
    `check`."""

    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # SGLang-style extensions, as on the chat route
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def check(self) -> None:
        """Refuse what this server does not do (400 naming the field)."""
        refused = {
            "background": bool(self.background),
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "include": bool(self.include),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
        }
        for name, bad in refused.items():
            if bad:
                raise APIError(400, f"{name}: not supported by this server", param=name)
        if self.truncation not in (None, "disabled"):
            raise APIError(400, 'truncation: only "disabled" is supported', param="truncation")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise APIError(400, "reasoning: reasoning settings are not supported by this server", "reasoning")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens: must be >= 1", param="max_output_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        if isinstance(self.input, str) and not self.input and self.previous_response_id is None:
            raise APIError(400, "input: must not be empty", param="input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError(400, "input: must not be empty", param="input")

    def echo_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the response object shows them (flat function tools, checked by `chat_tools`)."""
        return [
            {
                "type": "function",
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict", True),
            }
            for t in self.tools or []
        ]


def _text_of(content: Any, field: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{field}: must be a string or a list of content parts", param=field)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            where = f"{field}[{j}]"
            raise APIError(400, f"{where}: only text parts (input_text, output_text) are supported", where)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}.{key}: required (a non-empty string)", param=f"{where}.{key}")
    return value


def input_messages(raw: str | list[Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (OpenAI chat shapes), continuing ``history`` (the previous response's
    conversation, whose calls ``function_call_output`` items may answer)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}] if raw else []
    known_calls = {c["id"] for m in history for c in m.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object (a message or an item)", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                field = f"{where}.role"
                raise APIError(400, f"{field}: must be one of {', '.join(MESSAGE_ROLES)}", param=field)
            message = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought:
                message["reasoning_content"], thought = thought, ""
            out.append(message)
        elif kind == "reasoning":
            thought += _reasoning_of(item, where)
        elif kind == "function_call":
            call_id = _string(item, "call_id", where)
            name = _string(item, "name", where)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                field = f"{where}.arguments"
                raise APIError(400, f"{field}: must be the JSON text of an object", param=field)
            check_call_args(arguments, f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    out[-1]["reasoning_content"], thought = thought, ""
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in known_calls:
                field = f"{where}.call_id"
                raise APIError(
                    400, f"{field}: no function_call with call_id {call_id!r} in the conversation", field
                )
            output = _text_of(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            field = f"{where}.type"
            raise APIError(
                400,
                f"{field}: {kind!r} items are not supported "
                "(message, function_call, function_call_output, reasoning)",
                param=field,
            )
    return out


def _reasoning_of(item: dict[str, Any], where: str) -> str:
    """A ``reasoning`` input item's text: its ``reasoning_text`` content (a summary is not the model's
    own text and is not rendered; ``encrypted_content`` is refused, this server issues none)."""
    if item.get("encrypted_content") is not None:
        field = f"{where}.encrypted_content"
        raise APIError(400, f"{field}: this server issues no encrypted reasoning", param=field)
    content = item.get("content") or []
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a list of reasoning_text parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") == "reasoning_text"
            and isinstance(part.get("text"), str)
        ):
            field = f"{where}.content[{j}]"
            raise APIError(400, f"{field}: must be a reasoning_text part", param=field)
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat's ``{"type": "function", "function": {...}}``."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where}: must be an object", param=where)
        if tool.get("type") != "function":
            field = f"{where}.type"
            raise APIError(400, f'{field}: only "function" tools are supported', param=field)
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            field = f"{where}.{sorted(unknown)[0]}"
            raise APIError(400, f"{field}: unrecognized tool field", param=field)
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"{where}.name: required (a string)", param=f"{where}.name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses ``tool_choice`` -> chat's (a named function nests its name under ``function``)."""
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in TOOL_CHOICES:
            raise APIError(
                400, f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or a function", "tool_choice"
            )
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(
            400, 'tool_choice: a function is {"type": "function", "name": ...}', param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> chat's ``response_format`` (text, json_object, json_schema)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format: type must be text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format.schema: must be a JSON schema object", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def to_chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat-completions request that serves ``req`` over the whole conversation ``messages``."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise APIError(400, "input: must not be empty", param="input")
    body: dict[str, Any] = {
        "messages": messages,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_response_format(req.text),
        "stream": req.stream,
    }
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty"):
        body[name] = getattr(req, name)
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"input: {exc}", param="input") from None


RESPONSE_FIELD_NAMES = (
    ("tools[", ".function.", "."),
    ("response_format", "response_format", "text.format"),
    ("max_tokens", "max_tokens", "max_output_tokens"),
)


def responses_error(exc: APIError) -> APIError:
    """A chat-route error renamed into the Responses request's field names."""
    message, param = exc.message, exc.param
    for marker, old, new in RESPONSE_FIELD_NAMES:
        if marker in message:
            message = message.replace(old, new)
        if param is not None and marker in param:
            param = param.replace(old, new)
    return APIError(exc.status, message, param=param, code=exc.code)
