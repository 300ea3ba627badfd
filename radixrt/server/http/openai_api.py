"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Both generation routes turn the request into one ``GenerateReqInput`` over token ids (chat template
applied here), run it through the TokenizerManager like /generate does, and format the results.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixrt.disaggregation.request_fields import take_bootstrap
from radixrt.server.http.errors import APIError, JSONResponse, as_api_error, bad_request, refused
from radixrt.server.http.limits import ERROR_RESPONSES, GENERATION_RESPONSES, OFFLOAD_CHARS, openapi_body
from radixrt.server.http.openai_format import ChatFormatter, CompletionFormatter, _Formatter
from radixrt.server.http.openai_protocol import (
    RENAME_CHAT,
    RENAME_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    chat_prompt_ids,
    completion_prompts,
)
from radixrt.server.http.reasoning_output import reasoning_plan, thinking_opening
from radixrt.server.http.sglang_compat import CHAT_FIELDS, COMPLETION_FIELDS, strip_neutral
from radixrt.server.http.streaming import (
    CLIENT_CLOSED,
    DONE,
    ClientDisconnected,
    SSEResponse,
    convert,
    first_or_final,
    read_json,
    sse_event,
)
from radixrt.server.http.tool_calls import ToolPlan, ToolSupport, plan_tools
from radixrt.server.io_struct import GenerateReqInput
from radixrt.server.prompt_bound import max_token_bytes

if TYPE_CHECKING:
    from radixrt.server.http.context import ServerContext

COMPLETION_DEFAULT_MAX_TOKENS = 16


def model_names(ctx: ServerContext) -> set[str]:
    """The names this server's model answers to: the served name and the model path (as given and
    as resolved)."""
    return {ctx.model_name, ctx.model_path, *([ctx.args.model_path] if ctx.args.model_path else [])}


def check_model(ctx: ServerContext, model: object) -> None:
    """A request's ``model``: with ``--served-model-name`` set it must be one of ``model_names`` (404
    ``model_not_found`` otherwise, as OpenAI answers); without it any name is this server's one model
    (SGLang's clients send e.g. "default")."""
    if model is None or ctx.args.served_model_name is None or model in model_names(ctx):
        return
    raise APIError(
        404,
        f"model: {model!r} is not served here; this server's model is {ctx.model_name!r}",
        param="model",
        code="model_not_found",
    )


def build_openai_router(ctx: ServerContext) -> APIRouter:
    """The /v1 routes of one server."""
    router = APIRouter()
    max_token_bytes(ctx.tokenizer)  # computed once, now rather than on the event loop for a request
    tools = ToolSupport.for_tokenizer(ctx.tokenizer, ctx.args.tool_call_parser)

    def model_card() -> dict[str, Any]:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": int(ctx.started_at),
            "owned_by": "radixrt",
            "root": ctx.model_path,
            "max_model_len": ctx.context_len,
        }

    @router.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def get_model(model_id: str) -> Response:
        if model_id not in model_names(ctx):
            raise APIError(404, f"model {model_id!r} not found", param="model", code="model_not_found")
        return JSONResponse(model_card())

    completion_doc = openapi_body(CompletionRequest, {"prompt": "Hello", "max_tokens": 8})

    @router.post("/v1/completions", openapi_extra=completion_doc, responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> Response:
        body = await read_json(request, ctx.args.max_request_bytes)
        boot = _bootstrap(ctx, body)
        strip_neutral(body, COMPLETION_FIELDS)
        req = convert(body, CompletionRequest)
        check_model(ctx, req.model)
        req.check()
        try:
            prompts = await completion_prompts(ctx.tm, req.prompt)
        except ValueError as exc:
            raise bad_request(exc, RENAME_COMPLETION) from None
        max_new = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        params = req.sampling_params(max_new)
        want_lp = req.logprobs is not None
        echo_texts = None
        if req.echo:
            echo_texts = [
                p if isinstance(p, str) else str(ctx.tokenizer.decode(ids))
                for p, ids in zip(_prompt_items(req.prompt), prompts, strict=True)
            ]
        obj = GenerateReqInput(
            input_ids=prompts if len(prompts) > 1 else prompts[0],
            sampling_params=params,
            return_logprob=want_lp,
            logprob_start_len=0 if req.echo and want_lp else None,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            rid=req.rid,
            cache_salt=req.cache_salt,
            priority=req.priority,
            cache_control=req.cache_control,
            **boot,
        )
        fmt = CompletionFormatter(ctx.model_name, req.n, req.include_usage, req.logprobs, echo_texts, req.rid)
        return await _serve(ctx, request, obj, fmt, RENAME_COMPLETION)

    chat_doc = openapi_body(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    )

    @router.post("/v1/chat/completions", openapi_extra=chat_doc, responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ctx.args.max_request_bytes)
        boot = _bootstrap(ctx, body)
        strip_neutral(body, CHAT_FIELDS)
        req = convert(body, ChatCompletionRequest)
        check_model(ctx, req.model)
        req.check()
        plan = plan_tools(req, tools)
        if req.content_chars() < OFFLOAD_CHARS:
            ids = chat_prompt_ids(ctx.tokenizer, req, tools, plan)
        else:  # a long conversation: template and tokenizer run on a worker thread
            ids = await asyncio.to_thread(chat_prompt_ids, ctx.tokenizer, req, tools, plan)
        if len(ids) >= ctx.context_len:
            raise APIError(
                400,
                f"messages: the prompt has {len(ids)} tokens; the context length is {ctx.context_len}",
                param="messages",
                code="context_length_exceeded",
            )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_new = max_tokens if max_tokens is not None else ctx.context_len - len(ids)
        params = req.sampling_params(max_new)
        if plan is not None:
            params.update(tool_constraint(ctx, tools, plan))
        obj = GenerateReqInput(
            input_ids=ids,
            sampling_params=params,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            rid=req.rid,
            cache_salt=req.cache_salt,
            priority=req.priority,
            cache_control=req.cache_control,
            **boot,
        )
        parsing = None if plan is None else (tools.parser, plan.names)
        thinking = reasoning_plan(ctx.args.reasoning_parser, ctx.tokenizer, req, plan, ids)
        if thinking is not None and ctx.args.strip_thinking_cache:
            obj.strip_thinking = thinking_opening(thinking, ctx.tokenizer)
        fmt = ChatFormatter(
            ctx.model_name, req.n, req.include_usage, req.logprobs, req.rid, parsing, thinking
        )
        return await _serve(ctx, request, obj, fmt, RENAME_CHAT)

    return router


def _bootstrap(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    """sglang-router's PD fields of an OpenAI body (popped), validated for --disaggregation-mode."""
    try:
        return take_bootstrap(body, ctx.args.disaggregation_mode)
    except ValueError as exc:
        raise bad_request(exc) from None


def tool_constraint(ctx: ServerContext, tools: ToolSupport, plan: ToolPlan) -> dict[str, Any]:
    """The sampling parameter that makes the calls well-formed (none when ``auto`` stays free)."""
    grammar = tools.grammar(plan, ctx.args.json_whitespace)
    if grammar is None:
        return {}
    size = len(grammar.encode())
    if size > ctx.args.max_grammar_bytes:
        raise APIError(
            400,
            f"tools: their call grammar is {size} bytes, above this server's limit of "
            f"{ctx.args.max_grammar_bytes} (--max-grammar-bytes)",
            param="tools",
        )
    return {"ebnf": grammar}


def _prompt_items(prompt: str | list[Any]) -> list[Any]:
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    return list(prompt)


async def start_generation(
    ctx: ServerContext, request: Request, obj: GenerateReqInput, rename: dict[str, str]
) -> tuple[AsyncIterator[dict[str, Any]], Any] | Response:
    """Submit ``obj``: (the result stream, its first result — the whole one when not streaming), or the
    response to send instead when the client has gone (499). A refusal or bad input raises its 4xx, with
    the field names ``rename`` maps to the route's own."""
    agen = ctx.generate(request, obj)
    try:
        first = await first_or_final(request, agen, obj.stream)
    except ClientDisconnected:
        ctx.metrics.aborted.inc()
        return Response(status_code=CLIENT_CLOSED)
    except ValueError as exc:
        raise bad_request(exc, rename) from None
    results = first if isinstance(first, list) else [first]
    for error in filter(None, map(refused, results)):
        await agen.aclose()
        raise error
    return agen, first


async def _serve(
    ctx: ServerContext, request: Request, obj: GenerateReqInput, fmt: _Formatter, rename: dict[str, str]
) -> Response:
    started = await start_generation(ctx, request, obj, rename)
    if isinstance(started, Response):
        return started
    agen, first = started
    if not obj.stream:
        return JSONResponse(fmt.response(first if isinstance(first, list) else [first]))
    return SSEResponse(_events(fmt, first, agen), on_disconnect=ctx.metrics.aborted.inc)


async def _events(
    fmt: _Formatter, first: dict[str, Any], agen: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[bytes]:
    """Delta chunks, the usage chunk when asked for, then [DONE]; an error event if the request fails."""
    try:
        for chunk in fmt.chunks(first):
            yield sse_event(chunk)
        async for out in agen:
            for chunk in fmt.chunks(out):
                yield sse_event(chunk)
        if fmt.include_usage:
            yield sse_event(fmt.usage_chunk())
    except Exception as exc:
        yield sse_event(as_api_error(exc).body())
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
    yield DONE
