"""The Responses API's `local_shell` and `custom` tools (issue 73; frontend/responses/
client_tools.py): offered to the model as functions, their calls come back as
`local_shell_call` and `custom_tool_call` items, every streamed event valid against the openai
package's classes; the call items and their outputs sent back are the model's calls again; a
custom tool that tool_choice names answers with its raw input, held to its grammar (regex or
lark); a regex grammar holds under `required` too (the input string's JSON pattern)."""

from __future__ import annotations

import asyncio
import json
import re

import msgspec
import pytest
from tool_calls import serve_tools

from zllm.frontend.responses.api import ResponsesRequest, as_chat_request, echoed_settings
from zllm.frontend.responses.input import FunctionTool, chat_tools, chat_turns, client_tools
from zllm.frontend.responses.output import ResponseAssembler
from zllm.frontend.tools import ChoiceParser, ToolPlan
from zllm.protocol import FinishReason, RequestOutputDelta

openai = pytest.importorskip("openai")
from openai.types.responses import ResponseCustomToolCall  # noqa: E402
from openai.types.responses.response_output_item import LocalShellCall  # noqa: E402
from responses_events import EVENT_CLASSES, checked  # noqa: E402

PATCH_GRAMMAR = 'start: "*** Begin Patch\\n" ("+" LINE)* "*** End Patch"\nLINE: /[a-z]{1,8}\\n/\n'
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
CODE = {
    "type": "custom",
    "name": "code",
    "description": "A ticket code.",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[a-z]{2}"},
}
NOTE = {"type": "custom", "name": "note", "description": "Free text."}
SHELL = {"type": "local_shell"}
ASK = [{"role": "user", "content": "List the files."}]


def tools_of(*raw: dict) -> list[FunctionTool]:
    return [msgspec.convert(t, FunctionTool) for t in raw]


def assembler_for(tools: list[FunctionTool], plan: ToolPlan, parser: str | None, forced=None):
    echo = echoed_settings(ResponsesRequest(input="hi", tools=tools), plan, client_tools(tools))
    assembler = ResponseAssembler("resp_x", "tiny", echo, ChoiceParser(plan, parser, None))
    assembler.client_tools, assembler.forced = client_tools(tools), forced
    return assembler


def run(assembler: ResponseAssembler, texts: list[str], finish=FinishReason.STOP) -> list:
    async def outputs():
        for i, text in enumerate(texts):
            done = finish if i == len(texts) - 1 else None
            yield 0, RequestOutputDelta("r", 0, text, [i], finish_reason=done)

    async def collect() -> list[dict]:
        return [
            json.loads(chunk.split(b"data: ", 1)[1]) async for chunk in assembler.stream(outputs())
        ]

    return checked(asyncio.run(collect()))


# ---- without a server --------------------------------------------------------------------------


def test_the_models_calls_come_back_as_shell_and_custom_tool_calls() -> None:
    tools = tools_of(SHELL, APPLY_PATCH, CODE)
    offered = [msgspec.to_builtins(t) for t in chat_tools(tools) or []]
    assert [t["function"]["name"] for t in offered] == ["local_shell", "apply_patch", "code"]
    assert PATCH_GRAMMAR.strip() in offered[1]["function"]["description"]  # the model is told
    pattern = offered[2]["function"]["parameters"]["properties"]["input"]["pattern"]
    assert pattern == "^(?:[0-9]{3}-[a-z]{2})$"  # a JSON pattern may match anywhere: anchored
    patch = "*** Begin Patch\n+hello\n*** End Patch"
    texts = [
        '<tool_call>\n{"name": "local_shell", "arguments": {"command": ["ls", "-la"], ',
        '"working_directory": "/tmp"}}\n</tool_call>\n<tool_call>\n{"name": "apply_patch", ',
        '"arguments": {"input": ' + json.dumps(patch) + "}}\n</tool_call>\n",
        '<tool_call>\n{"name": "local_shell", "arguments": {"command": "echo hi"}}\n</tool_call>',
    ]
    plan = ToolPlan("auto", offered, None)
    streaming = assembler_for(tools, plan, "hermes")
    events = run(streaming, texts)
    final = events[-1].response
    shell, edit, shell_string = final.output
    assert isinstance(shell, LocalShellCall) and shell.status == "completed"
    assert shell.id.startswith("lsh_") and shell.call_id.startswith("call_")
    assert shell.action.type == "exec" and shell.action.command == ["ls", "-la"]
    assert shell.action.working_directory == "/tmp" and shell.action.env == {}
    assert shell_string.action.command == ["bash", "-lc", "echo hi"]  # a string: run by bash
    assert isinstance(edit, ResponseCustomToolCall)
    assert (edit.name, edit.input) == ("apply_patch", patch) and edit.id.startswith("ctc_")
    # The custom call's input streams as its own events; no function-call events at all.
    mine = [e for e in events if getattr(e, "output_index", None) == 1]
    deltas = [e.delta for e in mine if e.type == "response.custom_tool_call_input.delta"]
    [done] = [e for e in mine if e.type == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done.input == patch
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]
    # Whole (not streamed): the same items.
    whole = assembler_for(tools, plan, "hermes")
    for i, text in enumerate(texts):
        finish = FinishReason.STOP if i == len(texts) - 1 else None
        whole.collect(0, RequestOutputDelta("r", 0, text, [i], finish_reason=finish))
    strip = lambda item: {k: v for k, v in item.items() if k not in ("id", "call_id")}  # noqa: E731
    assert [strip(i) for i in whole.response()["output"]] == [
        strip(i.to_dict()) for i in final.output
    ]
    # The Response repeats the tools as given.
    assert [t.to_dict() for t in final.tools] == [SHELL, APPLY_PATCH, CODE]


def test_a_forced_custom_tool_streams_its_raw_input_as_written() -> None:
    tools = tools_of(APPLY_PATCH)
    offered = [msgspec.to_builtins(t) for t in chat_tools(tools) or []]
    plan = ToolPlan("named", offered, None, "apply_patch")
    texts = ["*** Begin", " Patch\n+a\n", "*** End Patch"]
    events = run(assembler_for(tools, plan, None, forced="apply_patch"), texts)
    final = events[-1].response
    [call] = final.output
    assert call.type == "custom_tool_call" and call.input == "".join(texts)
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert deltas == texts  # as the model wrote them
    assert final.tool_choice.to_dict() == {"type": "custom", "name": "apply_patch"}
    # Cut by max_output_tokens: the call is not whole.
    cut = run(
        assembler_for(tools, plan, None, forced="apply_patch"), texts[:2], FinishReason.LENGTH
    )
    assert cut[-1].type == "response.incomplete"


def test_call_items_sent_back_are_the_models_calls_again() -> None:
    items = [
        *ASK,
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "timeout_ms": None,
                    "user": None, "working_directory": "/srv"}},
        {"type": "local_shell_call_output", "id": "call_1", "output": "a.txt\n"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done."},
        {"type": "function_call", "call_id": "call_3", "name": "local_shell",
         "arguments": '{"command": ["pwd"]}'},
        {"type": "function_call_output", "call_id": "call_3", "output": "/srv"},
    ]  # fmt: skip
    turns = chat_turns(items, None)
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant", "tool"] + [
        "assistant",
        "tool",
    ]
    calls = [t.tool_calls[0] for t in turns if t.role == "assistant"]
    assert [(c.id, c.function.name) for c in calls] == [
        ("call_1", "local_shell"),
        ("call_2", "apply_patch"),
        ("call_3", "local_shell"),
    ]
    assert json.loads(calls[0].function.arguments) == {
        "command": ["ls"],
        "working_directory": "/srv",
    }
    assert json.loads(calls[1].function.arguments) == {"input": "*** Begin Patch\n*** End Patch"}
    results = [(t.tool_call_id, t.content) for t in turns if t.role == "tool"]
    assert results == [("call_1", "a.txt\n"), ("call_2", "Done."), ("call_3", "/srv")]


def test_a_custom_tools_choice_is_its_function() -> None:
    request = msgspec.convert(
        {"input": "hi", "tools": [CODE], "tool_choice": {"type": "custom", "name": "code"}},
        ResponsesRequest,
    )
    assert as_chat_request(request).tool_choice.function.name == "code"
    shell = msgspec.convert(
        {"input": "hi", "tools": [SHELL], "tool_choice": {"type": "local_shell"}},
        ResponsesRequest,
    )
    assert as_chat_request(shell).tool_choice.function.name == "local_shell"


# ---- through a real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tools_model, engine_pool, tmp_path_factory):
    log = tmp_path_factory.mktemp("client-tools") / "server.log"
    with serve_tools(engine_pool, tools_model, log) as server:
        yield server


def client_of(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


REQUIRED = dict(
    model="tiny", input=ASK, tool_choice="required", parallel_tool_calls=False,
    temperature=1.0, max_output_tokens=300,
)  # fmt: skip


@pytest.mark.e2e
def test_a_shell_call_is_asked_and_its_output_read_back(server) -> None:
    """tool_choice local_shell: the answer is a local_shell_call (the command's strings are
    sampled: a try cut by max_output_tokens is an incomplete call, and another is made)."""
    body = {**REQUIRED, "tools": [SHELL], "tool_choice": {"type": "local_shell"}}
    for _ in range(6):
        first = server.post("/v1/responses", body)
        assert first.status_code == 200, first.text
        [call] = first.json()["output"]
        assert call["type"] == "local_shell_call", call
        LocalShellCall.model_validate(call)
        if call["status"] == "completed":
            break
        assert first.json()["status"] == "incomplete"
    else:
        pytest.fail("every call was cut at max_output_tokens")
    action = call["action"]
    assert action["type"] == "exec" and action["command"]
    assert all(isinstance(part, str) for part in action["command"])
    assert first.json()["tool_choice"] == {"type": "local_shell"}
    # Sent back with its output: the same prompt as the function call it was.
    follow = {**REQUIRED, "tools": [SHELL], "tool_choice": "auto", "max_output_tokens": 1}
    shell_items = [call, {"type": "local_shell_call_output", "id": call["call_id"], "output": "ok"}]
    arguments = {"command": action["command"]}
    for key in ("timeout_ms", "working_directory", "env", "user"):
        if action.get(key):
            arguments[key] = action[key]
    function_items = [
        {"type": "function_call", "call_id": call["call_id"], "name": "local_shell",
         "arguments": json.dumps(arguments)},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
    ]  # fmt: skip
    as_shell = server.post("/v1/responses", {**follow, "input": [*ASK, *shell_items]})
    as_function = server.post("/v1/responses", {**follow, "input": [*ASK, *function_items]})
    assert as_shell.status_code == as_function.status_code == 200, as_shell.text
    used = [r.json()["usage"]["input_tokens"] for r in (as_shell, as_function)]
    assert used[0] == used[1]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "tool, allowed",
    [
        (CODE, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        (
            {**NOTE, "format": {"type": "grammar", "syntax": "lark",
                                "definition": 'start: "yes" | "no" | "maybe later"'}},
            lambda text: text in ("yes", "no", "maybe later"),
        ),
        (APPLY_PATCH, lambda text: re.fullmatch(r"\*\*\* Begin Patch\n(\+[a-z]{1,8}\n)*\*\*\* End Patch", text)),
    ],
    ids=["regex", "lark-choice", "lark-patch"],
)  # fmt: skip
def test_a_forced_custom_tool_answers_in_its_grammar(server, tool, allowed) -> None:
    client = client_of(server)
    for _ in range(3):  # sampled: a try may run past max_output_tokens
        body = dict(model="tiny", input=ASK, tools=[tool], max_output_tokens=120, temperature=1.0)
        choice = {"type": "custom", "name": tool["name"]}
        with client.responses.stream(**body, tool_choice=choice) as s:
            events = list(s)
        for event in events:  # every event valid against its class
            EVENT_CLASSES[event.type].model_validate(event.to_dict())
        final = events[-1].response
        if final.status == "incomplete":  # the grammar allows more than 120 tokens: cut
            continue
        [call] = final.output
        assert call.type == "custom_tool_call" and call.name == tool["name"]
        assert allowed(call.input), call.input
        deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
        assert "".join(deltas) == call.input
        assert final.tool_choice.to_dict() == choice
        return
    pytest.fail("every answer was cut at 120 tokens")


@pytest.mark.e2e
def test_a_regex_custom_tool_holds_under_required(server) -> None:
    """Under required the call is JSON in the template's format: the regex holds as the
    input string's pattern."""
    r = server.post("/v1/responses", {**REQUIRED, "tools": [CODE]})
    assert r.status_code == 200, r.text
    [call] = r.json()["output"]
    ResponseCustomToolCall.model_validate(call)
    assert call["name"] == "code" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", call["input"]), call


@pytest.mark.e2e
@pytest.mark.parametrize(
    "tool, choice, param",
    [
        ({"type": "custom", "description": "x"}, None, "tools[0].name"),
        ({**NOTE, "format": {"type": "grammar", "syntax": "lark"}}, None, "tools[0].format"),
        ({**NOTE, "format": {"type": "grammar", "syntax": "lark", "definition": "start: (("}},
         {"type": "custom", "name": "note"}, "tools[0].format.definition"),
    ],
)  # fmt: skip
def test_a_custom_tool_it_cannot_serve_is_a_400_naming_it(server, tool, choice, param) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "tools": [tool]}
    if choice is not None:
        body["tool_choice"] = choice
    r = server.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
