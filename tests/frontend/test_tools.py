"""Tool calling and reasoning through a real `zllm serve` and the official openai client.

SmolLM2 (its template ignores tools): tool_choice "required" and a named function are
guaranteed by the grammar, streamed and not; a follow-up turn with the tool's result.
A tiny model with a Qwen 2.5-style tools template and `<tool_call>` tokens, served with
--tool-call-parser hermes: a two-call turn (forced by a grammar) comes back as tool_calls,
streamed deltas concatenating to valid JSON arguments; once the model opens a call on its
own, the rest of it matches a tool's schema. The same tiny model, with a special [TOOL_CALLS]
token, served with each other parser (llama3_json, mistral, pythonic, qwen3_xml) and
--enable-auto-tool-choice: two calls forced in that format come back as tool_calls.
A tiny model whose template opens a think block, served with --reasoning-parser
deepseek_r1: reasoning_content apart from content, a JSON answer constrained only after
`</think>`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from tiny_models import write_tiny_model
from tool_calls import CALL_TOKENS, TIME, TOOLS, TOOLS_TEMPLATE, allowed_count, serve_think

from zllm.executor.requests.structured_output import GrammarCompiler, allocate_bitmask
from zllm.frontend.tools import _auto_call_grammar, template_shows_tools
from zllm.text.tokenizer import load_tokenizer

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def client_of(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def stream_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) of a streamed answer,
    checking OpenAI's delta rules on the way: id and name on a call's first delta only."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name, "a call's first delta names it"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# ---------------------------------------------------------------------------------------------
# SmolLM2: required and named, guaranteed by the grammar


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "server.log"
    with engine_pool.serve(
        smollm2_path, log, "--kv-cache-memory-bytes", "256M", "--served-model-name", "smollm2"
    ) as server:
        yield server


ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.mark.slow
@pytest.mark.e2e
def test_required_and_named_on_smollm2(smollm2_server) -> None:
    client = client_of(smollm2_server)
    common = dict(model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=200)
    answer = client.chat.completions.create(**common, tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(**common, tool_choice="required", stream=True)
    _, calls, finish = stream_calls(stream)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        check_call(call["name"], call["arguments"])
    # One call at most when parallel calls are off.
    single = client.chat.completions.create(
        **common, tool_choice="required", parallel_tool_calls=False
    )
    assert len(single.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(**common, tool_choice=named)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and answer.choices[0].finish_reason == "stop"
    check_call("get_time", call.function.arguments)
    _, calls, _ = stream_calls(
        client.chat.completions.create(**common, tool_choice=named, stream=True)
    )
    assert [c["name"] for c in calls.values()] == ["get_time"]
    check_call("get_time", calls[0]["arguments"])


@pytest.mark.slow
@pytest.mark.e2e
def test_a_follow_up_turn_with_tool_results(smollm2_server) -> None:
    client = client_of(smollm2_server)
    first = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0.0,
    )
    message = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21C"})}
        for call in message.tool_calls
    ]
    follow_up = ASK + [message.model_dump(exclude_none=True)] + results
    answer = client.chat.completions.create(
        model="smollm2",
        messages=follow_up,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=32,
        temperature=0.0,
    )
    assert answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


@pytest.mark.slow
@pytest.mark.e2e
def test_tool_choice_errors_are_400s(smollm2_server) -> None:
    import openai

    client = client_of(smollm2_server)
    # Left unset, the default is auto only where a parser can read the calls: here, none.
    plain = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0.0
    )
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    # SmolLM2's chat template renders no tools, so the model never sees them: auto asked
    # explicitly (Codex CLI always asks it) is an answer in text, as none is. (A template that
    # shows tools needs --tool-call-parser for auto: tests/frontend/responses'.)
    auto = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=4,
        temperature=0.0,
    )  # fmt: skip
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert not auto.choices[0].message.tool_calls
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="'nope', which is not in tools"):
        client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named
        )


def test_whether_a_template_shows_tools() -> None:
    assert template_shows_tools(TOOLS_TEMPLATE)
    assert not template_shows_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_shows_tools(None) and template_shows_tools("{% for")  # unknown: assume so


# ---------------------------------------------------------------------------------------------
# auto with the hermes parser, on a tiny model with a tools template


def forced_two_calls() -> tuple[str, list[tuple[str, dict]]]:
    """A Lark grammar whose only sentence is a two-call hermes turn, and the calls."""
    calls = [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "Asia/Tokyo"}),
    ]
    text = "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls
    )
    return f"start: {json.dumps(text)}", calls


@pytest.mark.e2e
def test_auto_parses_a_two_call_turn(tools_model, engine_pool, tmp_path) -> None:
    with engine_pool.serve(
        str(tools_model),
        tmp_path / "server.log",
        "--tool-call-parser",
        "hermes",
        "--served-model-name",
        "tiny",
    ) as server:
        client = client_of(server)
        grammar, expected = forced_two_calls()
        common = dict(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=400,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        answer = client.chat.completions.create(**common)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        got = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert got == expected
        assert not (choice.message.content or "").strip()
        content, calls, finish = stream_calls(client.chat.completions.create(**common, stream=True))
        assert finish == "tool_calls" and not content.strip()
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


def test_auto_constrains_a_call_once_the_model_opens_it(tools_model) -> None:
    """The grammar `auto` adds waits, leaving the output free, until `<tool_call>`; then only
    a call matching a tool's schema and `</tool_call>` may follow; then it waits again."""
    tokenizer = load_tokenizer(str(tools_model))
    structured = _auto_call_grammar(TOOLS, tokenizer, "hermes")
    open_id, close_id = (tokenizer.encode(t, add_special_tokens=False)[0] for t in CALL_TOKENS)
    assert structured is not None and structured.after_token == open_id and structured.repeat
    vocab = tokenizer.vocab_size
    matcher = GrammarCompiler(str(tools_model), vocab).matcher(structured, [0])

    def allowed() -> int:
        return allowed_count(matcher, vocab)

    free = allowed()
    for token in tokenizer.encode("Let me check.", add_special_tokens=False):
        matcher.consume(token)
    assert allowed() == free  # free text before a call
    matcher.consume(open_id)
    assert allowed() < free / 10  # inside a call: JSON of a tool's schema only
    call = '\n{"name":"get_time","arguments":{"timezone":"UTC"}}\n'
    for token in tokenizer.encode(call, add_special_tokens=False):
        matcher.consume(token)
    assert not matcher.waiting
    matcher.consume(close_id)
    assert matcher.waiting and allowed() == free  # closed: free again until the next call
    matcher.consume(open_id)
    bad = tokenizer.encode("hello", add_special_tokens=False)[0]
    mask = allocate_bitmask(1, vocab)
    matcher.fill_mask(mask[0])
    assert not (int(mask[0][bad // 32]) >> (bad % 32)) & 1  # prose is not a call


# ---------------------------------------------------------------------------------------------
# auto with the other parsers: each format forced by a grammar, through a real server

FORMAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    TIME,
]
FORMAT_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"timezone": "UTC"})]


def _format_sentence(parser: str, tag_id: int) -> tuple[str, str]:
    """(grammar, content the parser should leave) for FORMAT_CALLS in `parser`'s format."""
    (weather, w_args), (time, t_args) = FORMAT_CALLS
    if parser == "llama3_json":
        text = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in FORMAT_CALLS)
        return f"start: {json.dumps(text)}", ""
    if parser == "mistral":  # the special [TOOL_CALLS] token itself, then a JSON list
        calls = json.dumps([{"name": n, "arguments": a} for n, a in FORMAT_CALLS])
        return f"start: {json.dumps('Checking. ')} <[{tag_id}]> {json.dumps(calls)}", "Checking. "
    if parser == "pythonic":
        text = f'[{weather}(city="Paris", days=3), {time}(timezone="UTC")]'
        return f"start: {json.dumps(text)}", ""
    assert parser == "qwen3_xml"
    text = "Checking.\n" + "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in FORMAT_CALLS
    )
    return f"start: {json.dumps(text)}", "Checking.\n\n"  # the text between calls too


@pytest.fixture(scope="module")
def formats_model(tmp_path_factory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-formats"),
        chat_template=TOOLS_TEMPLATE,
        extra_tokens=CALL_TOKENS,
        extra_special=["[TOOL_CALLS]"],  # special, as in Mistral's tokenizers
        max_position_embeddings=2048,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "pythonic", "qwen3_xml"])
def test_auto_parses_each_format(parser, formats_model, engine_pool, tmp_path) -> None:
    """Two calls in the parser's format (and text before them where the format allows it)
    come back as tool_calls, the same streamed and not; streamed arguments concatenate to
    JSON equal to the whole answer's. With --enable-auto-tool-choice, as vLLM is started."""
    with engine_pool.serve(
        str(formats_model),
        tmp_path / "server.log",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        parser,
        "--served-model-name",
        "tiny",
    ) as server:
        client = client_of(server)
        tag_id = load_tokenizer(str(formats_model)).encode("[TOOL_CALLS]", add_special_tokens=False)
        grammar, content = _format_sentence(parser, tag_id[0])
        common = dict(
            model="tiny",
            messages=ASK,
            tools=FORMAT_TOOLS,
            tool_choice="auto",
            max_tokens=400,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        choice = client.chat.completions.create(**common).choices[0]
        assert choice.finish_reason == "tool_calls"
        whole = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert whole == FORMAT_CALLS
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == 2
        if parser == "mistral":  # Mistral's templates take nothing else in a later turn
            assert all(len(i) == 9 and i.isalnum() for i in ids)
        assert (choice.message.content or "") == content
        streamed_content, calls, finish = stream_calls(
            client.chat.completions.create(**common, stream=True)
        )
        assert finish == "tool_calls" and streamed_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == whole


# ---------------------------------------------------------------------------------------------
# Reasoning


@pytest.mark.e2e
def test_reasoning_is_separated_and_structure_follows_it(
    think_model, engine_pool, tmp_path
) -> None:
    model = think_model
    with serve_think(engine_pool, model, tmp_path / "server.log") as server:
        client = client_of(server)
        think_end = load_tokenizer(str(model)).encode("</think>", add_special_tokens=False)
        schema = {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        }
        common = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Is it?"}],
            temperature=1.0,
            seed=7,
            max_tokens=80,
            # `</think>` is likely but not forced: some reasoning comes first.
            logit_bias={str(think_end[0]): 4.0},
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        answer = client.chat.completions.create(**common).choices[0]
        reasoning = answer.message.model_extra.get("reasoning_content")
        assert reasoning is not None and "</think>" not in reasoning
        jsonschema.validate(json.loads(answer.message.content), schema)  # after </think> only
        streamed_reasoning, content = "", ""
        for chunk in client.chat.completions.create(**common, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                streamed_reasoning += delta.model_extra.get("reasoning_content") or ""
                content += delta.content or ""
        assert (streamed_reasoning, content) == (reasoning, answer.message.content)
        # Without the bias the tiny model never closes its thinking: all of it is reasoning.
        common.pop("logit_bias")
        common.pop("response_format")
        common["max_tokens"] = 12
        plain = client.chat.completions.create(**common).choices[0].message
        assert plain.model_extra.get("reasoning_content") and not plain.content
