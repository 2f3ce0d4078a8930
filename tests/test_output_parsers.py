"""Tool-call and reasoning parsers on canned model output, whole and streamed in every way
the text can be cut: every partition of short texts, and for longer ones every cut into two
and three pieces, fixed chunk sizes and seeded random partitions. A streamed answer must
assemble to exactly the whole-text result: the same content, the same calls, arguments that
concatenate to valid JSON."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from zllm.text.reasoning_parser import REASONING_PARSERS, parse_reasoning
from zllm.text.tool_parsers import TOOL_PARSERS, ParsedDelta, parse_tool_calls


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


def streamed_calls(name: str, chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = TOOL_PARSERS[name]()
    out = ParsedDelta()
    for chunk in chunks:
        out.add(parser.feed(chunk))
    out.add(parser.finish())
    calls: dict[int, list] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            assert d.id and d.id.startswith("call_") and d.name, "a call's first delta names it"
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return out.content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def whole_calls(name: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(name, text)
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
