"""Tool-call and reasoning parsers on canned model output, whole and streamed in every way
the text can be cut: every partition of short texts, and for longer ones every cut into two
and three pieces, fixed chunk sizes and seeded random partitions. A streamed answer must
assemble to exactly the whole-text result: the same content, the same calls, arguments that
concatenate to valid JSON."""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest

from zllm.text.reasoning_parser import REASONING_PARSERS, parse_reasoning
from zllm.text.tool_parsers import TOOL_PARSERS, ParsedDelta, parse_tool_calls
from zllm.text.tool_parsers.call_text import ValueScanner


def partitions(text: str):
    """Ways to cut `text` into chunks, as a stream of deltas might."""
    n = len(text)
    if n <= 12:
        for cuts in itertools.product([False, True], repeat=n - 1):
            yield _cut(text, [i + 1 for i, c in enumerate(cuts) if c])
        return
    for i in range(1, n):
        yield _cut(text, [i])
    for i in range(1, n, 3):
        for j in range(i + 1, n, 5):
            yield _cut(text, [i, j])
    for size in range(1, 9):
        yield _cut(text, list(range(size, n, size)))
    rng = random.Random(0)
    for _ in range(20):
        yield _cut(text, sorted(rng.sample(range(1, n), min(n - 1, rng.randrange(1, 12)))))


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed_calls(
    name: str, chunks: list[str], tools: list[dict] | None = None
) -> tuple[str, list[tuple[str, dict]]]:
    parser = TOOL_PARSERS[name](tools)
    out = ParsedDelta()
    for chunk in chunks:
        out.add(parser.feed(chunk))
    out.add(parser.finish())
    calls: dict[int, list] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            assert d.id and d.name, "a call's first delta names it"
            if name == "mistral":  # Mistral's templates take nothing else in a later turn
                assert len(d.id) == 9 and d.id.isalnum(), d.id
            elif name == "kimi_k2":  # the model's own id: its template matches results by it
                assert d.id.startswith("functions.") and d.id.endswith(f":{d.index}"), d.id
            else:
                assert d.id.startswith("call_"), d.id
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return out.content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def whole_calls(
    name: str, text: str, tools: list[dict] | None = None
) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(name, text, tools)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


HERMES = [
    ("plain", "Just text.", "Just text.", []),
    ("lookalike", "a <tool here <tool_cal", "a <tool here <tool_cal", []),
    (
        "one call after text",
        'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        "Sure.",
        [("f", {"x": 1})],
    ),
    (
        "two calls, nested, quotes, braces and unicode in strings",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris {}", '
        '"n": [1, {"a": "}"}], "u": "caf\\u00e9 \u4f60"}}</tool_call>\n'
        '<tool_call>{"name": "t", "parameters": {}}</tool_call>',
        "\n",
        [("get_weather", {"city": 'Pa"ris {}', "n": [1, {"a": "}"}], "u": "café 你"}), ("t", {})],
    ),
    (
        "arguments before name",
        '<tool_call>{"arguments": {"a": [1]}, "name": "x"}</tool_call>',
        "",
        [("x", {"a": [1]})],
    ),
    (
        "stringified arguments",
        '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        [("x", {"a": 1})],
    ),
    (
        "malformed JSON stays text",
        "<tool_call>{not json}</tool_call> then",
        "<tool_call>{not json}</tool_call> then",
        [],
    ),
    ("unclosed block at the end", "x <tool_call>{oops", "x <tool_call>{oops", []),
]


@pytest.mark.parametrize(("label", "text", "content", "calls"), HERMES, ids=[c[0] for c in HERMES])
def test_hermes(label, text, content, calls) -> None:
    assert whole_calls("hermes", text) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls("hermes", chunks) == (content, calls), chunks


def test_hermes_streams_arguments_as_they_come() -> None:
    """The name goes out once complete, then the arguments' text piece by piece; their
    concatenation is exactly the text the model wrote."""
    parser = TOOL_PARSERS["hermes"]()
    arguments = '{"city": "Paris", "days": [1, 2]}'
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"
    pieces = []
    for ch in text:
        pieces += parser.feed(ch).tool_calls
    pieces += parser.finish().tool_calls
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""
    assert len(pieces) > 10  # streamed, not sent whole at the end
    assert "".join(p.arguments for p in pieces) == arguments


LLAMA3 = [
    ("content", "Hello there", "Hello there", []),
    ("one call", '{"name": "f", "parameters": {"x": 1}}', "", [("f", {"x": 1})]),
    (
        "python tag and two calls",
        '<|python_tag|>{"name": "f", "parameters": {"x": "}"}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"x": "}"}), ("g", {})],
    ),
    ("broken object", '  {"broken": ', '{"broken": ', []),
    ("only a tag prefix", "<|pyth", "<|pyth", []),
]


@pytest.mark.parametrize(("label", "text", "content", "calls"), LLAMA3, ids=[c[0] for c in LLAMA3])
def test_llama3_json(label, text, content, calls) -> None:
    assert whole_calls("llama3_json", text) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls("llama3_json", chunks) == (content, calls), chunks


MISTRAL = [
    ("plain", "No calls [TOOL here.", "No calls [TOOL here.", []),
    (
        "a JSON list after text",
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": "]}"}}, '
        '{"arguments": {"y": [1]}, "name": "g"}]',
        "Sure. ",
        [("f", {"x": "]}"}), ("g", {"y": [1]})],
    ),
    (
        "v11 name then arguments, twice, one with [ARGS]",
        '[TOOL_CALLS]get_weather{"city": "caf\u00e9 你"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", {"city": "café 你"}), ("get_time", {})],
    ),
    ("not a call", "[TOOL_CALLS] sorry, no.", "[TOOL_CALLS] sorry, no.", []),
    ("a list of no calls", "[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("a bare tag at the end", "x [TOOL_CALLS]", "x [TOOL_CALLS]", []),
    (
        "text after the calls",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}] done',
        "done",
        [("f", {})],
    ),
]


@pytest.mark.parametrize(
    ("label", "text", "content", "calls"), MISTRAL, ids=[c[0] for c in MISTRAL]
)
def test_mistral(label, text, content, calls) -> None:
    assert whole_calls("mistral", text) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls("mistral", chunks) == (content, calls), chunks


PYTHONIC = [
    ("content", "Paris is sunny.", "Paris is sunny.", []),
    ("a citation is no call", "[1] says so", "[1] says so", []),
    (
        "two calls with literals of every kind",
        '[get_weather(city="Pa)ris", days=[1, 2], opts={"a": (1, True, None)}), '
        'tools.now(tz=\'UTC\', note="""x)""")]',
        "",
        [
            ("get_weather", {"city": "Pa)ris", "days": [1, 2], "opts": {"a": [1, True, None]}}),
            ("tools.now", {"tz": "UTC", "note": "x)"}),
        ],
    ),
    (
        "Llama 4 tags",
        ' <|python_start|>[f(x=1.5, s="你")]<|python_end|>',
        "",
        [("f", {"x": 1.5, "s": "你"})],
    ),
    ("no evaluation: a name is not a literal", "[f(x=os.system)]", "[f(x=os.system)]", []),
    ("positional arguments", "[f(1)]", "[f(1)]", []),
    ("an unclosed call", "[f(x=1", "[f(x=1", []),
    ("a good call, then junk", "[f(), 42]", ", 42]", [("f", {})]),
    (
        "quotes that may still grow into a triple quote, and escapes",
        '[f(s="""a""b\\"""", t=\'x\\\'y\', e="", u=\'\'\'\'\'\'), g()]',
        "",
        [("f", {"s": 'a""b"', "t": "x'y", "e": "", "u": ""}), ("g", {})],
    ),
]


@pytest.mark.parametrize(
    ("label", "text", "content", "calls"), PYTHONIC, ids=[c[0] for c in PYTHONIC]
)
def test_pythonic(label, text, content, calls) -> None:
    assert whole_calls("pythonic", text) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls("pythonic", chunks) == (content, calls), chunks


QWEN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hot": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "where": {"type": "object"},
                    "tags": {"type": "array"},
                    "maybe": {"type": ["integer", "null"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
            },
        },
    }
]


def _qwen_call(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


QWEN3_XML = [
    ("plain", "Just <tool text", "Just <tool text", []),
    (
        "values read by the schema",
        "Let me look.\n"
        + _qwen_call(
            "get_weather",
            city="42",
            days="3",
            hot="True",
            ratio="0.5",
            where='{"lat": 1}',
            tags="['a', 'b']",
            maybe="null",
            unit="celsius",
        ),
        "Let me look.\n",
        [
            (
                "get_weather",
                {
                    "city": "42",
                    "days": 3,
                    "hot": True,
                    "ratio": 0.5,
                    "where": {"lat": 1},
                    "tags": ["a", "b"],
                    "maybe": None,
                    "unit": "celsius",
                },
            )
        ],
    ),
    (
        "two calls; unknown parameters and unreadable values stay strings",
        _qwen_call("get_weather", days="three", other="<b>\n1</b>") + "\n" + _qwen_call("get_time"),
        "\n",
        [("get_weather", {"days": "three", "other": "<b>\n1</b>"}), ("get_time", {})],
    ),
    (
        "a tag that opens no function",
        "<tool_call>\nhello</tool_call>",
        "<tool_call>\nhello</tool_call>",
        [],
    ),
    (
        "cut off mid-call: still a JSON object",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<param",
        "<param",
        [("get_weather", {"days": 2})],
    ),
]


@pytest.mark.parametrize(
    ("label", "text", "content", "calls"), QWEN3_XML, ids=[c[0] for c in QWEN3_XML]
)
def test_qwen3_xml(label, text, content, calls) -> None:
    assert whole_calls("qwen3_xml", text, QWEN_TOOLS) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls("qwen3_xml", chunks, QWEN_TOOLS) == (content, calls), chunks


def test_qwen3_xml_reads_values_under_any_schema_a_client_sends() -> None:
    """Schemas are the client's: odd `type` and `enum` shapes leave the value a string (never
    a crash mid-stream), and NaN is not read as a number (its JSON would be invalid)."""
    from zllm.text.tool_parsers.qwen3_xml import read_value

    assert read_value("1", {"type": [{"x": 1}]}) == 1  # (no usable type: read as JSON)
    assert read_value("a", {"type": {"x": 1}}) == "a"
    assert read_value("a", {"enum": "abc"}) == "a"
    assert read_value("2", {"type": ["integer", {}]}) == 2
    assert read_value("NaN", {"type": "object"}) == "NaN"
    assert read_value("NaN", {"type": "number"}) == "NaN"


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "d": [1]}}]',
        ),
        ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "d": [1]}'),
        ("qwen3_xml", _qwen_call("get_weather", city="Paris", tags="[1]")),
    ],
)
def test_arguments_stream_as_they_come(parser, text) -> None:
    """The name goes out once complete, then the arguments in several pieces (not whole at
    the end), which concatenate to the whole-text arguments."""
    _, (call,) = parse_tool_calls(parser, text, QWEN_TOOLS)
    streaming = TOOL_PARSERS[parser](QWEN_TOOLS)
    pieces = []
    for ch in text:
        pieces += streaming.feed(ch).tool_calls
    pieces += streaming.finish().tool_calls
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    assert len(pieces) >= 3
    assert "".join(p.arguments for p in pieces) == call.arguments
    json.loads(call.arguments)


JSON_VALUES = [
    '{"a": "x\\"}{", "b": [1, {"c": "]"}], "d": "\\\\"}',
    '[{"name": "f"}, "[", "\\\\\\"", {}]',
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_a_json_scanner_reads_on_where_it_stopped(value) -> None:
    """A scanner fed a growing text answers at every step as a fresh one reading the whole
    text so far does: None until the value closes, then just past it, whatever follows."""
    assert json.loads(value) is not None
    text = "x " + value + ' ]} "tail'
    for chunks in partitions(text):
        resumed, so_far = ValueScanner(2), ""
        for chunk in chunks:
            so_far += chunk
            expected = ValueScanner(2).end(so_far)
            assert resumed.end(so_far) == expected, (chunks, so_far)
            assert expected == (2 + len(value) if len(so_far) >= 2 + len(value) else None)


def test_llama3_json_and_pythonic_stream_call_by_call() -> None:
    """These formats send each call whole, as soon as it closes, before the next one."""
    for parser, first, second in [
        ("llama3_json", '{"name": "f", "parameters": {}}; ', '{"name": "g", "parameters": {}}'),
        ("pythonic", "[f(), ", "g(x=1)]"),
    ]:
        streaming = TOOL_PARSERS[parser]()
        assert [c.name for c in streaming.feed(first).tool_calls] == ["f"]
        assert [
            c.name for c in streaming.feed(second).tool_calls + streaming.finish().tool_calls
        ] == ["g"]


# The tag-delimited formats (sections.py): canned answers, whole and streamed.
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
SECTIONED = [
    ("deepseek_v3", "plain", "Just text.", "Just text.", []),
    (
        "deepseek_v3",
        "two calls after text",
        f'Sure.{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Pa\\"ris", "n": [1]}}{DS_CALL_END}'
        f"{DS_CALL}noop{DS_SEP}{{}}{DS_CALL_END}{DS_END}",
        "Sure.",
        [("get_weather", {"city": 'Pa"ris', "n": [1]}), ("noop", {})],
    ),
    (
        "deepseek_v3",
        "V3's fenced form",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```'
        f"{DS_CALL_END}{DS_END}",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "deepseek_v3",
        "not JSON stays text",
        f"a{DS_BEGIN}{DS_CALL}f{DS_SEP}{{oops{DS_CALL_END}{DS_END}",
        f"a{DS_BEGIN}{DS_CALL}f{DS_SEP}{{oops{DS_CALL_END}{DS_END}",
        [],
    ),
    (
        "kimi_k2",
        "two calls",
        f'x{KIMI_BEGIN}{KIMI_CALL}functions.get_weather:0{KIMI_ARGS}{{"city": "Paris"}}'
        f"{KIMI_CALL_END}{KIMI_CALL}functions.noop:1{KIMI_ARGS}{{}}{KIMI_CALL_END}{KIMI_END}",
        "x",
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        "kimi_k2",
        "an unclosed section",
        f"y{KIMI_BEGIN}{KIMI_CALL}fun",
        f"y{KIMI_BEGIN}{KIMI_CALL}fun",
        [],
    ),
    (
        "glm45",
        "4.6's layout, typed by the schema",
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "Let me check.\n",
        [("get_weather", {"city": "007", "days": 3})],
    ),
    (
        "glm45",
        "4.7's layout, no schema: JSON where it reads",
        "<tool_call>f<arg_key>a</arg_key><arg_value>[1, 2]</arg_value><arg_key>b</arg_key>"
        "<arg_value>two words</arg_value></tool_call><tool_call>noop</tool_call>",
        "",
        [("f", {"a": [1, 2], "b": "two words"}), ("noop", {})],
    ),
    ("glm45", "not a call", "<tool_call>\n</tool_call>!", "<tool_call>\n</tool_call>!", []),
    (
        "minimax_m2",
        "two invokes",
        'ok\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="noop">\n'
        "</invoke>\n</minimax:tool_call>",
        "ok\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})],
    ),
    (
        "minimax_m2",
        "stray text in an invoke stays text",
        '<minimax:tool_call><invoke name="f">hello</invoke></minimax:tool_call>',
        '<minimax:tool_call><invoke name="f">hello</invoke></minimax:tool_call>',
        [],
    ),
    (
        "gemma4",
        "Gemma's notation: quotes, nesting, null, spaces",
        'Sure.<|tool_call>call:get_weather{city:<|"|>Pa"ris, {x}: [y]<|"|>, days: 3, '
        'tags:[<|"|>a<|"|>,[1.5,-2e3]], opt:None, on:false, nested:{k:{}}}<tool_call|>',
        "Sure.",
        [
            (
                "get_weather",
                {
                    "city": 'Pa"ris, {x}: [y]',
                    "days": 3,
                    "tags": ["a", [1.5, -2e3]],
                    "opt": None,
                    "on": False,
                    "nested": {"k": {}},
                },
            )
        ],
    ),  # fmt: skip
    (
        "gemma4",
        "not its notation stays text",
        "<|tool_call>call:f{a:<tool_call|><|tool_call>call:g{a:1}x<tool_call|>",
        "<|tool_call>call:f{a:<tool_call|><|tool_call>call:g{a:1}x<tool_call|>",
        [],
    ),
]
SECTIONED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
     "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "label", "text", "content", "calls"), SECTIONED, ids=[f"{c[0]}-{c[1]}" for c in SECTIONED]
)  # fmt: skip
def test_sectioned_formats(name, label, text, content, calls) -> None:
    assert whole_calls(name, text, SECTIONED_TOOLS) == (content, calls)
    for chunks in partitions(text):
        assert streamed_calls(name, chunks, SECTIONED_TOOLS) == (content, calls), chunks


def test_sectioned_calls_go_out_one_by_one() -> None:
    """Each call as soon as its end tag arrives, before the section closes."""
    parser = TOOL_PARSERS["deepseek_v3"](None)
    first = f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}"
    assert [c.name for c in parser.feed(first).tool_calls] == ["f"]
    assert [c.name for c in parser.feed(f"{DS_CALL}g{DS_SEP}{{}}{DS_CALL_END}").tool_calls] == ["g"]


# Each family's own chat template (llama.cpp keeps the released ones) writes an assistant turn
# of calls; its parser reads back the same calls. Values of every JSON kind, quotes, markup
# and non-ASCII text in a string.
TEMPLATE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
        "units": {"type": "object"}, "ok": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "noop", "description": "n",
     "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
TEMPLATE_CALLS = [
    ("get_weather", {"city": 'Paris "<b>" 你', "days": 3, "units": {"t": "C", "l": [1, 2]}, "ok": True}),
    ("noop", {}),
]  # fmt: skip


END_OF_GENERATION = {"gemma4": "<|tool_response>"}


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v31"),
        ("moonshotai-Kimi-K2.jinja", "kimi_k2"),
        ("GLM-4.6.jinja", "glm45"),
        ("GLM-4.7-Flash.jinja", "glm47"),
        ("MiniMax-M2.jinja", "minimax_m2"),
        ("google-gemma-4-31B-it.jinja", "gemma4"),
    ],
)
@pytest.mark.parametrize("with_tools", [True, False], ids=["schemas", "no-schemas"])
def test_a_familys_template_turn_reads_back_as_its_calls(template, parser, with_tools) -> None:
    from llama_cpp_convert import chat_template

    from zllm.text.tokenizer import render_chat_template

    source = chat_template(template)
    user = [{"role": "user", "content": "Weather?"}]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(TEMPLATE_CALLS)
    ]
    turn = {"role": "assistant", "content": "Let me check.", "tool_calls": calls}

    def render(messages, add_generation_prompt):
        return render_chat_template(source, messages, add_generation_prompt, tools=TEMPLATE_TOOLS)

    prompt, whole = render(user, True), render([*user, turn], False)
    # The model's turn: what the whole conversation adds to the prompt (a template may close
    # its generation prompt otherwise, e.g. an empty thinking block: from where they differ).
    start = len(os.path.commonprefix([prompt, whole]))
    if whole.rfind("<", 0, start) > whole.rfind(">", 0, start):
        start = whole.rfind("<", 0, start)  # (not inside a tag both begin: Gemma 4's `<|`)
    # (Gemma 4's template ends the turn with `<|tool_response>`, an end-of-generation token:
    # the model stops there, so its text never holds it.)
    answer = whole[start:].removesuffix(END_OF_GENERATION.get(parser, ""))
    tools = TEMPLATE_TOOLS if with_tools else None
    content, got = whole_calls(parser, answer, tools)
    assert got == TEMPLATE_CALLS, answer
    assert "Let me check." in content and "tool" not in content.replace("tool_call_id", "")
    for chunks in (_cut(answer, list(range(3, len(answer), 7))), list(answer)):
        assert streamed_calls(parser, chunks, tools) == (content, got)


REASONING = [
    ("deepseek_r1", "thinking hard</think>\n\nThe answer", "thinking hard", "The answer"),
    ("deepseek_r1", "<think>abc</think>x", "abc", "x"),
    ("deepseek_r1", "never closed", "never closed", ""),
    ("deepseek_r1", "a</thin", "a</thin", ""),
    ("qwen3", "<think>hm</think>\nok", "hm", "ok"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "plain answer", None, "plain answer"),
    ("qwen3", "  <thi", None, "  <thi"),
    ("qwen3", "<think>open </thin", "open </thin", ""),
    ("glm45", "<think>plan</think>\nanswer", "plan", "answer"),
    ("glm45", "\n<think></think>\nanswer", "", "answer"),
    ("kimi_k2", "no thoughts", None, "no thoughts"),
    ("minimax_m2", "\nplan a</think>\n\nanswer", "\nplan a", "answer"),
    ("gemma4", "<|channel>thought\nplan a<channel|>answer", "plan a", "answer"),
    ("gemma4", "<|channel>thought\n \n<channel|>\nx", "", "x"),
    ("gemma4", "no thoughts", None, "no thoughts"),
    ("gemma4", "<|channel>thou", None, "<|channel>thou"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
def test_reasoning(name, text, reasoning, content) -> None:
    assert parse_reasoning(name, text) == (reasoning, content)
    for chunks in partitions(text):
        parser = REASONING_PARSERS[name]()
        got_reasoning = got_content = ""
        for chunk in chunks:
            d = parser.feed(chunk)
            got_reasoning, got_content = got_reasoning + d.reasoning, got_content + d.content
        d = parser.finish()
        got_reasoning, got_content = got_reasoning + d.reasoning, got_content + d.content
        assert (got_reasoning, got_content) == (reasoning or "", content), chunks


@pytest.mark.parametrize(
    "parser", ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2", "gemma4"]
)
def test_formats_whose_tags_are_special_tokens_keep_them_in_the_text(parser) -> None:
    """Under tool_choice auto their answers decode with special tokens (their call tags are
    special tokens in the families' tokenizers); other choices and formats skip them."""
    from zllm.frontend.tools import ToolPlan, keep_call_tags
    from zllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8)
    assert keep_call_tags(params, ToolPlan("auto", None, None), parser).skip_special_tokens is False
    assert keep_call_tags(params, ToolPlan("none", None, None), parser).skip_special_tokens is True
    assert keep_call_tags(params, ToolPlan("auto", None, None), "hermes").skip_special_tokens


def test_gemma4_reasoning_keeps_its_marker_tokens_and_constrains_after_them() -> None:
    """Gemma 4's reasoning markers are special tokens: with its reasoning parser the answer
    decodes with them (any tool choice), and a structured-outputs constraint starts after
    `<channel|>`, its end marker, where a tokenizer has it as one token."""
    from zllm.frontend.tools import ToolPlan, keep_call_tags, think_end_token
    from zllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8)
    none = ToolPlan("none", None, None)
    assert keep_call_tags(params, none, None, "gemma4").skip_special_tokens is False
    assert keep_call_tags(params, none, None, "qwen3").skip_special_tokens is True

    class OneTokenMarkers:  # (a stand-in for Gemma 4's tokenizer: each marker one token)
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return {"<channel|>": [7], "</think>": [9]}.get(text, [1, 2])

    assert think_end_token(OneTokenMarkers(), "gemma4") == 7
    assert think_end_token(OneTokenMarkers(), "qwen3") == 9


def test_zllm_serve_offers_every_parser_by_name() -> None:
    """`--tool-call-parser` and `--reasoning-parser` take exactly the tables' names."""
    import dataclasses

    from zllm.config.arg_utils import flag_of
    from zllm.config.serve import ServerArgs

    fields = {f.name: flag_of(f) for f in dataclasses.fields(ServerArgs)}
    assert set(fields["tool_call_parser"].choices) == set(TOOL_PARSERS)
    assert set(fields["reasoning_parser"].choices) == set(REASONING_PARSERS)
