"""Every body zllm sends validates against OpenAI's published schemas, and no field of
OpenAI's or Anthropic's request schemas is accepted and silently ignored.

The schemas: tests/openai_schemas/ (a subset of github.com/openai/openai-openapi, its
source, commit and license named there). One real `zllm serve` on a tiny random model with a
tools template, a think block the request can switch off, --reasoning-parser deepseek_r1 and
--tool-call-parser hermes; raw JSON over HTTP (httpx), not the SDK's lenient parsing.

  shapes   completions (plain, logprobs, echo, n>1, streams with usage), chat (plain,
           logprobs, tool_calls, json_schema, n>1, streams with usage and tool-call deltas),
           embeddings (float, base64), responses (plain, function call, text.format,
           reasoning; every streamed event against its own schema), error bodies.
  walk     every top-level property of CreateChatCompletionRequest, CreateCompletionRequest,
           CreateResponse, CreateEmbeddingRequest and anthropic's MessageCreateParams is
           declared by zllm's request model and not ignored, listed in docs/serving.md as held by
           design, or refused: a 400 naming it when it is sent with a schema-valid value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from servers import sse_lines
from tiny_models import write_tiny_model
from tool_calls import CALL_TOKENS, TOOLS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent
DOCUMENT = json.loads((ROOT / "openai_schemas" / "openai-openapi-subset.json").read_text())
SCHEMAS: dict[str, Any] = DOCUMENT["components"]["schemas"]
BASE = "urn:openai-openapi"


def as_json_schema(node: Any) -> Any:
    """The document's schemas as JSON Schema 2020-12 says them: OpenAPI 3.0's `nullable:
    true`, which some of its schemas still carry, means "or null" (2020-12 validators ignore
    the keyword, and would refuse the null OpenAI itself sends)."""
    if isinstance(node, list):
        return [as_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: as_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def with_exceptions(document: dict) -> dict:
    """The document, where it describes less than OpenAI's own API sends (each a shape zllm
    sends as OpenAI does, which the schema leaves out):

    - completions logprobs: the first token of an echoed prompt has no logprob; its
      `token_logprobs` and `top_logprobs` entries are null (the schema: numbers, objects);
    - embeddings with `encoding_format: "base64"`: the vector is a base64 string (the schema
      has only the array of floats);
    - a streamed completions chunk: its finish_reason is null until the last (the chunks are
      CreateCompletionResponse objects, whose finish_reason is a string).
    """
    schemas = document["components"]["schemas"]
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]
    logprobs = choice["properties"]["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        logprobs[name]["items"] = {"anyOf": [logprobs[name]["items"], {"type": "null"}]}
    # A streamed completions chunk: OpenAI's document has no schema of its own for it (the
    # chunks are CreateCompletionResponse objects), and mid-stream finish_reason is null.
    chunk = json.loads(json.dumps(schemas["CreateCompletionResponse"]))
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [reason, {"type": "null"}]
    }
    schemas["CompletionChunk (streamed CreateCompletionResponse)"] = chunk
    vector = schemas["Embedding"]["properties"]["embedding"]
    schemas["Embedding"]["properties"]["embedding"] = {"anyOf": [vector, {"type": "string"}]}
    return document


REGISTRY = Registry().with_resource(
    BASE, Resource(with_exceptions(as_json_schema(DOCUMENT)), specification=DRAFT202012)
)


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"{BASE}#/components/schemas/{name}"}, registry=REGISTRY
    )


def check(name: str, body: dict) -> None:
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"at {list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5]
    )


def event_schemas() -> dict[str, str]:
    """A stream event's `type` -> its schema's name (ResponseStreamEvent is an anyOf of them)."""
    found = {}
    for ref in SCHEMAS["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        for value in SCHEMAS[name]["properties"]["type"]["enum"]:
            found[value] = name
    return found


EVENT_SCHEMAS = event_schemas()

# A template with tools (tests/tool_calls.py's Qwen 2.5 layout) that opens a think block unless
# chat_template_kwargs switch it off.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSE_TOOLS = [{"type": "function", **t["function"], "strict": True} for t in TOOLS]
JSON_SCHEMA = {
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_pool):
    path = tmp_path_factory.mktemp("schemas")
    model = write_tiny_model(
        path / "model",
        chat_template=TEMPLATE,
        extra_tokens=[*CALL_TOKENS, "<think>", "</think>"],
        max_position_embeddings=2048,  # the tools' JSON in byte-level tokens is long
    )
    with engine_pool.serve(
        str(model),
        path / "server.log",
        "--served-model-name",
        "tiny",
        "--reasoning-parser",
        "deepseek_r1",
        "--tool-call-parser",
        "hermes",
    ) as server:
        yield server


def post(server, path: str, body: dict, status: int = 200) -> dict:
    response = server.post(path, body)
    assert response.status_code == status, response.text
    return response.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """The JSON of each `data:` event of a stream, `[DONE]` left out."""
    with server.client() if hasattr(server, "client") else _client(server) as client:
        with client.stream("POST", server.url + path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            lines = list(sse_lines(r.iter_text()))
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data and (path == "/v1/responses" or data[-1] == "[DONE]"), lines[-3:]
    return [json.loads(d) for d in data if d != "[DONE]"]


def _client(server):
    import httpx

    return httpx.Client(headers=server.headers, verify=server.verify, timeout=120)


# ---- completions ---------------------------------------------------------------------------

COMPLETIONS = {
    "plain": {},
    "logprobs": {"logprobs": 2},
    "echo": {"echo": True, "logprobs": 1},
    "n": {"n": 2, "temperature": 1.0, "seed": 1},
    "stop": {"stop": ["e"], "max_tokens": 8},
}


@pytest.mark.parametrize("case", COMPLETIONS)
def test_completions(server, case) -> None:
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 5, **COMPLETIONS[case]}
    check("CreateCompletionResponse", post(server, "/v1/completions", body))
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(server, "/v1/completions", {**body, "stream_options": options})
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    for chunk in chunks:
        check("CompletionChunk (streamed CreateCompletionResponse)", chunk)


# ---- chat ----------------------------------------------------------------------------------

FORCED_CALL = {"tools": TOOLS, "tool_choice": "required"}
CHATS = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "n": {"n": 2, "temperature": 1.0, "seed": 1},
    "tool_calls": FORCED_CALL,
    "named_call": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": TOOLS[1]["function"]["name"]}},
    },
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA}},
    "json_object": {"response_format": {"type": "json_object"}},
}


@pytest.mark.parametrize("case", CHATS)
def test_chat(server, case) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 150, **NO_THINKING, **CHATS[case]}
    whole = post(server, "/v1/chat/completions", body)
    check("CreateChatCompletionResponse", whole)
    if "tool_choice" in body:
        assert whole["choices"][0]["message"]["tool_calls"], whole
    chunks = stream(
        server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    if "tool_choice" in body:
        assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)


def test_chat_reasoning(server) -> None:
    """The think block a random model never closes: reasoning_content (vLLM's field, beside
    OpenAI's; the schemas allow fields they do not name)."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0}
    whole = post(server, "/v1/chat/completions", body)
    assert whole["choices"][0]["message"]["reasoning_content"]
    check("CreateChatCompletionResponse", whole)
    for chunk in stream(server, "/v1/chat/completions", body):
        check("CreateChatCompletionStreamResponse", chunk)


# ---- embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings(server, encoding) -> None:
    body = {"model": "tiny", "input": ["one", "two words"], "encoding_format": encoding}
    check("CreateEmbeddingResponse", post(server, "/v1/embeddings", body))


# ---- responses -----------------------------------------------------------------------------

RESPONSES = {
    "plain": {**NO_THINKING, "instructions": "Be brief.", "metadata": {"k": "v"}},
    "function_call": {**NO_THINKING, "tools": RESPONSE_TOOLS, "tool_choice": "required"},
    "named_call": {
        **NO_THINKING,
        "tools": RESPONSE_TOOLS,
        "tool_choice": {"type": "function", "name": RESPONSE_TOOLS[0]["name"]},
    },
    "text_format": {
        **NO_THINKING,
        "text": {"format": {"type": "json_schema", **JSON_SCHEMA}},
    },
    "reasoning": {},
    "items": {
        **NO_THINKING,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": TOOLS[0]["function"]["name"],
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    },
}


@pytest.mark.parametrize("case", RESPONSES)
def test_responses(server, case) -> None:
    body = {"model": "tiny", "input": "What is the weather?", "max_output_tokens": 150}
    body.update(RESPONSES[case])
    whole = post(server, "/v1/responses", body)
    check("Response", whole)
    kinds = {item["type"] for item in whole["output"]}
    if "tool_choice" in body:
        assert "function_call" in kinds, whole
    if case == "reasoning":
        assert "reasoning" in kinds, whole
    events = stream(server, "/v1/responses", body)
    for event in events:
        assert event["type"] in EVENT_SCHEMAS, event["type"]
        check(EVENT_SCHEMAS[event["type"]], event)
        check("ResponseStreamEvent", event)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


# ---- errors --------------------------------------------------------------------------------

ERRORS = [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "nope"}, 404),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("/v1/embeddings", {"input": "x", "dimensions": 3}, 400),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400),
    ("/v1/responses", {"input": "x", "store": True}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), ERRORS)
def test_error_bodies(server, path, body, status) -> None:
    error = post(server, path, body, status)
    check("ErrorResponse", error)


def test_error_bodies_of_other_statuses(server) -> None:
    not_found = server.get("/v1/no-such-route")
    assert not_found.status_code == 404
    check("ErrorResponse", not_found.json())
    bad_json = server.post("/v1/chat/completions", b"{not json")
    assert bad_json.status_code == 400
    check("ErrorResponse", bad_json.json())


# ---- the walk: no request field accepted and silently ignored ----------------------------


def held_by_design() -> set[str]:
    """The names docs/serving.md lists as accepted and ignored by design (its paragraph
    that begins so): the doc and this test read one list."""
    serving = (ROOT.parents[2] / "docs" / "serving.md").read_text()  # (tests/frontend/openai)
    match = re.search(r"^Accepted and ignored by design.*?(?=\n\n)", serving, re.M | re.S)
    assert match, "docs/serving.md lost its 'Accepted and ignored by design' paragraph"
    listed = match.group(0).split(" (", 1)[0]  # the names, before the reasons
    return set(re.findall(r"`([a-z_]+)`", listed))


def properties(name: str) -> dict[str, Any]:
    """A request schema's top-level properties, its allOf parts merged."""
    schema, found = SCHEMAS[name], {}
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            found |= properties(part["$ref"].rsplit("/", 1)[1])
        found |= part.get("properties", {})
    return found


# Objects with required keys the plain candidates below lack (still checked against the
# schema before they are sent).
EXAMPLES = [
    {"voice": "alloy", "format": "wav"},
    {"id": "pmpt_1"},
    {"model": "omni-moderation-latest"},
    {"type": "content", "content": "x"},
    [{"name": "f"}],
]


def schema_valid_example(schema: dict) -> Any:
    """A non-null value the property's schema accepts (its default, an enum value, or the
    first of a few plain candidates that validates)."""
    absolute = json.loads(json.dumps(schema).replace('"#/components/', f'"{BASE}#/components/'))
    check_value = jsonschema.Draft202012Validator(as_json_schema(absolute), registry=REGISTRY)
    candidates = [*EXAMPLES, schema.get("default")]
    candidates += re.findall(r'"enum": \[("[^"]+")', json.dumps(schema))
    candidates += ["auto", "low", 1, True, "x", {}, [], {"type": "text"}, [{"type": "text"}]]
    for value in candidates:
        value = json.loads(value) if isinstance(value, str) and value.startswith('"') else value
        if value is not None and check_value.is_valid(value):
            return value
    raise AssertionError(f"no example value for {json.dumps(schema)[:200]}")


ROUTES = {
    "CreateChatCompletionRequest": (
        "/v1/chat/completions",
        "ChatCompletionRequest",
        {"messages": MESSAGES, "max_tokens": 1},
    ),
    "CreateCompletionRequest": (
        "/v1/completions",
        "CompletionRequest",
        {"prompt": "x", "max_tokens": 1},
    ),
    "CreateResponse": ("/v1/responses", "ResponsesRequest", {"input": "x", "max_output_tokens": 1}),
    "CreateEmbeddingRequest": ("/v1/embeddings", "EmbeddingsRequest", {"input": "x"}),
}


def request_model(name: str):
    from zllm.frontend.openai import pooling_protocol
    from zllm.frontend.openai import protocol as api_models
    from zllm.frontend.responses import api as responses_api

    modules = (api_models, pooling_protocol, responses_api)
    return next(getattr(m, name) for m in modules if hasattr(m, name))


@pytest.mark.parametrize("schema", ROUTES)
def test_no_openai_field_is_silently_ignored(server, schema) -> None:
    path, model_name, base = ROUTES[schema]
    model = request_model(model_name)
    refused = set(getattr(model, "UNSUPPORTED", ()))
    held = held_by_design()
    silent = []
    for name, prop in properties(schema).items():
        if name in refused:  # (c): sent with a value the schema accepts, a 400 naming it
            value = schema_valid_example(prop)
            error = post(server, path, {**base, name: value}, 400)["error"]
            assert error["param"] == name and name in error["message"], (name, value, error)
        elif name not in model.__struct_fields__ and name not in held:
            silent.append(name)  # neither (a) declared nor (b) listed: ignored, with a warning
    assert not silent, f"{schema}: accepted and ignored: {silent}"
    assert refused <= set(properties(schema)) | {"background_options"}, refused


# A value Anthropic's API accepts, for each field of MessageCreateParams held by design.
ANTHROPIC_VALUES = {
    "container": "container_1",
    "diagnostics": {},
    "inference_geo": "us",
    "speed": "fast",
    "user_profile_id": "profile_1",
    "workspace_id": "workspace_1",
}


def test_no_anthropic_field_is_silently_ignored(server) -> None:
    """Every field of MessageCreateParams is implemented (declared) or held by design: a
    request with it is answered, and the log names it as ignored."""
    from anthropic.types import message_create_params

    from zllm.frontend.anthropic.api import MessagesRequest

    params = message_create_params.MessageCreateParamsBase
    fields = params.__required_keys__ | params.__optional_keys__
    held = held_by_design()
    base = {"model": "tiny", "max_tokens": 1, "messages": MESSAGES}
    silent = []
    for name in sorted(fields):
        if name in MessagesRequest.__struct_fields__:
            continue
        if name not in held:
            silent.append(name)
            continue
        seen = len(server.log.read_text())  # (the app's own lines: this process's log)
        body = post(server, "/v1/messages", {**base, name: ANTHROPIC_VALUES[name]}, 200)
        assert body["type"] == "message", body
        assert f"fields this server ignores: {name}" in server.log.read_text()[seen:], name
    assert not silent, f"MessageCreateParams: accepted and ignored: {silent}"


def test_held_fields_are_schema_fields() -> None:
    """docs/serving.md's list names only fields of the schemas walked (so it cannot hold a name
    that excuses nothing), and each is declared by the request models that hold it."""
    from anthropic.types import message_create_params

    params = message_create_params.MessageCreateParamsBase
    every = set(params.__required_keys__ | params.__optional_keys__)
    for schema in ROUTES:
        every |= set(properties(schema))
    assert held_by_design() and held_by_design() <= every, held_by_design() - every
