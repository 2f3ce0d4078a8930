"""Qwen3-Coder's tool calls (`--tool-call-parser qwen3_xml`): free text, then blocks of

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its opening tag and one before its closing
tag are layout, not value); the tool's JSON schema says what it is: a string stays text;
integer, number, boolean and null are read as such; objects and arrays as JSON (or a Python
literal). A parameter the schema does not know, or a value that does not read as its type,
stays a string. The call goes out as it arrives: its name and `{` once `<function=...>` is
complete, then each parameter as `"key": value` once its closing tag arrives, then `}`;
so the pieces always concatenate to a JSON object, even when the model stops mid-call.
A `<tool_call>` not followed by a function stays content, as written. No torch here.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from zllm.text.tool_parsers.call_text import (
    ParsedDelta,
    ScanningToolParser,
    ToolCallDelta,
    make_tool_call_id,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_FUNCTION_SO_FAR = re.compile(
    r"\s*(?:<(?:f(?:u(?:n(?:c(?:t(?:i(?:o(?:n(?:=[^>\n]*)?)?)?)?)?)?)?)?)?)?"
)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_SPACE = " \t\r\n"


class Qwen3XmlToolParser(ScanningToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        # Each tool's parameter schemas, by name: they say how to read a value.
        self.properties: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters") or {}
            self.properties[function.get("name", "")] = parameters.get("properties") or {}
        super().__init__("content")  # content | opened | function | closing
        self.name = ""  # the function being read, and how many parameters went out
        self.num_params = 0

    def _content(self, out: ParsedDelta, final: bool) -> bool:
        return self._content_until(OPEN, out, final)

    def _opened(self, out: ParsedDelta, final: bool) -> bool:
        match = _FUNCTION.match(self.text, self.cursor)
        if match is None:
            growing = _FUNCTION_SO_FAR.fullmatch(self.text, self.cursor) is not None
            if growing and not final:
                return False
            out.content += OPEN  # no function follows: the tag is text
            self.pos += len(OPEN)
            self.state = "content"
            return True
        self.name, self.num_params = match.group(1).strip(), 0
        out.tool_calls.append(ToolCallDelta(self.index, make_tool_call_id(), self.name, "{"))
        self.cursor, self.state = match.end(), "function"
        return True

    def _function(self, out: ParsedDelta, final: bool) -> bool:
        at = self.cursor
        while at < len(self.text) and self.text[at] in _SPACE:
            at += 1
        rest = self.text[at:]
        if rest.startswith(FUNCTION_END):
            self._end_call(out, at + len(FUNCTION_END))
            self.state = "closing"
            return True
        if rest.startswith(CLOSE):  # `</function>` left out
            self._end_call(out, at + len(CLOSE))
            self.state = "content"
            return True
        parameter = _PARAMETER.match(self.text, at)
        if parameter is not None:
            value_start = parameter.end()
            end = self.text.find(PARAMETER_END, value_start)
            after = end + len(PARAMETER_END)
            if end < 0:  # a missing closing tag: the value ends where the function does
                end = after = self.text.find(FUNCTION_END, value_start)
            if end < 0:
                if not final:
                    return False
                end = after = len(self.text)
            key = parameter.group(1).strip()
            value = self._value(key, self.text[value_start:end])
            piece = (
                json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            )
            separator = ", " if self.num_params else ""
            out.tool_calls.append(ToolCallDelta(self.index, arguments=separator + piece))
            self.num_params += 1
            self.cursor = after
            return True
        if not final and any(tag.startswith(rest) for tag in (FUNCTION_END, CLOSE, "<parameter=")):
            return False
        if not final and rest.startswith("<parameter=") and ">" not in rest:
            return False
        # Anything else ends the call; what follows is content.
        self._end_call(out, at)
        self.state = "content"
        return True

    def _closing(self, out: ParsedDelta, final: bool) -> bool:
        return self._drop_closing_tag(self.cursor, CLOSE, final)

    def _end_call(self, out: ParsedDelta, settled: int) -> None:
        out.tool_calls.append(ToolCallDelta(self.index, arguments="}"))
        self.index += 1
        self.pos = self.cursor = settled

    def _value(self, key: str, raw: str) -> Any:
        raw = raw.removeprefix("\n").removesuffix("\n")
        schema = self.properties.get(self.name, {}).get(key)
        return read_value(raw, schema if isinstance(schema, dict) else None)


def read_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's raw text as its schema's type says; a string where it says none or
    the text does not read as that type."""
    if schema is None:
        return raw
    # A client's schema may be anything: only string type names count, only a list enum.
    kinds = schema.get("type")
    kinds = {k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)}
    enum = schema.get("enum")
    if not kinds and isinstance(enum, list):
        for option in enum:
            if raw == (option if isinstance(option, str) else json.dumps(option)):
                return option
        return raw
    text = raw.strip()
    if "null" in kinds and text == "null":
        return None
    if "string" in kinds:
        return raw
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in kinds:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in kinds:
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if number == number and number not in (float("inf"), float("-inf")):
                return int(number) if re.fullmatch(r"-?\d+", text) else number
    if kinds & {"object", "array"} or not kinds:
        try:
            value = json.loads(text)
            json.dumps(value, allow_nan=False)  # NaN, Infinity: not JSON arguments
            return value
        except ValueError:
            pass
        try:
            value = ast.literal_eval(text)
            json.dumps(value, allow_nan=False)
            return value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw
