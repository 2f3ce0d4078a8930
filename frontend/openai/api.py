"""OpenAI's /v1/completions and /v1/chat/completions as `ApiCall`s: a body's prompts and
SamplingParams (frontend/openai/format.py), its options, and the job that answers with
OpenAI's choices (frontend/openai/choices.py), whole or as chunks."""

from __future__ import annotations

from typing import Any

from zllm.errors import RequestError
from zllm.frontend import options
from zllm.frontend.generate import (
    ApiCall,
    ApiContext,
    ChatPrompt,
    GenerationJob,
    RequestIds,
)
from zllm.frontend.openai.choices import ChatAssembler, CompletionAssembler
from zllm.frontend.openai.format import (
    chat_images,
    chat_messages,
    chat_params,
    completion_params,
    prompt_inputs,
)
from zllm.frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from zllm.frontend.tools import ChoiceParser, ToolPlan, constrain, keep_call_tags, plan_tools
from zllm.protocol import RequestOptions
from zllm.sampling_params import SamplingParams
from zllm.text.template_kwargs import reasoning_parser_for


def tooled_chat_params(
    chat: ChatCompletionRequest,
    ctx: ApiContext,
    reasoning_parser: str | None,
    check_max_tokens: bool = True,
) -> tuple[SamplingParams, ToolPlan]:
    """A chat request's SamplingParams with the constraint its tools impose, and the plan;
    `reasoning_parser`: the request's own (none with thinking off), which a constraint
    waits out. `check_max_tokens=False` leaves a max_tokens past the context to the
    tokenizer's check, which knows the prompt's length too."""
    max_model_len = ctx.max_model_len if check_max_tokens else None
    params = chat_params(chat, max_model_len, ctx.sampling_defaults)
    config = ctx.config
    plan = plan_tools(chat, ctx.tokenizer, config.tool_call_parser, params.structured_outputs)
    params = keep_call_tags(params, plan, config.tool_call_parser, reasoning_parser)
    constrained = constrain(params, plan, ctx.tokenizer, reasoning_parser, config.tool_call_parser)
    return constrained, plan


class CompletionsCall(ApiCall):
    id_prefix = "cmpl"

    def __init__(self, body: CompletionRequest, ctx: ApiContext) -> None:
        self.body = body
        self.ctx = ctx
        self.inputs = prompt_inputs(body.prompt)
        self.prompts = list(self.inputs)
        self.params, self.echo_only = completion_params(
            body, ctx.max_model_len, ctx.sampling_defaults
        )
        self.add_special_tokens = body.add_special_tokens

    def options(self) -> RequestOptions:
        return _openai_options(self.body, self.ctx)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        body = self.body
        assembler = CompletionAssembler(
            n=self.params.n,
            prompts=self.inputs,
            echo=body.echo,
            echo_only=self.echo_only,
            want_logprobs=body.logprobs is not None,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.ctx.names.by_token_ids(body.return_tokens_as_token_ids),
        )
        head: dict[str, Any] = dict(id=ids.response_id, created=int(now), model=model)
        return GenerationJob(
            assembler=assembler,
            stream=body.stream,
            stream_options=body.stream_options,
            chunk=lambda choices, usage: CompletionStreamResponse(
                **head, choices=choices, usage=usage
            ),
            response=lambda: CompletionResponse(
                **head, choices=assembler.finish(), usage=assembler.usage.info()
            ),
        )


class ChatCall(ApiCall):
    id_prefix = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, ctx: ApiContext) -> None:
        self.body = body
        self.ctx = ctx
        messages = chat_messages(body.messages)
        config = ctx.config
        kwargs = options.template_kwargs(
            body.chat_template_kwargs,
            config.default_chat_template_kwargs,
            body.documents,
            body.reasoning_effort,
        )
        continue_final = options.continue_final_message(
            body.continue_final_message, body.add_generation_prompt
        )
        # Thinking switched off in the template: no reasoning to take apart.
        self.reasoning_parser = reasoning_parser_for(config.reasoning_parser, kwargs)
        params, self.plan = tooled_chat_params(body, ctx, self.reasoning_parser)
        self.params = options.with_thinking_budget(
            params,
            body.thinking_token_budget,
            config.reasoning_parser,
            self.reasoning_parser,
            ctx.tokenizer,
        )
        if body.chat_template is not None and not ctx.config.trust_request_chat_template:
            raise RequestError(
                "This server does not accept a chat_template in requests "
                "(start it with --trust-request-chat-template to allow it).",
                param="chat_template",
            )
        self.prompts = [
            ChatPrompt(
                messages,
                self.plan.tools,
                body.add_generation_prompt,
                body.chat_template,
                kwargs,
                continue_final,
                chat_images(body.messages),
            )
        ]
        self.add_special_tokens = body.add_special_tokens

    def options(self) -> RequestOptions:
        return _openai_options(self.body, self.ctx)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        body, n, config = self.body, self.params.n, self.ctx.config
        parsers = [
            ChoiceParser.of(self.plan, config.tool_call_parser, self.reasoning_parser)
            for _ in range(n)
        ]
        assembler = ChatAssembler(
            n=n,
            want_logprobs=body.logprobs,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.ctx.names.by_token_ids(body.return_tokens_as_token_ids),
            # None where tools, reasoning and harmony leave the text all content.
            parsers=[p for p in parsers if p is not None] or None,
        )
        head: dict[str, Any] = dict(id=ids.response_id, created=int(now), model=model)

        def chunk(
            choices: list[ChatStreamChoice], usage: UsageInfo | None = None
        ) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(**head, choices=choices, usage=usage)

        return GenerationJob(
            assembler=assembler,
            stream=body.stream,
            stream_options=body.stream_options,
            chunk=chunk,
            response=lambda: ChatCompletionResponse(
                **head,
                choices=assembler.finish(),
                usage=assembler.usage.info(),
                prompt_logprobs=assembler.prompt_logprobs,
            ),
            # Each choice's first chunk names its role.
            prelude=lambda: [
                chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(n)
            ],
        )


def _openai_options(
    body: CompletionRequest | ChatCompletionRequest, ctx: ApiContext
) -> RequestOptions:
    return RequestOptions(
        priority=options.priority(body.priority, ctx.config.engine.scheduler),
        cache_pin=options.cache_pin(body.cache_control),
        kv_transfer=options.kv_transfer(body.kv_transfer_params),
        cache_salt=options.cache_salt(body.cache_salt),
    )
