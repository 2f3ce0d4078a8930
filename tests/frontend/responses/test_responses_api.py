"""The Responses API with tools, structured output and reasoning: through a real `zllm serve`
and the official openai client, every streamed event parsed into its typed class and
validated against it.

A tiny model with a Qwen 2.5-style tools template (tests/tool_calls.py's): a function call forced
by tool_choice (required or named: a grammar, so a random model calls), answered with
function_call + function_call_output items, then a message; the follow-up turn is the same
prompt as chat's tool_calls + tool message (same tokens, same greedy answer). text.format
json_schema / json_object output parses and validates. A tiny model whose template opens a
think block, served with --reasoning-parser deepseek_r1: reasoning items and their events.
The assembler alone (no server): reasoning, a message and a call in one answer, in order.
Fields zllm does not implement are 400s naming them.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from tool_calls import TOOLS, serve_think

from zllm.frontend.responses.api import ResponsesRequest, echoed_settings
from zllm.frontend.responses.output import ResponseAssembler
from zllm.frontend.tools import ChoiceParser, ToolPlan
from zllm.protocol import FinishReason, RequestOutputDelta

openai = pytest.importorskip("openai")
from openai.types.responses import (  # noqa: E402
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from responses_events import checked  # noqa: E402

# Responses' function tools are flat: name and parameters beside the type.
RESPONSE_TOOLS = [{"type": "function", **t["function"], "strict": True} for t in TOOLS]
SCHEMAS = {t["name"]: t["parameters"] for t in RESPONSE_TOOLS}
ASK = "What is the weather in Paris, and the time in Tokyo?"


def client_of(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def streamed(client, **kwargs) -> tuple[list, object]:
    """(the events the client parsed, strictly validated, the final Response)."""
    raw = list(client.responses.create(**kwargs, stream=True))
    for event in raw:  # parsed into the typed classes, not as unknown events
        assert type(event).__module__.startswith("openai.types.responses."), event
    events = checked([e.to_dict() for e in raw])
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, raw[-1].response


def check_item_events(events: list, output: list) -> None:
    """Each output item's events: added, its deltas, done, at its output_index, adding up to
    the item the final response holds."""
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert (
        [e.output_index for e in added]
        == [e.output_index for e in done]
        == list(range(len(output)))
    )
    for index, item in enumerate(output):
        assert added[index].item.id == done[index].item.id == item.id
        assert done[index].item.to_dict() == item.to_dict()
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        if item.type == "function_call":
            assert deltas == item.arguments
            (args_done,) = [e for e in mine if e.type == "response.function_call_arguments.done"]
            assert args_done.arguments == item.arguments and args_done.item_id == item.id
        elif item.type == "message":
            assert deltas == item.content[0].text
        else:
            assert deltas == item.content[0].text


# ---------------------------------------------------------------------------------------------
# Function calls on a tiny model with a tools template


@pytest.fixture(scope="module")
def tools_server(tools_model, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses-tools") / "server.log"
    with engine_pool.serve(str(tools_model), log, "--served-model-name", "tiny") as server:
        yield server


def check_call(item) -> None:
    assert isinstance(item, ResponseFunctionToolCall) and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.e2e
@pytest.mark.parametrize(
    "stream, tool_choice",
    [(False, "required"), (True, "required"), (True, {"type": "function", "name": "get_time"})],
)
def test_a_function_call_round(tools_server, stream, tool_choice) -> None:
    """call (forced), function_call + function_call_output items, then an answer message."""
    client = client_of(tools_server)
    common = dict(model="tiny", tools=RESPONSE_TOOLS, temperature=0.0)
    # One call at most (a random model would go on calling until max_output_tokens).
    first_kwargs = dict(
        common, input=ASK, tool_choice=tool_choice, max_output_tokens=300, parallel_tool_calls=False
    )
    if stream:
        events, first = streamed(client, **first_kwargs)
        check_item_events(events, first.output)
        # The client's stream helper rebuilds the response from the events and checks their
        # identities (ids, output indexes) on the way.
        with client.responses.stream(**first_kwargs) as helper:
            rebuilt = helper.get_final_response()
        (call,) = rebuilt.output
        check_call(call)
    else:
        first = client.responses.create(**first_kwargs)
    assert first.status == "completed" and first.parallel_tool_calls is False
    (call,) = first.output
    check_call(call)
    if isinstance(tool_choice, dict):
        assert call.name == "get_time"
    if isinstance(tool_choice, dict):
        assert first.tool_choice.type == "function" and first.tool_choice.name == "get_time"
    else:
        assert first.tool_choice == "required"
    # The follow-up: the whole turn back (as a stateless client does), with each result.
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"result": "21C"}'}
        for c in first.output
    ]
    follow_up = [{"role": "user", "content": ASK}] + [
        c.model_dump(exclude_none=True) for c in first.output
    ]
    follow_up += results
    second_kwargs = dict(common, input=follow_up, max_output_tokens=8)
    if stream:
        events, second = streamed(client, **second_kwargs)
        check_item_events(events, second.output)
    else:
        second = client.responses.create(**second_kwargs)
    (message,) = second.output
    assert isinstance(message, ResponseOutputMessage) and message.content[0].text
    # The same conversation through chat (tool_calls, tool messages) is as long a prompt:
    # the items reached the chat template as chat's turns do.
    chat = client.chat.completions.create(
        model="tiny",
        tools=TOOLS,
        temperature=0.0,
        max_tokens=8,
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": c.call_id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in first.output
                ],
            },
        ]
        + [{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results],
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    without_result = client.responses.create(**{**second_kwargs, "input": follow_up[:-1]})
    assert without_result.usage.input_tokens < second.usage.input_tokens


@pytest.mark.e2e
def test_tool_choice_none_and_unset_give_a_message(tools_server) -> None:
    client = client_of(tools_server)
    for choice in ({"tool_choice": "none"}, {}):  # unset: none, without a tool-call parser
        answer = client.responses.create(
            model="tiny", input=ASK, tools=RESPONSE_TOOLS, max_output_tokens=6, **choice
        )
        (message,) = answer.output
        assert message.type == "message" and answer.output_text
        assert answer.tool_choice == "none"
        assert [t.name for t in answer.tools] == ["get_weather", "get_time"]


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["answer", "city"],
    "additionalProperties": False,
}


@pytest.mark.e2e
def test_text_format_is_enforced(tools_server) -> None:
    client = client_of(tools_server)
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    common = dict(model="tiny", input="Is it sunny?", temperature=1.0, max_output_tokens=80)
    whole = client.responses.create(**common, text={"format": fmt})
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), ANSWER_SCHEMA)
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "answer"
    events, final = streamed(client, **common, text={"format": fmt})
    check_item_events(events, final.output)
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), ANSWER_SCHEMA)
    # json_object: any JSON object.
    anything = client.responses.create(**common, text={"format": {"type": "json_object"}})
    assert anything.output_text.lstrip().startswith("{")  # a random model may not close it
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    # The client's own parse helper: a pydantic model as text_format.
    from typing import Literal

    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        city: str = Field(max_length=12)

    parsed = client.responses.parse(**common, text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer)


# ---------------------------------------------------------------------------------------------
# Reasoning items


@pytest.mark.e2e
def test_reasoning_items(think_model, engine_pool, tmp_path) -> None:
    with serve_think(engine_pool, think_model, tmp_path / "server.log") as server:
        client = client_of(server)
        # The template opens the think block and a random model never closes it: all of the
        # answer is reasoning, cut by max_output_tokens.
        common = dict(model="tiny", input="Is it?", temperature=0.0, max_output_tokens=12)
        whole = client.responses.create(**common)
        (item,) = whole.output
        assert isinstance(item, ResponseReasoningItem) and item.status == "incomplete"
        assert item.summary == [] and item.content[0].type == "reasoning_text"
        assert item.content[0].text and "</think>" not in item.content[0].text
        assert whole.status == "incomplete" and whole.output_text == ""
        assert whole.usage.output_tokens_details.reasoning_tokens == 12
        assert whole.usage.output_tokens == 12
        events, final = streamed(client, **common)
        check_item_events(events, final.output)
        kinds = [e.type for e in events]
        assert kinds.count("response.reasoning_text.delta") >= 1
        assert "response.reasoning_text.done" in kinds and "response.output_text.delta" not in kinds
        assert final.output[0].content[0].text == item.content[0].text
        # An earlier turn's reasoning item comes back in input: its text is the assistant
        # turn's reasoning_content, which this template does not show (the same prompt as
        # without it; tests/frontend/responses/test_codex_fields.py has one that does).
        short = dict(model="tiny", temperature=0.0, max_output_tokens=2)
        again = client.responses.create(
            **short,
            input=[
                {"role": "user", "content": "Is it?"},
                item.model_dump(exclude_none=True),
                {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "Sure?"},
            ],
        )
        plain = client.responses.create(
            **short,
            input=[
                {"role": "user", "content": "Is it?"},
                {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "Sure?"},
            ],
        )
        assert again.usage.input_tokens == plain.usage.input_tokens


def test_reasoning_a_message_and_a_call_in_order() -> None:
    """The assembler on its own: a reasoning parser and the hermes tool parser split one
    answer into three items, in the order written, each with its events; the whole
    response is the stream's last one."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]

    def assembler() -> ResponseAssembler:
        plan = ToolPlan("auto", tools, None)
        parser = ChoiceParser(plan, "hermes", "deepseek_r1")
        echo = echoed_settings(ResponsesRequest(input="hi"), plan)
        return ResponseAssembler("resp_x", "tiny", echo, parser)

    texts = ["Hmm, ", "let me see", "</th", "ink>\n\n", "I will ", "check.", "\n<tool_call>\n"]
    texts += ['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>\n']

    async def outputs():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            finish = FinishReason.STOP if last else None
            yield 0, RequestOutputDelta("r", 0, text, [i], finish_reason=finish)

    async def collect(stream) -> list[dict]:
        return [json.loads(chunk.split(b"data: ", 1)[1]) async for chunk in stream]

    streaming = assembler()
    events = checked(asyncio.run(collect(streaming.stream(outputs()))))
    kinds = [e.type for e in events if e.type.startswith("response.output_item")]
    assert kinds == ["response.output_item.added", "response.output_item.done"] * 3
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    check_item_events(events, final.output)
    reasoning, message, call = final.output
    assert reasoning.content[0].text == "Hmm, let me see"
    assert message.content[0].text == "I will check.\n\n"  # the text before <tool_call>
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert streaming.reasoning_tokens == 4  # the chunks up to and with `</think>`
    whole = assembler()
    for i, text in enumerate(texts):
        finish = FinishReason.STOP if i == len(texts) - 1 else None
        whole.collect(0, RequestOutputDelta("r", 0, text, [i], finish_reason=finish))
    response = whole.response()
    shown = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]
    ]
    streamed_items = [
        {k: v for k, v in item.to_dict().items() if k not in ("id", "call_id")}
        for item in final.output
    ]
    assert shown == streamed_items


# ---------------------------------------------------------------------------------------------
# What zllm does not implement: 400s naming it


UNSUPPORTED_VALUES = {
    "background_options": {"mode": "x"},
    "context_management": [{"type": "compaction"}],
    "conversation": "conv_1",
    "max_tool_calls": 2,
    "prompt": {"id": "pmpt_1"},
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "moderation": {"model": "omni-moderation-latest"},
    "top_logprobs": 2,
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", ResponsesRequest.UNSUPPORTED)
def test_unsupported_fields_are_400s(tools_server, name) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    r = tools_server.post("/v1/responses", {**body, name: UNSUPPORTED_VALUES[name]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name
    assert tools_server.post("/v1/responses", {**body, name: None}).status_code == 200


REFUSED = [
    # (local_shell and custom tools: tests/frontend/responses/test_client_tools.py)
    ({"tools": [RESPONSE_TOOLS[0], {"type": "teleport", "name": "x"}]}, "tools[1].type",
     "teleport"),
    ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "web_search_preview"}},
     "tool_choice.type", "web_search_preview"),
    ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "'nope', which is not in tools"),
    ({"tools": RESPONSE_TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]",
     "message.output_text.logprobs"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "reasoning.effort"),
    ({"reasoning": {"summary": "always"}}, "reasoning.summary", "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens must be at most"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "conversation state"),
    ({"store": True}, "store", "store"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "unsupported image URL 'x'"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                     "output": "x"}]},
     "input[1].call_id", "call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]},
     "input[0].arguments", "str"),
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("fields, param, words", REFUSED)
def test_what_zllm_does_not_do_is_a_400_naming_it(tools_server, fields, param, words) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields}
    r = tools_server.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    # The server keeps serving.
    ok = tools_server.post(
        "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    )
    assert ok.status_code == 200
