"""gpt-oss's harmony format: its channels taken apart into reasoning, content and tool calls
(`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`, vLLM's names; either turns
the one parser on, which gives all three).

Every message is a header and a body:

    <|start|>ROLE [to=RECIPIENT] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>TYPE] <|message|>BODY END

where END is `<|end|>`, `<|call|>` (after a tool call) or `<|return|>` (after the final answer;
the last two are stop tokens, so the engine's text usually ends before them). The prompt ends
with `<|start|>assistant`, so the output opens inside the first header:

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

    message                                       goes to
    recipient functions.NAME (any channel)        a tool call NAME; its body is the arguments
                                                  ("{}" when empty)
    channel analysis, or any other recipient      reasoning (a built-in tool's call, such as
    (browser.*, python: tools zllm does not run)  browser.search, is the model's working)
    channel final, commentary with no recipient   content (commentary's is a preamble meant
    (a preamble), no channel, another channel     for the user)

Two messages of one kind are joined by a newline, so their texts do not run together.

Streaming: a header is held until its `<|message|>` shows what it is; a body streams as it
comes, holding back a tail that could be the start of a marker. Nothing of a header reaches
the content. What is not harmony stays content, as written: text outside any message, and a
header that does not parse (words other than a role, a channel, a recipient and a content
type, or longer than MAX_HEADER_CHARS); a well-formed header cut short (the output ended, or
`<|end|>` came before `<|message|>`) is dropped. Nothing raises. No torch here.

The text must keep special tokens (frontend/tools.py asks the detokenizer to keep them
whenever this parser is on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from zllm.text.tool_parsers.call_text import (
    ToolCall,
    ToolCallDelta,
    make_tool_call_id,
    partial_suffix,
)

REASONING_PARSER_NAME = "openai_gptoss"
TOOL_PARSER_NAME = "openai"

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

# What a thinking budget counts from and, once spent, writes to end the reasoning.
REASONING_START = f"{CHANNEL}analysis{MESSAGE}"
REASONING_END = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"

MAX_HEADER_CHARS = 256  # a header longer than this without <|message|> is not one
FUNCTIONS = "functions."

# What opens a header: outside a message; at the output's start, also what may follow the
# prompt's `<|start|>assistant` directly.
_OPENERS = (START, CHANNEL)
_LEAD_OPENERS = (START, CHANNEL, CONSTRAIN, MESSAGE, " to=")
_BODY_ENDS = (END, CALL, RETURN)
_BODY_TAGS = (END, CALL, RETURN, START, CHANNEL)  # START/CHANNEL: a new header, no END
_HEADER_TAGS = (MESSAGE, START, END, CALL, RETURN)
_HEADER_PARTS = re.compile(r"(<\|channel\|>|<\|constrain\|>)")
_WORD = re.compile(r"[\w.\-:/=]+")


def uses_harmony(reasoning_parser: str | None, tool_parser: str | None) -> bool:
    """Whether a server's parsers name harmony's (either name turns the whole parser on)."""
    return reasoning_parser == REASONING_PARSER_NAME or tool_parser == TOOL_PARSER_NAME


@dataclass(slots=True)
class HarmonyHeader:
    role: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None  # "json" after <|constrain|>, or a bare word

    @property
    def function_name(self) -> str | None:
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :] or None

    @property
    def kind(self) -> str:
        """The message's kind: call, reasoning or content (the module docstring's table)."""
        if self.function_name is not None:
            return "call"
        if self.channel == "analysis" or self.recipient is not None:
            return "reasoning"
        return "content"


def parse_header(text: str) -> HarmonyHeader | None:
    """The header between a message's start and its `<|message|>`; None if it is not one."""
    header = HarmonyHeader()
    parts = _HEADER_PARTS.split(text)
    for i in range(0, len(parts), 2):
        marker = parts[i - 1] if i else None
        words = parts[i].split()
        if "<|" in parts[i] or any(_WORD.fullmatch(w) is None for w in words):
            return None
        if marker == CHANNEL:
            if header.channel is not None or not words:
                return None
            header.channel, words = words[0], words[1:]
        elif marker == CONSTRAIN and not words:
            return None
        for word in words:
            if word.startswith("to="):
                if header.recipient is not None:
                    return None
                header.recipient = word[3:]
            elif marker is None and header.role is None:
                header.role = word
            elif marker is not None and header.content_type is None:
                header.content_type = word
            else:
                return None
    return header


@dataclass(slots=True)
class HarmonyDelta:
    """What a stretch of output adds: the shape of both a reasoning parser's delta
    (reasoning, content) and a tool parser's (content, tool_calls, add)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: HarmonyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class HarmonyParser:
    """Harmony output, streamed (`feed`, then `finish`) or whole (`parse_harmony`). A state
    machine over the text not yet settled (`pending`):

        lead     the output's start: a header (the prompt opened the message) or plain text
        outside  between messages: text is content until a header opens
        header   reading a header, up to <|message|>
        body     a message's body, up to its end

    `tools` is taken as every tool parser's is, and not needed: a call names its function.
    """

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.state = "lead"
        self.pending = ""
        self.opener = ""  # the marker that opened the header being read (START, or "")
        self.kind: str | None = None  # the open message's kind
        self.index = 0  # the next tool call's index
        self.args_sent = False  # the open call has sent some arguments
        self.written: set[str] = set()  # kinds some message body has written to
        self.separate = False  # the open message's first text starts with a newline
        self.saw_reasoning = False

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now is (or belongs to a header of) reasoning: the Responses API
        counts a chunk's tokens as reasoning by it."""
        if self.state == "header":
            return f"{CHANNEL}analysis" in self.pending
        return self.state == "body" and self.kind == "reasoning"

    @staticmethod
    def reasoning_markers() -> tuple[str | None, str]:
        return REASONING_START, REASONING_END

    def feed(self, text: str) -> HarmonyDelta:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> HarmonyDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> HarmonyDelta:
        out = HarmonyDelta()
        while getattr(self, "_" + self.state)(out, final):
            pass
        return out

    # -- states: each settles what it can of `pending`; True to step again ------------------
    def _lead(self, out: HarmonyDelta, final: bool) -> bool:
        text = self.pending
        for opener in _LEAD_OPENERS:
            if text.startswith(opener):
                self.opener = START if opener == START else ""
                self.pending = text[len(START) :] if opener == START else text
                self.state = "header"
                return True
        if not final and any(o.startswith(text) for o in _LEAD_OPENERS):
            return False  # nothing yet, or the start of an opener: wait
        self.state = "outside"
        return True

    def _outside(self, out: HarmonyDelta, final: bool) -> bool:
        text = self.pending
        at, tag = _first(text, _OPENERS)
        if tag is None:
            keep = 0 if final else _held(text, _OPENERS)
            out.content += text[: len(text) - keep]
            self.pending = text[len(text) - keep :]
            return False
        out.content += text[:at]
        # A <|channel|> with no <|start|> before it is part of its header.
        self.opener = tag if tag == START else ""
        self.pending = text[at + len(tag) :] if tag == START else text[at:]
        self.state = "header"
        return True

    def _header(self, out: HarmonyDelta, final: bool) -> bool:
        text = self.pending
        at, tag = _first(text, _HEADER_TAGS)
        if tag == MESSAGE:
            header = parse_header(text[:at])
            self.pending = text[at + len(MESSAGE) :]
            if header is None:  # not a header: all of it stays content
                out.content += self.opener + text[: at + len(MESSAGE)]
                self.state = "outside"
            else:
                self._open(header, out)
            return True
        cut = tag is not None  # <|start|> or an end before <|message|>
        too_long = not cut and len(text) > MAX_HEADER_CHARS
        if not (cut or too_long or final):
            return False
        head = text[:at] if cut else text
        end = tag if cut and tag != START else ""  # an end marker closes this (empty) message
        if too_long or parse_header(head) is None:  # not a header: content, as written
            out.content += self.opener + head + end
        # A well-formed header cut short is an empty message: nothing to say. A <|start|>
        # stays, to open the next header.
        self.pending = text[at + len(end) :] if cut else ""
        self.state = "outside"
        return cut

    def _body(self, out: HarmonyDelta, final: bool) -> bool:
        text = self.pending
        at, tag = _first(text, _BODY_TAGS)
        if tag is None:
            keep = 0 if final else _held(text, _BODY_TAGS)
            self._write(out, text[: len(text) - keep])
            self.pending = text[len(text) - keep :]
            if final:
                self._close(out)
            return False
        self._write(out, text[:at])
        self._close(out)
        # A header with no end before it (<|start|>, <|channel|>) opens the next message.
        self.pending = text[at + len(tag) :] if tag in _BODY_ENDS else text[at:]
        self.state = "outside"
        return True

    # -- messages ----------------------------------------------------------------------------
    def _open(self, header: HarmonyHeader, out: HarmonyDelta) -> None:
        self.state, self.kind = "body", header.kind
        if self.kind == "call":
            out.tool_calls.append(
                ToolCallDelta(self.index, make_tool_call_id(), header.function_name, "")
            )
            self.args_sent = False
        self.separate = self.kind in self.written

    def _write(self, out: HarmonyDelta, text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            out.tool_calls.append(ToolCallDelta(self.index, arguments=text))
            self.args_sent = True
            return
        if self.separate:
            text, self.separate = "\n" + text, False
        self.written.add(self.kind or "content")
        if self.kind == "reasoning":
            out.reasoning += text
            self.saw_reasoning = True
        else:
            out.content += text

    def _close(self, out: HarmonyDelta) -> None:
        if self.kind == "call":
            if not self.args_sent:  # a call with no arguments: an empty object
                out.tool_calls.append(ToolCallDelta(self.index, arguments="{}"))
            self.index += 1
        self.kind = None


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """(where, which) of the first of `tags` in `text`; (-1, None) if none is."""
    best, found = -1, None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How much of `text`'s end could still grow into one of `tags`."""
    return max(partial_suffix(text, tag) for tag in tags)


@dataclass(slots=True)
class HarmonyOutput:
    reasoning: str | None  # None: no reasoning message had text
    content: str
    tool_calls: list[ToolCall]


def parse_harmony(text: str) -> HarmonyOutput:
    """A whole output's reasoning, content and calls, as the streamed pieces assemble."""
    parser = HarmonyParser()
    out = parser.feed(text)
    out.add(parser.finish())
    calls: dict[int, ToolCall] = {}
    for d in out.tool_calls:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.name or "", "", d.id or make_tool_call_id())
        calls[d.index].arguments += d.arguments
    reasoning = out.reasoning if parser.saw_reasoning else None
    return HarmonyOutput(reasoning, out.content, [calls[i] for i in sorted(calls)])
