"""An agent framework no one here wrote drives a tool loop against the live server: the OpenAI Agents
SDK's ``Agent`` with its Chat Completions model, pointed at radixrt's /v1.

The SDK builds the tools' schemas from Python signatures, sends ``tools`` / ``tool_choice``, parses the
reply's ``tool_calls`` with its own (strict, pydantic) validation, runs the Python function, sends the
result back as a ``tool`` message and asks again. The first turn is ``tool_choice="required"`` (so the
random-weight model calls a tool: the grammar makes it well-formed); the SDK then resets the choice to
``auto`` and the model answers in text.
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


def test_openai_agents_sdk_tool_loop(server: ServerProcess) -> None:
    from openai import AsyncOpenAI

    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_forecast(city: Literal["Paris", "Rome", "Oslo"], days: Annotated[int, Field(ge=1, le=5)]) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"{city}: sunny for {days} days"

    async def run() -> agents.RunResult:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        agent = agents.Agent(
            name="forecaster",
            instructions=f"You answer weather questions (session {uuid.uuid4().hex}).",
            model=agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
            # one call per turn: with parallel calls this random model keeps calling until max_tokens
            model_settings=agents.ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=96
            ),
            tools=[get_forecast],
        )
        try:
            return await agents.Runner.run(agent, "Will it rain in Oslo this week?", max_turns=4)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
    result = asyncio.run(run())
    assert len(calls) >= 1  # the SDK parsed our tool call, validated its arguments and ran the function
    city, days = calls[0]
    assert city in ("Paris", "Rome", "Oslo") and 1 <= days <= 5
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) >= 2  # the call turn and the answer turn
    second = result.raw_responses[1].usage
    # the answer turn's prompt repeats the call turn's and extends it: the RadixCache has it
    assert second.input_tokens_details.cached_tokens >= result.raw_responses[0].usage.input_tokens
