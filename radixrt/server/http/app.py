"""The FastAPI app: SGLang-native routes (/generate, health, admin, /metrics) plus the OpenAI router.

``build_app(ctx)`` wires routes to one ServerContext. Every route but /health needs the API key when
``--api-key`` is set; with ``--tenants`` a tenant's key reaches the generation routes only
(`radixrt.server.http.tenants`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from radixrt import __version__
from radixrt.disaggregation.request_fields import take_bootstrap
from radixrt.server.http.context import ServerContext
from radixrt.server.http.embeddings_api import build_embeddings_router
from radixrt.server.http.errors import (
    APIError,
    JSONResponse,
    as_api_error,
    bad_request,
    install_error_handlers,
    refused,
    worker_dead,
)
from radixrt.server.http.limits import GENERATION_RESPONSES, openapi_body, pretokenize
from radixrt.server.http.openai_api import build_openai_router, check_model
from radixrt.server.http.pins import build_pins_router
from radixrt.server.http.responses import build_responses_router
from radixrt.server.http.sglang_compat import normalize_generate
from radixrt.server.http.streaming import (
    CLIENT_CLOSED,
    DONE,
    ClientDisconnected,
    SSEResponse,
    collect,
    convert,
    first_or_final,
    read_json,
    sse_event,
)
from radixrt.server.http.tenants import AuthMiddleware
from radixrt.server.http.tokenize_api import build_tokenize_router
from radixrt.server.io_struct import GenerateReqInput
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.protocol import FlushCacheReq

HEALTH_GENERATE_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.1


class GenerateBody(GenerateReqInput, forbid_unknown_fields=True, kw_only=True):
    """The JSON body of POST /generate once ``normalize_generate`` dropped SGLang's neutral fields."""

    def to_request(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "text: give exactly one of `text` and `input_ids`", param="text")
        if isinstance(self.text, list) and not self.text or self.input_ids == []:
            raise APIError(
                400, "text: the batch is empty", param="text" if self.text is not None else "input_ids"
            )
        if isinstance(self.rid, list) and (not self.is_batch or len(self.rid) != self.batch_size()):
            prompts = f"a batch of {self.batch_size()}" if self.is_batch else "a single prompt"
            raise APIError(400, f"rid: a list of {len(self.rid)} ids for {prompts}", param="rid")
        return self


def build_app(ctx: ServerContext) -> FastAPI:
    """The ASGI app serving ``ctx``."""
    app = FastAPI(title="radixrt", version=__version__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    if ctx.args.api_key or ctx.tenants is not None:
        app.add_middleware(AuthMiddleware, api_key=ctx.args.api_key, tenants=ctx.tenants)
    app.include_router(build_openai_router(ctx))
    app.include_router(build_pins_router(ctx))
    app.include_router(build_responses_router(ctx))
    app.include_router(build_tokenize_router(ctx))
    app.include_router(build_embeddings_router(ctx))

    @app.get("/health")
    @app.head("/health")
    async def health() -> Response:
        status = ctx.client.health()  # ok, draining, warming_up, restarting, worker_down
        if status == "ok" and not ctx.ready:
            status = "starting"
        body: dict[str, Any] = {"status": status}
        warnings = ctx.health_warnings() if status == "ok" else []
        if warnings:  # still serving (200): a degraded part, e.g. a failed disk tier
            body["warnings"] = warnings
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """200 once a 1-token ping finished (``output_ids``), or, as SGLang does, once any token output
        arrived after the check began (``output_ids`` null): a busy queue delays the ping, not the worker."""
        obj = GenerateReqInput(text="ping", sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        since = time.monotonic()
        ping = asyncio.ensure_future(collect(ctx.generate(request, obj)))
        error: BaseException = TimeoutError(f"no output within {HEALTH_GENERATE_TIMEOUT_S:.0f}s")
        try:
            while time.monotonic() - since < HEALTH_GENERATE_TIMEOUT_S:
                await asyncio.wait({ping}, timeout=HEALTH_POLL_S)
                if ping.done() and ping.exception() is None:
                    return JSONResponse({"status": "ok", "output_ids": ping.result()["output_ids"]})
                if ctx.client.last_progress > since and ctx.client.is_alive():
                    return JSONResponse({"status": "ok", "output_ids": None})
                if ping.done():
                    error = ping.exception() or error
                    break
        finally:
            if not ping.done():
                ping.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ping
        return (error if isinstance(error, APIError) else worker_dead(WorkerDeadError(str(error)))).response()

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        return JSONResponse(ctx.model_info())

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        return JSONResponse(await ctx.server_info())

    @app.get("/get_load")
    async def get_load() -> Response:
        return JSONResponse(await ctx.load())

    @app.post("/flush_cache")  # NOTE: POST only: a GET that empties the cache is a CSRF hazard (405 + Allow)
    async def flush_cache() -> Response:
        out = await asyncio.wait_for(ctx.tm.control_request(FlushCacheReq()), 30)
        if not out.ok:
            raise APIError(400, out.message or "cannot flush the cache now")
        return JSONResponse({"message": "Cache flushed.", "success": True})

    @app.get("/metrics", response_class=PlainTextResponse)  # the OpenAPI document: text/plain
    async def metrics() -> Response:
        stats: dict[str, float] | None = None
        tenants: dict[str, dict[str, float]] | None = None
        try:
            out = await ctx.worker_stats()
            stats, tenants = out.stats, out.tenants
        except WorkerDeadError:
            pass
        return Response(ctx.metrics.render(stats, tenants), media_type=CONTENT_TYPE_LATEST)

    generate_doc = openapi_body(GenerateBody, {"text": "Hello", "sampling_params": {"max_new_tokens": 8}})

    @app.post("/generate", openapi_extra=generate_doc, responses=GENERATION_RESPONSES)
    async def generate(request: Request) -> Response:
        body = await read_json(request, ctx.args.max_request_bytes)
        check_model(ctx, body.get("model"))
        try:  # sglang-router's PD fields: read here, validated for --disaggregation-mode
            boot = take_bootstrap(body, ctx.args.disaggregation_mode)
        except ValueError as exc:
            raise bad_request(exc) from None
        normalize_generate(body)
        obj = convert(body, GenerateBody).to_request()
        for name, value in boot.items():
            setattr(obj, name, value)
        await pretokenize(ctx.tm, obj)  # a long text: on a worker thread
        agen = ctx.generate(request, obj)
        try:
            first = await first_or_final(request, agen, obj.stream)
        except ClientDisconnected:
            ctx.metrics.aborted.inc()
            return Response(status_code=CLIENT_CLOSED)
        except StopAsyncIteration:
            raise APIError(400, "text: the batch is empty") from None
        error = refused(first) if isinstance(first, dict) else None
        if error is not None:
            await agen.aclose()
            raise error
        if not obj.stream:
            return JSONResponse(first)
        return SSEResponse(_native_events(first, agen), on_disconnect=ctx.metrics.aborted.inc)

    return app


async def _native_events(first: dict[str, Any], agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """``data: {...}`` per cumulative snapshot, an error event if the request fails, then [DONE]."""
    try:
        yield sse_event(first)
        async for out in agen:
            yield sse_event(out)
    except Exception as exc:
        yield sse_event(as_api_error(exc).body())
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
    yield DONE
