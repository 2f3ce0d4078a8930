"""Tool calls in a model's own words, turned into OpenAI tool calls (`--tool-call-parser`).

    hermes       Hermes, Qwen 2.5 and Qwen 3: free text, then one or more
                 `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
                 ("parameters" is accepted for "arguments").
    llama3_json  Llama 3.1 / 3.2: the whole message is the call(s) when it starts (after an
                 optional `<|python_tag|>`) with `{`: `{"name": ..., "parameters": {...}}`,
                 several separated by `;`. Anything else is content.
    mistral      Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `name{...}` /
                 `name[ARGS]{...}` (zllm/text/mistral_tool_parser.py).
    pythonic     Llama 3.2 / Llama 4: `[f(x=1), g(y="a")]`, read with `ast`
                 (zllm/text/pythonic_tool_parser.py).
    qwen3_xml    Qwen3-Coder: `<tool_call><function=f><parameter=x>1</parameter>...` with
                 values read by the tool's schema (zllm/text/qwen3_xml_tool_parser.py).
    openai       gpt-oss: harmony's `<|channel|>commentary to=functions.f ...<|message|>{...}`
                 (zllm/text/harmony.py), which gives the analysis channel as reasoning too;
                 the same parser as --reasoning-parser openai_gptoss.

Every parser is made with the request's tools (OpenAI's shape; qwen3_xml reads their
parameter schemas, the others ignore them).

A parser is fed the generated text chunk by chunk (`feed`, then `finish`) and returns what
each chunk adds: `content`, and `ToolCallDelta`s with OpenAI's streaming semantics (the first
delta of a call carries its id and name; the arguments' JSON text follows in pieces). The
pieces of a call's arguments concatenate to exactly the JSON text of its arguments object;
`parse_tool_calls` on the whole text gives the same calls and content. Text that could be
the start of a tag is held back until the next chunk settles it. A block whose JSON does not
parse stays content, as written; nothing raises. No torch here.
"""

from __future__ import annotations

import json

from zllm.text.harmony import TOOL_PARSER_NAME, HarmonyParser
from zllm.text.mistral_tool_parser import MistralToolParser
from zllm.text.pythonic_tool_parser import PythonicToolParser
from zllm.text.qwen3_xml_tool_parser import Qwen3XmlToolParser
from zllm.text.tool_call_text import (
    CALL_HEAD,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ValueScanner,
    call_of,
    make_tool_call_id,
    partial_suffix,
    scanner_at,
)

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "make_tool_call_id"]


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


TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    TOOL_PARSER_NAME: HarmonyParser,
}


def parse_tool_calls(
    parser_name: str, text: str, tools: list[dict] | None = None
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer, as the streamed pieces would assemble."""
    parser = TOOL_PARSERS[parser_name](tools)
    out = parser.feed(text)
    out.add(parser.finish())
    calls: dict[int, ToolCall] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.name or "", "", d.id or make_tool_call_id())
        calls[d.index].arguments += d.arguments
    return out.content, [calls[i] for i in sorted(calls)]
