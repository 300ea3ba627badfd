"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A create request becomes a chat conversation (`radixrt.server.http.responses_protocol`): the stored
conversation of ``previous_response_id`` (if any), then ``input``; ``instructions`` lead it as a system
message (a previous response's instructions are not carried over, as OpenAI does). It is rendered, tool
prompt and call grammar included, exactly as /v1/chat/completions renders it, so a continuation's prompt
starts with the previous turn's prompt and reply and the RadixCache serves that prefix
(``usage.input_tokens_details.cached_tokens``). With ``store`` (the default) the response and its
conversation go into a `ResponsesStore`, which only the tenant that created them can read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixrt.server.http.errors import APIError, JSONResponse, as_api_error
from radixrt.server.http.limits import GENERATION_RESPONSES, OFFLOAD_CHARS, openapi_body
from radixrt.server.http.openai_api import check_model, start_generation, tool_constraint
from radixrt.server.http.openai_protocol import RENAME_CHAT, chat_prompt_ids
from radixrt.server.http.reasoning_output import reasoning_plan, thinking_opening
from radixrt.server.http.responses_format import (
    ResponseShell,
    ResponseStream,
    assistant_message,
    new_id,
    responses_event,
    shell_fields,
)
from radixrt.server.http.responses_items import input_item_list, item_page
from radixrt.server.http.responses_protocol import (
    ResponsesRequest,
    input_messages,
    responses_error,
    to_chat_request,
)
from radixrt.server.http.responses_store import ResponsesStore
from radixrt.server.http.streaming import (
    SSEResponse,
    convert,
    read_json,
)
from radixrt.server.http.tenants import principal_of
from radixrt.server.http.tool_calls import ToolSupport, plan_tools
from radixrt.server.io_struct import GenerateReqInput

if TYPE_CHECKING:
    from radixrt.server.http.context import ServerContext

RENAME_RESPONSES = {
    **RENAME_CHAT,
    "max_new_tokens": "max_output_tokens",
    "text": "input",
    "input_ids": "input",
}


def build_responses_router(ctx: ServerContext) -> APIRouter:
    """The /v1/responses routes of one server (their store lives as long as the server)."""
    router = APIRouter()
    tools = ToolSupport.for_tokenizer(ctx.tokenizer, ctx.args.tool_call_parser)
    store = ResponsesStore(ctx.args.responses_store_max_items, ctx.args.responses_store_ttl_s)
    doc = openapi_body(ResponsesRequest, {"input": "Hi", "max_output_tokens": 8})

    @router.post("/v1/responses", openapi_extra=doc, responses=GENERATION_RESPONSES)
    async def create_response(request: Request) -> Response:
        body = await read_json(request, ctx.args.max_request_bytes)
        req = convert(body, ResponsesRequest)
        check_model(ctx, req.model)
        req.check()
        tenant = principal_of(request).tenant
        history: list[dict[str, Any]] = []
        previous = None
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id, tenant)
            if previous is None:
                raise APIError(
                    404,
                    f"previous_response_id: no stored response {req.previous_response_id!r}",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = [dict(m) for m in previous.messages]
        conversation = history + input_messages(req.input, history)
        items = (previous.input_items + previous.response["output"] if previous is not None else []) + (
            input_item_list(req.input)
        )
        try:
            chat = to_chat_request(req, [dict(m) for m in conversation])
            chat.check()
            plan = plan_tools(chat, tools)
            if chat.content_chars() < OFFLOAD_CHARS:
                ids = chat_prompt_ids(ctx.tokenizer, chat, tools, plan)
            else:
                ids = await asyncio.to_thread(chat_prompt_ids, ctx.tokenizer, chat, tools, plan)
        except APIError as exc:
            raise responses_error(exc) from None
        if len(ids) >= ctx.context_len:
            raise APIError(
                400,
                f"input: the prompt has {len(ids)} tokens; the context length is {ctx.context_len}",
                param="input",
                code="context_length_exceeded",
            )
        max_new = req.max_output_tokens if req.max_output_tokens is not None else ctx.context_len - len(ids)
        params = chat.sampling_params(max_new)
        if plan is not None:
            params.update(responses_tool_constraint(ctx, tools, plan))
        obj = GenerateReqInput(input_ids=ids, sampling_params=params, stream=req.stream)
        thinking = reasoning_plan(ctx.args.reasoning_parser, ctx.tokenizer, chat, plan, ids)
        if thinking is not None and ctx.args.strip_thinking_cache:
            obj.strip_thinking = thinking_opening(thinking, ctx.tokenizer)
        shell = ResponseShell(
            new_id("resp"),
            shell_fields(ctx.model_name, req, req.echo_tools(), req.previous_response_id),
            tools=None if plan is None else (tools.parser, plan.names),
            reasoning=thinking,
            count_tokens=lambda text: len(ctx.tokenizer.encode(text, add_special_tokens=False)),
        )

        def keep(response: dict[str, Any]) -> None:
            if req.store:
                messages = [*conversation, assistant_message(response["output"])]
                store.put(shell.id, tenant, response, messages, items)

        started = await start_generation(ctx, request, obj, RENAME_RESPONSES)
        if isinstance(started, Response):
            return started
        agen, first = started
        if not req.stream:
            response = shell.final(first)
            keep(response)
            return JSONResponse(response)
        stream = ResponseStream(shell)
        return SSEResponse(_events(stream, first, agen, keep), on_disconnect=ctx.metrics.aborted.inc)

    @router.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        entry = store.get(response_id, principal_of(request).tenant)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        request: Request,
        response_id: str,
        limit: int = 20,
        order: str = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> Response:
        entry = store.get(response_id, principal_of(request).tenant)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(item_page(entry.input_items, limit, order, after, before))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        if not store.delete(response_id, principal_of(request).tenant):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return router


def responses_tool_constraint(ctx: ServerContext, tools: ToolSupport, plan: Any) -> dict[str, Any]:
    """`tool_constraint` with its errors in the Responses request's field names."""
    try:
        return tool_constraint(ctx, tools, plan)
    except APIError as exc:
        raise responses_error(exc) from None


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found", param="response_id", code="not_found")


async def _events(
    stream: ResponseStream, first: dict[str, Any], agen: AsyncIterator[dict[str, Any]], keep: Any
) -> AsyncIterator[bytes]:
    """The typed events of one response; an ``error`` event if the request fails midway."""
    try:
        for event in stream.start() + stream.update(first):
            yield responses_event(event)
        async for out in agen:
            for event in stream.update(out):
                yield responses_event(event)
        if stream.final is not None:
            keep(stream.final)
    except Exception as exc:
        error = as_api_error(exc)
        yield responses_event(
            {"type": "error", "sequence_number": stream.seq, "code": error.code, "message": error.message}
        )
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
