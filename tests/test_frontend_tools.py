"""Native tool calls in the DSL (`frontend_lang.tools`), on the in-process Engine and over HTTP.

Oracles: jsonschema for the arguments of the calls ``required`` / a named function force (the tiny model
has random weights: whatever validates is the grammar's doing), and the server's own rendering of the
same conversation (`ToolSupport.messages` + the chat template): a program's text is the prompt
/v1/chat/completions builds for it.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from server_harness import ServerProcess

import frontend_lang as sgl
from frontend_lang.tool_exec import GENERIC_TOOL_PROMPT
from radixrt.server.http.tool_calls import GENERIC_TOOL_PROMPT as SERVER_PROMPT
from radixrt.server.http.tool_calls import ToolPlan, ToolSupport

pytest_plugins = ["frontend_fixtures", "server_fixtures"]

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
}  # fmt: skip
LOOKUP = {"type": "object", "properties": {"key": {"type": "string", "maxLength": 8}}, "required": ["key"]}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "name": "lookup", "parameters": LOOKUP},  # the flat (Responses) shape works too
]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
SYSTEM = "You are a careful agent."


@sgl.function
def one_step(s: Any, question: str, choice: Any, result: str) -> None:
    s += sgl.system(SYSTEM + "\n\n" + sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("step", tools=TOOLS, tool_choice=choice, max_tokens=96))
    for call in s.tool_calls("step"):
        s += sgl.tool(call.id, result)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def check_calls(state: Any, names: set[str]) -> list[Any]:
    assert state.error() is None, state.error()
    calls = state.tool_calls("step")
    assert len(calls) == 1  # parallel_tool_calls defaults to False
    for call in calls:
        assert call.name in names and call.id.startswith("call_")
        jsonschema.validate(call.args, SCHEMAS[call.name])
        assert json.loads(call.arguments) == call.args
    return list(calls)


def test_generic_prompt_is_the_servers() -> None:
    assert GENERIC_TOOL_PROMPT == SERVER_PROMPT


@pytest.mark.parametrize(
    "choice", ["required", "lookup", {"type": "function", "function": {"name": "lookup"}}]
)
def test_required_and_named_calls_validate(fl_backend: sgl.EngineBackend, choice: Any) -> None:
    names = set(SCHEMAS) if choice == "required" else {"lookup"}
    for temperature in (0.0, 1.0):
        state = one_step.run(
            question="Weather in Oslo?",
            choice=choice,
            result="sunny",
            backend=fl_backend,
            temperature=temperature,
        )
        check_calls(state, names)


def test_program_text_is_the_servers_prompt(fl_backend: sgl.EngineBackend) -> None:
    """The conversation a program wrote renders, through the server's tool folding and the chat template,
    to exactly the program's text (so a server and a program share their cached prefixes)."""
    state = one_step.run(question="Weather?", choice="required", result='{"t": 21}', backend=fl_backend,
                         temperature=0)  # fmt: skip
    call = check_calls(state, set(SCHEMAS))[0]
    step = state["step"]
    assert step.startswith("<tool_call>") and call.name in step
    support = ToolSupport.for_tokenizer(fl_backend.tokenizer, None)
    plan = ToolPlan([dict(t) for t in sgl.tools.normalize_tools(TOOLS)], list(SCHEMAS), True, False)
    fn = {"name": call.name, "arguments": call.arguments}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"t": 21}'},
    ]
    rendered = fl_backend.tokenizer.apply_chat_template(
        support.messages(messages, plan), tokenize=False, add_generation_prompt=True
    )
    text = state.text()
    assert text.startswith(rendered) and text[len(rendered) :].startswith(state["answer"])
    assert '<tool_response>\n{"t": 21}\n</tool_response>' in text


def test_auto_and_errors(fl_backend: sgl.EngineBackend) -> None:
    state = one_step.run(question="Hi", choice="auto", result="x", backend=fl_backend, temperature=0)
    assert state.error() is None and isinstance(state.tool_calls("step"), list)
    for call in state.tool_calls("step"):  # whatever auto returns parses and names an offered tool
        assert call.name in SCHEMAS and isinstance(call.args, dict)
    with pytest.raises(KeyError, match="tools="):
        state.tool_calls("answer")
    with pytest.raises(ValueError, match="tool_choice"):
        sgl.gen("x", tools=TOOLS, tool_choice="nope")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        sgl.gen("x", tools=[{"type": "retrieval"}])

    @sgl.function
    def forged(s: Any) -> None:
        s += sgl.user("Hi")
        s += sgl.tool("call_forged", "x")

    bad = forged.run(backend=fl_backend)
    assert isinstance(bad.error(), ValueError) and "call_id" in str(bad.error())

    @sgl.function
    def two_constraints(s: Any) -> None:
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("x", tools=TOOLS, tool_choice="required", regex="a+"))

    bad = two_constraints.run(backend=fl_backend)
    assert isinstance(bad.error(), ValueError) and "regex" in str(bad.error())


def test_tool_calls_over_http(server: ServerProcess) -> None:
    """The same program against a live server's native /generate (RuntimeEndpoint)."""
    endpoint = sgl.RuntimeEndpoint(server.url, api_key=server.api_key)
    try:
        state = one_step.run(question="Weather?", choice="get_weather", result="sunny", backend=endpoint,
                             temperature=1.0)  # fmt: skip
        check_calls(state, {"get_weather"})
        assert "<tool_response>\nsunny\n</tool_response>" in state.text()
    finally:
        endpoint.shutdown()


def test_openai_backend_sends_native_tools(server: ServerProcess) -> None:
    """The same program on the OpenAI backend: the tools go to /v1/chat/completions as ``tools`` (no tool
    prompt in the program's text), the calls come back from ``message.tool_calls``, and the program's
    conversation reaches the server as OpenAI messages (an assistant turn with ``tool_calls``, a ``tool``
    message): the final answer equals the server's answer to that conversation sent by hand."""
    import openai

    key = server.api_key or "none"
    backend = sgl.OpenAI("m", base_url=server.url + "/v1", api_key=key)
    state = one_step.run(question="Weather?", choice="get_weather", result="sunny", backend=backend,
                         temperature=0)  # fmt: skip
    (call,) = check_calls(state, {"get_weather"})
    assert "# Tools" not in state.text() and "<tool_response>\nsunny\n</tool_response>" in state.text()
    assert state["step"].startswith("<tool_call>") and call.name in state["step"]
    assert state.get_meta_info("step")["finish_reason"] == "tool_calls"
    fn = {"name": call.name, "arguments": call.arguments}
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM + "\n\n"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
        direct = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert state["answer"] == direct.choices[0].message.content

    completion = sgl.OpenAI("m", base_url=server.url + "/v1", api_key=key, is_chat_model=False)
    bad = one_step.run(question="Hi", choice="required", result="x", backend=completion)
    assert isinstance(bad.error(), ValueError) and "chat model" in str(bad.error())
