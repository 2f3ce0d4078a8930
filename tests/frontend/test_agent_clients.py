"""Agent programs people point at self-hosted servers, unmodified, against a real `zllm serve`
(issue 73): the OpenAI Agents SDK through both of its model classes (Responses and Chat
Completions), one run with a tool round trip: the model calls the tool, the SDK runs it and
sends its output back, and the model answers.

The tiny random model is held to a call on the first turn by `tool_choice: required` (a
grammar); the SDK then resets tool_choice, and the agent's output type (a JSON schema the SDK
sends every turn) holds the answer: a random model would not end a free answer on its own,
and the SDK takes a Responses answer cut by max_output_tokens as an error.
"""

from __future__ import annotations

from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, Field

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402


@pytest.fixture(scope="module")
def server(tools_model, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-clients") / "server.log"
    args = ["--served-model-name", "tiny", "--tool-call-parser", "hermes"]
    with engine_pool.serve(str(tools_model), log, *args) as server:
        yield server


class Answer(BaseModel):
    summary: Annotated[str, Field(max_length=8)]


@pytest.mark.e2e
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_agents_sdk_runs_a_tool_round_trip(server, api) -> None:
    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    client = AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        max_retries=0,
        http_client=httpx.AsyncClient(event_hooks={"response": [record]}, timeout=120),
    )
    model_class = {
        "responses": agents.OpenAIResponsesModel,
        "chat_completions": agents.OpenAIChatCompletionsModel,
    }[api]
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tools you have.",
        tools=[get_weather],
        output_type=Answer,
        model=model_class(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120
        ),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=8)
    kinds = [item.type for item in result.new_items]
    # The model called, the SDK ran the tool and sent its output back, the model answered.
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert cities and all(len(city) <= 8 for city in cities)
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == kinds.count("tool_call_output_item") + 1
    # One request a turn, none refused or failed.
    assert statuses == [200] * len(result.raw_responses), statuses
