"""`chat_template_kwargs`: extra variables a chat template reads (vLLM's request field), such
as Qwen 3's `enable_thinking`.

    the server's --default-chat-template-kwargs
      └─ overridden key by key by the request's chat_template_kwargs
           └─ rendered beside messages, tools, add_generation_prompt, bos/eos_token

Names the server passes to the template itself (RESERVED) are refused, not overridden: a
request that set `messages` or `add_generation_prompt` this way would change the prompt
behind the fields that say what it is (vLLM lets them through; a 400 is clearer).

`documents` (vLLM's chat field, for RAG templates) is a template variable like any other:
the request's own `documents` field sets it, and a request giving both that field and
chat_template_kwargs.documents is refused (which one it meant is not knowable); the server's
default documents, if any, are overridden by either.

Turning thinking off (`enable_thinking: false`, Qwen 3's name; `thinking: false`, DeepSeek
V3.1's) also turns the reasoning parser off for that request: the template then closes an
empty think block in the prompt, or opens none, so everything the model writes is content.
Not harmony's (gpt-oss, zllm/text/tool_parsers/harmony.py): its template has no such
switch, and its channels are never plain content. No torch here.
"""

from __future__ import annotations

from typing import Any

from zllm.errors import ParamError
from zllm.text.tool_parsers.harmony import REASONING_PARSER_NAME

# What zllm/text/tokenizer.py renders every template with, and what HF's apply_chat_template
# takes as its own arguments.
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "chat_template",
        "tokenize",
        "raise_exception",
        "strftime_now",
    }
)

# The switches templates read to turn thinking off, by the names their models use.
THINKING_SWITCHES = ("enable_thinking", "thinking")


def check_template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs") -> None:
    """A ParamError naming the first reserved key (`param.key`)."""
    for key in kwargs:
        if key in RESERVED:
            raise ParamError(
                f"{param} may not set {key!r}: the server passes it to the chat template "
                "itself (use the request field of that name where there is one).",
                param=f"{param}.{key}",
            )


def merge_template_kwargs(
    defaults: dict[str, Any] | None, given: dict[str, Any] | None
) -> dict[str, Any]:
    """The request's kwargs over the server's defaults (both checked)."""
    check_template_kwargs(given or {})
    return {**(defaults or {}), **(given or {})}


def with_fields(
    kwargs: dict[str, Any], given: dict[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    """`kwargs` (merged) with the request's fields that are template variables, as vLLM
    passes them (`documents` for RAG templates, `reasoning_effort` for gpt-oss-style ones;
    None: not given); `given`: the request's own chat_template_kwargs, which may not name
    one of them too (which was meant is unknowable)."""
    out = dict(kwargs)
    for name, value in fields.items():
        if value is None:
            continue
        if given and name in given:
            raise ParamError(
                f"Give {name} either as the {name} field or in chat_template_kwargs, not both.",
                param=name,
            )
        out[name] = value
    return out


def thinking_disabled(kwargs: dict[str, Any]) -> bool:
    """Whether the kwargs switch the model's thinking off (explicitly False, not falsy)."""
    return any(kwargs.get(name) is False for name in THINKING_SWITCHES)


def reasoning_parser_for(server_parser: str | None, kwargs: dict[str, Any]) -> str | None:
    """The reasoning parser one request's answer goes through: none with thinking off."""
    if server_parser == REASONING_PARSER_NAME:
        return server_parser
    return None if thinking_disabled(kwargs) else server_parser
