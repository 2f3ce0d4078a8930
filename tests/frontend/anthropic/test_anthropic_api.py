"""Anthropic's Messages API through a real `zllm serve` and the official `anthropic` client
(whose `create` no longer takes temperature: the tests send it in the body):
text, streaming events, system prompts and turns, stop sequences, max_tokens, prefix-cache
reads in usage, count_tokens, `x-api-key`, Anthropic-shaped errors, and tools (tool_use
blocks whose input matches the schema, input_json_delta events, a tool_result turn)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from zllm.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.e2e

KEY = "sk-test-anthropic"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic") / "server.log"
    with engine_pool.serve(
        tiny_llama_dir, log, "--served-model-name", "tiny", "--block-size", "4", api_key=KEY
    ) as server:
        yield server


def client_of(server, key: str = KEY):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


USER = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


def test_text_message(server) -> None:
    client = client_of(server)
    message = client.messages.create(
        model="tiny",
        max_tokens=12,
        messages=USER,
        system="Be brief.",
        extra_body={"temperature": 0.0},
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.usage.input_tokens > 0


def test_streamed_events_match_the_whole_message(server) -> None:
    client = client_of(server)
    kwargs = dict(model="tiny", max_tokens=12, messages=USER, extra_body={"temperature": 0.0})
    whole = client.messages.create(**kwargs)
    names, text = [], ""
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            names.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(names)
    assert "message_delta" in names
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_turns_stop_sequences_and_cache_reads(server) -> None:
    client = client_of(server)
    turns = USER + [
        {"role": "assistant", "content": "Paged attention."},
        {"role": "user", "content": [{"type": "text", "text": "Continuous batching?"}]},
    ]
    free = client.messages.create(
        model="tiny", max_tokens=16, messages=turns, extra_body={"temperature": 0.0}
    )
    text = free.content[0].text
    stop = text[3:6]
    assert stop and stop in text
    cut = client.messages.create(
        model="tiny",
        max_tokens=16,
        messages=turns,
        extra_body={"temperature": 0.0},
        stop_sequences=[stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    # The same prompt again: its blocks come from the prefix cache.
    assert cut.usage.cache_read_input_tokens > 0
    total = cut.usage.input_tokens + cut.usage.cache_read_input_tokens
    assert total == free.usage.input_tokens + free.usage.cache_read_input_tokens


def test_count_tokens_is_the_prompt_length(server, tiny_llama_dir) -> None:
    client = client_of(server)
    counted = client.messages.count_tokens(model="tiny", messages=USER, system="Be brief.")
    tokenizer = load_tokenizer(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_errors_have_anthropics_shape(server) -> None:
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as err:
        client_of(server, key="wrong").messages.create(model="tiny", max_tokens=4, messages=USER)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    client = client_of(server)
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny", max_tokens=4, messages=USER, extra_body={"temperature": 3.0}
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]
    with pytest.raises(anthropic.BadRequestError, match="content.0: the data is not an image"):
        client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": image}]
        )


def test_tools_with_tool_choice_any(server) -> None:
    """tool_choice any: the answer is tool_use blocks whose input matches the schema,
    streamed as input_json_delta pieces that concatenate to it; then a tool_result turn."""
    client = client_of(server)
    kwargs = dict(
        model="tiny",
        max_tokens=300,
        messages=USER,
        tools=[WEATHER],
        # One call: the random tiny model would go on adding parallel calls.
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0},
    )
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id.startswith("toolu_") for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER["input_schema"])
    partial: dict[int, str] = {}
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and partial
    for index, text in partial.items():
        assert json.loads(text) == final.content[index].input
        jsonschema.validate(json.loads(text), WEATHER["input_schema"])
    named = client.messages.create(
        **{**kwargs, "tool_choice": {"type": "tool", "name": "get_weather"}}
    )
    (use,) = [b for b in named.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow_up = USER + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses
            ],
        },
    ]
    answer = client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=follow_up,
        tools=[WEATHER],
        extra_body={"temperature": 0.0},
    )
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"
