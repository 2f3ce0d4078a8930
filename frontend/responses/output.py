"""The answer to a Responses request: output items, whole or as OpenAI's stream of events.

The choice's text goes through the chat path's parser (frontend/tools.py: reasoning, content,
tool calls) and becomes items, in the order the model wrote them:

    reasoning      {id, summary: [], content: [{type: reasoning_text, text}]}
    message        {id, role: assistant, content: [{type: output_text, text}]}
    function_call  {id, call_id, name, arguments}
    local_shell_call / custom_tool_call: a call of such a tool (client_tools.py)

Each item streams as

    response.output_item.added
      reasoning:     response.content_part.added, response.reasoning_text.delta ...,
                     response.reasoning_text.done, response.content_part.done
      message:       response.content_part.added, response.output_text.delta ...,
                     response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ...,
                     response.function_call_arguments.done
      custom_tool_call: response.custom_tool_call_input.delta (as written where the tool
                     was forced, else once the call's input is whole),
                     response.custom_tool_call_input.done
      local_shell_call: nothing between added and done
    response.output_item.done

between response.created, response.in_progress and response.completed (or
response.incomplete when max_output_tokens cut it), every event with its sequence_number.
Content that is only whitespace opens no message (the newline between a model's tool calls);
an answer with no item at all is one message, empty or not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zllm.errors import RequestError
from zllm.frontend.openai.protocol import ToolCallDelta
from zllm.frontend.replies import check_failed
from zllm.frontend.responses.client_tools import ClientTool, custom_input, shell_action
from zllm.frontend.tools import ChoiceParser, Piece
from zllm.protocol import FinishReason, RequestOutputDelta

Event = tuple[str, dict[str, Any]]  # (type, body without type and sequence_number)

_encoder = msgspec.json.Encoder()


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class OutputItem:
    kind: str  # "reasoning", "message" or "function_call"
    id: str
    text: str = ""  # the reasoning, the message's text, or the call's arguments (JSON)
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a namespaced function's call: `name` is its own name
    status: str = "in_progress"
    summarized: bool = False  # a reasoning item whose summary is its text (reasoning.summary)
    encrypted_content: str | None = None  # a reasoning item's text sealed (include)
    client: ClientTool | None = None  # a call of local_shell or a custom tool
    raw: bool = False  # a custom tool's call whose text is its input (tool_choice forced it)

    def shown(self) -> dict[str, Any]:
        """The item as OpenAI shows it (ResponseReasoningItem, ResponseOutputMessage,
        ResponseFunctionToolCall)."""
        done = self.status != "in_progress"
        if self.client is not None:
            return self._client_call()
        if self.kind == "function_call":
            shown = {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
                "status": self.status,
            }
            if self.namespace is not None:
                shown["namespace"] = self.namespace
            return shown
        if self.kind == "reasoning":
            content = [_reasoning_part(self.text)] if done else []
            summary = (
                [{"type": "summary_text", "text": self.text}] if done and self.summarized else []
            )
            shown = {
                "type": "reasoning",
                "id": self.id,
                "summary": summary,
                "content": content,
                "status": self.status,
            }
            if self.encrypted_content is not None:
                shown["encrypted_content"] = self.encrypted_content
            return shown
        return {
            "type": "message",
            "id": self.id,
            "role": "assistant",
            "status": self.status,
            "content": [_text_part(self.text)] if done else [],
        }

    def _client_call(self) -> dict[str, Any]:
        """A local_shell_call (LocalShellCall) or a custom_tool_call (ResponseCustomToolCall)."""
        assert self.client is not None
        if self.client.kind == "local_shell":
            action, _ = shell_action(self.text)
            return {
                "type": "local_shell_call",
                "id": self.id,
                "call_id": self.call_id,
                "action": action,
                "status": self.status,
            }
        shown = {
            "type": "custom_tool_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "input": self.input,
        }
        if self.namespace is not None:
            shown["namespace"] = self.namespace
        return shown

    @property
    def input(self) -> str:
        """A custom tool call's input so far (whole once the item is done)."""
        if self.raw:
            return self.text
        return custom_input(self.text, raw=False) if self.status != "in_progress" else ""


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass
class ResponseAssembler:
    """The outputs of one Responses request as a Response object, whole or as events.
    `echo` holds the request's settings the Response object repeats (tools, text, ...)."""

    response_id: str
    model: str
    echo: dict[str, Any]
    parser: ChoiceParser | None
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[OutputItem] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    status: str = "in_progress"
    # A namespaced function's qualified name -> (namespace, name) (input.namespaced_functions).
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    # local_shell and custom tools by function name (input.client_tools); `forced`: the custom
    # tool tool_choice named, whose calls' text is the raw input.
    client_tools: dict[str, ClientTool] = field(default_factory=dict)
    forced: str | None = None
    summarize: bool = False  # reasoning items carry their text as their summary too
    seal: Callable[[str], str] | None = None  # reasoning items carry their text sealed
    _open: OutputItem | None = None
    _space: str = ""  # whitespace content held back until text follows it
    _sequence: int = 0

    # -- non-streaming ---------------------------------------------------------------------
    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        for _ in self._events(delta):
            pass

    def response(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": [item.shown() for item in self.items] if done else [],
            **self.echo,
            "store": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if self.status == "incomplete" else None
            ),
            # Left out until the end: OpenAI's schema has usage an object, never null.
            **({"usage": self._usage()} if done else {}),
        }

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            # cache_write_tokens: OpenAI's count of prompt tokens written at a price; the
            # prefix cache here stores blocks as a side effect, at no cost, so 0.
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    # -- streaming -------------------------------------------------------------------------
    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutputDelta]]
    ) -> AsyncIterator[bytes]:
        started = False
        async for _, delta in outputs:
            if not started:  # after the first output: errors before it are a 4xx/5xx
                started = True
                yield self._sse("response.created", {"response": self.response()})
                yield self._sse("response.in_progress", {"response": self.response()})
            for kind, body in self._events(delta):
                yield self._sse(kind, body)

    def error_event(self, error: RequestError) -> bytes:
        """The last event of a stream that failed after it started."""
        body = {"code": str(error.code or error.status), "message": error.message}
        return self._sse("error", body | {"param": error.param})

    def _sse(self, kind: str, body: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **body}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"

    # -- both --------------------------------------------------------------------------------
    def _events(self, delta: RequestOutputDelta) -> Iterator[Event]:
        """Update the items with this delta; yield the events it makes."""
        check_failed(delta)
        self.input_tokens = max(self.input_tokens, delta.num_prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.output_tokens += len(delta.token_ids)
        piece = self._piece(delta)
        if piece.reasoning:
            yield from self._text("reasoning", piece.reasoning)
        if piece.content:
            yield from self._content(piece.content)
        for call in piece.tool_calls:
            yield from self._call(call)
        if delta.finish_reason is None:
            return
        cut = delta.finish_reason == FinishReason.LENGTH
        if not self.items:  # nothing came out, or only whitespace: one message all the same
            yield from self._open_item(OutputItem("message", _new_id("msg_")))
            yield from self._add_text(self._space)
        yield from self._close("incomplete" if cut and self._cut_short() else "completed")
        self.status = "incomplete" if cut else "completed"
        final = "response.incomplete" if cut else "response.completed"
        yield final, {"response": self.response()}

    def _cut_short(self) -> bool:
        """Whether max_output_tokens cut the open item: any text, a call whose arguments
        are not whole JSON yet (`required` sends each call whole, before the cut)."""
        item = self._open
        if item is None or item.kind != "function_call":
            return True
        try:
            json.loads(item.text)
        except ValueError:
            return True
        return False

    def _piece(self, delta: RequestOutputDelta) -> Piece:
        """What this delta adds (through the chat path's parser, if the request has one);
        its tokens count as reasoning when the parser is in the reasoning before or after."""
        if self.parser is None:
            return Piece(content=delta.text)
        reasoning = self.parser.reasoning
        thinking = reasoning is not None and reasoning.in_reasoning
        piece = self.parser.feed(delta.text)
        thinking = thinking or (reasoning is not None and reasoning.in_reasoning)
        if delta.finish_reason is not None:
            rest = self.parser.finish()
            piece.reasoning += rest.reasoning
            piece.content += rest.content
            piece.tool_calls += rest.tool_calls
        if thinking:
            self.reasoning_tokens += len(delta.token_ids)
        return piece

    def _content(self, text: str) -> Iterator[Event]:
        if self._open is None or self._open.kind != "message":
            if not (self._space + text).strip():
                self._space += text
                return
            text, self._space = self._space + text, ""
        yield from self._text("message", text)

    def _text(self, kind: str, text: str) -> Iterator[Event]:
        if self._open is None or self._open.kind != kind:
            yield from self._close("completed")
            yield from self._open_item(
                OutputItem(kind, _new_id("rs_" if kind == "reasoning" else "msg_"))
            )
        yield from self._add_text(text)

    def _call(self, call: ToolCallDelta) -> Iterator[Event]:
        if call.id is not None:  # a new call: its own item
            yield from self._close("completed")
            name = call.function.name if call.function else None
            client = self.client_tools.get(name or "")
            namespace, name = self.namespaces.get(name or "", (None, name))
            prefix = {None: "fc_", "local_shell": "lsh_", "custom": "ctc_"}
            item = OutputItem(
                "function_call",
                _new_id(prefix[client.kind if client else None]),
                call_id=call.id,
                name=name,
            )
            item.namespace = namespace
            item.client = client
            item.raw = client is not None and client.name == self.forced
            yield from self._open_item(item)
        arguments = call.function.arguments if call.function else None
        if arguments and self._open is not None:
            yield from self._add_text(arguments)

    def _open_item(self, item: OutputItem) -> Iterator[Event]:
        self.items.append(item)
        self._open = item
        yield "response.output_item.added", {"output_index": self._index, "item": item.shown()}
        if item.kind == "message":
            yield "response.content_part.added", self._where() | {"part": _text_part("")}
        elif item.kind == "reasoning":
            yield "response.content_part.added", self._where() | {"part": _reasoning_part("")}

    def _add_text(self, text: str) -> Iterator[Event]:
        item = self._open
        assert item is not None
        item.text += text
        if item.client is not None:
            if item.raw:  # a forced custom tool: its input as it is written
                where = {"item_id": item.id, "output_index": self._index}
                yield "response.custom_tool_call_input.delta", where | {"delta": text}
        elif item.kind == "function_call":
            where = {"item_id": item.id, "output_index": self._index}
            yield "response.function_call_arguments.delta", where | {"delta": text}
        elif item.kind == "message":
            yield "response.output_text.delta", self._where() | {"delta": text, "logprobs": []}
        else:
            yield "response.reasoning_text.delta", self._where() | {"delta": text}

    def _close(self, status: str) -> Iterator[Event]:
        item = self._open
        if item is None:
            return
        self._open = None
        item.status = status
        if item.client is not None:
            yield from self._close_client_call(item)
        elif item.kind == "function_call":
            where = {"item_id": item.id, "output_index": self._index}
            done = {"name": item.name, "arguments": item.text}  # the name: OpenAI's schema
            yield "response.function_call_arguments.done", where | done
        elif item.kind == "message":
            where = self._where(item)
            yield "response.output_text.done", where | {"text": item.text, "logprobs": []}
            yield "response.content_part.done", where | {"part": _text_part(item.text)}
        else:
            where = self._where(item)
            yield "response.reasoning_text.done", where | {"text": item.text}
            yield "response.content_part.done", where | {"part": _reasoning_part(item.text)}
            item.summarized = self.summarize
            if self.summarize:  # the summary whole, as its events (one part: the text)
                at = {"item_id": item.id, "output_index": self._index, "summary_index": 0}
                part = {"type": "summary_text", "text": item.text}
                yield "response.reasoning_summary_part.added", at | {"part": part | {"text": ""}}
                yield "response.reasoning_summary_text.delta", at | {"delta": item.text}
                yield "response.reasoning_summary_text.done", at | {"text": item.text}
                yield "response.reasoning_summary_part.done", at | {"part": part}
            if self.seal is not None:
                item.encrypted_content = self.seal(item.text)
        yield "response.output_item.done", {"output_index": self._index, "item": item.shown()}

    def _close_client_call(self, item: OutputItem) -> Iterator[Event]:
        """A custom tool's input whole (at once, unless it streamed as written); a shell
        call whose arguments are not a whole command is incomplete."""
        where = {"item_id": item.id, "output_index": self._index}
        if item.client is not None and item.client.kind == "custom":
            if not item.raw:
                yield "response.custom_tool_call_input.delta", where | {"delta": item.input}
            yield "response.custom_tool_call_input.done", where | {"input": item.input}
        elif not shell_action(item.text)[1]:
            item.status = "incomplete"

    @property
    def _index(self) -> int:
        """The output_index of the newest item (the open one)."""
        return len(self.items) - 1

    def _where(self, item: OutputItem | None = None) -> dict[str, Any]:
        item = item or self._open
        assert item is not None
        return {"item_id": item.id, "output_index": self._index, "content_index": 0}


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex
