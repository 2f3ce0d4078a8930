"""Structured outputs (guided decoding): what a request asks its answer to match, as a grammar.

A request carries `SamplingParams.structured_outputs` (`StructuredOutputsParams`, beside it in
zllm/sampling_params.py), vLLM's shape: exactly one of

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

from zllm.errors import ParamError
from zllm.sampling_params import StructuredOutputsParams

_PARAM = "structured_outputs"  # the request field errors name


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
