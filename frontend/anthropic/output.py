"""The answer of one Anthropic Messages request (frontend/anthropic/api.py) as Anthropic
content blocks: whole (a `MessagesResponse`) or as the stream's events, from the engine's
output deltas through the request's `ChoiceParser` (reasoning, text, tool calls), thinking
blocks signed by `ThinkingSigner` (frontend/anthropic/thinking.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zllm.frontend.anthropic.thinking import ThinkingSigner
from zllm.frontend.replies import check_failed
from zllm.frontend.tools import ChoiceParser, ToolPlan
from zllm.protocol import FinishReason, RequestOutputDelta


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


_encoder = msgspec.json.Encoder()


def event(name: str, body: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"


@dataclass
class MessageAssembler:
    """The outputs of one Messages request as Anthropic content blocks, whole or as events."""

    response_id: str
    model: str
    parser: ChoiceParser | None
    blocks: list[dict[str, Any]] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    stop_reason: str | None = None
    stop_sequence: str | None = None
    _open: str | None = None  # "text", "thinking" or "tool_use": the block being streamed
    _tool_index: int | None = None  # the tool call the open tool_use block carries
    signer: ThinkingSigner | None = None  # signs each thinking block as it closes
    omit_thinking: bool = False  # thinking.display "omitted": blocks without their text

    @classmethod
    def of(
        cls,
        response_id: str,
        model: str,
        plan: ToolPlan,
        reasoning_parser: str | None,
        tool_parser: str | None,
    ) -> MessageAssembler:
        parser = ChoiceParser.of(plan, tool_parser, reasoning_parser)
        return cls(response_id, model, parser)

    def usage(self) -> Usage:
        return Usage(
            input_tokens=self.input_tokens - self.cached_tokens,
            output_tokens=self.output_tokens,
            cache_read_input_tokens=self.cached_tokens,
        )

    # -- non-streaming ---------------------------------------------------------------------
    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        for _ in self._events(delta):
            pass

    def response(self) -> MessagesResponse:
        return MessagesResponse(
            id=self.response_id,
            model=self.model,
            content=[_finished(b) for b in self.blocks],
            stop_reason=self.stop_reason,
            stop_sequence=self.stop_sequence,
            usage=self.usage(),
        )

    # -- streaming -------------------------------------------------------------------------
    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutputDelta]]
    ) -> AsyncIterator[bytes]:
        started = False
        async for _, delta in outputs:
            if not started:
                started = True
                self._count(delta)
                start = MessagesResponse(
                    id=self.response_id,
                    model=self.model,
                    content=[],
                    stop_reason=None,
                    usage=self.usage(),
                )
                yield event("message_start", {"type": "message_start", "message": start})
                yield event("ping", {"type": "ping"})
            for name, body in self._events(delta):
                yield event(name, body)

    # -- both --------------------------------------------------------------------------------
    def _count(self, delta: RequestOutputDelta) -> None:
        self.input_tokens = max(self.input_tokens, delta.num_prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)

    def _events(self, delta: RequestOutputDelta):
        """Update the blocks with this delta; yield the (event name, body) it makes."""
        check_failed(delta)
        self._count(delta)
        self.output_tokens += len(delta.token_ids)
        if self.parser is None:
            pieces = [("text", delta.text, None)]
        else:
            piece = self.parser.feed(delta.text)
            if delta.finish_reason is not None:
                rest = self.parser.finish()
                piece.reasoning += rest.reasoning
                piece.content += rest.content
                piece.tool_calls += rest.tool_calls
            pieces = [("thinking", piece.reasoning, None), ("text", piece.content, None)]
            pieces += [("tool_use", None, call) for call in piece.tool_calls]
        for kind, text, call in pieces:
            if kind == "tool_use":
                yield from self._tool_piece(call)
            elif text:
                yield from self._text_piece(kind, text)
        if delta.finish_reason is not None:
            yield from self._close()
            self._finish(delta)
            yield (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": {"output_tokens": self.output_tokens},
                },
            )
            yield "message_stop", {"type": "message_stop"}

    def _text_piece(self, kind: str, text: str):
        if kind == "thinking" and self.omit_thinking:
            if self._open != kind:  # the block opens and stays empty; its signature signs ""
                yield from self._close()
                yield from self._start(kind, {"type": "thinking", "thinking": "", "signature": ""})
            return
        if self._open != kind:
            yield from self._close()
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            yield from self._start(kind, block)
        key, delta_type = (
            ("text", "text_delta") if kind == "text" else ("thinking", "thinking_delta")
        )
        self.blocks[-1][key] += text
        yield (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": len(self.blocks) - 1,
                "delta": {"type": delta_type, key: text},
            },
        )

    def _tool_piece(self, call):
        if call.id is not None:  # a new call: its own block
            yield from self._close()
            self._tool_index = call.index
            block = {
                "type": "tool_use",
                "id": _tool_use_id(call.id),
                "name": call.function.name,
                "input": {},
                "_json": "",
            }
            yield from self._start("tool_use", block)
        arguments = call.function.arguments if call.function else ""
        if arguments:
            self.blocks[-1]["_json"] += arguments
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": len(self.blocks) - 1,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                },
            )

    def _start(self, kind: str, block: dict[str, Any]):
        self.blocks.append(block)
        self._open = kind
        shown = {k: v for k, v in block.items() if not k.startswith("_")}
        yield (
            "content_block_start",
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown},
        )

    def _close(self):
        if self._open == "thinking" and self.signer is not None:
            # Anthropic's order: the signature comes last, just before the block stops.
            block = self.blocks[-1]
            block["signature"] = self.signer.sign(block["thinking"])
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": len(self.blocks) - 1,
                    "delta": {"type": "signature_delta", "signature": block["signature"]},
                },
            )
        if self._open is not None:
            self._open = None
            yield (
                "content_block_stop",
                {"type": "content_block_stop", "index": len(self.blocks) - 1},
            )

    def _finish(self, delta: RequestOutputDelta) -> None:
        if delta.finish_reason == FinishReason.LENGTH:
            self.stop_reason = "max_tokens"
        elif isinstance(delta.stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", delta.stop_reason
        elif any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        else:
            self.stop_reason = "end_turn"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _finished(block: dict[str, Any]) -> dict[str, Any]:
    """A block as the whole response shows it: a tool_use's input parsed from its JSON."""
    if block["type"] != "tool_use":
        return block
    shown = {k: v for k, v in block.items() if not k.startswith("_")}
    try:
        shown["input"] = json.loads(block["_json"] or "{}")
    except ValueError:  # cut by max_tokens: the JSON never closed
        shown["input"] = {}
    return shown


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]
