"""Tools and reasoning in chat answers: what a request's `tools` and `tool_choice` ask of the
engine, and how each choice's text becomes content, reasoning and tool calls on the way out.

    tool_choice   the engine's output is constrained to                 parsed by
    none          nothing (tools still reach the chat template)         -
    auto          the model's own format; with hermes, after its        --tool-call-parser
                  call-opening token (`<tool_call>`), the rest of the   (hermes, llama3_json,
                  call matches the tool schemas (a grammar that waits   mistral, pythonic,
                  for that token); other formats are parsed only        qwen3_xml, deepseek_v3,
                                                                        kimi_k2, glm45,
                                                                        minimax_m2, openai)
    required      a JSON array of {"name", "parameters"} objects, one   _RequiredCalls
                  per call, each matching its tool's schema
    a function    that function's parameters schema: the text is the    _NamedCall
                  arguments

`required` and a named function hold whatever the model or chat template: the grammar
forces the shape, so every call parses and its arguments match the schema. With
--reasoning-parser, the text first goes through the reasoning parser; a constraint then
waits for the end of the reasoning (`</think>`).

gpt-oss's harmony (--reasoning-parser openai_gptoss or --tool-call-parser openai,
zllm/text/tool_parsers/harmony.py) is one parser for all three: its channels give the reasoning, the
content and, under `auto`, the calls. Its text keeps special tokens (its headers are made of
them); a constraint waits for its answer's header, `<|channel|>final<|message|>` (several
tokens: StructuredOutputsParams.after_tokens).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zllm.errors import RequestError
from zllm.frontend.openai.protocol import (
    ChatCompletionRequest,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCallDelta,
)
from zllm.sampling_params import SamplingParams, StructuredOutputsParams
from zllm.text.reasoning_parser import REASONING_PARSERS, reasoning_markers
from zllm.text.tokenizer import Tokenizer
from zllm.text.tool_parsers import TOOL_PARSERS, make_tool_call_id
from zllm.text.tool_parsers.harmony import HarmonyDelta, HarmonyParser, uses_harmony

# The tokens that open a tool call in each parser's format, when they are one special token:
# `auto` then constrains what follows them (TOOL_CALL_GRAMMARS).
_CALL_OPEN = {"hermes": ("<tool_call>", "</tool_call>")}


@dataclass(slots=True)
class ToolPlan:
    """What one chat request asks: how tools are called, and the constraint that implies."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # as the chat template receives them (OpenAI's shape)
    structured: StructuredOutputsParams | None  # the grammar required/named/auto impose
    function_name: str | None = None  # mode "named"
    parallel: bool = True


def plan_tools(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    tool_parser: str | None,
    user_structured: StructuredOutputsParams | None,
) -> ToolPlan:
    """A request's tool plan; a RequestError (400) for a choice it cannot honour."""
    tools = [msgspec_to_builtins(t) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        # OpenAI's default with tools is auto; a server without a tool-call parser cannot
        # parse calls, so there the default is none (asking for auto explicitly is a 400).
        choice = "auto" if tools and tool_parser is not None else "none"
    if not tools:
        if choice not in ("none", "auto"):
            raise RequestError("tool_choice needs tools.", param="tool_choice")
        return ToolPlan("none", None, None)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique.", param="tools")
    if choice == "none":
        return ToolPlan("none", tools, None)
    # required or a named function: the answer is calls, and the request's own format (for a
    # message: an agent loop sends it every turn) has no message to shape on this turn.
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise RequestError(
                f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
            )
        schema = _parameters(tools[names.index(name)])
        return ToolPlan("named", tools, StructuredOutputsParams(json=schema), name)
    if choice == "required":
        schema = _calls_schema(tools, body.parallel_tool_calls)
        return ToolPlan(
            "required",
            tools,
            StructuredOutputsParams(json=schema),
            parallel=body.parallel_tool_calls,
        )
    # auto
    if tool_parser is None and not template_shows_tools(getattr(tokenizer, "chat_template", None)):
        # The model never sees the tools (its chat template renders none), so it cannot call
        # one: its answer is text, as under none (SmolLM2's template; Codex asks auto always).
        return ToolPlan("none", tools, None)
    if tool_parser is None:
        raise RequestError(
            'tool_choice "auto" needs a server started with --tool-call-parser '
            f'({", ".join(sorted(TOOL_PARSERS))}); or use "required" or a named function.',
            param="tool_choice",
        )
    structured = user_structured or _auto_call_grammar(tools, tokenizer, tool_parser)
    return ToolPlan("auto", tools, structured, parallel=body.parallel_tool_calls)


@functools.lru_cache(maxsize=16)
def template_shows_tools(template: str | None) -> bool:
    """Whether a chat template reads its `tools` variable (unknown or unparsable: assume so)."""
    if template is None:
        return True
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:
        return True


def msgspec_to_builtins(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call_schemas(tools: list[dict[str, Any]], arguments_key: str) -> list[dict[str, Any]]:
    """One object schema per tool: {"name": that name, arguments_key: its parameters}."""
    return [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [t["function"]["name"]]},
                arguments_key: _parameters(t),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]


def _calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": _call_schemas(tools, "parameters")},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _auto_call_grammar(
    tools: list[dict[str, Any]], tokenizer: Tokenizer, parser: str
) -> StructuredOutputsParams | None:
    """For `auto`: once the model opens a call, the call matches a tool's schema. Needs the
    format's open and close tags to be single special tokens; else the parser alone."""
    tags = _CALL_OPEN.get(parser)
    if tags is None:
        return None
    ids = [_single_token(tokenizer, tag) for tag in tags]
    if None in ids:
        return None
    open_id, close_id = ids
    call = {"anyOf": _call_schemas(tools, "arguments")}
    grammar = (
        f"start: WS call WS <[{close_id}]>\nWS: /[ \\t\\n]*/\ncall: %json {json.dumps(call)}\n"
    )
    return StructuredOutputsParams(grammar=grammar, after_token=open_id, repeat=True)


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def constrain(
    params: SamplingParams,
    plan: ToolPlan,
    tokenizer: Tokenizer,
    reasoning_parser: str | None,
    tool_parser: str | None = None,
) -> SamplingParams:
    """The request's structured-outputs constraint: the tool plan's (required, a named
    function, auto's call grammar) or the request's own; with a reasoning parser, one
    that does not wait for tokens of its own applies after the reasoning: after `</think>`,
    or harmony's `<|channel|>final<|message|>` (its answer's header)."""
    structured = plan.structured if plan.structured is not None else params.structured_outputs
    if structured is None:
        return params
    waits = structured.after_token is not None or structured.after_tokens is not None
    harmony = uses_harmony(reasoning_parser, tool_parser)  # either name turns harmony on
    if (reasoning_parser is not None or harmony) and not waits:
        if harmony:
            final = harmony_final_tokens(tokenizer)
            if final is not None:
                structured = msgspec.structs.replace(structured, after_tokens=final)
        else:
            think_end = think_end_token(tokenizer, reasoning_parser)
            if think_end is not None:
                structured = msgspec.structs.replace(structured, after_token=think_end)
    return msgspec.structs.replace(params, structured_outputs=structured)


# Formats whose call tags are special tokens in the model's tokenizer (Mistral's
# `[TOOL_CALLS]`, DeepSeek's `<｜tool▁calls▁begin｜>`, Kimi K2's, GLM's `<tool_call>`, MiniMax's
# `<minimax:tool_call>`, Gemma 4's `<|tool_call>` and `<|"|>`): decoding must keep special
# tokens, or the parser never sees a call.
_SPECIAL_CALL_TAGS = frozenset(
    {"mistral", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "glm47", "minimax_m2", "gemma4"}
)
# Reasoning formats whose markers are special tokens (Gemma 4's `<|channel>`, `<channel|>`).
_SPECIAL_REASONING_MARKERS = frozenset({"gemma4"})


def keep_call_tags(
    params: SamplingParams,
    plan: ToolPlan,
    tool_parser: str | None,
    reasoning_parser: str | None = None,
) -> SamplingParams:
    """`auto` with such a format, a reasoning format of special-token markers, and harmony
    always: special tokens stay in the text (as vLLM does)."""
    special_calls = plan.mode == "auto" and tool_parser in _SPECIAL_CALL_TAGS
    special_markers = reasoning_parser in _SPECIAL_REASONING_MARKERS
    if not (special_calls or special_markers or uses_harmony(reasoning_parser, tool_parser)):
        return params
    return msgspec.structs.replace(params, skip_special_tokens=False)


def think_end_token(tokenizer: Tokenizer, reasoning_parser: str) -> int | None:
    """The token that ends the reasoning in the parser's format (`</think>`, Gemma 4's
    `<channel|>`), where it is one token."""
    return _single_token(tokenizer, reasoning_markers(reasoning_parser)[1])


def harmony_final_tokens(tokenizer: Tokenizer) -> list[int] | None:
    """The ids of harmony's `<|channel|>final<|message|>`, where its markers are single
    tokens (gpt-oss's tokenizer); None elsewhere."""
    if None in (_single_token(tokenizer, t) for t in ("<|channel|>", "<|message|>")):
        return None
    return tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Output: one parser per choice


@dataclass(slots=True)
class Piece:
    """What one stretch of a choice's text adds to its message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """A choice's text -> reasoning, content and tool calls, streamed or whole."""

    def __init__(self, plan: ToolPlan, tool_parser: str | None, reasoning_parser: str | None):
        self.plan = plan
        # Harmony's one parser gives reasoning and calls: it stands in the reasoning's place.
        harmony = uses_harmony(reasoning_parser, tool_parser)
        self.reasoning = None
        if harmony:
            self.reasoning = HarmonyParser(plan.tools)
        elif reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[reasoning_parser]()
        self.calls: _Calls | None = None
        if plan.mode == "auto" and not harmony:
            self.calls = _ParserCalls(TOOL_PARSERS[tool_parser](plan.tools))  # type: ignore[index]
        elif plan.mode == "required":
            self.calls = _RequiredCalls()
        elif plan.mode == "named":
            self.calls = _NamedCall(plan.function_name or "")
        self.num_calls = 0

    @classmethod
    def of(
        cls, plan: ToolPlan, tool_parser: str | None, reasoning_parser: str | None
    ) -> ChoiceParser | None:
        """A choice's parser where tools, a reasoning parser or harmony shape its text; None
        where the text is all content."""
        shaped = plan.mode != "none" or reasoning_parser is not None
        if not shaped and not uses_harmony(None, tool_parser):
            return None
        return cls(plan, tool_parser, reasoning_parser)

    def feed(self, text: str) -> Piece:
        return self._route(self.reasoning.feed(text) if self.reasoning else None, text, False)

    def finish(self) -> Piece:
        return self._route(self.reasoning.finish() if self.reasoning else None, "", True)

    def _route(self, split, text: str, final: bool) -> Piece:
        piece = Piece()
        if split is not None:
            piece.reasoning, text = split.reasoning, split.content
            if isinstance(split, HarmonyDelta):
                piece.tool_calls = _ParserCalls.convert(split)[1]
        if self.calls is None:
            piece.content = text
        else:
            content, calls = self.calls.feed(text)
            if final:
                more_content, more_calls = self.calls.finish()
                content, calls = content + more_content, calls + more_calls
            piece.content = content
            piece.tool_calls += calls
        self.num_calls += len({c.index for c in piece.tool_calls if c.id is not None})
        return piece

    @property
    def called_tools(self) -> bool:
        return self.num_calls > 0


class _Calls:
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []


def _delta(index: int, name: str | None = None, arguments: str = "") -> ToolCallDelta:
    if name is not None:
        return ToolCallDelta(
            index=index,
            id=make_tool_call_id(),
            type="function",
            function=FunctionCallDelta(name=name, arguments=arguments),
        )
    return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))


class _ParserCalls(_Calls):
    """auto: the model's own format, through a --tool-call-parser."""

    def __init__(self, parser) -> None:
        self.parser = parser

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return self.convert(self.parser.feed(text))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.convert(self.parser.finish())

    @staticmethod
    def convert(parsed) -> tuple[str, list[ToolCallDelta]]:
        calls = []
        for d in parsed.tool_calls:
            if d.name is not None:
                calls.append(
                    ToolCallDelta(
                        index=d.index,
                        id=d.id or make_tool_call_id(),
                        type="function",
                        function=FunctionCallDelta(name=d.name, arguments=d.arguments),
                    )
                )
            elif d.arguments:
                calls.append(_delta(d.index, arguments=d.arguments))
        return parsed.content, calls


class _NamedCall(_Calls):
    """A named function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not self.started:
            self.started = True
            return "", [_delta(0, self.name, text)]
        return "", [_delta(0, arguments=text)] if text else []


class _RequiredCalls(_Calls):
    """required: a JSON array of {"name", "parameters"}; each call is sent whole once its
    object closes (found by a scanner that tracks strings and nesting)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.scanned = 0  # characters of buffer already scanned
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.object_start = -1
        self.index = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        calls = []
        for i in range(self.scanned, len(self.buffer)):
            c = self.buffer[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                continue
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
                if c == "{" and self.depth == 2:
                    self.object_start = i
            elif c in "]}":
                if c == "}" and self.depth == 2 and self.object_start >= 0:
                    calls.append(self._call(self.buffer[self.object_start : i + 1]))
                    self.object_start = -1
                self.depth -= 1
        self.scanned = len(self.buffer)
        return "", calls

    def _call(self, text: str) -> ToolCallDelta:
        obj = json.loads(text)  # the grammar made it valid
        delta = _delta(self.index, obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))
        self.index += 1
        return delta
