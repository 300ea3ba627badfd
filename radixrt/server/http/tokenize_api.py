"""POST /tokenize and /detokenize (also under /v1/), in vLLM's and SGLang's shapes.

/tokenize takes either ``prompt`` (a string or a list of strings, SGLang's batch form) or ``messages``
(rendered with the chat template exactly as /v1/chat/completions renders them, tools included) and
answers ``{"tokens", "count", "max_model_len"}`` (``token_strs`` with ``return_token_strs``). As in
vLLM, ``add_special_tokens`` defaults to true for a prompt and to false for messages (the template
writes its own markers). /detokenize takes ``tokens`` (ids or a batch of id lists) and answers the text
as ``prompt`` (vLLM's name) and ``text`` (SGLang's). Neither route runs the model; a prompt longer than
the context is counted, not refused (``count`` > ``max_model_len`` tells the client).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixrt.server.http.errors import APIError, JSONResponse
from radixrt.server.http.limits import ERROR_RESPONSES, OFFLOAD_CHARS, openapi_body
from radixrt.server.http.openai_api import check_model
from radixrt.server.http.openai_protocol import ChatCompletionRequest, ChatMessage, ToolDef, chat_prompt_ids
from radixrt.server.http.streaming import convert, read_json
from radixrt.server.http.tool_calls import ToolSupport, plan_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixrt.server.http.context import ServerContext

TOKENIZE_ROUTES = ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /tokenize: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /detokenize: token ids, or a list of id lists."""

    model: str | None = None
    tokens: list[Any]  # ids, or lists of ids (checked in the route: msgspec takes one list type)
    skip_special_tokens: bool = False


def special_wrap(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text (e.g. ``([bos], [])``)."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return full[:at], full[at + len(bare) :]
    raise ValueError("the tokenizer's special tokens do not wrap the text")  # no such HF tokenizer known


def build_tokenize_router(ctx: ServerContext) -> APIRouter:
    """The tokenizer routes of one server (no model run; tenants reach them like the generation routes)."""
    router = APIRouter()
    tokenizer = ctx.tokenizer
    tools = ToolSupport.for_tokenizer(tokenizer, ctx.args.tool_call_parser)
    wrap = special_wrap(tokenizer)

    def chat_ids(req: TokenizeRequest, messages: list[ChatMessage]) -> list[int]:
        kwargs = {**(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt}
        chat = ChatCompletionRequest(messages=messages, tools=req.tools, chat_template_kwargs=kwargs)
        ids = chat_prompt_ids(tokenizer, chat, tools, plan_tools(chat, tools))
        return [*wrap[0], *ids, *wrap[1]] if req.add_special_tokens else ids

    def prompt_ids(texts: list[str], special: bool) -> list[list[int]]:
        return [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]

    async def tokenize(request: Request) -> Response:
        req = convert(await read_json(request, ctx.args.max_request_bytes), TokenizeRequest)
        check_model(ctx, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of `prompt` and `messages`", param="prompt")
        batch: list[list[int]]
        if req.messages is not None:
            if _chars(req.messages) < OFFLOAD_CHARS:
                batch = [chat_ids(req, req.messages)]
            else:
                batch = [await asyncio.to_thread(chat_ids, req, req.messages)]
        else:
            texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt or [])
            if not texts:
                raise APIError(400, "prompt: the batch is empty", param="prompt")
            special = req.add_special_tokens is not False
            if sum(map(len, texts)) < OFFLOAD_CHARS:
                batch = prompt_ids(texts, special)
            else:
                batch = await asyncio.to_thread(prompt_ids, texts, special)
        single = not isinstance(req.prompt, list)
        body: dict[str, Any] = {
            "tokens": batch[0] if single else batch,
            "count": len(batch[0]) if single else [len(ids) for ids in batch],
            "max_model_len": ctx.context_len,
        }
        if req.return_token_strs:
            strs = [tokenizer.convert_ids_to_tokens(ids) for ids in batch]
            body["token_strs"] = strs[0] if single else strs
        return JSONResponse(body)

    async def detokenize(request: Request) -> Response:
        req = convert(await read_json(request, ctx.args.max_request_bytes), DetokenizeRequest)
        check_model(ctx, req.model)
        single = not req.tokens or not isinstance(req.tokens[0], list)
        batch: list[list[Any]] = [req.tokens] if single else req.tokens
        for i, ids in enumerate(batch):
            where = "tokens" if single else f"tokens[{i}]"
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise APIError(400, f"{where}: must be a list of token ids or a list of such lists", "tokens")
            bad = [t for t in ids if not 0 <= t < ctx.tm.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"{where}: token id {bad[0]} outside the vocabulary [0, {ctx.tm.vocab_size})",
                    "tokens",
                )
        texts = [str(tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)) for ids in batch]
        text: str | list[str] = texts[0] if single else texts
        return JSONResponse({"prompt": text, "text": text})

    tokenize_doc = openapi_body(TokenizeRequest, {"prompt": "Hello"})
    detokenize_doc = openapi_body(DetokenizeRequest, {"tokens": [1, 2, 3]})
    for prefix in ("", "/v1"):
        router.post(f"{prefix}/tokenize", openapi_extra=tokenize_doc, responses=ERROR_RESPONSES)(tokenize)
        router.post(f"{prefix}/detokenize", openapi_extra=detokenize_doc, responses=ERROR_RESPONSES)(
            detokenize
        )
    return router


def _chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else 0 for m in messages)
