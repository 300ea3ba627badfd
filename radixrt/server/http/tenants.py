"""Who sends a request: the API key -> the admin or a tenant; which routes a tenant key reaches; what a
non-admin client is told about the cache.

Without ``--tenants`` the only key is ``--api-key`` (when set), required on every route but /health.
With ``--tenants`` (which needs ``--api-key``, the admin key):

- ``Authorization: Bearer <key>`` (or ``X-API-Key``) names the principal: the admin key runs its requests
  as `radixrt.config.tenants.ADMIN_TENANT`, a tenant's key as that tenant; a missing or unknown key is a 401;
- a tenant key reaches only the generation and model routes (`TENANT_ROUTES`); every other route is an
  admin route (flush, server info, load, metrics, health_generate, and any added later): 403.

The tenant goes to the worker next to the request (``TokenizerManager.generate(obj, tenant=...)``),
which derives the cache namespace from it (`radixrt.config.tenants.namespace`): a body field cannot change it.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from radixrt.config.tenants import ADMIN_TENANT, TenantConfig
from radixrt.server.http.errors import APIError

OPEN_ROUTES = frozenset({"/health"})  # no key needed
TENANT_ROUTES = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/get_model_info", "/model_info",
     "/openapi.json", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/embeddings"}
)  # fmt: skip
REPORT_PAGE_TOKENS = 16  # --cache-report-granularity page: cached_tokens in whole pages of this many tokens


@dataclass(frozen=True, slots=True)
class Principal:
    """The sender of a request: the tenant it runs as (None without tenants) and whether it is the admin."""

    tenant: str | None
    admin: bool


ANONYMOUS = Principal(None, False)  # no --api-key and no --tenants: anyone, as today


def principal_of(request: Request) -> Principal:
    """The principal `AuthMiddleware` found for ``request`` (ANONYMOUS when no key is configured)."""
    p = request.scope.get("state", {}).get("principal")
    return p if isinstance(p, Principal) else ANONYMOUS


def load_tenants(api_key: str | None, path: str | None) -> TenantConfig | None:
    """The ``--tenants`` file, validated (ValueError with the file's problem, or a missing admin key)."""
    if path is None:
        return None
    config = TenantConfig.load(path)
    if not api_key:
        raise ValueError(
            "tenants: --tenants needs --api-key, the admin key (the only key that reaches /metrics, "
            "/flush_cache, /server_info and the other admin routes)"
        )
    owner = config.by_key(api_key)
    if owner is not None:
        raise ValueError(
            f"tenants: --api-key is also a key of tenant {owner.name!r}; the admin key is its own"
        )
    return config


def _is_tenant_route(path: str) -> bool:
    # /v1/responses/{id}: a tenant reads and deletes its own stored responses (`responses_store`)
    return (
        path in TENANT_ROUTES or path.startswith(("/v1/models/", "/v1/responses/")) or path == "/v1/responses"
    )


class AuthMiddleware:
    """401 for every route but /health without a known key; 403 for a tenant key on an admin route.
    Puts the request's `Principal` into the ASGI scope's state (read back with `principal_of`)."""

    def __init__(self, app: ASGIApp, api_key: str | None, tenants: TenantConfig | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.keys = [(k.encode(), t.name) for t in tenants.tenants for k in t.api_keys] if tenants else None

    def resolve(self, token: bytes) -> Principal | None:
        """The principal owning ``token``; None for an unknown one. Every key is compared (constant time)."""
        admin = self.api_key is not None and secrets.compare_digest(token, self.api_key)
        if self.keys is None:
            return Principal(None, True) if admin else None
        if admin:
            return Principal(ADMIN_TENANT, True)
        owner = None
        for key, name in self.keys:
            if secrets.compare_digest(token, key):
                owner = name
        return None if owner is None else Principal(owner, False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        principal = self.resolve(token)
        error = None
        if principal is None:
            message = "invalid or missing API key (send `Authorization: Bearer <key>`)"
            error = APIError(401, message, code="invalid_api_key")
        elif not principal.admin and not _is_tenant_route(scope["path"]):
            message = f"{scope['path']}: an admin route; it needs the admin key (--api-key), not a tenant's"
            error = APIError(403, message, code="admin_key_required")
        if error is not None:
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def report_cached(result: Any, granularity: str) -> Any:
    """``result`` (one TokenizerManager output or a batch's list) with ``cached_tokens`` as a non-admin
    key sees it: ``page`` rounds down to whole `REPORT_PAGE_TOKENS`-token pages, ``none`` reports 0."""
    for item in result if isinstance(result, list) else [result]:
        meta = item["meta_info"]
        cached = int(meta["cached_tokens"])
        meta["cached_tokens"] = 0 if granularity == "none" else cached - cached % REPORT_PAGE_TOKENS
        meta.pop("cached_tokens_details", None)  # the tiers' split would tell the exact count
    return result


async def coarsened(agen: AsyncGenerator[Any, None], granularity: str) -> AsyncGenerator[Any, None]:
    """``agen``'s outputs through `report_cached`; closing this closes ``agen`` (which aborts the request)."""
    try:
        async for out in agen:
            yield report_cached(out, granularity)
    finally:
        await agen.aclose()
