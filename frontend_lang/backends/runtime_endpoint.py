"""RuntimeEndpoint: a radixrt (or SGLang) server over HTTP, through its native ``/generate`` API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from frontend_lang.backends.base import BackendError
from frontend_lang.backends.native import NativeBackend
from frontend_lang.chat_template import template_for_tokenizer
from frontend_lang.retention import DEFAULT_PIN_TTL, check_pin_ttl


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


class RuntimeEndpoint(NativeBackend):
    """A server at ``base_url`` (``Authorization: Bearer api_key`` when given).

    When the server's tokenizer directory exists on this machine (a local server), it is loaded so
    that ``select`` sets exact token boundaries; otherwise select commits the prefix first and uses
    its token count. ``chat_template`` names a template to use instead of the tokenizer's own.
    ``retention`` (default on) sends program-aware retention hints: request priorities and pins of
    shared prefixes for ``pin_ttl`` seconds at most (``frontend_lang.retention``).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        chat_template: str | None = None,
        timeout: float = 600.0,
        load_tokenizer: bool = True,
        retention: bool = True,
        pin_ttl: float = DEFAULT_PIN_TTL,
    ) -> None:
        self.retention, self.pin_ttl = bool(retention), check_pin_ttl(pin_ttl)
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._get("/get_model_info")
        path = str(self.model_info.get("tokenizer_path") or self.model_info.get("model_path") or "")
        self.tokenizer = None
        if load_tokenizer and path and (Path(path) / "tokenizer.json").is_file():
            from radixrt.models.tokenizer import load_tokenizer as load

            self.tokenizer = load(path)
        self.chat_template = template_for_tokenizer(self.tokenizer, path, chat_template)

    def _get(self, route: str) -> dict[str, Any]:
        try:
            resp = self.client.get(route)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}{route}: {exc}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"{route}: HTTP {resp.status_code}: {_error_message(resp)}")
        data: dict[str, Any] = resp.json()
        return data

    def _call(self, payload: dict[str, Any]) -> Any:
        try:
            resp = self.client.post("/generate", json=payload)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}/generate: {exc}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"/generate: HTTP {resp.status_code}: {_error_message(resp)}")
        return resp.json()

    def _admin(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        try:
            resp = self.client.request(method, route, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}{route}: {exc}") from exc
        if resp.status_code in (403, 404) and route == "/pin_prefix":
            why = "has no /pin_prefix route" if resp.status_code == 404 else "lets only the admin key pin"
            raise BackendError(
                f"{self.base_url} {why}: retention hints pin shared prefixes (pass retention=False to "
                "RuntimeEndpoint)"
            )
        if resp.status_code >= 400:
            raise BackendError(f"{method} {route}: HTTP {resp.status_code}: {_error_message(resp)}")
        return resp.json()

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._admin("POST", "/pin_prefix", body)
        return out

    def _unpin(self, pin_id: str) -> None:
        try:
            resp = self.client.delete(f"/pins/{pin_id}")
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}/pins/{pin_id}: {exc}") from exc
        # NOTE: 404: the pin is gone already (its TTL lapsed, or another program pinned the same
        # tokens, which is the same pin, and released it): what releasing asks for.
        if resp.status_code >= 400 and resp.status_code != 404:
            raise BackendError(f"DELETE /pins/{pin_id}: HTTP {resp.status_code}: {_error_message(resp)}")

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.client.stream("POST", "/generate", json=payload) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise BackendError(f"/generate: HTTP {resp.status_code}: {_error_message(resp)}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(f"/generate stream: {event['error'].get('message', event['error'])}")
                yield event

    def flush_cache(self) -> bool:
        return self.client.post("/flush_cache").status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self.client.close()
