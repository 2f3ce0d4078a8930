"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the same
engine as the OpenAI routes.

A Messages request becomes the chat request zllm already serves: the system prompt a system
message, `tool_use` blocks an assistant turn's tool calls, `tool_result` blocks tool
messages, `tools` OpenAI functions and `tool_choice` {auto, any, tool, none} -> auto,
required, a named function, none (frontend/tools.py: the same grammar and parsers). The
answer comes back as Anthropic content blocks, and a stream as Anthropic's events:

    message_start, ping
    content_block_start (thinking | text | tool_use), content_block_delta (thinking_delta
    | text_delta | input_json_delta; a thinking block's signature_delta last),
    content_block_stop                              ... once per block
    message_delta (stop_reason, usage), message_stop

The answer's blocks and events: frontend/anthropic/output.py. `thinking` (disabled, or
enabled with a budget) and the signatures of thinking blocks: frontend/anthropic/thinking.py.

Usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those served
from the prefix cache. Errors have Anthropic's shape ({"type": "error", "error": ...}).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.responses import Response

from zllm.errors import ParamError, RequestError
from zllm.frontend import options
from zllm.frontend.anthropic.output import MessageAssembler, event
from zllm.frontend.anthropic.thinking import (
    ThinkingConfig,
    ThinkingSigner,
    check_thinking,
    omits_thinking,
    template_switch,
    thinking_budget,
)
from zllm.frontend.generate import ApiCall, ApiContext, ChatPrompt, GenerationJob, RequestIds
from zllm.frontend.openai.api import tooled_chat_params
from zllm.frontend.openai.format import chat_images, chat_messages
from zllm.frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
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
)
from zllm.frontend.replies import RETRY_AFTER_S, json_response
from zllm.kv.cache_control import parse_cache_control
from zllm.protocol import CachePin, RequestOptions
from zllm.text.template_kwargs import reasoning_parser_for

logger = logging.getLogger(__name__)

# ---- request -------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None  # pin the prompt up to here (cache_pin_of)


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any] = {}
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", kw_only=True):
    source: dict[str, Any] = {}


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str = ""
    signature: str | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock | ImageBlock | ThinkingBlock


class AnthropicMessage(msgspec.Struct, kw_only=True):
    # "system": Claude Code sends system turns inside `messages`; they join the system prompt
    # in order (as_chat_request), as Anthropic's API merges them.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: dict[str, Any] = {}
    cache_control: dict[str, Any] | None = None
    # None or "custom": a function the client runs. Any other type is one of Anthropic's
    # server tools (web_search_..., code_execution_..., web_fetch_...): this server cannot
    # run them, so they are left out of the prompt with a warning (hosted_tools).
    type: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    """`output_config.format`: the answer as JSON matching `schema` (structured outputs)."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    """`output_config`: `effort` reaches the chat template as its `reasoning_effort` (the
    templates that read one, gpt-oss's for instance; "max" is their "high"), `format` is
    structured outputs."""

    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(msgspec.Struct, kw_only=True):
    # Fields of Anthropic's API that mean nothing for a self-hosted model (container,
    # inference_geo, speed, workspace_id, context_management: its server-side clearing of
    # old tool results, ...) are not declared: the app logs them as ignored and answers.

    model: str
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # Extended thinking (frontend/anthropic/thinking.py).
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Anthropic's automatic caching: the prompt up to its last block pinned for the ttl
    # (cache_pin_of); zllm's prefix caching reuses prompts whether or not it is set.
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None  # held as it is: one tier here
    # zllm's extra parameter, as on the OpenAI endpoints: set by `zllm proxy` for
    # prefill/decode disaggregation (zllm/proxy/app.py).
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # zllm's extra parameter, as on the OpenAI endpoints
    # Not Anthropic's: vLLM's extra, as on chat completions (zllm/text/template_kwargs.py).
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- response ------------------------------------------------------------------------------


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    error: AnthropicErrorInfo
    type: str = "error"


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(error: RequestError) -> AnthropicError:
    kind = _ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    message = error.message
    if error.context_overflow is not None:
        # Anthropic's words to the letter: clients (Claude Code) parse the three numbers
        # and retry with a max_tokens that fits.
        input_tokens, max_tokens, limit = error.context_overflow
        message = (
            f"input length and `max_tokens` exceed context limit: {input_tokens} + "
            f"{max_tokens} > {limit}, decrease input length or `max_tokens` and try again"
        )
    return AnthropicError(AnthropicErrorInfo(kind, message))


def error_event(error: RequestError) -> bytes:
    return event("error", error_body(error))


def error_response(error: RequestError) -> Response:
    headers = error.headers
    if error.status == 503 and not headers:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return json_response(error_body(error), error.status, headers)


# ---- translation ---------------------------------------------------------------------------


def as_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is: system, turns, tools and tool choice."""
    messages: list[ChatMessage] = []
    system = system_text(req)
    if system:
        messages.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        if m.role != "system":
            messages += _turn(m, i)
    tools = [
        Tool(
            function=FunctionDefinition(
                name=t.name,
                description=t.description,
                parameters=t.input_schema or {"type": "object", "properties": {}},
            )
        )
        for t in client_tools(req.tools)
    ]
    fields: dict[str, Any] = {"messages": messages, "tools": tools or None}
    if isinstance(req, MessagesRequest):
        fields |= {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
        choice = req.tool_choice
        if choice is not None:
            fields["tool_choice"] = _tool_choice(choice)
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        output_format = req.output_config.format if req.output_config else None
        if output_format is not None:
            schema = JsonSchemaFormat(schema=output_format.schema, strict=True)
            fields["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
    return ChatCompletionRequest(**fields)


def system_text(req: MessagesRequest | CountTokensRequest) -> str:
    """The system prompt: `system`, then the text of each system turn in `messages`, in
    order, a blank line between them."""
    parts = []
    if req.system:
        parts.append(
            req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        )
    for m in req.messages:
        if m.role == "system":
            blocks = [m.content] if isinstance(m.content, str) else m.content
            parts.append("\n".join(b if isinstance(b, str) else _text_of(b) for b in blocks))
    return "\n\n".join(p for p in parts if p)


def _text_of(block: Block) -> str:
    if isinstance(block, TextBlock):
        return block.text
    raise RequestError(
        f"a system message holds text blocks only, not {type(block).__name__}.", param="messages"
    )


def client_tools(tools: list[AnthropicTool] | None) -> list[AnthropicTool]:
    """The tools the client runs; Anthropic's server tools (a `type` other than custom) are
    left out of the prompt with a warning: no server here runs them."""
    hosted = [t for t in tools or [] if t.type not in (None, "custom")]
    if hosted:
        logger.warning(
            "Leaving out server tools this server cannot run: %s",
            ", ".join(f"{t.name} ({t.type})" for t in hosted),
        )
    return [t for t in tools or [] if t.type in (None, "custom")]


# output_config.effort as the chat templates' reasoning_effort (theirs ends at "high").
EFFORTS = {"max": "high"}


class MessagesCall(ApiCall):
    id_prefix = "msg"

    def __init__(self, body: MessagesRequest, ctx: ApiContext) -> None:
        chat = as_chat_request(body)
        self.body = body
        self.ctx = ctx
        config = ctx.config
        if body.thinking is not None:
            check_thinking(body.thinking, body.max_tokens, config.reasoning_parser)
        signer = ctx.thinking_signer
        assert signer is not None, "the app makes one"
        check_signatures(body.messages, signer)
        self.signer = signer
        effort = body.output_config.effort if body.output_config else None
        kwargs = options.template_kwargs(
            body.chat_template_kwargs,
            config.default_chat_template_kwargs,
            reasoning_effort=EFFORTS.get(effort, effort),
        )
        # `thinking` has the last word
        kwargs |= template_switch(body.thinking, config.reasoning_parser)
        self.reasoning_parser = reasoning_parser_for(config.reasoning_parser, kwargs)
        # max_tokens past the context is the tokenizer's to refuse, with the prompt's length:
        # Anthropic's error names both (error_body), and clients retry from its numbers.
        params, self.plan = tooled_chat_params(
            chat, ctx, self.reasoning_parser, check_max_tokens=False
        )
        budget = thinking_budget(body.thinking, ctx.tokenizer, self.reasoning_parser)
        self.params = msgspec.structs.replace(params, thinking_budget=budget) if budget else params
        self.prompts = [
            ChatPrompt(
                chat_messages(chat.messages),
                self.plan.tools,
                template_kwargs=kwargs,
                images=chat_images(chat.messages),
            )
        ]

    def options(self) -> RequestOptions:
        return RequestOptions(
            cache_pin=cache_pin_of(self.body),
            kv_transfer=options.kv_transfer(self.body.kv_transfer_params),
            cache_salt=options.cache_salt(self.body.cache_salt),
        )

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        config = self.ctx.config
        assembler = MessageAssembler.of(
            ids.response_id, model, self.plan, self.reasoning_parser, config.tool_call_parser
        )
        assembler.signer = self.signer
        assembler.omit_thinking = omits_thinking(self.body.thinking)
        return GenerationJob.of_events(assembler, self.body.stream, error_event)


def cache_pin_of(req: MessagesRequest) -> CachePin | None:
    """The prefix pin a Messages request's cache_control blocks ask for: the prompt up to
    the last marked block (tools, then system, then messages, Anthropic's order), as the
    number of chat messages it ends after, for as long as the longest ttl among them."""
    marks: list[tuple[int, dict[str, Any], str]] = []  # (messages before, value, param)
    for i, tool in enumerate(req.tools or []):
        if tool.cache_control is not None:
            marks.append((0, tool.cache_control, f"tools.{i}.cache_control"))
    num_messages = 1 if system_text(req) else 0  # system turns in `messages` join it
    for j, block in enumerate(req.system if isinstance(req.system, list) else []):
        if block.cache_control is not None:
            marks.append((1, block.cache_control, f"system.{j}.cache_control"))
    for i, message in enumerate(req.messages):
        if message.role != "system":
            num_messages += len(_turn(message, i))
        blocks = message.content if isinstance(message.content, list) else []
        for j, block in enumerate(blocks):
            value = getattr(block, "cache_control", None)
            if value is not None:
                at = 1 if message.role == "system" else num_messages
                marks.append((at, value, f"messages.{i}.content.{j}.cache_control"))
    if req.cache_control is not None:  # automatic caching: up to the last block
        marks.append((num_messages, req.cache_control, "cache_control"))
    if not marks:
        return None
    try:
        ttls = [parse_cache_control(value, param).ttl_s for _, value, param in marks]
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None
    return CachePin(ttl_s=max(ttls), num_messages=max(at for at, _, _ in marks))


def check_signatures(messages: list[AnthropicMessage], signer: ThinkingSigner) -> None:
    """Every thinking block sent back must carry the signature this server gave it."""
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            if isinstance(block, ThinkingBlock) and not signer.verify(
                block.thinking, block.signature
            ):
                raise RequestError(
                    f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block",
                    param=f"messages.{i}.content.{j}.signature",
                )


def _tool_choice(choice: AnthropicToolChoice) -> str | NamedToolChoice:
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice of type tool needs a name.", param="tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _turn(message: AnthropicMessage, index: int) -> list[ChatMessage]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool
    messages (before its text), an assistant turn's tool_use blocks its tool calls."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts: list[str] = []
    parts: list[ContentPart] = []  # text and images in order, when the turn holds an image
    calls: list[ToolCallMessage] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append(ContentPart(type="text", text=block.text))
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                ToolCallMessage(
                    id=block.id, function=FunctionCall(name=block.name, arguments=arguments)
                )
            )
        elif isinstance(block, ToolResultBlock):
            content = block.content
            if not isinstance(content, str):
                content = "\n".join(b.text for b in content)
            results.append(
                ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id)
            )
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block, f"messages.{index}.content.{j}"))
        # Thinking blocks of earlier turns (their signatures checked: check_signatures) are
        # not sent back to the model, as Anthropic drops them.
    turn: list[ChatMessage] = list(results)
    has_image = any(isinstance(part, SourcedImagePart) for part in parts)
    if texts or calls or has_image or not results:
        content: str | list[ContentPart] = parts if has_image else "\n".join(texts)
        turn.append(ChatMessage(role=message.role, content=content, tool_calls=calls or None))
    return turn


def _image_part(block: ImageBlock, where: str) -> SourcedImagePart:
    """An image block as a chat image part: base64 data as a data: URL, or its url."""
    source = block.source
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type") or "image/png"
        url = f"data:{media_type};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise RequestError(
            "an image block's source must be {type: base64, media_type, data} or {type: url, url}.",
            param=f"{where}.source",
        )
    return SourcedImagePart(type="image_url", image_url=ImageURL(url=url), where=where)
