"""The OpenAI Agents SDK's default model, ``OpenAIResponsesModel``, drives a tool loop over radixrt's
/v1/responses: the SDK sends flat function tools and its own input items, parses our ``function_call``
output items with its strict (pydantic) validation, runs the Python function, sends the result back as a
``function_call_output`` item (the whole conversation, or only the new items with
``auto_previous_response_id``, which continues the stored response) and asks again.

Every turn is ``tool_choice="required"`` (the grammar makes the random-weight model's calls valid and
ends them; a free-text answer from it would run into ``max_output_tokens``, a ``response.incomplete`` the
SDK raises on), and the agent's ``tool_use_behavior`` ends the run after the second tool result: two turns
of a real loop, the second continuing the first.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Literal

import pytest
from pydantic import Field
from server_harness import ServerProcess

agents = pytest.importorskip("agents")  # the `openai-agents` package (dev extra)

pytest_plugins = ["server_fixtures"]


@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous-response-id-streamed"])
def test_openai_agents_sdk_responses_tool_loop(server: ServerProcess, chained: bool) -> None:
    from openai import AsyncOpenAI

    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_forecast(city: Literal["Paris", "Rome", "Oslo"], days: Annotated[int, Field(ge=1, le=5)]) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"{city}: sunny for {days} days"

    def two_calls(
        _: agents.RunContextWrapper[None], results: list[agents.FunctionToolResult]
    ) -> agents.ToolsToFinalOutputResult:
        return agents.ToolsToFinalOutputResult(len(calls) >= 2, results[-1].output if results else None)

    async def run() -> agents.RunResultBase:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        agent = agents.Agent(
            name="forecaster",
            instructions=f"You answer weather questions (session {uuid.uuid4().hex}).",
            model=agents.OpenAIResponsesModel(model="m", openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=96
            ),
            tools=[get_forecast],
            reset_tool_choice=False,
            tool_use_behavior=two_calls,
        )
        question = "Will it rain in Oslo this week?"
        try:
            if not chained:
                return await agents.Runner.run(agent, question, max_turns=4)
            streamed = agents.Runner.run_streamed(
                agent, question, max_turns=4, auto_previous_response_id=True
            )
            async for _ in streamed.stream_events():
                pass
            return streamed
        finally:
            await client.close()

    agents.set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
    result = asyncio.run(run())
    assert len(calls) == 2  # the SDK parsed our function_call items, validated their arguments, ran the tool
    for city, days in calls:
        assert city in ("Paris", "Rome", "Oslo") and 1 <= days <= 5
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"] * 2, kinds
    assert result.final_output == f"{calls[1][0]}: sunny for {calls[1][1]} days"
    assert len(result.raw_responses) == 2
    first, second = result.raw_responses[0], result.raw_responses[1]
    assert first.response_id is not None and first.response_id.startswith("resp_")
    # the answer turn's prompt repeats the call turn's and extends it: the RadixCache has it
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with server.client() as c:  # the stored second turn says whether the SDK continued the first by id
        stored = c.get(f"/v1/responses/{second.response_id}").json()
    assert stored["previous_response_id"] == (first.response_id if chained else None)
