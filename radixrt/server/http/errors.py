"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}`` on every route.

Client mistakes are 4xx with a message naming the field, a dead worker is 503; an unexpected
exception is a 500 that is logged, never a crash of the server.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from radixrt.server.tokenizer_manager import RequestFailedError
from radixrt.transport.client import WorkerDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# A worker status (RequestFailedError) -> the error ``code``; 429 and 503 also send Retry-After.
_WORKER_CODES = {429: "rate_limit_exceeded", 503: "server_overloaded", 504: "request_timeout"}
RETRY_AFTER_S = 1


class JSONResponse(Response):
    """JSON via msgspec (fast; non-finite floats such as a -inf logprob become null)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


class APIError(Exception):
    """An error answer: HTTP status, message and the OpenAI ``param`` / ``code`` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **(self.headers or {})})


def bad_request(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """400 from a ValueError whose message starts with the field name (``"top_p: must be ..."``)."""
    message = str(exc)
    field, sep, rest = message.partition(":")
    param = field.strip() if sep and field and " " not in field.strip() else None
    if param is not None and rename and param in rename:
        param = rename[param]
        message = f"{param}:{rest}"
    return APIError(400, message, param=param)


def worker_dead(exc: Exception) -> APIError:
    return APIError(503, f"the worker is not available: {exc}", code="worker_unavailable")


def refused(result: dict[str, Any]) -> APIError | None:
    """The error answer for a request the worker refused outright (aborted before any token): the
    client's mistake (400), unless the worker itself failed (503). None for any other result."""
    meta = result["meta_info"]
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "abort" or meta.get("completion_tokens"):
        return None
    message = str(reason.get("message", "the request was aborted"))
    if message.startswith("worker error"):
        return worker_dead(WorkerDeadError(message))
    return APIError(400, message)


def as_api_error(exc: Exception) -> APIError:
    """Map any exception raised while serving a request to the error answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, WorkerDeadError):
        return worker_dead(exc)
    if isinstance(exc, RequestFailedError):
        retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status_code in (429, 503) else None
        return APIError(exc.status_code, exc.message, code=_WORKER_CODES.get(exc.status_code), headers=retry)
    if isinstance(exc, TimeoutError):
        return APIError(503, "the worker did not answer in time", code="worker_timeout")
    if isinstance(exc, ValueError):
        return bad_request(exc)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path (a 405's ``Allow`` header)."""
    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error (ours, FastAPI's, Starlette's 404/405) through the OpenAI error shape."""

    async def on_api_error(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names one route's methods; the path may have more
            headers["Allow"] = _allowed_methods(request)
        return APIError(exc.status_code, str(exc.detail), headers=headers).response()

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return APIError(
            400, f"{loc or 'request'}: {first.get('msg', 'invalid request')}", param=loc or None
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(WorkerDeadError, on_api_error)
    app.add_exception_handler(RequestFailedError, on_api_error)
    app.add_exception_handler(ValueError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_api_error)
