"""`thinking_token_budget` (vLLM's name) on Chat Completions and Responses: the same budget
as Anthropic's `thinking.budget_tokens` (zllm/text/thinking_budget.py `budget_for`): after
that many reasoning tokens the engine writes the end marker and the answer follows.

The tiny model (seed 5) opens its thinking in the prompt and, greedy, does not close it
within these tests' lengths, so the budget's cut shows exactly: the reasoning is the first
BUDGET tokens the model writes unbudgeted, then the forced `</think>`, then the answer."""

from __future__ import annotations

import pytest
from tiny_models import write_tiny_model
from tool_calls import SWITCHABLE_THINK_TEMPLATE

pytestmark = pytest.mark.e2e

TEMPLATE = SWITCHABLE_THINK_TEMPLATE
MESSAGES = [{"role": "user", "content": "Is it?"}]
BUDGET = 24
ANSWER_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    return write_tiny_model(
        root / "model",
        seed=5,
        chat_template=TEMPLATE,
        extra_tokens=["<think>", "</think>"],
        max_position_embeddings=1024,
    )


@pytest.fixture(scope="module")
def server(model, engine_pool):
    args = ["--served-model-name", "tiny", "--reasoning-parser", "deepseek_r1"]
    with engine_pool.serve(str(model), model.parent / "server.log", *args) as server:
        yield server


def test_chat_and_responses_cut_the_reasoning_at_the_budget(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    reference = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=BUDGET, temperature=0.0
    )
    reasoning = reference.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and not reference.choices[0].message.content  # all of it thinking

    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=BUDGET + 1 + ANSWER_TOKENS,
        temperature=0.0,
        extra_body={"thinking_token_budget": BUDGET},
    )
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.content  # the answer after the forced </think>
    assert chat.usage.completion_tokens == BUDGET + 1 + ANSWER_TOKENS

    response = client.responses.create(
        model="tiny",
        input=MESSAGES,
        max_output_tokens=BUDGET + 1 + ANSWER_TOKENS,
        temperature=0.0,
        extra_body={"thinking_token_budget": BUDGET},
    )
    [thought] = [item for item in response.output if item.type == "reasoning"]
    assert "".join(part.text for part in thought.content) == reasoning
    assert response.output_text == message.content


def test_a_budget_on_a_server_that_cannot_find_the_reasoning_is_refused(model, engine_pool):
    with engine_pool.serve(str(model), model.parent / "plain.log") as plain:
        for path, body in (
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
            ("/v1/responses", {"input": "Is it?", "max_output_tokens": 4}),
        ):
            r = plain.post(path, {**body, "model": str(model), "thinking_token_budget": 8})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "thinking_token_budget"
            assert "--reasoning-parser" in error["message"]
