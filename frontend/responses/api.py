"""OpenAI's Responses API (`POST /v1/responses`), stateless: a Responses request becomes the
chat request zllm serves (frontend/responses/input.py: input items as turns, function tools,
tool_choice, text.format as response_format), so tools, structured outputs and reasoning go
through the same grammar and parsers as chat (frontend/tools.py); the answer comes back as
output items, whole or as OpenAI's stream of events (frontend/responses/output.py).

zllm keeps no conversation state: `previous_response_id`, and `store: true`, are 400s. So is
every other field of the API zllm does not implement (`UNSUPPORTED`, and the values
`check_request` refuses), naming it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from zllm.errors import RequestError
from zllm.frontend import options
from zllm.frontend.generate import ApiCall, ApiContext, ChatPrompt, GenerationJob, RequestIds
from zllm.frontend.openai.api import tooled_chat_params
from zllm.frontend.openai.format import chat_images, chat_messages
from zllm.frontend.openai.protocol import ChatCompletionRequest
from zllm.frontend.responses.client_tools import ClientTool, forced_grammar
from zllm.frontend.responses.input import (
    FunctionTool,
    FunctionToolChoice,
    ReasoningConfig,
    TextConfig,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    chat_turns,
    client_tools,
    namespaced_functions,
)
from zllm.frontend.responses.output import ResponseAssembler, response_id
from zllm.frontend.responses.reasoning_carrier import ReasoningCarrier
from zllm.frontend.tools import ChoiceParser, ToolPlan, constrain
from zllm.protocol import RequestOptions
from zllm.text.template_kwargs import reasoning_parser_for

logger = logging.getLogger(__name__)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    # Fields of OpenAI's Responses API zllm does not implement: a 400 naming them.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "background_options",
        "context_management",
        "conversation",
        "max_tool_calls",
        "moderation",
        "prompt",
        "prompt_cache_options",
        "prompt_cache_retention",
        "top_logprobs",
    )

    model: str | None = None
    # Text (one user turn), or items: message, function_call, function_call_output,
    # reasoning (frontend/responses/input.py reads each by its type).
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's, as on chat completions: at most this many reasoning tokens (frontend/options.py).
    thinking_token_budget: Annotated[int, Meta(ge=1)] | None = None
    # Refused when they ask for what zllm does not do (check_request).
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Stateless: no stored responses to continue from, none stored.
    previous_response_id: str | None = None
    store: bool | None = None
    # Held as they are: labels for the caller's records, cache and tier hints (prefix
    # caching is automatic, one tier here), stream options (no obfuscation to turn off).
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # zllm's extra parameter, as on the other generation endpoints: set by `zllm proxy` for
    # prefill/decode disaggregation (zllm/proxy/app.py).
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # as on the other generation endpoints
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions


class ResponsesCall(ApiCall):
    id_prefix = "resp"

    def __init__(self, body: ResponsesRequest, ctx: ApiContext) -> None:
        check_request(body)
        assert ctx.thinking_signer is not None, "the app makes one"
        self.carrier = ReasoningCarrier(ctx.thinking_signer)
        chat = as_chat_request(body, self.carrier)
        self.body = body
        self.ctx = ctx
        effort = body.reasoning.effort if body.reasoning is not None else None
        kwargs = options.template_kwargs(
            body.chat_template_kwargs, ctx.config.default_chat_template_kwargs, None, effort
        )
        self.reasoning_parser = reasoning_parser_for(ctx.config.reasoning_parser, kwargs)
        try:
            self.params, self.plan = tooled_chat_params(chat, ctx, self.reasoning_parser)
        except RequestError as e:  # named as the chat request names it: rename it
            name = CHAT_PARAMS.get(e.param or "")
            if name is not None:
                if e.message.startswith(f"{e.param} "):
                    e.message = name + e.message[len(e.param or "") :]
                e.param = name
            raise
        self.client_tools = client_tools(body.tools)
        self.forced = self._force_custom_tool()
        self.params = options.with_thinking_budget(
            self.params,
            body.thinking_token_budget,
            ctx.config.reasoning_parser,
            self.reasoning_parser,
            ctx.tokenizer,
        )
        self.prompts = [
            ChatPrompt(
                chat_messages(chat.messages),
                self.plan.tools,
                template_kwargs=kwargs,
                images=chat_images(chat.messages),
            )
        ]

    def _force_custom_tool(self) -> str | None:
        """tool_choice naming a custom tool: the answer is its raw input, constrained by its
        grammar (in place of the JSON arguments a named function's answer would be)."""
        tool = self.client_tools.get(self.plan.function_name or "")
        if self.plan.mode != "named" or tool is None or tool.kind != "custom":
            return None
        at = next(i for i, t in enumerate(self.body.tools or []) if t.name == tool.name)
        structured = forced_grammar(tool, f"tools[{at}]")
        self.plan = dataclasses.replace(self.plan, structured=structured)
        unconstrained = msgspec.structs.replace(self.params, structured_outputs=None)
        self.params = constrain(
            unconstrained,
            self.plan,
            self.ctx.tokenizer,
            self.reasoning_parser,
            self.ctx.config.tool_call_parser,
        )
        return tool.name

    def options(self) -> RequestOptions:
        return RequestOptions(
            kv_transfer=options.kv_transfer(self.body.kv_transfer_params),
            cache_salt=options.cache_salt(self.body.cache_salt),
        )

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        config = self.ctx.config
        parser = ChoiceParser.of(self.plan, config.tool_call_parser, self.reasoning_parser)
        echo = echoed_settings(self.body, self.plan, self.client_tools)
        assembler = ResponseAssembler(response_id(), model, echo, parser)
        assembler.namespaces = namespaced_functions(self.body.tools)
        assembler.client_tools, assembler.forced = self.client_tools, self.forced
        reasoning = self.body.reasoning
        assembler.summarize = reasoning is not None and bool(
            reasoning.summary or reasoning.generate_summary
        )
        if ENCRYPTED_REASONING in (self.body.include or []):
            assembler.seal = self.carrier.seal
        return GenerationJob.of_events(assembler, self.body.stream, assembler.error_event)


# The chat request's names for a Responses request's fields, where they differ.
CHAT_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format.schema",
}


# A Response object's schema for /openapi.json: it is built as a dict (OpenAI's shape, its
# required fields included), not a Struct.
RESPONSE_OBJECT: dict[str, Any] = {"type": "object", "required": ["id", "object", "output"]}


def check_request(req: ResponsesRequest) -> None:
    """400s for what zllm does not do: keep state, run in the background, return encrypted
    or summarized reasoning, set verbosity, truncate a conversation."""
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
    if req.background:
        raise RequestError("unsupported parameter: background (true)", param="background")
    if req.truncation == "auto":
        raise RequestError(
            "truncation auto: zllm does not drop parts of a conversation; a prompt too long is "
            "a 400. Send disabled or leave it out.",
            param="truncation",
        )
    for i, value in enumerate(req.include or []):
        if value in NOTHING_TO_INCLUDE:
            logger.warning("include: %r: this server runs no such tool; nothing to include", value)
        elif value != ENCRYPTED_REASONING:
            raise RequestError(
                f"include: {value!r} is not supported (zllm includes "
                f"{ENCRYPTED_REASONING!r}; it returns no logprobs or input images here).",
                param=f"include[{i}]",
            )
    if req.text is not None and req.text.verbosity is not None:
        raise RequestError("unsupported parameter: text.verbosity", param="text.verbosity")


ENCRYPTED_REASONING = "reasoning.encrypted_content"
# include values about the results of tools OpenAI's servers run (none run here).
NOTHING_TO_INCLUDE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
)


def as_chat_request(
    req: ResponsesRequest, carrier: ReasoningCarrier | None = None
) -> ChatCompletionRequest:
    """The chat request a Responses request is; `carrier` opens the reasoning items'
    encrypted_content."""
    return ChatCompletionRequest(
        messages=chat_turns(req.input, req.instructions, carrier.open if carrier else None),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=chat_response_format(req.text),
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
    )


def echoed_tool(tool: FunctionTool) -> dict[str, Any]:
    """A tool as the request gave it: a namespace's members nested, the fields of other
    types left out (OpenAI's schema allows no null there)."""
    shown = msgspec.to_builtins(tool)
    kept = ("name", "description", "parameters", "strict") if tool.type == "function" else ()
    for name in list(shown):
        if shown[name] is None and name not in kept:
            shown.pop(name)
    if tool.tools is not None:
        shown["tools"] = [echoed_tool(member) for member in tool.tools]
    if tool.format is not None:
        shown["format"] = {k: v for k, v in shown["format"].items() if v is not None}
    return shown


def echoed_settings(
    req: ResponsesRequest, plan: ToolPlan, tools: dict[str, ClientTool] | None = None
) -> dict[str, Any]:
    """The request's settings a Response object repeats, as they were applied."""
    client = (tools or {}).get(plan.function_name or "")
    if plan.mode == "named" and client is not None and client.kind == "local_shell":
        tool_choice: Any = {"type": "local_shell"}
    elif plan.mode == "named":
        kind = "custom" if client is not None else "function"
        tool_choice = {"type": kind, "name": plan.function_name}
    else:
        tool_choice = plan.mode
    fmt = req.text.format if req.text is not None else None
    text_format = {"type": "text"} if fmt is None else _without_none(msgspec.to_builtins(fmt))
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "tool_choice": tool_choice,
        "tools": [echoed_tool(t) for t in req.tools or []],
        "text": {"format": text_format},
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": (req.reasoning.summary or req.reasoning.generate_summary)
            if req.reasoning
            else None,
        },
        "truncation": "disabled",
    }


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}
