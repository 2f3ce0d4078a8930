"""Tool calls written as a Python list of calls (`--tool-call-parser pythonic`), as Llama 3.2
and Llama 4 write them:

    [get_weather(city="Paris", unit="celsius"), get_time(timezone="UTC")]

optionally between `<|python_start|>` and `<|python_end|>`. The message is calls when it
starts (after spaces and that tag) with `[`; anything else is content. Each call is read with
`ast` (never evaluated): keyword arguments whose values are literals (strings, numbers,
True/False/None, lists, dicts, tuples) become the arguments object. A call goes out whole
once its closing parenthesis arrives, so calls stream one by one. From the first thing that is
not such a call on, the text is content, as written. No torch here.
"""

from __future__ import annotations

import ast
import json
import re

from zllm.text.tool_parsers.call_text import (
    ParsedDelta,
    ScanningToolParser,
    ToolCallDelta,
    make_tool_call_id,
)

OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
_CALL_NAME = re.compile(r"[ \t\r\n,]*([A-Za-z_][\w.]*)\s*\(")
_CALL_NAME_SO_FAR = re.compile(r"[ \t\r\n,]*(?:[A-Za-z_][\w.]*\s*)?")
_SPACE = " \t\r\n"


class PythonicToolParser(ScanningToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__("deciding")  # deciding | calls | after | content
        self.call_scan: _CallScanner | None = None  # the call being read

    def _deciding(self, out: ParsedDelta, final: bool) -> bool:
        """Calls if the text opens with `[` (after spaces and an optional tag), else content;
        wait while the start is only spaces or part of the tag."""
        at = _skip(self.text, 0)
        rest = self.text[at:]
        if rest.startswith(OPEN):
            at = _skip(self.text, at + len(OPEN))
            rest = self.text[at:]
        elif not final and OPEN.startswith(rest):
            return False
        if rest.startswith("["):
            self.cursor, self.state = at + 1, "calls"
        elif not rest and not final:
            return False
        else:
            self.state = "content"
        return True

    def _calls(self, out: ParsedDelta, final: bool) -> bool:
        at = _skip(self.text, self.cursor, _SPACE + ",")
        if self.text.startswith("]", at):
            self.pos = self.cursor = at + 1
            self.state = "after"
            return True
        name = _CALL_NAME.match(self.text, self.cursor)
        if name is None:
            growing = _CALL_NAME_SO_FAR.fullmatch(self.text, self.cursor) is not None
            if growing and not final:
                return False
            self.state = "content"
            return True
        self.call_scan = _CallScanner.of_call(self.call_scan, name.end())
        end = self.call_scan.end(self.text)
        if end is None:
            if final:
                self.state = "content"
                return True
            return False
        call = _read_call(self.text[name.start(1) : end])
        if call is None:
            self.state = "content"
            return True
        out.tool_calls.append(ToolCallDelta(self.index, make_tool_call_id(), *call))
        self.index += 1
        self.pos = self.cursor = end
        return True

    def _after(self, out: ParsedDelta, final: bool) -> bool:
        """After the list: its closing tag is dropped; any other text is content."""
        return self._drop_closing_tag(self.pos, CLOSE, final)

    def _content(self, out: ParsedDelta, final: bool) -> bool:
        out.content += self.text[self.pos :]
        self.pos = len(self.text)
        return False


def _skip(text: str, at: int, chars: str = _SPACE) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


class _CallScanner:
    """Where a call whose arguments start at text[start] closes: just past its `)`, tracking
    Python strings (triple-quoted too) and nesting. The text only grows between calls, and
    each call reads on from where the last one stopped, so a long call that streams in token
    by token is read once. It waits, rather than guess, where what has arrived could still
    become a triple quote."""

    __slots__ = ("start", "_next", "_depth", "_quote", "_end")

    def __init__(self, start: int) -> None:
        self.start = start
        self._next = start  # the first character not yet read
        self._depth = 1
        self._quote = ""  # the open string's quote, "" outside one
        self._end: int | None = None

    @classmethod
    def of_call(cls, scanner: _CallScanner | None, start: int) -> _CallScanner:
        """`scanner` if it reads the call whose arguments start at `start` (it goes on where it
        stopped), else a new scanner for that call."""
        if scanner is not None and scanner.start == start:
            return scanner
        return cls(start)

    def end(self, text: str) -> int | None:
        """Index just past the closing `)`, or None if it has not arrived yet."""
        if self._end is not None:
            return self._end
        i, depth, quote = self._next, self._depth, self._quote
        while i < len(text):
            c = text[i]
            if quote:
                if c == "\\":
                    if i + 1 >= len(text):
                        break
                    i += 2
                    continue
                if text.startswith(quote, i):
                    i, quote = i + len(quote), ""
                    continue
                if len(quote) == 3 and _may_grow_into(text, i, quote):
                    break
                i += 1
                continue
            if c in "'\"":
                if _may_grow_into(text, i, c * 3):
                    break
                quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(quote)
                continue
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth == 0:
                    self._end = i + 1
                    return self._end
            i += 1
        self._next, self._depth, self._quote = i, depth, quote
        return None


def _may_grow_into(text: str, i: int, quote: str) -> bool:
    """text[i:] is a proper prefix of a triple quote: the next characters decide what it is."""
    rest = text[i:]
    return len(rest) < len(quote) and quote.startswith(rest)


def _read_call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `name(key=literal, ...)`, or None if it is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.Call) or tree.args:
        return None
    name = _dotted(tree.func)
    if name is None:
        return None
    arguments = {}
    for keyword in tree.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, a complex number, NaN: no JSON for it
        return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None
