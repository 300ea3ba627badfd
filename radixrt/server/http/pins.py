"""Admin routes over the RadixCache's TTL pins (`radixrt.mem_cache.pins`).

- ``POST /pin_prefix {"text" | "input_ids", "ttl"?, "cache_salt"?, "tenant"?}`` caches the prompt (a
  prefill-only request, nearly free when it is cached already) and pins it:
  ``{"pin_id", "pinned_tokens"}`` (``pin_id`` null and 0 tokens when the pin budget is full). The pin
  lives in the namespace of the admin (or of ``tenant``, with ``--tenants``) and ``cache_salt``;
- ``GET /pins``: ``[{"pin_id", "tokens", "expires_in_s", "tenant"}, ...]``, soonest expiry first;
- ``DELETE /pins/{pin_id}`` releases one pin (404 when unknown), ``DELETE /pins`` all of them.

None of these paths is a tenant route, so `radixrt.server.http.tenants.AuthMiddleware` answers a tenant key
with 403: only the admin key pins.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixrt.mem_cache.pins import DEFAULT_TTL_S, parse_ttl
from radixrt.server.http.errors import APIError, JSONResponse, refused
from radixrt.server.http.streaming import collect, convert, read_json
from radixrt.server.http.tenants import principal_of
from radixrt.server.io_struct import GenerateReqInput
from radixrt.transport.protocol import DropPinsReq, ListPinsReq, StatsOut, WorkerInput

if TYPE_CHECKING:
    from radixrt.server.http.context import ServerContext

CONTROL_TIMEOUT_S = 30.0


class PinPrefixBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The JSON body of POST /pin_prefix."""

    text: str | None = None
    input_ids: list[int] | None = None
    ttl: float | str | None = None  # seconds, or "600", "30s", "5m", "1h" (default 5 minutes)
    cache_salt: str | None = None
    tenant: str | None = None  # with --tenants: pin into this tenant's namespace instead of the admin's


def build_pins_router(ctx: ServerContext) -> APIRouter:
    """The pin admin routes of one server."""
    router = APIRouter()

    async def control(msg: WorkerInput) -> StatsOut:
        return await asyncio.wait_for(ctx.tm.control_request(msg), CONTROL_TIMEOUT_S)

    @router.post("/pin_prefix")
    async def pin_prefix(request: Request) -> Response:
        body = convert(await read_json(request, ctx.args.max_request_bytes), PinPrefixBody)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "text: give exactly one of `text` and `input_ids`", param="text")
        ttl = DEFAULT_TTL_S if body.ttl is None else parse_ttl(body.ttl, "ttl")
        tenant = principal_of(request).tenant
        if body.tenant is not None:
            names = {t.name for t in ctx.tenants.tenants} if ctx.tenants is not None else set()
            if body.tenant not in names:
                raise APIError(400, f"tenant: {body.tenant!r} is not a tenant of this server", param="tenant")
            tenant = body.tenant
        obj = GenerateReqInput(
            text=body.text,
            input_ids=body.input_ids,
            sampling_params={"max_new_tokens": 0},
            cache_salt=body.cache_salt,
            cache_control={"type": "ephemeral", "ttl": ttl},
        )
        out: dict[str, Any] = await collect(ctx.tm.generate(obj, tenant=tenant))
        error = refused(out)
        if error is not None:
            raise error
        meta = out["meta_info"]
        return JSONResponse({"pin_id": meta.get("pin_id"), "pinned_tokens": meta["pinned_tokens"]})

    @router.get("/pins")
    async def list_pins() -> Response:
        out = await control(ListPinsReq())
        return JSONResponse([msgspec.structs.asdict(p) for p in out.pins or []])

    @router.delete("/pins/{pin_id}")
    async def drop_pin(pin_id: str) -> Response:
        out = await control(DropPinsReq(pin_id))
        if not out.ok:
            raise APIError(404, out.message, param="pin_id", code="pin_not_found")
        return JSONResponse({"dropped": 1})

    @router.delete("/pins")
    async def drop_pins() -> Response:
        out = await control(DropPinsReq())
        return JSONResponse({"dropped": int(out.stats.get("dropped", 0))})

    return router
