"""Mistral's tool calls (`--tool-call-parser mistral`): free text, then `[TOOL_CALLS]` and

    [{"name": "f", "arguments": {...}}, ...]   a JSON list (v0.3-era tokenizers), or
    f{...}  /  f[ARGS]{...}                      the name, then the arguments object (v11+
                                                  tokenizers), one `[TOOL_CALLS]` per call.

A call's name goes out once it is complete, then its arguments' JSON text as it arrives (in
the list form, when the name comes before "arguments"; otherwise the call goes out whole once
its object closes). Ids are nine letters and digits: Mistral's chat templates refuse any other
id when the call comes back in a later turn. What follows a `[TOOL_CALLS]` that is not a call
stays content, as written. No torch here.
"""

from __future__ import annotations

import json
import re

from zllm.text.tool_parsers.call_text import (
    CALL_HEAD,
    ParsedDelta,
    ScanningToolParser,
    ToolCallDelta,
    ValueScanner,
    call_of,
    make_mistral_tool_call_id,
    scanner_at,
)

TAG = "[TOOL_CALLS]"
# v11+: a name, an optional `[ARGS]`, then the arguments object.
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*\{")
# What may still grow into _NAMED: a name, then part of `[ARGS]`.
_NAMED_SO_FAR = re.compile(r"[A-Za-z0-9_.\-]*\s*(?:\[(?:A(?:R(?:G(?:S\]?)?)?)?)?)?\s*")
_SPACE = " \t\r\n"


class MistralToolParser(ScanningToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        # content | opened (pos at a TAG) | named | args | list | list_args | between
        super().__init__("content")
        self.object_start = -1  # list form: the call object being read
        self.args_start = -1  # the arguments object being streamed, and how far it went out
        self.args_sent = -1
        # Read on as the text grows (positions in it never move): the call object of the
        # list form, and the arguments object being streamed.
        self.object_scan: ValueScanner | None = None
        self.args_scan: ValueScanner | None = None

    # Each state reads from self.cursor; True means "step again", False "wait for more".

    def _content(self, out: ParsedDelta, final: bool) -> bool:
        return self._content_until(TAG, out, final)

    def _opened(self, out: ParsedDelta, final: bool) -> bool:
        at = self._skip(self.cursor, _SPACE)
        if at == len(self.text):
            return self._not_a_call(out) if final else False
        if self.text[at] == "[":
            self.cursor, self.state = at + 1, "list"
        else:
            self.cursor, self.state = at, "named"
        return True

    def _named(self, out: ParsedDelta, final: bool) -> bool:
        match = _NAMED.match(self.text, self.cursor)
        if match is None:
            growing = _NAMED_SO_FAR.fullmatch(self.text, self.cursor) is not None
            return False if growing and not final else self._not_a_call(out)
        self._start_call(out, match.group(1), match.end() - 1)
        self.state = "args"
        return True

    def _args(self, out: ParsedDelta, final: bool) -> bool:
        end = self._stream_arguments(out, final)
        if end is None:
            return False
        self.index += 1
        self.pos = self.cursor = end
        self.state = "between"
        return True

    def _between(self, out: ParsedDelta, final: bool) -> bool:
        """After a call: another `[TOOL_CALLS]`, or the end; anything else is content."""
        at = self._skip(self.cursor, _SPACE)
        rest = self.text[at:]
        if rest.startswith(TAG):
            self.pos, self.cursor, self.state = at, at + len(TAG), "opened"
            return True
        if not final and TAG.startswith(rest):
            return False
        self.pos, self.state = at, "content"
        return True

    def _list(self, out: ParsedDelta, final: bool) -> bool:
        at = self._skip(self.cursor, _SPACE + ",")
        if at == len(self.text):
            return self._not_a_call(out) if final else False
        if self.text[at] == "]":
            self.pos = self.cursor = at + 1
            self.state = "between"
            return True
        if self.text[at] != "{":
            return self._not_a_call(out)
        self.object_start = self.cursor = at
        head = CALL_HEAD.match(self.text, at)
        if head is not None and self.text.startswith("{", head.end()):
            self._start_call(out, _json_string(head.group(1)), head.end())
            self.state = "list_args"
            return True
        self.object_scan = scanner_at(self.object_scan, at)
        end = self.object_scan.end(self.text)
        if end is None:  # the name not complete yet, or another key order: wait for it all
            return self._not_a_call(out) if final else False
        call = call_of(self.text[at:end])
        if call is None:
            return self._not_a_call(out)
        name, arguments = call
        out.tool_calls.append(
            ToolCallDelta(self.index, make_mistral_tool_call_id(), name, arguments)
        )
        self.index += 1
        self.pos = self.cursor = end
        return True

    def _list_args(self, out: ParsedDelta, final: bool) -> bool:
        if self._stream_arguments(out, final) is None:
            return False
        self.object_scan = scanner_at(self.object_scan, self.object_start)
        end = self.object_scan.end(self.text)  # the call object around the arguments
        if end is None and not final:
            return False
        self.index += 1
        self.pos = self.cursor = len(self.text) if end is None else end
        self.state = "list"
        return not final or end is not None

    # Helpers

    def _start_call(self, out: ParsedDelta, name: str, args_start: int) -> None:
        out.tool_calls.append(ToolCallDelta(self.index, make_mistral_tool_call_id(), name))
        self.args_start = self.args_sent = args_start

    def _stream_arguments(self, out: ParsedDelta, final: bool) -> int | None:
        """Send the arguments' text that arrived; their end once closed (at the end of the
        text, the arguments as far as the model wrote them)."""
        self.args_scan = scanner_at(self.args_scan, self.args_start)
        end = self.args_scan.end(self.text)
        upto = len(self.text) if end is None else end
        if upto > self.args_sent:
            out.tool_calls.append(
                ToolCallDelta(self.index, arguments=self.text[self.args_sent : upto])
            )
            self.args_sent = upto
        return end if end is not None else (len(self.text) if final else None)

    def _not_a_call(self, out: ParsedDelta) -> bool:
        """What follows is no call: the tag (if nothing of its calls went out) and the text
        after it become content, read on for another tag."""
        if self.text.startswith(TAG, self.pos):
            out.content += TAG
            self.pos += len(TAG)
        self.state = "content"
        return True

    def _skip(self, at: int, chars: str) -> int:
        while at < len(self.text) and self.text[at] in chars:
            at += 1
        return at


def _json_string(body: str) -> str:
    return json.loads(f'"{body}"')
