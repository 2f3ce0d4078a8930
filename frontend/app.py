"""The OpenAI-compatible HTTP server: a Starlette app over an `EngineClient`.

    POST /v1/completions, /v1/chat/completions   generation (JSON, or SSE with `stream`)
    GET  /v1/models                              the served model names (LoRA adapters too)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters at run time (vLLM's)
    POST /sleep?level=1, /wake_up; GET /is_sleeping      sleep mode (--enable-sleep-mode)
    POST /tokenize, /detokenize                  vLLM's shapes, with the frontend's tokenizer
    GET  /health, /version, /metrics             open even when an API key is set
                                                 (unless --protect-metrics)
    GET  /dashboard, /dashboard/stats            the live dashboard (frontend/dashboard.py)
    GET  /openapi.json                           the API's OpenAPI 3.1 description

The routes only parse: generation goes through `frontend/generate.py`, streams and
disconnects through `frontend/streaming.py`, keys/limits/admission through
`frontend/middleware.py`. Every error is OpenAI's `{"error": {...}}` with its HTTP status.
No torch in this process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest as prometheus_text
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import zllm
from zllm.cache_control import parse_cache_control
from zllm.config import check_priority
from zllm.engine_client import EngineClient
from zllm.errors import ParamError, RequestError
from zllm.frontend import anthropic_api, responses_api
from zllm.frontend.admission import SHUTTING_DOWN, Admission
from zllm.frontend.api_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeBody,
    DetokenizeResponse,
    EmbeddingsRequest,
    LoadLoRAAdapterBody,
    ModelCard,
    ModelList,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoRAAdapterBody,
    decode_body,
)
from zllm.frontend.embeddings import EMBED_PARAMS, EmbeddingsAssembler, embedding_inputs
from zllm.frontend.generate import Generation, GenerationJob, RequestIds
from zllm.frontend.lora_adapters import LORA_STATE_FILE, LoRAAdapters
from zllm.frontend.metrics import Metrics
from zllm.frontend.middleware import TICKET_KEY, Gate
from zllm.frontend.openai_format import (
    ChatAssembler,
    CompletionAssembler,
    LogprobText,
    chat_messages,
    chat_params,
    completion_params,
    prompt_inputs,
)
from zllm.frontend.openapi import openapi_schema
from zllm.frontend.responses import encode_json, error_response, json_response
from zllm.frontend.streaming import ClientGone
from zllm.frontend.tools import ChoiceParser, ToolPlan, plan_tools, think_end_token
from zllm.inputs import check_vocabulary
from zllm.lora import LoRARequest
from zllm.protocol import CachePin, KVTransferParams, TokenizeRequest
from zllm.sampling_params import SamplingParams
from zllm.serve_config import ServeConfig
from zllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Tokenize or detokenize this much in a worker thread, not on the event loop.
_BIG_INPUT = 16384


def build_app(
    config: ServeConfig,
    client: EngineClient,
    tokenizer: Tokenizer,
    run_dir: str | None = None,
) -> Starlette:
    """`run_dir`: the supervisor's run directory, where state that must outlive a frontend
    restart is kept (the LoRA adapters loaded at run time)."""
    server = OpenAIServer(config, client, tokenizer, run_dir)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"]),
        Route("/sleep", server.sleep, methods=["POST"]),
        Route("/wake_up", server.wake_up, methods=["POST"]),
        Route("/is_sleeping", server.is_sleeping, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/dashboard", server.prometheus.dashboard.page, methods=["GET"]),
        Route("/dashboard/stats", server.prometheus.dashboard.stats, methods=["GET"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
    ]
    middleware = [Middleware(Gate, config=config, admission=server.admission, routes=routes)]
    if config.allowed_origins:  # CORS is off unless asked for
        cors = Middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
        middleware.insert(0, cors)  # outermost: preflights need no API key
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception},
    )
    app.state.server = server
    return app


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(RequestError(exc.detail, exc.status_code))


def _anthropic_errors(
    handler: Callable[..., Awaitable[Response]],
) -> Callable[..., Awaitable[Response]]:
    """As _api_errors, in Anthropic's error shape."""

    @functools.wraps(handler)
    async def wrapper(self: OpenAIServer, request: Request) -> Response:
        try:
            return await handler(self, request)
        except RequestError as e:
            return anthropic_api.error_response(e)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("error serving %s %s", request.method, request.url.path)
            return anthropic_api.error_response(
                RequestError(f"internal server error: {type(e).__name__}: {e}", 500)
            )

    return wrapper


def _api_errors(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Any failure of a route becomes an OpenAI error response; the server keeps serving."""

    @functools.wraps(handler)
    async def wrapper(self: OpenAIServer, request: Request) -> Response:
        try:
            return await handler(self, request)
        except RequestError as e:
            return error_response(e)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("error serving %s %s", request.method, request.url.path)
            return error_response(
                RequestError(f"internal server error: {type(e).__name__}: {e}", 500)
            )

    return wrapper


class OpenAIServer:
    """The route handlers and what they share: engine client, tokenizer, metrics."""

    def __init__(
        self,
        config: ServeConfig,
        client: EngineClient,
        tokenizer: Tokenizer,
        run_dir: str | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.names = LogprobText(tokenizer)
        self.max_model_len = config.engine.scheduler.max_model_len
        # The model's generation_config.json defaults, for fields a request leaves unset.
        self.sampling_defaults = config.engine.generation_config.defaults
        self.created = int(time.time())
        self.prometheus = Metrics(client, config.model_names[0])
        self.admission = Admission(config.max_in_flight)
        self.generation = Generation(config, client, self.prometheus)
        self.adapters = LoRAAdapters(
            config.engine,
            config.model_names,
            config.lora_modules,
            os.path.join(run_dir, LORA_STATE_FILE) if run_dir else None,
        )
        self._openapi: bytes | None = None

    # ---- generation ----------------------------------------------------------------------
    @_api_errors
    async def completions(self, request: Request) -> Response:
        body = self._decode(await request.body(), CompletionRequest)
        model, lora = self._model(body.model)
        prompts = prompt_inputs(body.prompt)
        params, echo_only = completion_params(body, self.max_model_len, self.sampling_defaults)
        self.admission.admit(request.scope[TICKET_KEY], len(prompts))
        ids = RequestIds.of(request, "cmpl")
        now = time.time()
        requests = [
            TokenizeRequest(
                req_id=ids.engine_id(i, len(prompts)),
                sampling_params=params,
                prompt=p.text,
                prompt_token_ids=p.token_ids,
                add_special_tokens=body.add_special_tokens,
                arrival_time=now,
                lora=lora,
                priority=self._priority(body.priority),
                cache_pin=_cache_pin(body.cache_control),
                kv_transfer=_kv_transfer(body.kv_transfer_params),
            )
            for i, p in enumerate(prompts)
        ]
        assembler = CompletionAssembler(
            n=params.n,
            prompts=prompts,
            echo=body.echo,
            echo_only=echo_only,
            want_logprobs=body.logprobs is not None,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.names,
        )
        head: dict[str, Any] = dict(id=ids.response_id, created=int(now), model=model)
        job = GenerationJob(
            ids,
            requests,
            assembler,
            body.stream,
            body.stream_options,
            chunk=lambda choices, usage: CompletionStreamResponse(
                **head, choices=choices, usage=usage
            ),
            response=lambda: CompletionResponse(
                **head, choices=assembler.finish(), usage=assembler.usage.info()
            ),
        )
        return await self.generation.run(request, job)

    @_api_errors
    async def chat_completions(self, request: Request) -> Response:
        body = self._decode(await request.body(), ChatCompletionRequest)
        model, lora = self._model(body.model)
        messages = chat_messages(body.messages)
        params = chat_params(body, self.max_model_len, self.sampling_defaults)
        plan = plan_tools(
            body, self.tokenizer, self.config.tool_call_parser, params.structured_outputs
        )
        params = self._constrain(params, plan)
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise RequestError(
                "This server does not accept a chat_template in requests "
                "(start it with --trust-request-chat-template to allow it).",
                param="chat_template",
            )
        self.admission.admit(request.scope[TICKET_KEY], 1)
        ids = RequestIds.of(request, "chatcmpl")
        now = time.time()
        engine_request = TokenizeRequest(
            req_id=ids.engine_id(0, 1),
            sampling_params=params,
            messages=messages,
            tools=plan.tools,
            add_generation_prompt=body.add_generation_prompt,
            chat_template=body.chat_template,
            add_special_tokens=body.add_special_tokens,
            arrival_time=now,
            lora=lora,
            priority=self._priority(body.priority),
            cache_pin=_cache_pin(body.cache_control),
            kv_transfer=_kv_transfer(body.kv_transfer_params),
        )
        shaped = plan.mode != "none" or self.config.reasoning_parser is not None
        assembler = ChatAssembler(
            n=params.n,
            want_logprobs=body.logprobs,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            names=self.names,
            parsers=[
                ChoiceParser(plan, self.config.tool_call_parser, self.config.reasoning_parser)
                for _ in range(params.n)
            ]
            if shaped
            else None,
        )
        head: dict[str, Any] = dict(id=ids.response_id, created=int(now), model=model)

        def chunk(choices: list[ChatStreamChoice], usage=None) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(**head, choices=choices, usage=usage)

        job = GenerationJob(
            ids,
            [engine_request],
            assembler,
            body.stream,
            body.stream_options,
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
                for i in range(params.n)
            ],
        )
        return await self.generation.run(request, job)

    @_api_errors
    async def embeddings(self, request: Request) -> Response:
        body = self._decode(await request.body(), EmbeddingsRequest)
        model, lora = self._model(body.model)
        inputs = embedding_inputs(body)
        self.admission.admit(request.scope[TICKET_KEY], len(inputs))
        ids = RequestIds.of(request, "embd")
        now = time.time()
        requests = [
            TokenizeRequest(
                req_id=ids.engine_id(i, len(inputs)),
                sampling_params=EMBED_PARAMS,
                prompt=p.text,
                prompt_token_ids=p.token_ids,
                arrival_time=now,
                lora=lora,
            )
            for i, p in enumerate(inputs)
        ]
        assembler = EmbeddingsAssembler(len(inputs), body.encoding_format)
        job = GenerationJob(
            ids,
            requests,
            assembler,
            False,
            None,
            chunk=lambda choices, usage: None,  # type: ignore[arg-type,return-value]
            response=lambda: assembler.response(model),
        )
        return await self.generation.run(request, job)

    # ---- OpenAI's Responses API (stateless) ----------------------------------------------
    @_api_errors
    async def responses(self, request: Request) -> Response:
        body = self._decode(await request.body(), responses_api.ResponsesRequest)
        model, lora = self._model(body.model)
        responses_api.check_stateless(body)
        chat = responses_api.as_chat_request(body)
        params = chat_params(chat, self.max_model_len, self.sampling_defaults)
        self.admission.admit(request.scope[TICKET_KEY], 1)
        ids = RequestIds.of(request, "resp")
        engine_request = TokenizeRequest(
            req_id=ids.engine_id(0, 1),
            sampling_params=params,
            messages=chat_messages(chat.messages),
            arrival_time=time.time(),
            lora=lora,
            kv_transfer=_kv_transfer(body.kv_transfer_params),
        )
        assembler = responses_api.ResponseAssembler(responses_api.response_id(), model, body)
        job = GenerationJob(
            ids,
            [engine_request],
            assembler,
            body.stream,
            None,
            chunk=lambda choices, usage: None,  # type: ignore[arg-type,return-value]
            response=assembler.response,  # type: ignore[arg-type]
            events=assembler.stream,
            done=b"",
            on_error=responses_api.error_event,
        )
        return await self.generation.run(request, job)

    # ---- Anthropic's Messages API ----------------------------------------------------------
    @_anthropic_errors
    async def messages(self, request: Request) -> Response:
        body = self._decode(await request.body(), anthropic_api.MessagesRequest)
        model, lora = self._model(body.model)
        chat = anthropic_api.as_chat_request(body)
        params = chat_params(chat, self.max_model_len, self.sampling_defaults)
        plan = plan_tools(
            chat, self.tokenizer, self.config.tool_call_parser, params.structured_outputs
        )
        params = self._constrain(params, plan)
        self.admission.admit(request.scope[TICKET_KEY], 1)
        ids = RequestIds.of(request, "msg")
        engine_request = TokenizeRequest(
            req_id=ids.engine_id(0, 1),
            sampling_params=params,
            messages=chat_messages(chat.messages),
            tools=plan.tools,
            arrival_time=time.time(),
            lora=lora,
            cache_pin=anthropic_api.cache_pin_of(body),
            kv_transfer=_kv_transfer(body.kv_transfer_params),
        )
        assembler = anthropic_api.MessageAssembler.of(
            ids.response_id,
            model,
            plan,
            self.config.reasoning_parser,
            self.config.tool_call_parser,
        )
        job = GenerationJob(
            ids,
            [engine_request],
            assembler,
            body.stream,
            None,
            chunk=lambda choices, usage: None,  # type: ignore[arg-type,return-value]
            response=assembler.response,
            events=assembler.stream,
            done=b"",
            on_error=anthropic_api.error_event,
        )
        return await self.generation.run(request, job)

    @_anthropic_errors
    async def count_tokens(self, request: Request) -> Response:
        body = self._decode(await request.body(), anthropic_api.CountTokensRequest)
        self._model_name(body.model)
        chat = anthropic_api.as_chat_request(body)
        tools = [msgspec.to_builtins(t) for t in chat.tools or []] or None
        try:
            text = self.tokenizer.apply_chat_template(
                chat_messages(chat.messages),
                add_generation_prompt=True,
                **({"tools": tools} if tools else {}),
            )
        except Exception as e:  # jinja errors, or a model without a template
            raise RequestError(f"Could not apply the chat template: {e}", param="messages") from e
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, False)
        return json_response(anthropic_api.CountTokensResponse(len(tokens)))

    def _constrain(self, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
        """The request's structured-outputs constraint: the tool plan's (required, a named
        function, auto's call grammar) or the request's own; with a reasoning parser, one
        that does not wait for a token of its own applies after `</think>`."""
        structured = plan.structured if plan.structured is not None else params.structured_outputs
        if structured is None:
            return params
        if self.config.reasoning_parser is not None and structured.after_token is None:
            think_end = think_end_token(self.tokenizer)
            if think_end is not None:
                structured = msgspec.structs.replace(structured, after_token=think_end)
        return msgspec.structs.replace(params, structured_outputs=structured)

    # ---- other routes --------------------------------------------------------------------
    @_api_errors
    async def models(self, request: Request) -> Response:
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=self.config.engine.model_path,
                max_model_len=self.max_model_len,
            )
            for name in self.config.model_names
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                created=self.created,
                root=lora.lora_path,
                parent=self.config.model_names[0],
                max_model_len=self.max_model_len,
            )
            for lora in self.adapters.by_name.values()
        ]
        return json_response(ModelList(cards))

    @_api_errors
    async def load_lora_adapter(self, request: Request) -> Response:
        body = self._decode(await request.body(), LoadLoRAAdapterBody)
        lora = await self.adapters.load(body.lora_name, body.lora_path)
        logger.info(
            "LoRA adapter %s (id %d) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            lora.lora_path,
        )
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @_api_errors
    async def unload_lora_adapter(self, request: Request) -> Response:
        body = self._decode(await request.body(), UnloadLoRAAdapterBody)
        lora = self.adapters.unload(body.lora_name)
        logger.info("LoRA adapter %s (id %d) unloaded", lora.lora_name, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    # ---- sleep mode ------------------------------------------------------------------------
    @_api_errors
    async def sleep(self, request: Request) -> Response:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            raise RequestError("level must be 1 or 2", param="level") from None
        if level not in (1, 2):
            raise RequestError("level must be 1 or 2", param="level")
        return await self._sleep_control("sleep", level)

    @_api_errors
    async def wake_up(self, request: Request) -> Response:
        return await self._sleep_control("wake_up", 1)

    async def _sleep_control(self, command: str, level: int) -> Response:
        if not self.config.engine.enable_sleep_mode:
            raise RequestError("sleep mode is off (start the server with --enable-sleep-mode)")
        reply = await self.client.sleep_control(command, level)
        if not reply.ok:
            raise RequestError(reply.message, 400)
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return json_response({"is_sleeping": self.client.is_sleeping})

    async def health(self, request: Request) -> Response:
        if self.admission.draining:
            return error_response(RequestError(SHUTTING_DOWN, 503))
        ok, reason = self.client.health()
        if ok and reason != "ok":
            # Degraded: some data-parallel engine is down, the others serve (and say so).
            return json_response({"status": "degraded", "message": reason})
        if ok:
            return Response(status_code=200)
        return error_response(RequestError(reason, 503))

    async def version(self, request: Request) -> Response:
        return json_response({"version": zllm.__version__})

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = encode_json(openapi_schema(self.config))
        return Response(self._openapi, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_text(self.prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @_api_errors
    async def tokenize(self, request: Request) -> Response:
        body = self._decode(await request.body(), TokenizeBody)
        self._model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("Give exactly one of prompt and messages.", param="prompt")
        if body.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt
                )
            except Exception as e:  # jinja errors, or a model without a template
                raise RequestError(
                    f"Could not apply the chat template: {e}", param="messages"
                ) from e
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await _maybe_in_thread(len(text), self.tokenizer.encode, text, add_special)
        token_strs = None
        if body.return_token_strs:
            token_strs = [self.tokenizer.backend.id_to_token(t) or "" for t in tokens]
        return json_response(
            TokenizeResponse(
                count=len(tokens),
                max_model_len=self.max_model_len,
                tokens=tokens,
                token_strs=token_strs,
            )
        )

    @_api_errors
    async def detokenize(self, request: Request) -> Response:
        body = self._decode(await request.body(), DetokenizeBody)
        self._model_name(body.model)
        try:
            check_vocabulary(body.tokens, self.tokenizer.vocab_size, "tokens")
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        text = await _maybe_in_thread(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return json_response(DetokenizeResponse(prompt=text))

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _decode(data: bytes, cls: type) -> Any:
        body, unknown = decode_body(data, cls)
        if unknown:
            logger.warning("The request has fields this server ignores: %s", ", ".join(unknown))
        return body

    def _priority(self, priority: int) -> int:
        try:
            check_priority(priority, self.config.engine.scheduler)
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        return priority

    def _model_name(self, requested: str | None) -> str:
        return self._model(requested)[0]

    def _model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name a request answers with, and the LoRA adapter it names (if any)."""
        names = self.config.model_names
        if requested is None or requested in names:
            return requested or names[0], None
        lora = self.adapters.get(requested)
        if lora is not None:
            return requested, lora
        served = [*names, *self.adapters.by_name]
        raise RequestError(
            f"The model `{requested}` does not exist. Served models: {', '.join(served)}.",
            status=404,
            param="model",
            code="model_not_found",
        )


async def _maybe_in_thread(size: int, fn: Callable, *args: Any) -> Any:
    if size > _BIG_INPUT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _cache_pin(cache_control: dict[str, Any] | None) -> CachePin | None:
    """The pin a request's `cache_control` extra asks for (its whole prompt), or None."""
    if cache_control is None:
        return None
    try:
        return parse_cache_control(cache_control)
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None


def _kv_transfer(params: dict[str, Any] | None) -> KVTransferParams | None:
    """A request's `kv_transfer_params` (prefill/decode disaggregation), or None."""
    if not params:
        return None
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise RequestError(
                f"kv_transfer_params.{key} must be true or false", param="kv_transfer_params"
            )
        flags[key] = value
    return KVTransferParams(**flags) if any(flags.values()) else None
