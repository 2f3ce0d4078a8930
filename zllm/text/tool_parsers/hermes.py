"""Hermes, Qwen 2.5 and Qwen 3's tool calls (`--tool-call-parser hermes`): free text, then one
or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks ("parameters"
is accepted for "arguments"). A call's name goes out once complete, then its arguments' JSON
text as it arrives."""

from __future__ import annotations

import json

from zllm.text.tool_parsers.call_text import (
    CALL_HEAD,
    ParsedDelta,
    ToolCallDelta,
    ValueScanner,
    call_of,
    make_tool_call_id,
    partial_suffix,
    scanner_at,
)


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.buffer = ""  # text not yet settled
        self.in_call = False
        self.index = 0  # the next call's index
        # The call being streamed: its id/name sent, how much of its arguments was sent.
        self.call_started = False
        self.args_start = -1
        self.args_sent = 0
        # Reads the arguments object on as the buffer grows (a call's own: reset per call,
        # since the buffer starts afresh at each call's tag).
        self.args_scan: ValueScanner | None = None

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:
            self._end_call(self.buffer, out, closed=False)
        else:
            out.content += self.buffer
        self.buffer = ""
        return out

    def _step(self, out: ParsedDelta) -> bool:
        if not self.in_call:
            start = self.buffer.find(self.OPEN)
            if start < 0:
                keep = partial_suffix(self.buffer, self.OPEN)
                out.content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            out.content += self.buffer[:start]
            self.buffer = self.buffer[start + len(self.OPEN) :]
            self.in_call, self.call_started, self.args_start, self.args_sent = True, False, -1, 0
            self.args_scan = None
            return True
        end = self.buffer.find(self.CLOSE)
        if end >= 0:
            body = self.buffer[:end]
            self.buffer = self.buffer[end + len(self.CLOSE) :]
            self._end_call(body, out, closed=True)
            return True
        self._stream_call(self.buffer, out)
        return False

    def _stream_call(self, body: str, out: ParsedDelta) -> None:
        """Inside an open block: send the name once complete, then the arguments' text as it
        arrives, if they are an object following the name."""
        if self.args_start < 0:
            head = CALL_HEAD.match(body)
            if head is None or not body[head.end() :].startswith("{"):
                return  # name not complete yet, another key order, or stringified: wait
            self.args_start = head.end()
            name = json.loads(f'"{head.group(1)}"')
            out.tool_calls.append(ToolCallDelta(self.index, make_tool_call_id(), name))
            self.call_started = True
        # At the call's end `body` is the buffer before the closing tag; the scanner may have
        # read part of that tag already, which holds no quote, bracket or backslash.
        self.args_scan = scanner_at(self.args_scan, self.args_start)
        end = self.args_scan.end(body)
        upto = end if end is not None else len(body)
        piece = body[self.args_start + self.args_sent : upto]
        if piece:
            out.tool_calls.append(ToolCallDelta(self.index, arguments=piece))
            self.args_sent += len(piece)

    def _end_call(self, body: str, out: ParsedDelta, closed: bool) -> None:
        call = call_of(body)
        if self.call_started:
            # Its name and part of its arguments went out already: send the rest as written.
            self._stream_call(body, out)
            self.index += 1
        elif call is not None:
            name, arguments = call
            out.tool_calls.append(ToolCallDelta(self.index, make_tool_call_id(), name, arguments))
            self.index += 1
        else:  # not a call: the block stays text
            out.content += self.OPEN + body + (self.CLOSE if closed else "")
        self.in_call = False
