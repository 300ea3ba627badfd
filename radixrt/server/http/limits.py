"""Bounds on what a request may cost the HTTP process before it is refused, and what OpenAPI says.

A JSON body must be ``application/json`` (a browser sends ``text/plain`` across origins without a
CORS preflight), at most ``--max-request-bytes`` long (the declared Content-Length and the bytes
actually received are both counted) and nested at most ``MAX_JSON_DEPTH`` deep. Long prompts are
tokenized on a worker thread so that the event loop (``/health`` included) keeps answering.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from fastapi import Request

from radixrt.server.http.errors import APIError
from radixrt.server.io_struct import GenerateReqInput, SingleReq

if TYPE_CHECKING:
    from radixrt.server.tokenizer_manager import TokenizerManager

MAX_JSON_DEPTH = 64
OFFLOAD_CHARS = 4096  # prompts with more characters in all are tokenized off the event loop
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')


def check_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (``application/json`` or ``application/*+json``)."""
    declared = request.headers.get("content-type", "")
    kind = declared.split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise APIError(
            415,
            f"Content-Type: expected application/json, got {declared or 'none'}",
            param="Content-Type",
            code="unsupported_media_type",
        )


def too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"request body: larger than {max_bytes} bytes (--max-request-bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as its declared or received length exceeds ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (brackets inside strings do not count).

    Linear in C/numpy: escaped backslashes and quotes are dropped first, so every remaining ``"``
    opens or closes a string, and the pieces between string delimiters alternate outside / inside.
    """
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_BRACKETS)
    if b"[" not in plain and b"{" not in plain:
        return 0
    outside = b"".join(plain.split(b'"')[::2])
    codes = np.frombuffer(outside, dtype=np.uint8)
    steps = (
        (codes == ord("[")).astype(np.int32) + (codes == ord("{")) - (codes == ord("]")) - (codes == ord("}"))
    )
    return int(np.cumsum(steps).max(initial=0))


def check_depth(body: bytes) -> None:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"request body: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed",
            code="json_too_deep",
        )


async def tokenize_texts(tm: TokenizerManager, texts: list[str]) -> list[list[int]]:
    """``tm.tokenize`` of each text (its checks included), on a worker thread when they are long."""

    def run() -> list[list[int]]:
        return [tm.tokenize(SingleReq(text=t, input_ids=None, sampling_params={})) for t in texts]

    if sum(map(len, texts)) < OFFLOAD_CHARS:
        return run()
    return await asyncio.to_thread(run)


async def pretokenize(tm: TokenizerManager, obj: GenerateReqInput) -> None:
    """Replace a long ``text`` (or batch of texts) by its token ids, tokenized off the event loop."""
    if obj.text is None:
        return
    texts = [obj.text] if isinstance(obj.text, str) else list(obj.text)
    if sum(map(len, texts)) < OFFLOAD_CHARS:
        return
    ids = await tokenize_texts(tm, texts)
    obj.input_ids = ids if obj.is_batch else ids[0]
    obj.text = None


# -- OpenAPI ---------------------------------------------------------------------------------------
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    400: "Invalid request (the message names the field)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    415: "Body is not application/json",
    429: "Queue full",
    503: "Worker unavailable",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for status, text in _ERRORS.items()
}
# The generation routes: JSON, or Server-Sent Events with ``"stream": true``.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The result", "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}


def openapi_body(type_: type, example: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` declaring a route's JSON request body as ``type_``'s (msgspec) JSON schema,
    with one valid ``example``."""
    schema = msgspec.json.schema(type_)
    defs = schema.pop("$defs", {})
    media = {"schema": _inline(schema, defs), "example": example}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``$ref`` to ``#/$defs/X`` replaced by X (the body types are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
