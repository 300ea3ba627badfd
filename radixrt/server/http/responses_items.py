"""The input items of a stored response, for GET /v1/responses/{id}/input_items.

A response's input items are everything the model saw for it, oldest first: with ``previous_response_id``
the previous response's input items and output items, then this request's ``input`` as items. Each item
has an ``id`` (a client's own id is kept; others get one here) and OpenAI's item shape: ``message`` items
with ``input_text`` parts (``output_text`` for the assistant's), ``function_call``,
``function_call_output`` and ``reasoning`` items as sent. The list pages as OpenAI's does: ``limit``
(1..100, default 20), ``order`` (``desc``, the default, newest first; or ``asc``), and the cursors
``after`` / ``before`` (item ids, exclusive).
"""

from __future__ import annotations

from typing import Any

from radixrt.server.http.errors import APIError
from radixrt.server.http.responses_format import new_id

MAX_PAGE = 100
ORDERS = ("asc", "desc")


def _parts(content: Any, kind: str) -> list[dict[str, Any]]:
    """A message's content as a list of text parts of type ``kind`` (content was checked on input)."""
    if isinstance(content, str):
        texts = [content]
    else:
        texts = [p["text"] for p in content]
    if kind == "output_text":
        return [{"type": kind, "text": t, "annotations": []} for t in texts]
    return [{"type": kind, "text": t} for t in texts]


def input_item_list(raw: str | list[Any]) -> list[dict[str, Any]]:
    """A request's ``input`` (already validated by ``input_messages``) as items with ids."""
    if isinstance(raw, str):
        if not raw:
            return []
        return [_message("user", raw, None)]
    items: list[dict[str, Any]] = []
    for item in raw:
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message(item["role"], item["content"], item.get("id")))
        elif kind == "function_call":
            items.append(
                {
                    "id": item.get("id") or new_id("fc"),
                    "type": "function_call",
                    "status": "completed",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        elif kind == "function_call_output":
            output = item["output"]
            items.append(
                {
                    "id": item.get("id") or new_id("fco"),
                    "type": "function_call_output",
                    "status": "completed",
                    "call_id": item["call_id"],
                    "output": output if isinstance(output, str) else "".join(p["text"] for p in output),
                }
            )
        else:  # reasoning
            items.append({**item, "id": item.get("id") or new_id("rs")})
    return items


def _message(role: str, content: Any, item_id: str | None) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": _parts(content, kind),
    }


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None, before: str | None
) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as OpenAI's list object; 400 naming a bad parameter."""
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit: must be in [1, {MAX_PAGE}]", param="limit")
    if order not in ORDERS:
        raise APIError(400, f"order: must be one of {', '.join(ORDERS)}", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in ordered]
    start, stop = 0, len(ordered)
    if after is not None:
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after")
        start = ids.index(after) + 1
    if before is not None:
        if before not in ids:
            raise APIError(400, f"before: no input item {before!r} in this response", param="before")
        stop = ids.index(before)
    window = ordered[start:stop]
    page = window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > limit,
    }
