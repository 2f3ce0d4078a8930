"""Gemma 4's tool calls (`--tool-call-parser gemma4`): free text and calls

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{t:<|"|>C<|"|>}}<tool_call|>

as its chat template writes them: the arguments in Gemma's own notation, not JSON (keys bare,
strings between `<|"|>` quotes, which nothing inside escapes; numbers, true, false and null
as JSON writes them; objects and lists as JSON's with those values). Read into JSON here.
The model's turn ends at `<|tool_response>` (an end-of-generation token: the tool's results
come next). (sections.py: each call goes out when its `<tool_call|>` arrives.) No torch here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from zllm.text.tool_parsers.sections import ReadCall, SectionToolParser

QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:([^{\s]+)\s*(?=\{)")
_SCALAR = re.compile(r"\s*([^,}\]\s]+)")
_KEY = re.compile(r"\s*([^:}]+):")


class _NotGemma(ValueError):
    """The text is not Gemma's notation (the call stays content)."""


def _value(text: str, at: int) -> tuple[Any, int]:
    """The value starting at `at` (after whitespace) and where it ends."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise _NotGemma("an unclosed string")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at):
        return _object(text, at + 1)
    if text.startswith("[", at):
        return _list(text, at + 1)
    scalar = _SCALAR.match(text, at)
    if scalar is None:
        raise _NotGemma("no value")
    word = scalar.group(1)
    if word == "None":  # (what the template writes for a null argument)
        return None, scalar.end()
    try:
        return json.loads(word), scalar.end()
    except ValueError:
        raise _NotGemma(f"not a value: {word!r}") from None


def _object(text: str, at: int) -> tuple[dict, int]:
    """An object's members after its `{`, to after its `}`."""
    members: dict[str, Any] = {}

    def member(at: int) -> int:
        key = _KEY.match(text, at)
        if key is None:
            raise _NotGemma("no key")
        name = key.group(1).strip()
        if name.startswith(QUOTE) and name.endswith(QUOTE) and len(name) > 2 * len(QUOTE):
            name = name[len(QUOTE) : -len(QUOTE)]  # (a key written quoted)
        members[name], at = _value(text, key.end())
        return at

    return members, _items(text, at, "}", member)


def _list(text: str, at: int) -> tuple[list, int]:
    """A list's items after its `[`, to after its `]`."""
    items: list[Any] = []

    def item(at: int) -> int:
        value, at = _value(text, at)
        items.append(value)
        return at

    return items, _items(text, at, "]", item)


def _items(text: str, at: int, close: str, read: Callable[[int], int]) -> int:
    """Comma-separated items read by `read` (from where one starts to where it ends), up to
    `close`; where `close` ends."""
    first = True
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if text.startswith(close, at):
            return at + 1
        if not first:
            if not text.startswith(",", at):
                raise _NotGemma("items not separated")
            at += 1
        at, first = read(at), False


def gemma_arguments(text: str) -> dict | None:
    """An arguments object in Gemma's notation (`{key:value,...}`), None where `text` is not
    one whole."""
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        value, end = _object(text, 1)
    except _NotGemma:
        return None
    return value if not text[end:].strip() else None


class Gemma4ToolParser(SectionToolParser):
    OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
    CALL_END = CLOSE

    def read_call(self, text: str) -> ReadCall | None:
        name = _NAME.match(text)
        if name is None:
            return None
        arguments = gemma_arguments(text[name.end() :])
        if arguments is None:
            return None
        return ReadCall(name.group(1), json.dumps(arguments, ensure_ascii=False))
