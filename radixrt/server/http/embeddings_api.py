"""POST /v1/embeddings (OpenAI's shapes) for decoder-based embedding models served with ``--is-embedding``.

Each input (a string, a list of strings, token ids or a list of id lists) runs as a prefill-only request
whose final hidden states the worker pools (`radixrt.worker.pooling`): ``last`` token or ``mean``, as the
checkpoint's sentence-transformers pooling config (``1_Pooling/config.json``) says, ``last`` without one
(e5-mistral, gte-Qwen, Qwen3-Embedding). The vector is L2-normalized here. ``encoding_format`` ``float`` or
``base64`` (little-endian float32, what the openai client asks for by default); ``dimensions`` is refused
(no model here is trained for truncation). A server without ``--is-embedding`` answers 400 saying how to
serve embeddings.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixrt.server.http.errors import APIError, JSONResponse, bad_request, refused
from radixrt.server.http.limits import ERROR_RESPONSES, openapi_body
from radixrt.server.http.openai_api import check_model
from radixrt.server.http.openai_protocol import completion_prompts
from radixrt.server.http.streaming import collect, convert, read_json
from radixrt.server.io_struct import GenerateReqInput

if TYPE_CHECKING:
    from radixrt.server.http.context import ServerContext

NOT_EMBEDDING = (
    "this server does not serve embeddings: start one with an embedding model and --is-embedding "
    "(e.g. `radixrt serve --model-path <decoder embedding model> --is-embedding`)"
)


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/embeddings."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def pooling_mode(model_path: str) -> str:
    """``mean`` or ``last``, from the checkpoint's sentence-transformers pooling config (``last`` if none)."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return "last"
    modes = json.loads(config.read_text())
    if modes.get("pooling_mode_mean_tokens"):
        return "mean"
    if modes.get("pooling_mode_lasttoken"):
        return "last"
    raise ValueError(f"{config}: a pooling mode radixrt does not serve (it serves mean and lasttoken)")


def normalized(vector: list[float]) -> list[float]:
    """``vector`` scaled to unit L2 norm (a zero vector stays zero)."""
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def build_embeddings_router(ctx: ServerContext) -> APIRouter:
    """The /v1/embeddings route of one server."""
    router = APIRouter()
    mode = pooling_mode(ctx.model_path) if ctx.args.is_embedding else None
    doc = openapi_body(EmbeddingRequest, {"input": ["Hello", "world"]})

    @router.post("/v1/embeddings", openapi_extra=doc, responses=ERROR_RESPONSES)
    async def embeddings(request: Request) -> Response:
        req = convert(await read_json(request, ctx.args.max_request_bytes), EmbeddingRequest)
        check_model(ctx, req.model)
        if mode is None:
            raise APIError(400, NOT_EMBEDDING, param="model", code="model_not_embedding")
        if req.dimensions is not None:
            raise APIError(
                400, "dimensions: not supported (this server returns the model's full vectors)", "dimensions"
            )
        if req.encoding_format not in ("float", "base64"):
            raise APIError(400, "encoding_format: must be float or base64", param="encoding_format")
        try:
            prompts = await completion_prompts(ctx.tm, req.input)
        except ValueError as exc:
            raise bad_request(exc, {"prompt": "input", "text": "input", "input_ids": "input"}) from None
        except APIError as exc:
            raise APIError(400, exc.message.replace("prompt", "input"), param="input") from None
        obj = GenerateReqInput(
            input_ids=prompts if len(prompts) > 1 else prompts[0],
            sampling_params={"max_new_tokens": 0},
            embed=mode,
        )
        try:
            out = await collect(ctx.generate(request, obj))
        except ValueError as exc:
            raise bad_request(exc, {"text": "input", "input_ids": "input"}) from None
        results = out if isinstance(out, list) else [out]
        for error in filter(None, map(refused, results)):
            raise error
        data = []
        for i, res in enumerate(results):
            vector = normalized(res["embedding"])
            value: Any = vector
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": ctx.model_name, "usage": usage})

    return router
