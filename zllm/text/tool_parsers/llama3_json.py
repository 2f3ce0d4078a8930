"""Llama 3.1 / 3.2's tool calls (`--tool-call-parser llama3_json`): the whole message is the
call(s) when it starts (after an optional `<|python_tag|>`) with `{`: `{"name": ...,
"parameters": {...}}`, several separated by `;`; anything else is content. Each call goes out
whole once its object closes."""

from __future__ import annotations

from zllm.text.tool_parsers.call_text import (
    ParsedDelta,
    ToolCallDelta,
    ValueScanner,
    call_of,
    make_tool_call_id,
    scanner_at,
)


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.buffer = ""
        self.mode = "deciding"  # "deciding", "content" or "calls"
        self.scanned = 0  # in calls mode: buffer[:scanned] is settled
        self.index = 0
        self.call_scan: ValueScanner | None = None  # the call object being read

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        if self.mode == "deciding":
            self._decide(final=False)
        if self.mode == "content":
            out.content, self.buffer = self.buffer, ""
        elif self.mode == "calls":
            self._calls(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "deciding":
            self._decide(final=True)
        if self.mode == "calls":
            self._calls(out, final=True)
        else:
            out.content, self.buffer = self.buffer, ""
        return out

    def _decide(self, final: bool) -> None:
        """Calls if the message opens with `{` (after an optional tag), else content; wait
        while the start is only whitespace or part of the tag."""
        head = self.buffer.lstrip()
        if head.startswith(self.TAG):
            after = head[len(self.TAG) :].lstrip()
            if after.startswith("{"):
                self.mode, self.buffer = "calls", after
            elif after or final:
                self.mode = "content"
            return
        if head.startswith("{"):
            self.mode, self.buffer = "calls", head
        elif final or (head and not self.TAG.startswith(head)):
            self.mode = "content"

    def _calls(self, out: ParsedDelta, final: bool) -> None:
        """Each complete top-level object is a call, sent whole; `;` and spaces between
        them are dropped. What does not parse (or never closes) is content."""
        while True:
            rest = self.buffer[self.scanned :]
            stripped = rest.lstrip(" \t\n;")
            start = self.scanned + len(rest) - len(stripped)
            if not stripped:
                self.scanned = start if final else self.scanned
                break
            if not stripped.startswith("{"):  # text after the calls
                out.content += self.buffer[start:]
                self.scanned = len(self.buffer)
                break
            self.call_scan = scanner_at(self.call_scan, start)
            end = self.call_scan.end(self.buffer)
            if end is None:
                if final:
                    out.content += self.buffer[start:]
                    self.scanned = len(self.buffer)
                break
            call = call_of(self.buffer[start:end])
            if call is None:
                out.content += self.buffer[start:end]
            else:
                name, arguments = call
                out.tool_calls.append(
                    ToolCallDelta(self.index, make_tool_call_id(), name, arguments)
                )
                self.index += 1
            self.scanned = end
