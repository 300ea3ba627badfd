"""The Responses API (/v1/responses) on a live server, through the official ``openai`` client.

Oracles: /v1/chat/completions on the same conversation (greedy decoding is deterministic, so a response's
text and token counts must equal the chat answer's), jsonschema for the calls ``required`` forces, the
stream's events reassembling into the non-streamed response, and the RadixCache's ``cached_tokens`` on a
continued conversation. The tiny random-weight model writes nonsense: every well-formed call is the
grammar's doing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER},
    # No arguments: an open {"type": "object"} let the random model write an object past max_output_tokens,
    # so whether a `required` turn completed its call depended on the (random) instructions.
    {"type": "function", "name": "noop", "description": "Does nothing.", "parameters": NOOP},
]
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def fresh() -> str:
    """Instructions no other test has sent (nothing of the prompt is cached)."""
    return f"You are agent {uuid.uuid4().hex}."


def test_text_input_matches_chat_completions(client: openai.OpenAI) -> None:
    system = fresh()
    resp = client.responses.create(
        model="m", instructions=system, input="Say hello.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"
    assert resp.instructions == system and resp.max_output_tokens == 12 and resp.temperature == 0


def test_message_list_input(client: openai.OpenAI) -> None:
    system = fresh()
    items: Any = [
        {"role": "developer", "content": system},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Again."},
    ]  # fmt: skip
    resp = client.responses.create(model="m", input=items, max_output_tokens=10, temperature=0)
    chat = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": system},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again."},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def calls_of(resp: Any) -> list[Any]:
    return [item for item in resp.output if item.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_required_and_named_calls_validate(client: openai.OpenAI, choice: Any) -> None:
    for seed in (1, 2, 3):
        resp = client.responses.create(
            model="m", instructions=fresh(), input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_output_tokens=120, temperature=1.0, extra_body={"seed": seed},
        )  # fmt: skip
        calls = calls_of(resp)
        assert len(calls) == 1 and resp.status == "completed", resp
        call = calls[0]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert call.name in ({"get_weather"} if isinstance(choice, dict) else {"get_weather", "noop"})
        schema = WEATHER if call.name == "get_weather" else NOOP
        jsonschema.validate(json.loads(call.arguments), schema)
    assert resp.tools[0].type == "function" and resp.tools[0].name == "get_weather"  # type: ignore[union-attr]


def test_stream_events_reassemble_the_response(client: openai.OpenAI) -> None:
    """Greedy: the stream's items equal the non-streamed response's; the events come in OpenAI's order."""
    kw: dict[str, Any] = dict(
        model="m", instructions=fresh(), input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=0,
    )  # fmt: skip
    full = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.delta" in kinds
    call = calls_of(full)[0]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments and done[0].name == call.name
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in full.output]
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
        (i.type, getattr(i, "name", None)) for i in full.output
    ]
    assert final.usage is not None and full.usage is not None
    assert final.usage.output_tokens == full.usage.output_tokens


def test_stream_helper_text(client: openai.OpenAI) -> None:
    """``client.responses.stream`` (the SDK's accumulating helper) sees consistent events; a response cut by
    ``max_output_tokens`` ends in ``response.incomplete``."""
    kw: dict[str, Any] = dict(model="m", instructions=fresh(), input="Tell a story.", max_output_tokens=16,
                              temperature=0)  # fmt: skip
    full = client.responses.create(**kw)
    deltas, last = [], None
    with client.responses.stream(**kw) as stream:
        for event in stream:
            last = event
            if event.type == "response.output_text.delta":
                assert event.snapshot == "".join(deltas) + event.delta  # the helper's accumulated text
                deltas.append(event.delta)
    assert "".join(deltas) == full.output_text
    assert last is not None and last.type == f"response.{full.status}"
    assert last.response.output_text == full.output_text  # type: ignore[union-attr]


def test_store_retrieve_delete(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="m", instructions=fresh(), input="Hi", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.store is True
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="Hi", max_output_tokens=2, previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_previous_response_id_tool_loop_hits_the_cache(client: openai.OpenAI, server: ServerProcess) -> None:
    """A tool loop continued by id: the second turn renders the same conversation as the explicit chat
    request (same prompt tokens) and its prefix is the first turn's prompt, found in the RadixCache."""
    system = fresh()
    first = client.responses.create(
        model="m", instructions=system, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=0,
    )  # fmt: skip
    call = calls_of(first)[0]
    second = client.responses.create(
        model="m", instructions=system, previous_response_id=first.id, tools=TOOLS, tool_choice="auto",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    chat = client.chat.completions.create(
        model="m", tools=CHAT_TOOLS, tool_choice="auto", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}],
    )  # fmt: skip
    assert chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # the continuation is stored too, and continues again
    third = client.responses.create(
        model="m",
        instructions=system,
        previous_response_id=second.id,
        tools=TOOLS,
        input="Thanks.",
        max_output_tokens=4,
    )
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    with server.client() as c:
        wait_idle(c)


def test_input_items_list_the_conversation(client: openai.OpenAI, server: ServerProcess) -> None:
    """GET /v1/responses/{id}/input_items: what the model saw, oldest first with ``order="asc"`` (the
    previous turn's input and output, then this turn's input), newest first by default, paged by the
    SDK's cursor (``after``) with the same items as one page."""
    system = fresh()
    first = client.responses.create(
        model="m", instructions=system, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=0,
    )  # fmt: skip
    call = calls_of(first)[0]
    given = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ]
    second = client.responses.create(
        model="m", instructions=system, previous_response_id=first.id, input=given, max_output_tokens=4
    )
    items = list(client.responses.input_items.list(second.id, order="asc", limit=100))
    kinds = [i.type for i in items]
    assert kinds == ["message", *[o.type for o in first.output], "function_call_output", "message"]
    assert items[0].role == "user" and items[0].content[0].text == "Weather in Rome?"  # type: ignore[union-attr]
    assert [i.id for i in items[1 : 1 + len(first.output)]] == [o.id for o in first.output]
    assert items[-2].call_id == call.call_id and items[-2].output == "Sunny, 24 C"  # type: ignore[union-attr]
    assert items[-1].content[0].text == "And tomorrow?"  # type: ignore[union-attr]
    assert len({i.id for i in items}) == len(items)
    newest_first = list(client.responses.input_items.list(second.id))
    assert [i.id for i in newest_first] == [i.id for i in reversed(items)]
    paged = list(client.responses.input_items.list(second.id, order="asc", limit=2))  # the SDK pages on
    assert [i.id for i in paged] == [i.id for i in items]
    first_items = list(client.responses.input_items.list(first.id))
    assert [i.type for i in first_items] == ["message"]
    with server.client() as c:
        for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_nope", "after")):
            r = c.get(f"/v1/responses/{second.id}/input_items?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert c.get("/v1/responses/resp_nope/input_items").status_code == 404


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f b"}]}, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": ""}, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    with server.client() as c:
        r = c.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_unknown_ids_are_404(server: ServerProcess) -> None:
    with server.client() as c:
        for r in (c.get("/v1/responses/resp_nope"), c.delete("/v1/responses/resp_nope")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = c.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_tenants_see_only_their_own_responses(launch_server: Any, tmp_path: Any) -> None:
    tenants = tmp_path / "tenants.json"
    keys = {"alpha": "sk-alpha", "beta": "sk-beta"}
    tenants.write_text(json.dumps({"tenants": [{"name": n, "api_keys": [k]} for n, k in keys.items()]}))
    srv = launch_server("--tenants", str(tenants), api_key="sk-admin")

    def as_(key: str) -> httpx.Client:
        return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    with as_("sk-alpha") as alpha, as_("sk-beta") as beta:
        r = alpha.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert alpha.get(f"/v1/responses/{rid}").json()["id"] == rid
        assert beta.get(f"/v1/responses/{rid}").status_code == 404
        assert alpha.get(f"/v1/responses/{rid}/input_items").json()["data"][0]["type"] == "message"
        assert beta.get(f"/v1/responses/{rid}/input_items").status_code == 404
        assert beta.delete(f"/v1/responses/{rid}").status_code == 404
        r = beta.post(
            "/v1/responses", json={"input": "x", "previous_response_id": rid, "max_output_tokens": 2}
        )
        assert r.status_code == 404
        cont = alpha.post(
            "/v1/responses", json={"input": "x", "previous_response_id": rid, "max_output_tokens": 2}
        )
        assert cont.status_code == 200, cont.text
        assert alpha.delete(f"/v1/responses/{rid}").status_code == 200
        assert alpha.get(f"/v1/responses/{rid}").status_code == 404
