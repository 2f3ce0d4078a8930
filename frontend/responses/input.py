"""What a Responses request asks, in the chat request's terms (frontend/responses/api.py
builds that request; frontend/tools.py and the structured-output path then serve it as they
serve chat):

    Responses                                      chat
    input item message (user/assistant/system/     a message (developer -> system; text
      developer; input_text/output_text parts)       parts joined)
    input item function_call (call_id, name,       the assistant turn's tool_calls (calls in
      arguments)                                     a row, and the message before them, are
                                                     one assistant turn)
    input item function_call_output (call_id,      a `tool` message answering that call
      output)
    input item reasoning                           dropped: earlier turns' thinking is not
                                                     sent back to the model (as on /v1/messages)
    tools: {type: function, name, parameters}      tools: {type: function, function: {...}}
    tool_choice: none/auto/required,               tool_choice: the same, or
      {type: function, name}                         {type: function, function: {name}}
    text.format: text/json_object/json_schema      response_format

Anything else (built-in tools, other item or content types) is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from zllm.errors import RequestError
from zllm.frontend.openai.protocol import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    SourcedImagePart,
    Tool,
    ToolCallMessage,
    error_param,
)
from zllm.frontend.openai.protocol import ContentPart as ChatContentPart

# ---- request parts -------------------------------------------------------------------------


class FunctionTool(msgspec.Struct, kw_only=True):
    """A Responses tool: a function is flat (name and parameters beside `type`); any other
    type (web_search, file_search, ...) is one zllm does not run: a 400."""

    type: str
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced either way, as chat's is


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # a 400: zllm cannot tune a model's length of answer


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """Reasoning comes from the server's --reasoning-parser as reasoning items carrying the
    model's own text. `effort` reaches the chat template as `reasoning_effort` (as chat's
    field does); zllm cannot summarize: `summary` is a 400."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


# ---- input items ---------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None  # an earlier assistant turn's refusal part
    image_url: str | None = None  # input_image: a data: or http(s) URL
    file_id: str | None = None  # input_image from an uploaded file: zllm keeps no files
    detail: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[ContentPart]


_Item = TypeVar("_Item", MessageItem, FunctionCallItem, FunctionCallOutputItem)

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_turns(input: str | list[dict[str, Any]], instructions: str | None) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first, then each input item."""
    turns: list[ChatMessage] = []
    if instructions:
        turns.append(ChatMessage(role="system", content=instructions))
    if isinstance(input, str):
        turns.append(ChatMessage(role="user", content=input))
        return turns
    for i, raw in enumerate(input):
        kind = raw.get("type", "message")  # a message may leave its type out
        where = f"input[{i}]"
        if kind == "message":
            item = _convert(raw, MessageItem, where)
            role = "system" if item.role == "developer" else item.role
            turns.append(ChatMessage(role=role, content=_content(item.content, f"{where}.content")))
        elif kind == "function_call":
            call = _convert(raw, FunctionCallItem, where)
            tool_call = ToolCallMessage(
                id=call.call_id, function=FunctionCall(name=call.name, arguments=call.arguments)
            )
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), tool_call]
            else:
                turns.append(ChatMessage(role="assistant", content="", tool_calls=[tool_call]))
        elif kind == "function_call_output":
            result = _convert(raw, FunctionCallOutputItem, where)
            content = _text(result.output, f"{where}.output")
            turns.append(ChatMessage(role="tool", content=content, tool_call_id=result.call_id))
        elif kind != "reasoning":
            raise RequestError(
                f"input items of type {kind!r} are not supported; zllm accepts "
                f"{', '.join(INPUT_ITEM_TYPES)}.",
                param=f"{where}.type",
            )
    if not turns:
        raise RequestError("input holds no message or function call.", param="input")
    return turns


def _convert(raw: dict[str, Any], cls: type[_Item], where: str) -> _Item:
    try:
        return msgspec.convert(raw, type=cls)
    except msgspec.ValidationError as e:
        path = error_param(str(e))
        param = where if path is None else f"{where}.{path}".replace(".[", "[")
        raise RequestError(f"Invalid {where}: {e}", param=param) from None


def _content(content: str | list[ContentPart], where: str) -> str | list[ChatContentPart]:
    """A message's content: its text, or with input_image parts the parts in order."""
    if isinstance(content, str) or all(part.type != "input_image" for part in content):
        return _text(content, where)
    parts: list[ChatContentPart] = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            if part.image_url is None:
                raise RequestError(
                    "an input_image needs an image_url (a data: or http(s) URL); zllm keeps "
                    "no uploaded files for file_id.",
                    param=f"{where}[{j}]",
                )
            url = ImageURL(url=part.image_url, detail=part.detail)
            parts.append(SourcedImagePart(type="image_url", image_url=url, where=f"{where}[{j}]"))
        else:
            parts.append(ChatContentPart(type="text", text=_part_text(part, f"{where}[{j}]")))
    return parts


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def _part_text(part: ContentPart, where: str) -> str:
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    if part.type in _TEXT_PARTS and part.text is not None:
        return part.text
    raise RequestError(
        f"content of type {part.type!r} is not supported here; zllm takes text parts, and "
        "input_image parts in messages.",
        param=where,
    )


# ---- tools, tool_choice, text.format -------------------------------------------------------


def chat_tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    """Function tools in chat's nested shape; any other tool type is a 400."""
    result = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise RequestError(
                f"tools of type {tool.type!r} are not supported; zllm runs no built-in "
                "tools, only functions the client runs (type function).",
                param=f"tools[{i}].type",
            )
        if tool.name is None:
            raise RequestError("a function tool needs a name.", param=f"tools[{i}].name")
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        result.append(Tool(function=definition))
    return result or None


def chat_tool_choice(
    choice: str | FunctionToolChoice | None,
) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise RequestError(
            f"tool_choice of type {choice.type!r} is not supported; use none, auto, required "
            'or {"type": "function", "name": ...}.',
            param="tool_choice.type",
        )
    if not choice.name:
        raise RequestError("tool_choice of type function needs a name.", param="tool_choice.name")
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def chat_response_format(text: TextConfig | None) -> ResponseFormat | None:
    """text.format as chat's response_format: enforced by the same grammar."""
    if text is None or text.format is None:
        return None
    fmt = text.format
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    if fmt.schema is None:
        raise RequestError(
            "text.format of type json_schema needs a schema.", param="text.format.schema"
        )
    schema = JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)
