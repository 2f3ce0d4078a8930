"""What every tool-call parser (zllm/text/tool_parsers/) shares: the call and delta types
a parser returns, and the scanners that find where a tag or a JSON value ends in text that is
still arriving. No torch here.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

_ID_CHARS = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def make_mistral_tool_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id in a later turn."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=make_tool_call_id)


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which call of the message
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


class ScanningToolParser:
    """A streaming tool-call parser as a state machine over the text so far (mistral,
    pythonic, qwen3_xml): each state is a method `_<state>(out, final)` that reads from
    `self.cursor` and returns True to step again, False to wait for more text (or, with
    `final`, because the text ended). `self.pos`: text[:pos] is settled, sent as content or
    as calls; `self.index`: the next call's index."""

    def __init__(self, state: str) -> None:
        self.text = ""  # everything fed so far
        self.pos = 0
        self.cursor = 0
        self.state = state
        self.index = 0

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while getattr(self, "_" + self.state)(out, final):
            pass
        return out

    def _content_until(self, tag: str, out: ParsedDelta, final: bool) -> bool:
        """Send text as content up to `tag` (holding back a tail that may grow into it);
        at the tag, move to state "opened" with the cursor past it."""
        start = self.text.find(tag, self.pos)
        if start < 0:
            keep = 0 if final else partial_suffix(self.text[self.pos :], tag)
            upto = len(self.text) - keep
            out.content += self.text[self.pos : upto]
            self.pos = upto
            return False
        out.content += self.text[self.pos : start]
        self.pos, self.cursor, self.state = start, start + len(tag), "opened"
        return True

    def _drop_closing_tag(self, at: int, tag: str, final: bool) -> bool:
        """After the calls: from `at`, past spaces, drop `tag` if it is there, wait while the
        text may still grow into it; then on to state "content" (the rest is content)."""
        while at < len(self.text) and self.text[at] in " \t\r\n":
            at += 1
        rest = self.text[at:]
        if rest.startswith(tag):
            self.pos = at + len(tag)
        elif not final and tag.startswith(rest):
            return False
        self.state = "content"
        return True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# The characters a JSON scanner stops at: inside a string its end or an escape, outside one
# a string's start or a bracket. Everything between them is skipped at C speed.
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class ValueScanner:
    """Where the JSON object or array starting at text[start] ends, in a text that only grows
    between calls: each call reads on from where the last one stopped, so a long value that
    streams in token by token is read once, not once per token."""

    __slots__ = ("start", "_next", "_depth", "_in_string", "_end")

    def __init__(self, start: int) -> None:
        self.start = start
        self._next = start  # the first character not yet read
        self._depth = 0
        self._in_string = False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the value, or None if it has not closed in `text` yet."""
        if self._end is not None:
            return self._end
        i, depth, in_string = self._next, self._depth, self._in_string
        while True:
            found = (_IN_STRING if in_string else _OUTSIDE).search(text, i)
            if found is None:
                i = len(text)
                break
            i = found.start()
            c = text[i]
            if c == "\\":  # an escape: skip the next character, once it has arrived
                if i + 1 >= len(text):
                    break
                i += 2
                continue
            if c == '"':
                in_string = not in_string
            elif c in "{[":
                depth += 1
            else:  # } or ]
                depth -= 1
                if depth == 0:
                    self._end = i + 1
                    return self._end
            i += 1
        self._next, self._depth, self._in_string = i, depth, in_string
        return None


def scanner_at(scanner: ValueScanner | None, start: int) -> ValueScanner:
    """`scanner` if it reads the value at `start` of the same growing text, else a new one."""
    return scanner if scanner is not None and scanner.start == start else ValueScanner(start)


def arguments_json(obj: dict) -> str | None:
    """A call object's arguments as JSON text (a stringified object is unwrapped)."""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_of(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call object's text, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = arguments_json(obj)
    return None if arguments is None else (obj["name"], arguments)


# `{"name": "...", "arguments": ` at the start of a call: name first, so it can stream.
CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
