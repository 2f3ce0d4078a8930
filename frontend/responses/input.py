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
    input item reasoning (encrypted_content,       the next assistant turn's reasoning_content
      or its reasoning_text content)                 (the chat template decides what it shows)
    tools: {type: function, name, parameters}      tools: {type: function, function: {...}}
    tools the server cannot run (web_search, ...)  left out, with a warning in the log
    tools: {type: namespace, name: NS, tools:      each function as "NS__NAME" (qualified_name);
      [functions]} (Codex CLI's MCP servers,         the model's call comes back as a
      its agents)                                    function_call with namespace NS, name NAME
    input item function_call with namespace NS     a tool call of "NS__NAME"
    tools: {type: local_shell}, {type: custom}     functions the model calls; the calls come
      and their call and output items                back in the API's shapes
                                                     (frontend/responses/client_tools.py)
    tool_choice: none/auto/required,               tool_choice: the same, or
      {type: function, name}                         {type: function, function: {name}}
    text.format: text/json_object/json_schema      response_format

Anything else (other tool, item or content types) is a 400 naming where it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
from zllm.frontend.responses.client_tools import (
    LOCAL_SHELL,
    ClientTool,
    CustomFormat,
    custom_call_arguments,
    custom_function,
    local_shell_function,
    shell_call_arguments,
)

logger = logging.getLogger(__name__)

# ---- request parts -------------------------------------------------------------------------


class FunctionTool(msgspec.Struct, kw_only=True):
    """A Responses tool: a function is flat (name and parameters beside `type`); a namespace
    holds functions (`tools`); `local_shell` and `custom` (its `format`) are the client's
    too; the tools OpenAI's servers run are left out; any other type is a 400."""

    type: str
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's
    defer_loading: bool | None = None  # a namespace member's hint: offered all the same
    format: CustomFormat | None = None  # a custom tool's


# A namespaced function's name as the model sees it (Codex's own flat spelling).
NAMESPACE_SEPARATOR = "__"


def qualified_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def namespaced_functions(tools: list[FunctionTool] | None) -> dict[str, tuple[str, str]]:
    """Each namespaced function's qualified name -> (namespace, name): how the model's call
    of it goes back to the client."""
    return {
        qualified_name(tool.name, member.name): (tool.name, member.name)
        for tool in tools or []
        if tool.type == "namespace" and tool.name
        for member in tool.tools or []
        if member.name
    }


def client_tools(tools: list[FunctionTool] | None) -> dict[str, ClientTool]:
    """The local_shell and custom tools, by the function name the model calls them with."""
    found: dict[str, ClientTool] = {}
    for tool in tools or []:
        if tool.type == LOCAL_SHELL:
            found[LOCAL_SHELL] = ClientTool("local_shell", LOCAL_SHELL)
        elif tool.type == "custom" and tool.name:
            found[tool.name] = ClientTool("custom", tool.name, tool.format)
    return found


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
    field does); `summary` (or the older `generate_summary`) also puts the text in the item's
    summary: the model's own reasoning is the summary here, whichever length is asked."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


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
    namespace: str | None = None  # a namespaced function's call, as the output gave it


class ReasoningItem(msgspec.Struct, kw_only=True):
    content: list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[ContentPart]


class ShellCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    action: dict[str, Any]


class ShellCallOutputItem(msgspec.Struct, kw_only=True):
    """A local shell call's result: OpenAI's schema names the call by `id`, its guide by
    `call_id`; either is read."""

    output: str
    call_id: str | None = None
    id: str | None = None


class CustomCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    input: str
    namespace: str | None = None


_Item = TypeVar(
    "_Item",
    MessageItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
    ShellCallItem,
    ShellCallOutputItem,
    CustomCallItem,
)

INPUT_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "local_shell_call",
    "local_shell_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
)
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# Tools OpenAI's servers run for the model; a self-hosted server runs none of them (an mcp
# tool's server included: nothing beyond loopback is reached).
HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use",
    "computer_use_preview",
    "image_generation",
    "mcp",
)


def chat_turns(
    input: str | list[dict[str, Any]],
    instructions: str | None,
    open_sealed: Callable[[str, str], str] | None = None,
) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first, then each input item.
    `open_sealed(encrypted_content, param)`: a reasoning item's sealed text
    (frontend/responses/reasoning_carrier.py)."""
    turns: list[ChatMessage] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede
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
            message = ChatMessage(role=role, content=_content(item.content, f"{where}.content"))
            if role == "assistant" and reasoning:
                message.reasoning_content, reasoning = "\n".join(reasoning), []
            turns.append(message)
        elif kind in ("function_call", "local_shell_call", "custom_tool_call"):
            tool_call = _tool_call(raw, kind, where)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant" and not reasoning:
                last.tool_calls = [*(last.tool_calls or []), tool_call]
            else:
                message = ChatMessage(role="assistant", content="", tool_calls=[tool_call])
                if reasoning:
                    message.reasoning_content, reasoning = "\n".join(reasoning), []
                turns.append(message)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            result = _convert(raw, FunctionCallOutputItem, where)
            content = _text(result.output, f"{where}.output")
            turns.append(ChatMessage(role="tool", content=content, tool_call_id=result.call_id))
        elif kind == "local_shell_call_output":
            shell = _convert(raw, ShellCallOutputItem, where)
            call_id = shell.call_id or shell.id
            if call_id is None:
                raise RequestError(
                    "a local_shell_call_output needs the call's call_id (or id).", param=where
                )
            turns.append(ChatMessage(role="tool", content=shell.output, tool_call_id=call_id))
        elif kind == "reasoning":
            text = _reasoning_text(_convert(raw, ReasoningItem, where), where, open_sealed)
            if text:
                reasoning.append(text)
        else:
            raise RequestError(
                f"input items of type {kind!r} are not supported; zllm accepts "
                f"{', '.join(INPUT_ITEM_TYPES)}.",
                param=f"{where}.type",
            )
    if not turns:
        raise RequestError("input holds no message or function call.", param="input")
    return turns


def _tool_call(raw: dict[str, Any], kind: str, where: str) -> ToolCallMessage:
    """A call item (the model's own, sent back) as the function call the model made."""
    if kind == "local_shell_call":
        shell = _convert(raw, ShellCallItem, where)
        name, call_id, arguments = LOCAL_SHELL, shell.call_id, shell_call_arguments(shell.action)
    elif kind == "custom_tool_call":
        custom = _convert(raw, CustomCallItem, where)
        name, call_id = custom.name, custom.call_id
        if custom.namespace is not None:
            name = qualified_name(custom.namespace, custom.name)
        arguments = custom_call_arguments(custom.input)
    else:
        call = _convert(raw, FunctionCallItem, where)
        name, call_id, arguments = call.name, call.call_id, call.arguments
        if call.namespace is not None:
            name = qualified_name(call.namespace, call.name)
    return ToolCallMessage(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def _reasoning_text(
    item: ReasoningItem, where: str, open_sealed: Callable[[str, str], str] | None
) -> str:
    """A reasoning item's text: sealed (encrypted_content, read back), or its content, or
    its summary, as the client kept it."""
    if item.encrypted_content is not None:
        if open_sealed is None:
            raise RequestError(
                f"{where}.encrypted_content: this server seals no reasoning.",
                param=f"{where}.encrypted_content",
            )
        return open_sealed(item.encrypted_content, f"{where}.encrypted_content")
    parts = item.content or item.summary or []
    return "\n".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(parts))


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
    """Function tools in chat's nested shape; tools the server cannot run are left out with
    a warning; any other tool type is a 400."""
    result = []
    hosted = [tool.type for tool in tools or [] if tool.type in HOSTED_TOOLS]
    if hosted:
        logger.warning("Leaving out tools this server cannot run: %s", ", ".join(hosted))
    for i, tool in enumerate(tools or []):
        if tool.type in HOSTED_TOOLS:
            continue
        if tool.type == "namespace":
            result += _namespace_functions(tool, f"tools[{i}]")
        elif tool.type == LOCAL_SHELL:
            result.append(local_shell_function())
        elif tool.type == "custom":
            result.append(custom_function(tool.name, tool.description, tool.format, f"tools[{i}]"))
        else:
            result.append(_function(tool, f"tools[{i}]"))
    return result or None


def _namespace_functions(tool: FunctionTool, where: str) -> list[Tool]:
    """A namespace's functions under their qualified names (the namespace's description
    before each one's own)."""
    if not tool.name:
        raise RequestError("a namespace tool needs a name.", param=f"{where}.name")
    return [
        _function(member, f"{where}.tools[{j}]", tool.name, tool.description)
        for j, member in enumerate(tool.tools or [])
    ]


def _function(
    tool: FunctionTool, where: str, namespace: str | None = None, about: str | None = None
) -> Tool:
    """A function tool (a namespace's member: its qualified name, the namespace's
    description `about` before its own); any other type is a 400 naming it."""
    if tool.type != "function":
        raise RequestError(
            f"tools of type {tool.type!r} are not supported; zllm runs no built-in "
            "tools, only tools the client runs: function (and namespaces of them), custom, "
            "local_shell.",
            param=f"{where}.type",
        )
    if tool.name is None:
        raise RequestError("a function tool needs a name.", param=f"{where}.name")
    definition = FunctionDefinition(
        name=tool.name if namespace is None else qualified_name(namespace, tool.name),
        description=" ".join(d for d in (about, tool.description) if d) or None,
        parameters=tool.parameters,
        strict=tool.strict,
    )
    return Tool(function=definition)


def chat_tool_choice(
    choice: str | FunctionToolChoice | None,
) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type == LOCAL_SHELL:
        return NamedToolChoice(function=NamedFunction(name=LOCAL_SHELL))
    if choice.type not in ("function", "custom"):
        raise RequestError(
            f"tool_choice of type {choice.type!r} is not supported; use none, auto, required, "
            '{"type": "function" or "custom", "name": ...} or {"type": "local_shell"}.',
            param="tool_choice.type",
        )
    if not choice.name:
        raise RequestError(
            f"tool_choice of type {choice.type} needs a name.", param="tool_choice.name"
        )
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
