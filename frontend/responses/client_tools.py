"""The Responses API's tools that the client runs but that are not functions: `local_shell`
(the model asks the client to run a command) and `custom` (a freeform tool: its input is any
text, or text a grammar allows). The model sees each as a function, so every chat template
and tool-call parser serves them; the call comes back in the API's own item shape.

    tool                                 offered to the model as             call comes back as
    {type: local_shell}                  function local_shell(command[],     local_shell_call
                                           timeout_ms, working_directory,      {call_id, action:
                                           env, user)                          {type: exec, ...}}
    {type: custom, name, format: text}   function NAME(input: string)        custom_tool_call
    {type: custom, name, format:         the same; input's string carries      {call_id, name,
      {type: grammar, syntax: regex}}      the regex as its JSON pattern       input}
    {type: custom, name, format:         the same; the grammar is in the
      {type: grammar, syntax: lark}}       description, and enforced when
                                           tool_choice names the tool (the
                                           whole answer is then the input)

Under `auto` or `required` a lark grammar cannot be enforced: the call is JSON in the chat
template's format, and its input a JSON string inside it. When `tool_choice` names the tool,
the answer is nothing but the input, and the grammar constrains it (`forced_grammar`).

Their calls come back to the server as input items: `local_shell_call` and `custom_tool_call`
(the model's own call), `local_shell_call_output` and `custom_tool_call_output` (its result;
Codex sends a `function_call_output` for a shell call, also read).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from zllm.errors import RequestError
from zllm.frontend.openai.protocol import FunctionDefinition, Tool
from zllm.sampling_params import StructuredOutputsParams

LOCAL_SHELL = "local_shell"

_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "description": 'The command and its arguments, e.g. ["ls", "-la"].',
        },
        "timeout_ms": {"type": "integer", "description": "Stop the command after this long."},
        "working_directory": {"type": "string", "description": "Run it in this directory."},
        "env": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Environment variables to set.",
        },
        "user": {"type": "string", "description": "Run it as this user."},
    },
    "required": ["command"],
    "additionalProperties": False,
}
_SHELL_ABOUT = "Run a shell command on the user's machine and get its output."


class CustomFormat(msgspec.Struct, kw_only=True):
    """A custom tool's input: any text, or text a grammar allows."""

    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


@dataclass(frozen=True, slots=True)
class ClientTool:
    """One such tool, by the function name the model calls it with."""

    kind: Literal["local_shell", "custom"]
    name: str
    format: CustomFormat | None = None


def local_shell_function() -> Tool:
    return Tool(
        function=FunctionDefinition(
            name=LOCAL_SHELL, description=_SHELL_ABOUT, parameters=_SHELL_PARAMETERS
        )
    )


def custom_function(
    name: str | None, description: str | None, fmt: CustomFormat | None, where: str
) -> Tool:
    """A custom tool as a function of one string, `input`."""
    if not name:
        raise RequestError("a custom tool needs a name.", param=f"{where}.name")
    fmt = fmt or CustomFormat()
    text: dict[str, Any] = {"type": "string", "description": "The tool's input, as free text."}
    about = description or ""
    if fmt.type == "grammar":
        if fmt.syntax is None or not fmt.definition:
            raise RequestError(
                "a custom tool's grammar format needs a syntax (lark or regex) and a definition.",
                param=f"{where}.format",
            )
        if fmt.syntax == "regex":  # anchored: a JSON schema's pattern may match anywhere
            text["pattern"] = f"^(?:{fmt.definition})$"
        text["description"] = f"The tool's input, matching this {fmt.syntax} grammar."
        about = f"{about}\nInput grammar ({fmt.syntax}):\n{fmt.definition}".strip()
    parameters = {
        "type": "object",
        "properties": {"input": text},
        "required": ["input"],
        "additionalProperties": False,
    }
    definition = FunctionDefinition(name=name, description=about or None, parameters=parameters)
    return Tool(function=definition)


def forced_grammar(tool: ClientTool, where: str) -> StructuredOutputsParams | None:
    """When tool_choice names a custom tool, the answer is its raw input: constrained by its
    grammar, or free text (None: no constraint at all). A grammar llguidance cannot compile
    is a 400 naming the tool's definition (`where`: the tool's place in the request)."""
    from zllm.errors import ParamError
    from zllm.text.structured_outputs import check_structured_outputs

    fmt = tool.format
    if fmt is None or fmt.type != "grammar" or fmt.definition is None:
        return None
    if fmt.syntax == "regex":
        structured = StructuredOutputsParams(regex=fmt.definition)
    else:
        structured = StructuredOutputsParams(grammar=fmt.definition)
    try:
        check_structured_outputs(structured)
    except ParamError as e:
        raise RequestError(str(e), param=f"{where}.format.definition") from None
    return structured


# ---- the model's call, as the API's item ---------------------------------------------------


def shell_action(arguments: str) -> tuple[dict[str, Any], bool]:
    """A local_shell call's action from the function call's arguments, and whether they were
    whole (a call cut by max_output_tokens is not). A command given as one string (a model's
    habit) runs through `bash -lc`."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
        whole = isinstance(args, dict)
    except ValueError:
        args, whole = {}, False
    if not isinstance(args, dict):
        args = {}
    command = args.get("command", [])
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    elif not isinstance(command, list):
        command = []
    action = {
        "type": "exec",
        "command": [str(part) for part in command],
        "timeout_ms": args.get("timeout_ms"),
        "working_directory": args.get("working_directory"),
        "env": args.get("env") or {},
        "user": args.get("user"),
    }
    return action, whole and bool(action["command"])


def custom_input(arguments: str, raw: bool) -> str:
    """A custom tool call's input: the whole answer where tool_choice forced the tool (`raw`),
    else the `input` string of the function call's arguments (or the arguments as written,
    if the model wrote something else)."""
    if raw:
        return arguments
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get("input"), str):
        return args["input"]
    return arguments


# ---- the calls and their results sent back -------------------------------------------------


def shell_call_arguments(action: dict[str, Any]) -> str:
    """A local_shell_call item's action as the function call's arguments."""
    command = action.get("command") or []
    if isinstance(command, str):
        command = shlex.split(command)
    args = {"command": command}
    for key in ("timeout_ms", "working_directory", "env", "user"):
        if action.get(key):
            args[key] = action[key]
    return json.dumps(args, ensure_ascii=False)


def custom_call_arguments(text: str) -> str:
    return json.dumps({"input": text}, ensure_ascii=False)
