"""``--log-requests``: one log line per request the worker ended, from the TokenizerManager's
finished-request listeners (the hook /metrics uses).

A line holds the request's id, tenant, token counts, finish reason and latencies, never its prompt or
output text, nor a matched stop string or an abort message (they may quote either)::

    request rid=3f2a tenant=alpha prompt_tokens=812 cached_tokens=768 generated_tokens=64 finish=stop latency=1.204s ttft=0.081s
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def finish_text(reason: dict[str, Any] | None) -> str:
    """The finish reason's type, with the HTTP status of a failed request: ``stop``, ``abort/504``."""
    if reason is None:
        return "none"
    kind = str(reason.get("type", "unknown"))
    status = reason.get("status_code")
    return kind if status is None else f"{kind}/{status}"


def request_line(result: dict[str, Any]) -> str:
    """The log line of one finished TokenizerManager result (its ``meta_info``, ``timing``, ``tenant``)."""
    meta = result["meta_info"]
    timing = result.get("timing") or {}
    latency = float(timing.get("e2e", meta.get("e2e_latency", 0.0)))
    ttft = timing.get("ttft")
    return (
        f"request rid={meta['id']} tenant={result.get('tenant') or '-'} "
        f"prompt_tokens={meta['prompt_tokens']} cached_tokens={meta['cached_tokens']} "
        f"generated_tokens={meta['completion_tokens']} finish={finish_text(meta['finish_reason'])} "
        f"latency={latency:.3f}s ttft={'-' if ttft is None else f'{ttft:.3f}s'}"
    )


def log_request(result: dict[str, Any]) -> None:
    """A finished-request listener (``TokenizerManager.listeners``): log ``request_line`` at INFO."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", request_line(result))
