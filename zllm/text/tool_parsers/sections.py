"""What the tag-delimited tool-call formats share (deepseek_v3.py, kimi_k2.py, glm45.py,
minimax_m2.py): free text, then a section of calls between an opening and a closing tag,
each call ending in its own tag (a format whose section holds one call ends both with one
tag). A parser of this kind says only how one call's text reads (`read_call`).

Each call goes out whole (id, name and arguments in one delta) once its end tag arrives, so a
client streaming the answer sees the calls one by one; the content before the section streams
as it comes, holding back a tail that may grow into the opening tag. A call whose text does not
read stays content, as written; so does a section the text ends inside of that holds no call.
No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zllm.text.tool_parsers.call_text import (
    ParsedDelta,
    ToolCallDelta,
    make_tool_call_id,
    partial_suffix,
)
from zllm.text.tool_parsers.qwen3_xml import read_value


@dataclass(slots=True)
class ReadCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str | None = None  # the model's own id of the call (Kimi K2's), else one is made


class SectionToolParser:
    OPEN = ""  # where the calls start
    CLOSE = ""  # where they end
    CALL_END = ""  # where each call ends (CLOSE for one call per section)

    def __init__(self, tools: list[dict] | None = None) -> None:
        # Each tool's parameter schemas, by name: the XML formats read values by them.
        self.properties: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters") or {}
            self.properties[function.get("name", "")] = parameters.get("properties") or {}
        self.buffer = ""  # text not yet settled
        self.in_section = False
        self.section_calls = 0  # calls read in the open section
        self.open_written = False  # its opening tag went out as content (a call did not read)
        self.index = 0  # the next call's index

    def read_call(self, text: str) -> ReadCall | None:
        """One call's text (between the section's or the last call's tag and this call's end
        tag), or None where it is not a call."""
        raise NotImplementedError

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_section and self.buffer.strip():
            self._settle(self.buffer, "", out)  # a call whose end tag never came
        elif self.in_section and not self.section_calls:
            out.content += ("" if self.open_written else self.OPEN) + self.buffer
        elif not self.in_section:
            out.content += self.buffer
        self.buffer, self.in_section = "", False
        return out

    def _step(self, out: ParsedDelta) -> bool:
        if not self.in_section:
            start = self.buffer.find(self.OPEN)
            if start < 0:
                keep = partial_suffix(self.buffer, self.OPEN)
                out.content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            out.content += self.buffer[:start]
            self.buffer = self.buffer[start + len(self.OPEN) :]
            self.in_section, self.section_calls, self.open_written = True, 0, False
            return True
        close = self.buffer.find(self.CLOSE)
        end = self.buffer.find(self.CALL_END) if self.CALL_END != self.CLOSE else -1
        if end >= 0 and (close < 0 or end < close):  # a call inside a longer section
            self._settle(self.buffer[:end], self.CALL_END, out)
            self.buffer = self.buffer[end + len(self.CALL_END) :]
            return True
        if close >= 0:  # the section's end (and, for one call per section, the call's)
            body = self.buffer[:close]
            if body.strip() or self.CALL_END == self.CLOSE:
                self._settle(body, "", out)
            if not self.section_calls:  # no call read: the section was text
                out.content += ("" if self.open_written else self.OPEN) + self.CLOSE
            self.buffer = self.buffer[close + len(self.CLOSE) :]
            self.in_section = False
            return True
        return False

    def _settle(self, text: str, end_tag: str, out: ParsedDelta) -> None:
        """A call's text and the tag that ended it: out as a call, or as content."""
        call = self.read_call(text)
        if call is None:
            opening = "" if self.section_calls or self.open_written else self.OPEN
            out.content += opening + text + end_tag
            self.open_written = True
            return
        call_id = call.id or make_tool_call_id()
        out.tool_calls.append(ToolCallDelta(self.index, call_id, call.name, call.arguments))
        self.index += 1
        self.section_calls += 1

    def typed(self, function: str, key: str, raw: str) -> Any:
        """An XML format's parameter value: as the tool's schema types it; with no schema,
        JSON where it reads as JSON (the templates write every non-string value as JSON),
        else the text."""
        schema = self.properties.get(function, {}).get(key)
        if isinstance(schema, dict):
            return read_value(raw, schema)
        try:
            return json.loads(raw)
        except ValueError:
            return raw


def json_object(text: str) -> str | None:
    """`text` as an arguments object's JSON text, None where it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
