"""OpenAI's Responses API (`POST /v1/responses`), stateless: text or message input,
`instructions`, `max_output_tokens`, and the answer as one output message.

A Responses request becomes the chat request zllm serves (instructions as a system message,
input items as turns); the answer comes back as a Response object, or as its stream of
events:

    response.created, response.in_progress
    response.output_item.added, response.content_part.added
    response.output_text.delta ...
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

zllm keeps no conversation state: `previous_response_id`, and `store: true`, are 400s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from zllm.errors import RequestError
from zllm.frontend import options
from zllm.frontend.api_models import ChatCompletionRequest, ChatMessage
from zllm.frontend.generate import ApiCall, ApiContext, ChatPrompt, GenerationJob, RequestIds
from zllm.frontend.openai_format import chat_messages, chat_params
from zllm.frontend.responses import check_failed
from zllm.protocol import FinishReason, RequestOptions, RequestOutputDelta


class InputText(msgspec.Struct, kw_only=True):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    type: Literal["message"] = "message"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputMessage], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    # Stateless: no stored responses to continue from, none stored.
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # zllm's extra parameter, as on the other generation endpoints: set by `zllm proxy` for
    # prefill/decode disaggregation (zllm/proxy/app.py).
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # as on the other generation endpoints
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions


class ResponsesCall(ApiCall):
    id_prefix = "resp"

    def __init__(self, body: ResponsesRequest, ctx: ApiContext) -> None:
        check_stateless(body)
        chat = as_chat_request(body)
        self.body = body
        self.params = chat_params(chat, ctx.max_model_len, ctx.sampling_defaults)
        kwargs = options.template_kwargs(
            body.chat_template_kwargs, ctx.config.default_chat_template_kwargs
        )
        self.prompts = [ChatPrompt(chat_messages(chat.messages), template_kwargs=kwargs)]

    def options(self) -> RequestOptions:
        return RequestOptions(
            kv_transfer=options.kv_transfer(self.body.kv_transfer_params),
            cache_salt=options.cache_salt(self.body.cache_salt),
        )

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        assembler = ResponseAssembler(response_id(), model, self.body)
        return GenerationJob.of_events(assembler, self.body.stream, error_event)


# A Response object's schema for /openapi.json: it is built as a dict (OpenAI's shape, its
# required fields included), not a Struct.
RESPONSE_OBJECT: dict[str, Any] = {"type": "object", "required": ["id", "object", "output"]}


def check_stateless(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise RequestError(
            "previous_response_id: zllm keeps no conversation state; send the whole "
            "conversation as input.",
            param="previous_response_id",
        )
    if req.store:
        raise RequestError(
            "store: zllm keeps no record of responses; send store false or leave it out.",
            param="store",
        )


def as_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
    else:
        for item in req.input:
            content = item.content
            if not isinstance(content, str):
                content = "\n".join(part.text for part in content)
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=content))
    return ChatCompletionRequest(
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
    )


_encoder = msgspec.json.Encoder()


@dataclass
class ResponseAssembler:
    """The outputs of one Responses request as a Response object, whole or as events."""

    response_id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])
    text: str = ""
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    status: str = "in_progress"
    _sequence: int = 0

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        self._add(delta)

    def _add(self, delta: RequestOutputDelta) -> None:
        check_failed(delta)
        self.input_tokens = max(self.input_tokens, delta.num_prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.output_tokens += len(delta.token_ids)
        self.text += delta.text
        if delta.finish_reason is not None:
            self.status = (
                "incomplete" if delta.finish_reason == FinishReason.LENGTH else "completed"
            )

    def _message(self, done: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": self.text, "annotations": []}] if done else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": content,
        }

    def response(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        req = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": [self._message(done)] if done else [],
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "metadata": req.metadata or {},
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "tools": [],
            "store": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if self.status == "incomplete" else None
            ),
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            }
            if done
            else None,
        }

    def _event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **body}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutputDelta]]
    ) -> AsyncIterator[bytes]:
        started = False
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        async for _, delta in outputs:
            if not started:
                started = True
                yield self._event("response.created", response=self.response())
                yield self._event("response.in_progress", response=self.response())
                yield self._event(
                    "response.output_item.added", output_index=0, item=self._message(False)
                )
                yield self._event(
                    "response.content_part.added",
                    **where,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            self._add(delta)
            if delta.text:
                yield self._event("response.output_text.delta", **where, delta=delta.text)
        part = {"type": "output_text", "text": self.text, "annotations": []}
        yield self._event("response.output_text.done", **where, text=self.text)
        yield self._event("response.content_part.done", **where, part=part)
        yield self._event("response.output_item.done", output_index=0, item=self._message(True))
        final = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield self._event(final, response=self.response())


def error_event(error: RequestError) -> bytes:
    body = {
        "type": "error",
        "code": str(error.code or error.status),
        "message": error.message,
        "param": error.param,
    }
    return b"event: error\ndata: " + _encoder.encode(body) + b"\n\n"


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex
