"""Request bodies in, Server-Sent Events out, and client disconnects turned into aborts.

Whatever a route awaits on behalf of a client (a whole generation, or the first streamed event) runs
under ``run_until_disconnect``; a streamed answer is an ``SSEResponse``. Both cancel the work and close
the TokenizerManager's generator when the client goes away, which sends the worker an AbortReq.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from radixrt.server.http.errors import APIError
from radixrt.server.http.limits import check_content_type, check_depth, read_body

T = TypeVar("T")
logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # the status logged for a request whose client went away (never sent)
_PATH = re.compile(r"`\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def sse_event(obj: Any) -> bytes:
    """One ``data: {...}`` event."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: 415 unless declared application/json, 413 beyond ``max_bytes``, 400
    for an empty, malformed, too deeply nested (`radixrt.server.http.limits`) or non-object body."""
    check_content_type(request)
    body = await read_body(request, max_bytes)
    if not body.strip():
        raise APIError(400, "request body: expected a JSON object, got an empty body")
    check_depth(body)
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise APIError(400, f"request body: malformed JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(data).__name__}")
    return data


def convert(data: dict[str, Any], type_: type[T]) -> T:
    """Check a decoded JSON object against a msgspec Struct (strict types, no unknown fields)."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: msgspec.ValidationError) -> APIError:
    """400 naming the field: ``"max_tokens: Expected `int`, got `str`"``."""
    text = str(exc)
    path = _PATH.search(text)
    param = path.group(1) if path and path.group(1) else None
    unknown = _UNKNOWN.search(text)
    if unknown:
        name = unknown.group(1) if param is None else f"{param}.{unknown.group(1)}"
        return APIError(400, f"{name}: unrecognized request argument", param=name)
    message = text.split(" - at ")[0]
    missing = _MISSING.search(text)
    if missing:
        name = missing.group(1) if param is None else f"{param}.{missing.group(1)}"
        return APIError(400, f"{name}: required field missing", param=name)
    return APIError(400, f"{param}: {message}" if param else message, param=param)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call after the body was read: from then on the only message the client can send is a disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled: the work must not outlive it
        await _cancel(task)
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    raise ClientDisconnected()


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has stopped (its ``finally`` blocks have run)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def collect(agen: AsyncIterator[Any]) -> Any:
    """The last item of a TokenizerManager generator (the final result, or the list of a batch)."""
    result: Any = None
    try:
        async for out in agen:
            result = out
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
    return result


async def _first(agen: AsyncIterator[Any]) -> Any:
    return await agen.__anext__()


async def first_or_final(request: Request, agen: AsyncIterator[Any], stream: bool) -> Any:
    """A stream's first snapshot (validation errors surface here, before any byte is sent), or the
    final result; raises ClientDisconnected (work cancelled, request aborted) if the client leaves."""
    return await run_until_disconnect(request, _first(agen) if stream else collect(agen))


class SSEResponse(Response):
    """``text/event-stream`` from an async iterator of encoded events.

    Unlike Starlette's StreamingResponse it always closes the iterator: on completion, on error and
    when the client disconnects (which it watches for while the iterator waits for the next token).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None] | None = None) -> None:
        # NOTE: no Response.__init__: it would render an empty body and send Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done() and self.on_disconnect is not None:
                self.on_disconnect()
        finally:
            watcher.cancel()
            if not pump.done():
                pump.cancel()
            # NOTE: the pump iterates the events; closing them before it stopped would raise
            # "aclose(): asynchronous generator is already running".
            with contextlib.suppress(asyncio.CancelledError, OSError):
                try:
                    await pump
                except Exception:  # the response has started: nothing left to tell the client
                    logger.exception("error while streaming a response")
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
