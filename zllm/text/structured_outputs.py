"""Structured outputs (guided decoding): what a request asks its answer to match, as a grammar.

A request carries `SamplingParams.structured_outputs`, vLLM's shape: exactly one of

    json         a JSON schema (dict or JSON text): the answer is one JSON value matching it
    json_object  True: any JSON object (OpenAI's response_format {"type": "json_object"})
    regex        the answer matches the regular expression, whole
    choice       the answer is one of these strings
    grammar      a context-free grammar: Lark (llguidance's dialect) or GBNF/EBNF (`::=`)

`grammar_of` turns it into an llguidance grammar; `check_structured_outputs` compiles it once
(in the tokenizer worker, or `LLM` offline) so a grammar that cannot compile is a ParamError,
a 400 naming the problem, before anything is scheduled. The executor builds the token-level
matcher from the same grammar text (executor/sample/structured_output.py).

llguidance (the grammar library) is one dependency-free wheel: it keeps torch out of the
processes that import this module. No torch here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from zllm.errors import ParamError

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_PARAM = "structured_outputs"  # the request field errors name


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's `StructuredOutputsParams`: set exactly one field."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Whitespace between JSON tokens: none (compact, the default: fewer tokens, fewer ways
    # to wander) or what the model likes (True).
    whitespace_flexible: bool = False
    # zllm's own: the grammar applies only after the model emits this token (its output is
    # free until then): `</think>` for reasoning models, a tool-call opening tag for tool
    # calls. With `repeat`, once the grammar completes the output is free again until the
    # next such token (one constrained tool call per opening tag).
    after_token: int | None = None
    repeat: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            given = ", ".join(kinds) or "none"
            raise ParamError(
                f"structured outputs take exactly one of {', '.join(_KINDS)}; got {given}.",
                _PARAM,
            )
        if self.choice is not None and not self.choice:
            raise ParamError("choice must list at least one string.", _PARAM)

    def kinds(self) -> list[str]:
        # json_object=False counts as unset.
        return [k for k in _KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) the answer must match."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    options = {"whitespace_flexible": params.whitespace_flexible}
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ParamError(f"the JSON schema is not valid JSON: {e}", _PARAM) from None
        if not isinstance(schema, dict):
            raise ParamError("a JSON schema must be a JSON object.", _PARAM)
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ParamError(f"invalid JSON schema: {e}", _PARAM) from None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in params.choice or []))
    text = params.grammar or ""
    if "::=" in text:  # GBNF (llama.cpp's EBNF dialect); Lark uses ':'
        try:
            text = gbnf_to_lark(text)
        except (GbnfToLarkError, ValueError) as e:
            raise ParamError(f"invalid GBNF grammar: {e}", _PARAM) from None
    return LLMatcher.grammar_from_lark(text)


def check_structured_outputs(params: StructuredOutputsParams) -> str:
    """Compile the grammar once; returns it, or raises ParamError naming the problem."""
    from llguidance import LLMatcher

    grammar = grammar_of(params)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ParamError(f"invalid {params.kind} for structured outputs: {messages[0]}", _PARAM)
    return grammar
